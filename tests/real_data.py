"""The real sample data copied into tests/fixtures/real, and a project that merges its three formats."""

from __future__ import annotations

import hashlib
from pathlib import Path

REAL = Path(__file__).resolve().parent / "fixtures" / "real"


def write_real_project(root: Path, extra: str = "") -> Path:
    """Write `root/vlmctl.yaml` whose data.sources are the LLaVA, ShareGPT and messages samples; `extra` is appended
    inside the data section (indent it two spaces) and may go on with more sections. Returns the config path."""
    # The messages file names its images relative to the LLaMA-Factory repository root (data/mllm_demo_data/N.jpg).
    (root / "lf").mkdir(parents=True)
    (root / "lf" / "data").symlink_to(REAL / "llamafactory_mllm_demo", target_is_directory=True)
    config = root / "vlmctl.yaml"
    config.write_text(
        "data:\n"
        "  sources:\n"
        f"    - path: {REAL / 'llava_examples' / 'llava_format.json'}\n"
        f"    - path: {REAL / 'llamafactory_mllm_demo' / 'mllm_demo.json'}\n"
        f"    - path: {REAL / 'llamafactory_mllm_demo' / 'v1_multimodal_demo.jsonl'}\n"
        "      image_root: lf\n"
        "  val_ratio: 0.3\n" + extra
    )
    return config


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}
