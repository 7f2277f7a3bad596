"""End to end on real data: three input formats merged in one project -> validate -> prepare -> build -> train
(torchrun, 2 processes, FSDP2) -> convert --verify -> eval --task loss -> push --dry-run. Each stage's output is
checked, not only its exit code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cli_runner import run_cli as run
from real_data import REAL, tree_digest, write_real_project

STEPS = 4

pytestmark = pytest.mark.slow




def as_json(out: str):
    """The JSON document printed by --json (libraries may log a line before it on the same stream)."""
    start = 0 if out.startswith("{") else out.index("\n{") + 1
    return json.loads(out[start:])


def write_project(root: Path) -> Path:
    return write_real_project(
        root,
        # The messages file repeats the ShareGPT demo in another format: keep both so that all three readers feed
        # training (with dedup on, those 24 samples are dropped as `duplicate`, checked below).
        "  dedup: false\n"
        "project:\n  name: e2e\n"
        "model:\n  preset: tiny\n  init: random\n  dtype: fp32\n"
        "train:\n  stage: full\n  precision: fp32\n  packing: true\n  tokens_per_batch: 1024\n  learning_rate: 2.0e-3\n"
        f"  max_steps: {STEPS}\n  save_steps: 2\n  logging_steps: 1\n  num_workers: 0\n  run_name: e2e-run\n"
        "hub:\n  repo_id: example-org/e2e-tiny\n",
    )


def test_real_formats_end_to_end(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = tree_digest(REAL)
    root = tmp_path / "proj"
    config = write_project(root)
    c = ["-c", str(config)]

    # ---- data validate: clean with the project's settings; with dedup the only finding is the repeated demo
    code, out, err = run([*c, "data", "validate", "--json"], capfd)
    assert code == 0, err
    report = as_json(out)
    assert report["ok"] and report["total"] == report["kept"] == 33 and report["rejected"] == 0
    code, out, _ = run([*c, "data", "validate", "--json", "data.dedup=true"], capfd)
    report = as_json(out)
    assert code == 1 and report["counts"] == {"duplicate": 24} and report["kept"] == 9
    by_source = {s["name"]: s for s in report["sources"]}
    assert by_source["v1_multimodal_demo.jsonl"]["rejected"] == {"duplicate": 24}

    # ---- data prepare
    code, out, err = run([*c, "data", "prepare", "--num-proc", "1", "--json"], capfd)
    assert code == 0, err
    prepared = as_json(out)
    assert {s["format"]: s["kept"] for s in prepared["sources"]} == {"llava": 3, "sharegpt": 6, "messages": 24}
    n_train, n_val = prepared["splits"]["train"]["samples"], prepared["splits"]["val"]["samples"]
    assert n_train + n_val == 33 and n_train >= 4 and n_val >= 1
    pdir = root / "data" / "prepared"
    assert (pdir / "manifest.json").is_file() and list((pdir / "train").glob("*.parquet")) and list((pdir / "val").glob("*.parquet"))

    # ---- model build (tiny, random init; tokenizer trained on the prepared data)
    code, out, err = run([*c, "model", "build", "--json"], capfd)
    assert code == 0, err
    built = as_json(out)
    mdir = root / "outputs" / "model"
    assert built["summary"]["visual_tokens_per_image"] == 64 and built["summary"]["parameters"]["total"] > 0
    assert (mdir / "config.json").is_file() and (mdir / "tokenizer.json").is_file() and (mdir / "processor_config.json").is_file()

    # ---- train: torchrun, 2 processes, FSDP2 on CPU
    code, out, err = run([*c, "train", "--launcher", "torchrun", "--nproc-per-node", "2", "--strategy", "fsdp"], capfd)
    assert code == 0, err + out[-3000:]
    run_dir = root / "outputs" / "runs" / "e2e-run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # same data every step at this size: the loss goes down
    ckpt = run_dir / "checkpoints" / f"checkpoint-{STEPS}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["world_size"] == 2 and state["strategy"] == "fsdp"
    final = run_dir / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()

    # ---- convert the DCP checkpoint of the last step; --verify compares logits with the checkpoint's model
    export = root / "outputs" / "export"
    code, out, err = run(["convert", str(ckpt), "-o", str(export), "--verify", "--json"], capfd)
    assert code == 0, err
    conv = as_json(out)
    assert conv["kind"] == "dcp" and conv["verify"]["passed"] and conv["verify"]["max_abs_diff"] <= conv["verify"]["tolerance"]
    assert {"config.json", "model.safetensors"} <= {name for name, _ in conv["files"]}
    from safetensors.torch import load_file

    exported, trained = load_file(export / "model.safetensors"), load_file(final / "model.safetensors")
    assert exported.keys() == trained.keys()
    assert all((exported[k].float() - trained[k].float()).abs().max() == 0 for k in trained)  # same step, same weights

    # ---- eval --task loss on the val split
    code, out, err = run([*c, "eval", str(export), "--task", "loss", "--json"], capfd)
    assert code == 0, err
    ev = as_json(out)
    assert ev["task"] == "loss" and ev["n"] == n_val
    assert ev["metrics"]["loss"] > 0 and ev["metrics"]["perplexity"] == pytest.approx(math.exp(ev["metrics"]["loss"]))
    eval_dir = Path(ev["output_dir"])
    lines = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == n_val and sum(r["tokens"] for r in lines) == ev["metrics"]["tokens"]

    # ---- push --dry-run: the files that would be uploaded and a generated model card
    code, out, err = run([*c, "push", str(export), "--dry-run", "--json"], capfd)
    assert code == 0, err
    push = as_json(out)
    assert push["dry_run"] and push["repo_id"] == "example-org/e2e-tiny" and push["card_generated"]
    sizes = {f["path"]: f["size"] for f in push["files"]}
    assert sizes["model.safetensors"] == (export / "model.safetensors").stat().st_size and "README.md" in sizes
    assert "example-org/e2e-tiny" in push["card"] or "e2e" in push["card"]

    assert tree_digest(REAL) == before  # inputs are never modified
