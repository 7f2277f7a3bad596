"""`vlmctl generate` end to end on the shared real samples (LLaVA, ShareGPT-style and OpenAI-style messages files)
with a tiny random LLaVA: one prediction row per readable sample, in input order, scorable by `vlmctl eval`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from cli_runner import run_cli as run
from real_data import REAL
from vlmctl.config import DataSource
from vlmctl.data.formats import read_source
from vlmctl.data.sample import Sample
from vlmctl.evaluation import references_of

LLAVA = REAL / "llava_examples" / "llava_format.json"
SHAREGPT = REAL / "llamafactory_mllm_demo" / "mllm_demo.json"
MESSAGES = REAL / "llamafactory_mllm_demo" / "v1_multimodal_demo.jsonl"


def readable(source: DataSource) -> list[Sample]:
    return [s for s in read_source(source) if isinstance(s, Sample)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random LLaVA preset, tokenizer trained on the real samples' text."""
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder = tmp_path_factory.mktemp("generate") / "model"
    texts = [t for path in (LLAVA, SHAREGPT) for s in readable(DataSource(path=str(path))) for t in s.text_parts()]
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder), tokenizer_texts=texts)
    return folder


@pytest.fixture
def image_root(tmp_path) -> Path:
    # The messages file names its images relative to the LLaMA-Factory repository root (data/mllm_demo_data/N.jpg).
    root = tmp_path / "lf"
    root.mkdir()
    (root / "data").symlink_to(REAL / "llamafactory_mllm_demo", target_is_directory=True)
    return root


@pytest.mark.parametrize("name", ["llava", "sharegpt", "messages"])
def test_generate_writes_one_row_per_readable_sample(name, tiny_model, image_root, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no project file: MODEL is given
    path = {"llava": LLAVA, "sharegpt": SHAREGPT, "messages": MESSAGES}[name]
    extra = ["--image-root", str(image_root)] if name == "messages" else []
    expected = readable(DataSource(path=str(path), image_root=image_root if extra else None))
    assert expected
    out = tmp_path / "out" / "predictions.jsonl"
    code, stdout, err = run(["generate", str(tiny_model), "--input", str(path), "-o", str(out), "--batch-size", "2",
                             "--max-new-tokens", "3", "--device", "cpu", *extra], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in expected]
    for row, sample in zip(rows, expected):
        assert set(row) >= {"id", "prompt", "prediction"} and isinstance(row["prediction"], str)
        assert row["references"] == references_of(sample)
        # the prompt is the conversation cut before its last assistant turn, with the generation prompt appended
        assert row["references"][0] not in row["prompt"] and row["prompt"].rstrip().endswith("assistant")
    assert sorted(p.name for p in out.parent.iterdir()) == ["predictions.jsonl"]  # no temporary file left
    assert f"Wrote {len(rows)} predictions" in stdout and "vlmctl eval --predictions" in stdout


def test_generate_options_output_folder_json_and_scoring(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["generate", str(tiny_model), "-i", str(LLAVA), "-o", str(tmp_path / "preds"), "--limit", "2",
                          "--max-new-tokens", "2", "--temperature", "0.8", "--seed", "1", "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["n"] == 2 and summary["backend"] == "hf" and summary["output"] == str(tmp_path / "preds" / "predictions.jsonl")
    assert len((tmp_path / "preds" / "predictions.jsonl").read_text().splitlines()) == 2
    # the rows carry their references, so `vlmctl eval` scores them as they are
    code, out, err = run(["eval", "--predictions", str(tmp_path / "preds" / "predictions.jsonl"), "--task", "vqa",
                          "-o", str(tmp_path / "scored"), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["n"] == 2


def test_generate_on_the_prepared_val_split_of_a_project(tiny_model, tmp_path, capsys, monkeypatch):
    from test_eval_runner import vqa_sample, write_prepared

    write_prepared(tmp_path / "data" / "prepared", [vqa_sample(0, "red"), vqa_sample(1, "blue", answers=["blue", "navy"])])
    (tmp_path / "vlmctl.yaml").write_text("project:\n  name: g\n")
    monkeypatch.chdir(tmp_path / "data")  # the project file is found in a parent folder
    code, _, err = run(["generate", str(tiny_model), "--input", "val", "-o", "val.jsonl", "--max-new-tokens", "2"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "data" / "val.jsonl").read_text().splitlines()]
    assert [(r["id"], r["references"]) for r in rows] == [("s0", ["red"]), ("s1", ["blue", "navy"])]
    (tmp_path / "data" / "prepared" / "val" / "part-00000.parquet").unlink()
    code, _, err = run(["generate", str(tiny_model), "--input", "val"], capsys)
    assert code == 1 and "vlmctl data prepare" in err


def test_generate_usage_errors(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if importlib.util.find_spec("vllm") is None:
        code, _, err = run(["generate", str(tiny_model), "--input", str(LLAVA), "--backend", "vllm"], capsys)
        assert code == 2 and "needs the vllm package" in err and "pip install vllm" in err
    code, _, err = run(["generate", str(tiny_model), "--input", str(LLAVA), "--backend", "tgi"], capsys)
    assert code == 2 and "unknown backend" in err
    code, _, err = run(["generate", str(tiny_model), "--input", str(LLAVA), "--format", "csv"], capsys)
    assert code == 2 and "unknown --format" in err
    code, _, err = run(["generate", str(tiny_model), "--input", str(LLAVA), "--batch-size", "0"], capsys)
    assert code == 2 and "batch_size must be positive" in err
    code, _, err = run(["generate", str(tiny_model), "--input", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 1 and "does not exist" in err
    code, _, err = run(["generate", "--input", str(LLAVA)], capsys)
    assert code == 2 and "no MODEL given" in err
    code, _, err = run(["generate", str(tiny_model)], capsys)
    assert code == 2 and "--input" in err
    assert not (tmp_path / "predictions.jsonl").exists()
