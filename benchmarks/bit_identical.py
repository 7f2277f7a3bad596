"""Bit-identity of training between two versions of vlmctl on the CPU suite's runs.

Builds one tiny model and one prepared data set (as tests/integration/test_train_runs.py does), then runs the same
short `vlmctl train` (2 ranks under torchrun, gloo) once with the `vlmctl` package of a reference tree and once with
this checkout's, for each case: fsdp, ddp, zero3, sequence parallelism (SP=2 with activation checkpointing and the
tiled MLP) and LoRA (with gradient accumulation). It compares, exactly:

- every metrics.jsonl row's loss, loss_avg, grad_norm, lr, label_tokens and token counts;
- the bytes of every file of the final export's `*.safetensors`.

Usage (from the repository root)::

    python benchmarks/bit_identical.py                   # the reference is `git merge-base HEAD main`
    python benchmarks/bit_identical.py --ref-commit c23213c --cases fsdp,lora --work /tmp/bitid

Exit status 0 when every case is identical, 1 otherwise (the differing fields and files are printed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("step", "loss", "loss_avg", "grad_norm", "lr", "label_tokens", "text_tokens", "visual_tokens", "dummy_images")
COMMON = ["train.max_steps=4", "train.save_steps=2", "train.logging_steps=1"]
CASES = {
    "fsdp": ["--strategy", "fsdp"],
    "ddp": ["--strategy", "ddp"],
    "zero3": ["--strategy", "zero3", "train.tokens_per_batch=100"],
    "sp2": ["--strategy", "fsdp", "train.sequence_parallel=2", "train.activation_checkpointing=full", "train.tiled_mlp=2",
            "train.attn_implementation=sdpa"],
    "lora": ["--strategy", "fsdp", "train.stage=finetune", "train.lora.r=4", "train.lora.alpha=8", "train.lora.dropout=0",
             "train.gradient_accumulation_steps=2"],
}
TOKENIZER_TEXTS = ["What color is the triangle? How many circles are there? Is the square left of the circle? "
                   "What shape is the red object? Answer with one word. red green blue yellow purple yes no 0 1 2 3"] * 20
CONFIG = """
project: {name: bitid}
data: {prepared_dir: data/prepared, max_length: 512}
model: {preset: tiny, init: random, output_dir: model}
train:
  stage: full
  strategy: fsdp
  nproc_per_node: 2
  precision: fp32
  learning_rate: 2.0e-3
  warmup_ratio: 0.0
  micro_batch_size: 2
  tokens_per_batch: 192
  max_steps: 4
  save_steps: 2
  logging_steps: 1
  num_workers: 0
  output_dir: runs
"""


def build_project(folder: Path) -> None:
    """The tiny model and 96 prepared samples of the integration tests, with this checkout's code."""
    if (folder / "vlmctl.yaml").is_file():
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from shapes_shards import write_shapes_shards

    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    folder.mkdir(parents=True, exist_ok=True)
    write_shapes_shards(folder / "data", 96)
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder / "model"), tokenizer_texts=TOKENIZER_TEXTS)
    (folder / "vlmctl.yaml").write_text(CONFIG)


def reference_tree(commit: str, folder: Path) -> Path:
    """`commit`'s vlmctl package extracted under `folder` (the PYTHONPATH of the reference runs)."""
    if not (folder / "vlmctl").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "vlmctl"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def check_imports(code: Path, cwd: Path) -> None:
    """Raise SystemExit unless a process started in `cwd` (as the runs are) with PYTHONPATH=`code` imports the
    vlmctl package under `code` (an installed vlmctl must not stand in for the one compared)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    found = subprocess.run([sys.executable, "-c", "import vlmctl; print(vlmctl.__file__)"], env=env, check=True,
                           cwd=cwd, capture_output=True, text=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(code.resolve()):
        raise SystemExit(f"PYTHONPATH={code} imports vlmctl from {found}")


def train(project: Path, code: Path, name: str, args: list[str], port: int) -> Path:
    """One `vlmctl train` run of `project` with the vlmctl package under `code`; returns its run folder."""
    check_imports(code, project)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vlmctl", "-c", str(project / "vlmctl.yaml"), "train", "--launcher", "torchrun",
           "--nproc-per-node", "2", "--master-port", str(port), *args, *COMMON, f"train.run_name={name}"]
    out = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    return project / "runs" / name


def rows(run: Path) -> list[dict]:
    return [{k: r.get(k) for k in FIELDS} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def export_digests(run: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run / "final").glob("*.safetensors"))}


def compare(ref: Path, new: Path) -> list[str]:
    """What differs between two runs' rows and exported weights (empty when bit-identical)."""
    problems = []
    a, b = rows(ref), rows(new)
    if len(a) != len(b):
        problems.append(f"{len(a)} metrics rows against {len(b)}")
    for x, y in zip(a, b):
        for key in FIELDS:
            if x[key] != y[key]:
                problems.append(f"step {x['step']}: {key} {x[key]!r} != {y[key]!r}")
    da, db = export_digests(ref), export_digests(new)
    if not da:
        problems.append("no exported safetensors in the reference run")
    if da != db:
        problems.append(f"exported weights differ: {da} != {db}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref-commit", default=None, help="the reference commit (default: merge-base of HEAD and main)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "vlmctl-bit-identical")
    opts = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # this checkout's vlmctl builds the shared model and data
    commit = opts.ref_commit or subprocess.run(["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], check=True,
                                               capture_output=True, text=True).stdout.strip()
    project = opts.work / "project"
    build_project(project)
    ref_code = reference_tree(commit, opts.work / f"ref-{commit[:12]}")
    from vlmctl.distributed.env import free_port

    failed = 0
    for case in opts.cases.split(","):
        runs = {}
        for label, code in (("ref", ref_code), ("new", ROOT)):
            name = f"{case}-{label}"
            subprocess.run(["rm", "-rf", str(project / "runs" / name)], check=True)
            runs[label] = train(project, code, name, CASES[case], free_port())
        problems = compare(runs["ref"], runs["new"])
        steps = len(rows(runs["new"]))
        print(f"{case:6s} {'IDENTICAL' if not problems else 'DIFFERENT'}: {steps} steps' losses, grad norms, lr and "
              f"token counts; {len(export_digests(runs['new']))} exported safetensors file(s) against {commit[:12]}", flush=True)
        for line in problems[:20]:
            print("   ", line)
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
