"""`vlmctl eval MODEL --lmms-eval TASKS` end to end.

With the stand-in lmms-eval of tests/lmms_stub.py (always): the device reaches the adapter, lmms-eval's output
goes to stderr and lmms_eval.log, its scores come back into metrics.json, and a failing run (including one that
exits 0, as lmms-eval's CLI does) is a failing `vlmctl eval` that shows lmms-eval's error.

With the real lmms-eval (when installed, with decord for its llava_hf adapter): a local task (JSONL + images in a
folder passed with --lmms-eval-include) on the tiny random LLaVA, offline; and, marked `network`, a Hub task.
Tests marked `network` run only when selected (`-m network`) or with VLMCTL_TEST_NETWORK=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from cli_runner import run_cli as run
from lmms_stub import fake_model_dir, use_stub, write_stub

# Looked up before any test puts the stand-in on the path.
if importlib.util.find_spec("lmms_eval") is None:
    _NO_REAL_LMMS = ("lmms-eval is not installed here (it requires torchvision, and PyPI's torchvision does not load "
                     "beside a CPU build of torch): see docs/evaluation.md")
elif importlib.util.find_spec("decord") is None:
    _NO_REAL_LMMS = "lmms-eval's llava_hf adapter imports decord, which is not installed"
else:
    _NO_REAL_LMMS = ""
needs_real_lmms = pytest.mark.skipif(bool(_NO_REAL_LMMS), reason=_NO_REAL_LMMS or "-")


def _network_selected(config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return os.environ.get("VLMCTL_TEST_NETWORK") == "1" or (re.search(r"\bnetwork\b", expr) is not None and "not network" not in expr)


@pytest.fixture(autouse=True)
def _network_only_when_selected(request):
    if request.node.get_closest_marker("network") and not _network_selected(request.config):
        pytest.skip("needs the Hugging Face Hub (lmms-eval downloads the task's data when it runs): select with -m network")


@pytest.fixture
def project(tmp_path, write_config, monkeypatch):
    """(model folder, project file) in tmp_path; the working directory is tmp_path."""
    monkeypatch.chdir(tmp_path)
    return fake_model_dir(tmp_path / "model"), write_config("project:\n  name: t\n")


@pytest.fixture
def stub(tmp_path, monkeypatch):
    def write(**kwargs) -> Path:
        root = write_stub(tmp_path / "stub", **kwargs)
        use_stub(monkeypatch, root)
        monkeypatch.setenv("LMMS_STUB_ARGV", str(tmp_path / "argv.json"))
        return root

    return write


def test_scores_come_back_and_the_machine_device_reaches_the_adapter(project, stub, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine: CPU
    model, cfg = project
    stub()
    out = tmp_path / "out"
    code, stdout, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval", "shapes,docs", "-o", str(out), "--json"], capsys)
    assert code == 0, err
    summary = json.loads(stdout)  # lmms-eval's own output went to stderr, not into the JSON
    assert summary["metrics"] == {"lmms_eval/shapes/exact_match": 0.5, "lmms_eval/shapes/anls": 0.75,
                                  "lmms_eval/docs/exact_match": 0.5, "lmms_eval/docs/anls": 0.75}
    assert json.loads((out / "metrics.json").read_text())["metrics"] == summary["metrics"]
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--model") + 1] == "llava_hf"
    assert argv[argv.index("--model_args") + 1] == f"pretrained={model},device=cpu,device_map=cpu,dtype=float32"
    assert argv[argv.index("--batch_size") + 1] == "1"  # lmms-eval's default, not eval.batch_size (8)
    assert "Verbosity set to INFO" in err and "Verbosity set to INFO" in (out / "lmms_eval" / "lmms_eval.log").read_text()

    code, stdout, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval", "shapes", "-o", str(out)], capsys)
    assert code == 0, err
    assert "lmms_eval/shapes/anls" in stdout and f"Wrote {out}/ (metrics.json, lmms_eval/)" in stdout

    # A later run into the same folder that fails: a failing `vlmctl eval`, the earlier results not taken as its own.
    monkeypatch.setenv("LMMS_STUB", "swallow")
    code, _, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval", "shapes", "-o", str(out), "--batch-size", "4"], capsys)
    assert code == 1
    assert "lmms-eval failed (it logged the error and exited with code 0)" in err
    assert "AssertionError: Do not support batch_size_per_gpu > 1 for now" in err
    assert "answers one sample at a time" in err and "lmms_eval.log" in err
    assert json.loads((out / "metrics.json").read_text())["metrics"] == summary["metrics"]


def test_transformers_device_map_error_is_shown_not_hidden(project, stub, capsys):
    # An adapter that declares no device_map gets none, and fails as lmms-eval 0.7.3 did for every run without a
    # device: the error and a non-zero exit, not "wrote no results".
    model, cfg = project
    stub(params=("pretrained", "device"))
    code, _, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval", "shapes", "-q"], capsys)
    assert code == 1
    assert "ValueError: When passing device_map as a string" in re.sub(r"\s*│\s*", " ", err)
    assert "wrote no scores" not in err


def test_non_zero_exit_is_reported_with_its_code(project, stub, capsys, monkeypatch):
    model, cfg = project
    stub()
    monkeypatch.setenv("LMMS_STUB", "crash")
    code, _, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval", "shapes"], capsys)
    assert code == 1
    assert "lmms-eval failed (exit code 1)" in err and "RuntimeError: CUDA out of memory" in err


def test_missing_adapter_dependency_stops_before_lmms_eval_starts(project, stub, tmp_path, capsys, monkeypatch):
    model, cfg = project
    stub(imports=("import decord",))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None if name == "decord" else real(name, package))
    code, _, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval", "shapes", "-o", str(tmp_path / "out")], capsys)
    assert code == 2
    assert "llava_hf adapter imports decord, which is not installed" in err and "pip install decord" in err
    assert not (tmp_path / "argv.json").exists() and not (tmp_path / "out" / "lmms_eval" / "lmms_eval.log").exists()


def test_include_folder_is_checked(project, stub, capsys):
    model, cfg = project
    stub()
    code, _, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval", "shapes", "--lmms-eval-include", "nope"], capsys)
    assert code == 2 and "no such folder" in err
    code, _, err = run(["eval", str(model), "-c", str(cfg), "--lmms-eval-include", "."], capsys)
    assert code == 2 and "needs --lmms-eval" in err


# ---------------------------------------------------------------------------------------------------------------
# The real lmms-eval
# ---------------------------------------------------------------------------------------------------------------

TASK_YAML = """\
task: shapes_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
process_results: !function utils.process_results
generation_kwargs:
  max_new_tokens: 4
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: answered
    aggregation: mean
    higher_is_better: true
