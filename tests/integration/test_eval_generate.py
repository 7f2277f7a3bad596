"""`vlmctl eval` with a tiny random LLaVA: batched generation, teacher-forced loss, the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_eval_runner import png_bytes, run, write_prepared
from vlmctl.data.sample import Sample
from vlmctl.evaluation import runner
from vlmctl.evaluation.loss import teacher_forced_loss
from vlmctl.inference import generate, load_for_generation, request_from_sample

QUESTIONS = ["What color?", "What shape is the object in the middle of the picture?", "How many?", "Is the square left of the circle, or right of it?"]


def make_samples(n: int) -> list[Sample]:
    colors = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    out = []
    for i in range(n):
        user = [{"type": "image", "index": 0}, {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]
        if i % 5 == 4:  # a text-only sample in the batch
            user = user[1:]
        out.append(Sample(
            id=f"s{i}",
            messages=[{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": ["red", "green", "blue"][i % 3]}]}],
            images=[png_bytes(colors[i % 3])] if i % 5 != 4 else [],
        ))
    return out


def _build_tiny(folder: Path) -> Path:
    """The project's tiny random LLaVA preset (ChatML template, `<image>` token), tokenizer trained on the samples."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    texts = [t for s in make_samples(8) for t in s.text_parts()]
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder), tokenizer_texts=texts)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return _build_tiny(tmp_path_factory.mktemp("tiny") / "model")


def test_batched_left_padded_generation_equals_one_at_a_time(tiny_model):
    samples = make_samples(6)
    model, processor = load_for_generation(tiny_model, device="cpu")
    requests = [request_from_sample(s) for s in samples]
    batched = generate(model, processor, requests, batch_size=6, max_new_tokens=6)
    single = generate(model, processor, requests, batch_size=1, max_new_tokens=6)
    assert [a for _, a in batched] == [a for _, a in single]
    prompt = batched[0][0]
    assert "What color?" in prompt and prompt.rstrip().endswith("assistant")  # cut before the answer, generation prompt added
    assert "red" not in prompt


def test_teacher_forced_loss_matches_unbatched(tiny_model):
    samples = make_samples(5)
    model, processor = load_for_generation(tiny_model, device="cpu")
    batched = teacher_forced_loss(model, processor, samples, batch_size=5)
    single = teacher_forced_loss(model, processor, samples, batch_size=1)
    for (a, n), (b, m) in zip(batched, single):
        assert n == m and n > 0 and a == pytest.approx(b, rel=1e-4)


def test_cli_eval_on_prepared_val(tiny_model, tmp_path, capsys, write_config):
    import os
    import shutil

    # The project's model export is found without naming it: newest train.output_dir/*/final.
    run_final = tmp_path / "outputs" / "runs" / "run1" / "final"
    shutil.copytree(tiny_model, run_final)
    os.utime(run_final)
    write_prepared(tmp_path / "data" / "prepared", make_samples(7))
    cfg = write_config("project:\n  name: t\neval:\n  max_new_tokens: 3\n")
    code, out, err = run(["eval", "-c", str(cfg), "--limit", "5", "--batch-size", "2"], capsys)
    assert code == 0, err
    folder = tmp_path / "outputs" / "eval" / "run1-vqa"
    summary = json.loads((folder / "metrics.json").read_text())
    assert summary["n"] == 5 and summary["task"] == "vqa" and summary["model"] == str(run_final.resolve())
    assert set(summary["metrics"]) == {"vqa_accuracy", "exact_match"}
    rows = [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"s{i}" for i in range(5)]
    assert all(r["references"] == [["red", "green", "blue"][i % 3]] and r["score"] in (0.0, 1.0) for i, r in enumerate(rows))
    page = (folder / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4  # sample s4 has no image
    assert "vqa_accuracy" in out

    code, out, err = run(["eval", str(run_final), "-c", str(cfg), "--task", "loss", "-o", str(tmp_path / "loss"), "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["task"] == "loss" and summary["n"] == 7
    assert summary["metrics"]["perplexity"] == pytest.approx(2.718281828 ** summary["metrics"]["loss"], rel=1e-6)
    assert summary["metrics"]["loss"] > 0


def test_optional_backends_give_clear_errors(tiny_model, tmp_path, capsys, write_config):
    import importlib.util

    write_prepared(tmp_path / "data" / "prepared", make_samples(2))
    cfg = write_config("project:\n  name: t\n")
    if importlib.util.find_spec("vllm") is None:
        code, _, err = run(["eval", str(tiny_model), "-c", str(cfg), "--backend", "vllm"], capsys)
        assert code == 2 and "needs the vllm package" in err
    if importlib.util.find_spec("lmms_eval") is None:
        code, _, err = run(["eval", str(tiny_model), "-c", str(cfg), "--lmms-eval", "docvqa_val"], capsys)
        assert code == 2 and "needs the lmms-eval package" in err


@pytest.mark.slow
def test_torchrun_two_ranks_shard_and_gather(tiny_model, tmp_path, write_config):
    import os
    import subprocess
    import sys

    samples = make_samples(5)
    write_prepared(tmp_path / "data" / "prepared", samples)
    cfg = write_config("project:\n  name: t\neval:\n  max_new_tokens: 3\n")
    expected = runner.run_eval(tiny_model, samples, task="vqa", batch_size=2, max_new_tokens=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLMCTL_DEBUG": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "vlmctl", "eval", str(tiny_model), "-c", str(cfg), "-o", str(tmp_path / "out"), "--batch-size", "2", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in samples]  # every sample once, in order, from both ranks
    assert [r["prediction"] for r in rows] == [r.prediction for r in expected.records]
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["n"] == 5
