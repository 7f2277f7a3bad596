"""Run lmms-eval (github.com/EvolvingLMMs-Lab/lmms-eval, the community's evaluation harness) on a model folder and
read its scores back as flat `lmms_eval/<task>/<metric>` entries for metrics.json. Optional dependency.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from vlmctl.errors import UsageError, VlmctlError



def lmms_eval_available() -> bool:
    return importlib.util.find_spec("lmms_eval") is not None


def lmms_command(model_dir: Path, tasks: str, out_dir: Path, batch_size: int) -> list[str]:
    """The `python -m lmms_eval ...` command line for `model_dir` (its adapter chosen from config.json)."""
    from vlmctl.families import compose_family, detect_family, get_family

    # the family's lmms-eval adapter; else the compose family's (llava_hf reads any LlavaForConditionalGeneration folder)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        adapter = get_family(detect_family(config)).lmms_model
    except VlmctlError:
        adapter = None
    return [
        sys.executable, "-m", "lmms_eval", "--model", adapter or compose_family().lmms_model,
        "--model_args", f"pretrained={model_dir}", "--tasks", tasks, "--batch_size", str(batch_size),
        "--output_path", str(out_dir),
    ]


def collect_scores(out_dir: Path) -> dict[str, float]:
    """Numeric results of every `*results*.json` lmms-eval wrote under `out_dir`, as {"lmms_eval/task/metric": value}
    (lmms-eval names metrics `metric,filter`, e.g. `exact_match,none`; the `,none` filter suffix is dropped)."""
    scores: dict[str, float] = {}
    for f in sorted(Path(out_dir).rglob("*results*.json")):
        data = json.loads(f.read_text())
        for task, values in (data.get("results") or {}).items():
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in name:
                    scores[f"lmms_eval/{task}/{name.removesuffix(',none')}"] = float(value)
    return scores


def run_lmms_eval(model_dir: Path, tasks: str, out_dir: Path, batch_size: int = 1) -> dict[str, float]:
    """Run lmms-eval's `tasks` (comma-separated) on `model_dir`, writing its files to `out_dir/lmms_eval`.

    Raises UsageError when lmms-eval is not installed, VlmctlError when it fails or reports no scores.
    """
    if not lmms_eval_available():
        raise UsageError("--lmms-eval needs the lmms-eval package, which is not installed", hint="pip install lmms-eval")
    target = Path(out_dir) / "lmms_eval"
    proc = subprocess.run(lmms_command(model_dir, tasks, target, batch_size), check=False)
    if proc.returncode != 0:
        raise VlmctlError(f"lmms-eval exited with code {proc.returncode}", hint="see its output above; check the task names with `python -m lmms_eval --tasks list`")
    scores = collect_scores(target)
    if not scores:
        raise VlmctlError(f"lmms-eval wrote no results under {target}", hint="check the task names with `python -m lmms_eval --tasks list`")
    return scores
