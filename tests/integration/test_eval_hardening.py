"""`vlmctl eval` loses nothing silently: every skipped sample is reported (console, metrics.json, skipped.jsonl,
report.html), and no evaluation overwrites an earlier one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from test_eval_runner import run, write_prepared
from vlmctl.evaluation import runner
from vlmctl.evaluation.metrics import ScoredRecord
from vlmctl.evaluation.results import EvalResult


def write_llava_eval(folder: Path, name: str = "llava_eval.json") -> Path:
    """5 VQA records: 3 good, one with a missing image, one with two placeholders for one image."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, color in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        Image.new("RGB", (32, 32), color).save(folder / f"{i}.png")

    def rec(i, image, question="<image>\nWhat color?"):
        return {"id": f"q{i}", "image": image,
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "red"}]}

    records = [rec(0, "0.png"), rec(1, "gone.png"), rec(2, "1.png"), rec(3, "2.png", "<image> and <image>?"), rec(4, "2.png")]
    path = folder / name
    path.write_text(json.dumps(records, indent=1))
    return path


def test_load_samples_returns_the_skipped_samples_with_reasons(tmp_path):
    path = write_llava_eval(tmp_path / "raw")
    samples = runner.load_samples(str(path), tmp_path / "unused")
    assert [s.id for s in samples] == ["q0", "q2", "q4"]
    assert [(s["id"], s["reason"]) for s in samples.skipped] == [("q1", "missing_image"), ("q3", "placeholder_mismatch")]
    assert samples.skipped[0]["location"].endswith("llava_eval.json:16") and "gone.png" in samples.skipped[0]["detail"]
    # the prepared val split has nothing to skip
    write_prepared(tmp_path / "prepared", list(samples))
    assert runner.load_samples("val", tmp_path / "prepared").skipped == []


def test_outputs_list_every_skipped_sample(tmp_path):
    skipped = [{"source": "x.json", "location": "x.json:16", "reason": "missing_image", "detail": "gone.png does not exist", "id": "q1"},
               {"source": "x.json", "location": "x.json:21", "reason": "placeholder_mismatch", "detail": "2 <image> for 1", "id": "q3"}]
    recs = [ScoredRecord("q0", "red", ["red"], prompt="What color?", score=1.0)]
    result = EvalResult(task="vqa", model="/m", data="x.json", metrics={"vqa_accuracy": 1.0}, records=recs, skipped=skipped)
    runner.write_outputs(result, tmp_path / "out", [r.to_json() for r in recs])
    summary = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert summary["n"] == 1
    assert summary["skipped"] == {"count": 2, "reasons": {"missing_image": 1, "placeholder_mismatch": 1}, "file": "skipped.jsonl"}
    rows = [json.loads(x) for x in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert rows == skipped
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Skipped samples (2)" in page and "x.json:21" in page and "2 &lt;image&gt; for 1" in page
    # without skipped samples metrics.json keeps its plain shape
    clean = EvalResult(task="vqa", model="/m", data="val", metrics={"vqa_accuracy": 1.0}, records=recs)
    assert set(clean.summary()) == {"task", "model", "data", "n", "metrics"}


def test_output_folders_are_named_after_the_data_and_never_reused(tmp_path):
    root = tmp_path / "eval"
    first = runner.default_output_dir(root, "run1", "vqa", "val")
    assert first == root / "run1-vqa" and first.is_dir()
    assert runner.default_output_dir(root, "run1", "vqa", "val") == root / "run1-vqa-2"
    assert runner.default_output_dir(root, "run1", "vqa", "data/raw/llava_train.json") == root / "run1-vqa-llava_train"
    assert runner.default_output_dir(root, "run1", "vqa", "data/raw/llava_train.json", create=False) == root / "run1-vqa-llava_train-2"
    assert runner.default_output_dir(root, "../x y", "caption", "a b/c d.jsonl").name == "x_y-caption-c_d"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from test_eval_generate import _build_tiny

    return _build_tiny(tmp_path_factory.mktemp("tiny") / "model")


def test_cli_reports_skipped_samples_and_keeps_earlier_evaluations(tiny_model, tmp_path, capsys, write_config):
    data = write_llava_eval(tmp_path / "raw")
    cfg = write_config("project:\n  name: t\neval:\n  max_new_tokens: 2\n")
    code, out, err = run(["eval", str(tiny_model), "-c", str(cfg), "--data", str(data), "--task", "vqa"], capsys)
    assert code == 0, err
    assert "Skipped 2 of 5 samples" in out and "missing_image 1, placeholder_mismatch 1" in out
    folder = tmp_path / "outputs" / "eval" / "model-vqa-llava_eval"
    summary = json.loads((folder / "metrics.json").read_text())
    assert summary["n"] == 3 and summary["skipped"]["count"] == 2
    assert len((folder / "skipped.jsonl").read_text().splitlines()) == 2
    assert "Skipped samples (2)" in (folder / "report.html").read_text()

    # the same evaluation again, then another data set: new folders, the first one untouched
    before = (folder / "predictions.jsonl").read_bytes()
    code, out, err = run(["eval", str(tiny_model), "-c", str(cfg), "--data", str(data), "--task", "vqa", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["output_dir"] == str(folder.with_name("model-vqa-llava_eval-2"))
    other = write_llava_eval(tmp_path / "raw2", "other.json")
    code, out, err = run(["eval", str(tiny_model), "-c", str(cfg), "--data", str(other), "--task", "vqa", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["output_dir"] == str(folder.with_name("model-vqa-other"))
    assert (folder / "predictions.jsonl").read_bytes() == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["model-vqa-llava_eval", "model-vqa-llava_eval-2", "model-vqa-other"]
