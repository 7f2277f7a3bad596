"""Benchmark the host memory and start-up time of `vlmctl train` on CPU: peak PSS summed over the launcher, the
launch agent and every rank, per phase of the run, and the time from launch to the start-up table and to the first
step.

    python benchmarks/bench_train_memory.py --workdir /tmp/bench_train_memory              # this checkout
    python benchmarks/bench_train_memory.py --workdir /tmp/bench_train_memory --code /tmp/old-vlmctl --label before

The project is the `tiny` template (`vlmctl init`, `data prepare`, `model build`) whose language model is then
replaced by a wider and deeper random-init Qwen2 (`--hidden`, `--layers`; 24 x 1024 gives 0.27B parameters), saved
in bf16 as `model build` saves (0.54 GB), so the weights dominate the processes' memory. `vlmctl train` runs
torchrun with `--nproc-per-node` ranks (FSDP2 over gloo, fp32 as on every CPU run: the bf16 weights are read into
fp32, 1.09 GB), `--steps` steps of 2 samples per rank, the final checkpoint and the export. `--code DIR` runs the
`vlmctl` package found in DIR instead (e.g. another commit unpacked with `git archive COMMIT vlmctl | tar -x -C
DIR`), so two versions are measured on the same project.

Memory: every `--interval` seconds the script sums `Pss` of `/proc/<pid>/smaps_rollup` over the `vlmctl train`
process and all its descendants (PSS splits shared pages among the processes that map them, so the sum counts the
shared libraries and page-cache mappings once) and keeps the peak of each phase: `load` (launch to the start-up
table, which the ranks print once the model is loaded, wrapped and holds its weights), `train` (to the last step's
line) and `end` (the final checkpoint and export, to the exit). On CPU the training state (gathered layers,
gradients, AdamW moments) lives in host memory too, so the `train` phase shows training's own footprint; on GPUs
only the `load` and `end` phases use host memory for weights. Times: from starting `vlmctl train` to the start-up
table and to the first step's line. Results are printed as a Markdown row and written to
`<workdir>/results-<label>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def vlmctl(workdir: Path, *args: str, env: dict | None = None) -> None:
    """Run `python -m vlmctl ARGS` in `workdir`; raise with its output when it fails."""
    proc = subprocess.run([sys.executable, "-m", "vlmctl", *args], cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"vlmctl {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def make_project(workdir: Path, *, hidden: int, layers: int, preset: str | None = None) -> int:
    """The tiny template's project in `workdir` (kept between runs) with a `layers` x `hidden` Qwen2 language
    model, or (`preset`) the size preset's whole model, random init, built by `vlmctl model build`. Returns the
    model's parameter count."""
    import torch
    import transformers
    import yaml

    model_dir = workdir / "outputs" / "model"
    if not (workdir / "vlmctl.yaml").is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        vlmctl(workdir, "init", ".")
        vlmctl(workdir, "data", "prepare")
    if preset is not None:
        marker = workdir / f".model-{preset}"
        if not marker.is_file():
            project = yaml.safe_load((workdir / "vlmctl.yaml").read_text())
            project["model"] = {"preset": preset, "init": "random", "output_dir": "outputs/model"}
            (workdir / "vlmctl.yaml").write_text(yaml.safe_dump(project, sort_keys=False))
            vlmctl(workdir, "model", "build", "--force")
            for old in workdir.glob(".model-*"):
                old.unlink()
            marker.touch()
        config = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(config)
        return sum(p.numel() for p in model.parameters())
    marker = workdir / f".model-{layers}x{hidden}"
    if not marker.is_file():
        vlmctl(workdir, "model", "build", "--force")
        config = transformers.AutoConfig.from_pretrained(model_dir)
        text = config.text_config.to_dict()
        text.pop("layer_types", None)  # derived from the number of layers
        text.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=11 * hidden // 4, head_dim=64,
                    num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256))
        config.text_config = type(config.text_config)(**text)
        torch.manual_seed(0)
        model = transformers.LlavaForConditionalGeneration(config).to(torch.bfloat16)  # model.dtype's default
        model.save_pretrained(model_dir)
        for old in workdir.glob(".model-*"):
            old.unlink()
        marker.touch()
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def tree_pss(root: int) -> tuple[int, int]:
    """(summed PSS in bytes, number of processes) of process `root` and its descendants."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = 0
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total, len(procs)


def measure(workdir: Path, *, label: str, nproc: int, steps: int, code: Path | None, interval: float,
            extra: list[str] = ()) -> dict:
    """Run `vlmctl train` once and sample its processes' PSS until it exits, per phase: `load` (launch to the
    start-up table, printed once the model is loaded, wrapped and its weights placed), `train` (to the last step's
    line) and `end` (the final checkpoint and the export, to the exit)."""
    import threading

    run = workdir / "outputs" / "runs" / label
    subprocess.run(["rm", "-rf", str(run)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if code is not None:
        env["PYTHONPATH"] = f"{code}{os.pathsep}{env.get('PYTHONPATH', '')}"
    overrides = [f"train.run_name={label}", f"train.max_steps={steps}", "train.save_steps=100000", "train.logging_steps=1",
                 "train.micro_batch_size=2", "train.strategy=fsdp", f"train.nproc_per_node={nproc}", *extra]
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "vlmctl", "train", "--launcher", "torchrun", *overrides], cwd=workdir,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "world size" in line:
                marks.setdefault("train", time.monotonic() - start)
            if f"step 1/{steps}" in line:
                marks.setdefault("step1", time.monotonic() - start)
            if f"step {steps}/{steps}" in line:
                marks.setdefault("end", time.monotonic() - start)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peaks = {"load": 0, "train": 0, "end": 0}
    most = 0
    while proc.poll() is None:
        pss, count = tree_pss(proc.pid)
        most = max(most, count)
        phase = "end" if "end" in marks else "train" if "train" in marks else "load"
        peaks[phase] = max(peaks[phase], pss)
        time.sleep(interval)
    wall = time.monotonic() - start
    reader.join(timeout=10)
    if proc.returncode != 0:
        raise SystemExit("vlmctl train failed:\n" + "".join(lines)[-4000:])
    return {"label": label, "peak_pss_bytes": max(peaks.values()), "peak_pss_by_phase_bytes": peaks,
            "startup_table_s": marks.get("train"), "first_step_s": marks.get("step1"), "wall_s": wall,
            "processes": most, "nproc": nproc, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_train_memory"))
    parser.add_argument("--label", default="after", help="run name and results file suffix")
    parser.add_argument("--code", type=Path, default=None, help="a folder holding another vlmctl package to measure")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between PSS samples")
    parser.add_argument("--preset", default=None,
                        help="build this size preset's whole model (random init) instead of the widened tiny one, "
                             "e.g. qwen2.5-vl-7b on GPUs")
    parser.add_argument("overrides", nargs="*", help="extra KEY=VALUE overrides for `vlmctl train`")
    args = parser.parse_args()

    params = make_project(args.workdir, hidden=args.hidden, layers=args.layers, preset=args.preset)
    result = measure(args.workdir, label=args.label, nproc=args.nproc_per_node, steps=args.steps, code=args.code,
                     interval=args.interval, extra=args.overrides)
    result.update({"parameters": params, "checkpoint_bytes_bf16": 2 * params, "cpu": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count()})
    (args.workdir / f"results-{args.label}.json").write_text(json.dumps(result, indent=2))
    gb, peaks = 1e9, result["peak_pss_by_phase_bytes"]
    print("| run | ranks | parameters | peak PSS: load / train / checkpoint + export (GB) | launch to start-up table / "
          "step 1 (s) | wall (s) |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.label} | {args.nproc_per_node} | {params / 1e6:.0f}M ({2 * params / gb:.2f} GB bf16) | "
          f"{peaks['load'] / gb:.2f} / {peaks['train'] / gb:.2f} / {peaks['end'] / gb:.2f} | "
          f"{result['startup_table_s']:.1f} / {result['first_step_s']:.1f} | {result['wall_s']:.1f} |")

if __name__ == "__main__":
    main()
