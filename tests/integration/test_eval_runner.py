"""`vlmctl eval` without a model: scoring predictions files, reading samples, model folder checks, outputs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from vlmctl.data.sample import Sample, arrow_schema
from vlmctl.errors import DataError, ModelError
from vlmctl.evaluation import runner
from vlmctl.inference import check_model_dir, request_from_sample
from cli_runner import run_cli as run




def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def png_bytes(color=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def vqa_sample(i: int, answer: str, **meta) -> Sample:
    return Sample(
        id=f"s{i}",
        messages=[
            {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        images=[png_bytes()],
        meta=meta,
    )


def write_prepared(folder: Path, samples: list[Sample]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "val").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([s.to_row() for s in samples], schema=arrow_schema()), folder / "val" / "part-00000.parquet")
    return folder


def test_predictions_file_scored_without_a_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no project file here
    preds = write_jsonl(tmp_path / "preds.jsonl", [
        {"id": "q1", "prediction": "Two", "answers": [{"answer": "2"}] * 3 + [{"answer": "3"}] * 7},
        {"id": "q2", "prediction": "red", "references": ["red"]},
        {"id": "q3", "prediction": "a dog", "answer": "cat"},
    ])
    code, out, err = run(["eval", "--predictions", str(preds), "--task", "vqa"], capsys)
    assert code == 0, err
    assert "vqa_accuracy" in out and "0.6333" in out  # (0.9 + 1 + 0) / 3
    folder = tmp_path / "preds-scored"
    summary = json.loads((folder / "metrics.json").read_text())
    assert set(summary) == {"task", "model", "data", "n", "metrics"}
    assert summary["task"] == "vqa" and summary["n"] == 3
    assert summary["metrics"]["vqa_accuracy"] == pytest.approx((0.9 + 1 + 0) / 3)
    rows = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    assert [r["score"] for r in rows] == pytest.approx([0.9, 1.0, 0.0])
    assert rows[0]["references"][0] == "2" and set(rows[0]) >= {"id", "prompt", "prediction", "references", "score"}
    assert "<table>" in (folder / "report.html").read_text()


def test_predictions_auto_task_mcq_json_and_limit(tmp_path, capsys):
    preds = write_jsonl(tmp_path / "mc.jsonl", [
        {"id": 1, "prediction": "The answer is (B).", "answer": "B", "options": ["cat", "dog"]},
        {"id": 2, "prediction": "cat", "answer": "B", "options": ["cat", "dog"]},
        {"id": 3, "prediction": "dog", "answer": "dog", "options": ["cat", "dog"]},
    ])
    code, out, err = run(["eval", "--predictions", str(preds), "-o", str(tmp_path / "o"), "--json", "--limit", "2"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["task"] == "mcq" and summary["n"] == 2
    assert summary["metrics"] == {"mcq_accuracy": 0.5, "mcq_unparsed": 0.0}


def test_predictions_caption_task(tmp_path, capsys):
    preds = write_jsonl(tmp_path / "cap.jsonl", [
        {"id": "a", "prediction": "a red square on grey", "references": ["a red square on grey", "red square"]},
        {"id": "b", "prediction": "two blue circles side by side", "references": ["two blue circles side by side"]},
    ])
    code, out, err = run(["eval", "--predictions", str(preds), "--task", "caption", "-o", str(tmp_path / "o"), "--json"], capsys)
    assert code == 0, err
    metrics = json.loads(out)["metrics"]
    assert metrics["bleu4"] == pytest.approx(1.0) and metrics["cider"] > 1.0


def test_bad_predictions_file_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prediction": "x", "answer": "x"}\n{"id": 2, "prediction": \n')
    code, _, err = run(["eval", "--predictions", str(bad), "-o", str(tmp_path / "o")], capsys)
    assert code == 1 and "bad.jsonl:2" in err and "not valid JSON" in err
    write_jsonl(bad, [{"id": 1, "prediction": "x"}])
    code, _, err = run(["eval", "--predictions", str(bad), "-o", str(tmp_path / "o")], capsys)
    assert code == 1 and "bad.jsonl:1: missing references" in err
    code, _, err = run(["eval", "--predictions", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o")], capsys)
    assert code == 1 and "no such predictions file" in err
    write_jsonl(bad, [{"id": 1, "prediction": "x", "answer": "x"}])
    code, _, err = run(["eval", "--predictions", str(bad), "--task", "loss", "-o", str(tmp_path / "o")], capsys)
    assert code == 2 and "needs a model" in err


def test_load_samples_from_prepared_val_with_limit_and_references(tmp_path):
    samples = [vqa_sample(0, "red"), vqa_sample(1, "blue", answers=["blue", "navy"]), vqa_sample(2, "green")]
    prepared = write_prepared(tmp_path / "prepared", samples)
    got = runner.load_samples("val", prepared, limit=2)
    assert [s.id for s in got] == ["s0", "s1"]
    assert runner.references_of(got[0]) == ["red"]
    assert runner.references_of(got[1]) == ["blue", "navy"]
    assert got[0].images == samples[0].images
    cut = request_from_sample(got[0])
    assert [m["role"] for m in cut.messages] == ["user"]
    # a prepared split folder also works as --data PATH
    assert len(runner.load_samples(str(prepared / "val"), tmp_path / "unused")) == 3
    with pytest.raises(DataError, match="no prepared val split"):
        runner.load_samples("val", tmp_path / "missing")
    with pytest.raises(DataError, match="no such file"):
        runner.load_samples(str(tmp_path / "nope.json"), prepared)


def test_the_default_model_is_the_newest_final_among_equal_runs(tmp_path):
    import os

    from vlmctl.runs import project_model

    runs = tmp_path / "runs"
    for i, name in enumerate(["old", "new"]):
        (runs / name / "final").mkdir(parents=True)
        os.utime(runs / name / "final", (1000 + i, 1000 + i))
    (runs / "no-final").mkdir()
    assert project_model(runs, tmp_path / "model").path == (runs / "new" / "final").resolve()
    assert project_model(tmp_path / "none", tmp_path / "model").path == tmp_path / "model"


def test_model_folder_without_processor_is_a_clear_error(tmp_path, capsys, write_config):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="has no processor") as exc:
        check_model_dir(model)
    assert str(model) in exc.value.message and "save_pretrained" in exc.value.hint
    with pytest.raises(ModelError, match="no model folder"):
        check_model_dir(tmp_path / "missing")
    # through the CLI: one red panel naming the folder and the fix, exit code 1
    write_prepared(tmp_path / "data" / "prepared", [vqa_sample(0, "red")])
    cfg = write_config("project:\n  name: t\n")
    code, _, err = run(["eval", str(model), "-c", str(cfg)], capsys)
    assert code == 1 and "has no processor" in err and "Fix:" in err


def test_fold_lmms_scores_into_existing_metrics(tmp_path):
    from vlmctl.evaluation.lmms import collect_scores, lmms_command

    (tmp_path / "metrics.json").write_text(json.dumps({"task": "vqa", "model": "/m", "data": "val", "n": 5, "metrics": {"vqa_accuracy": 0.5}}))
    res_dir = tmp_path / "lmms_eval" / "m"
    res_dir.mkdir(parents=True)
    (res_dir / "2025_results.json").write_text(json.dumps({"results": {"docvqa_val": {"alias": "docvqa_val", "anls,none": 0.71, "anls_stderr,none": 0.01}}}))
    scores = collect_scores(tmp_path / "lmms_eval")
    assert scores == {"lmms_eval/docvqa_val/anls": 0.71}
    runner.fold_into_metrics(tmp_path, scores, model="/m", data="lmms")
    merged = json.loads((tmp_path / "metrics.json").read_text())
    assert merged["metrics"] == {"vqa_accuracy": 0.5, "lmms_eval/docvqa_val/anls": 0.71} and merged["n"] == 5
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    assert "llava_hf" in lmms_command(tmp_path, "docvqa_val", tmp_path / "x", 2)


def test_base_mode_build_folder_checks_its_source(tmp_path):
    source = tmp_path / "base"
    source.mkdir()
    (source / "config.json").write_text("{}")
    built = tmp_path / "built"
    built.mkdir()
    (built / "vlmctl_model.json").write_text(json.dumps({"mode": "base", "source": str(source), "family": "llava"}))
    with pytest.raises(ModelError, match=f"{source} has no processor"):
        check_model_dir(built)
    for name in ("preprocessor_config.json", "tokenizer.json"):
        (source / name).write_text("{}")
    check_model_dir(built)


def test_report_page_escapes_text_and_inlines_images(tmp_path):
    from vlmctl.evaluation.metrics import ScoredRecord
    from vlmctl.evaluation.report import render_report

    recs = [ScoredRecord("m1", "<b>B</b>", ["B"], options=["cat & dog", "fish"], prompt="Which?", score=0.0)]
    result = runner.EvalResult(task="mcq", model="/m", data="val", metrics={"mcq_accuracy": 0.0}, records=recs)
    page = render_report(result, {"m1": png_bytes()})
    assert "<b>&lt;b&gt;B&lt;/b&gt;</b>" in page  # the prediction, escaped, in bold
    assert "A. cat &amp; dog" in page and "B. fish" in page
    assert page.count("data:image/png;base64,") == 1 and "class='bad'" in page


def test_load_samples_reads_raw_formats(tmp_path):
    from vlmctl.data.synthetic import generate_shapes_vqa

    path = generate_shapes_vqa(tmp_path / "shapes", num_samples=4, image_size=32)
    got = runner.load_samples(str(path), tmp_path / "unused", limit=3)
    records = json.loads(path.read_text())
    assert [s.id for s in got] == [r["id"] for r in records[:3]]
    assert [runner.references_of(s) for s in got] == [[r["conversations"][1]["value"]] for r in records[:3]]
    assert all(len(s.images) == 1 for s in got)