metadata:
  version: 0.0
"""

TASK_UTILS = '''\
import os

from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))


def doc_to_visual(doc):
    return [Image.open(os.path.join(HERE, doc["image"])).convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def process_results(doc, results):
    answer = results[0].strip().lower()
    return {"exact_match": float(answer == doc["answer"]), "answered": 1.0}
'''


def write_local_task(folder: Path) -> Path:
    """An lmms-eval task folder: shapes.yaml reading shapes.jsonl (three coloured squares, "What color?") with
    the `json` loader of datasets, and utils.py loading the images next to it. No network."""
    from PIL import Image

    (folder / "images").mkdir(parents=True)
    rows = []
    for i, (name, rgb) in enumerate([("red", (200, 30, 30)), ("green", (30, 200, 30)), ("blue", (30, 30, 200))]):
        Image.new("RGB", (16, 16), rgb).save(folder / "images" / f"{name}.png")
        rows.append({"id": i, "question": "What color is the picture?", "answer": name, "image": f"images/{name}.png"})
    (folder / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "shapes.yaml").write_text(TASK_YAML.format(data=folder / "shapes.jsonl"))
    (folder / "utils.py").write_text(TASK_UTILS)
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from test_eval_generate import _build_tiny

    return _build_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.slow
@needs_real_lmms
def test_real_lmms_eval_on_a_local_task(tiny_model, tmp_path, write_config, capsys):
    tasks = write_local_task(tmp_path / "tasks")
    cfg = write_config("project:\n  name: t\n")
    out = tmp_path / "out"
    code, stdout, err = run(["eval", str(tiny_model), "-c", str(cfg), "--lmms-eval", "shapes_local",
                             "--lmms-eval-include", str(tasks), "-o", str(out), "--json"], capsys)
    assert code == 0, err[-3000:]
    metrics = json.loads(stdout)["metrics"]
    (results,) = (out / "lmms_eval").rglob("*_results.json")
    written = json.loads(results.read_text())["results"]["shapes_local"]
    assert metrics == {"lmms_eval/shapes_local/exact_match": written["exact_match,none"],
                       "lmms_eval/shapes_local/answered": 1.0}
    assert "device=cpu,device_map=cpu,dtype=float32" in err  # lmms-eval prints the model args it was given


@pytest.mark.slow
@pytest.mark.network
@needs_real_lmms
def test_real_lmms_eval_on_a_hub_task(tiny_model, tmp_path, write_config, capsys, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    cfg = write_config("project:\n  name: t\n")
    code, stdout, err = run(["eval", str(tiny_model), "-c", str(cfg), "--lmms-eval", "mme", "--limit", "2",
                             "-o", str(tmp_path / "out"), "--json"], capsys)
    assert code == 0, err[-3000:]
    assert {"lmms_eval/mme/mme_perception_score", "lmms_eval/mme/mme_cognition_score"} <= set(json.loads(stdout)["metrics"])
