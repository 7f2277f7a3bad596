"""Exit codes as the README documents them: 0 success, 1 a runtime failure (and `data validate` finding defects),
2 a usage or configuration error, 130 interrupted. One real command per code (in-process through the CLI)."""

from __future__ import annotations

import json

import pytest

from cli_runner import run_cli as run


def _llava(folder, records, image=True):
    if image:
        from PIL import Image

        Image.new("RGB", (64, 64), "red").save(folder / "red.png")
    (folder / "d.json").write_text(json.dumps(records))


def _record(i, image="red.png", answer="red"):
    return {"id": f"s{i}", "image": image, "conversations": [
        {"from": "human", "value": f"<image>\nWhat color is the square? ({i})"}, {"from": "gpt", "value": answer}]}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project whose only source is d.json (llava format), checked in one process."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vlmctl.yaml").write_text(
        "project: {name: codes}\ndata:\n  sources:\n    - {path: d.json, format: llava}\n  num_proc: 1\n")
    return tmp_path


def test_0_success(project, capsys):
    _llava(project, [_record(0)])
    code, out, err = run(["data", "validate"], capsys)
    assert code == 0, err
    code, out, err = run(["config", "show", "--json"], capsys)
    assert code == 0 and json.loads(out)["project"]["name"] == "codes"


def test_1_validate_finds_defects(project, capsys):
    _llava(project, [_record(0), _record(1, image="missing.png")])
    code, out, err = run(["data", "validate"], capsys)
    assert code == 1
    assert "missing_image" in out + err and "Traceback" not in err


def test_1_runtime_failure(project, capsys):
    # The data can be read but nothing survives the checks: `data prepare` fails at run time.
    _llava(project, [_record(0, image="missing.png"), _record(1, image="gone.png")], image=False)
    code, _, err = run(["data", "prepare"], capsys)
    assert code == 1
    assert "Data error" in err and "Traceback" not in err
    # A model folder that is already there: `model build` refuses before loading anything.
    (project / "outputs" / "model").mkdir(parents=True)
    code, _, err = run(["model", "build"], capsys)
    assert code == 1 and "already exists" in err and "--force" in err


def test_2_usage_error(project, capsys):
    code, _, err = run(["config", "show", "--no-such-flag"], capsys)
    assert code == 2 and "No such option" in err
    code, _, err = run(["config", "show", "notanoverride"], capsys)
    assert code == 2 and "Usage error" in err and "section.key=value" in err
    code, _, err = run(["init", str(project / "new"), "--template", "nope"], capsys)
    assert code == 2


def test_2_config_error(project, capsys, tmp_path):
    (project / "vlmctl.yaml").write_text("train:\n  learnig_rate: 1.0e-4\n")
    code, _, err = run(["config", "show"], capsys)
    assert code == 2 and "Config error" in err and "Traceback" not in err
    code, _, err = run(["config", "show", "-c", str(tmp_path / "nowhere.yaml")], capsys)
    assert code == 2
    (project / "vlmctl.yaml").write_text("project: {name: codes}\n")
    code, _, err = run(["config", "show", "train.max_stepz=5"], capsys)
    assert code == 2 and "max_steps" in err


def test_2_missing_data_path_is_a_config_error(project, capsys):
    code, _, err = run(["data", "validate"], capsys)  # d.json was never written
    assert "does not exist" in err
    assert code == 2


def test_130_interrupted(project, capsys, monkeypatch):
    import vlmctl.config

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(vlmctl.config, "dump_config", interrupted)
    code, _, err = run(["config", "show"], capsys)
    assert code == 130 and "Interrupted" in err and "Traceback" not in err
