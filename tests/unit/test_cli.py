"""The CLI surface: commands listed, fast help without heavy imports, exit codes, error panels, init."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_runner import run_cli as run

COMMANDS = ["init", "data", "model", "train", "convert", "push", "eval", "bench", "demo", "config"]




def test_help_lists_every_command(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for cmd in COMMANDS:
        assert f" {cmd} " in out
    code, out, _ = run(["data", "--help"], capsys)
    assert "prepare" in out and "validate" in out
    code, out, _ = run(["model", "--help"], capsys)
    assert "build" in out


@pytest.mark.parametrize("cmd", [["init"], ["train"], ["data", "prepare"], ["model", "build"], ["eval"], ["convert"], ["push"], ["demo"], ["config", "show"], ["bench"]])
def test_each_command_help_has_an_example(cmd, capsys):
    code, out, _ = run([*cmd, "--help"], capsys)
    assert code == 0
    assert "Example: vlmctl" in out


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys\n"
        "from vlmctl.cli.app import main\n"
        "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "vlmctl", "--version"], capture_output=True, text=True, check=True).stdout
    from vlmctl import __version__

    assert out.strip() == f"vlmctl {__version__}"


def test_init_then_config_show(tmp_path, capsys, monkeypatch):
    proj = tmp_path / "demo"
    code, out, err = run(["init", str(proj), "--template", "tiny"], capsys)
    assert code == 0, err
    assert (proj / "vlmctl.yaml").is_file() and (proj / "data" / "README.md").is_file()
    data = json.loads((proj / "data" / "raw" / "shapes_vqa.json").read_text())
    assert len(data) == 3000 and (proj / "data" / "raw" / data[0]["image"]).is_file()
    assert "vlmctl data prepare" in out
    code, out, err = run(["-c", str(proj / "vlmctl.yaml"), "config", "show", "--json"], capsys)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["project"]["name"] == "demo"
    assert shown["model"]["preset"] == "tiny"
    # discovery from a subfolder, with an override
    monkeypatch.chdir(proj / "data")
    code, out, _ = run(["config", "show", "--json", "train.max_steps=5"], capsys)
    assert code == 0 and json.loads(out)["train"]["max_steps"] == 5


def test_init_refuses_to_overwrite_and_lists_templates(tmp_path, capsys):
    proj = tmp_path / "p"
    assert run(["init", str(proj), "--template", "llava"], capsys)[0] == 0
    before = (proj / "vlmctl.yaml").read_text()
    (proj / "vlmctl.yaml").write_text(before + "# my edit\n")
    code, _, err = run(["init", str(proj), "--template", "llava"], capsys)
    assert code == 2 and "already exists" in err and "--force" in err
    assert (proj / "vlmctl.yaml").read_text().endswith("# my edit\n")
    code, _, err = run(["init", str(proj), "--template", "llava", "--force"], capsys)
    assert code == 0 and (proj / "vlmctl.yaml").read_text() == before
    code, _, err = run(["init", str(tmp_path / "q"), "--template", "nope"], capsys)
    assert code == 2 and "tiny" in err and "qwen2.5-vl-lora" in err


def test_config_errors_exit_2_with_panel(tmp_path, capsys):
    path = tmp_path / "vlmctl.yaml"
    path.write_text("train:\n  learnig_rate: 1.0e-4\n")
    code, _, err = run(["config", "show", "-c", str(path)], capsys)
    assert code == 2
    assert "Config error" in err and "did you mean train.learning_rate?" in err
    assert "Traceback" not in err
    path.write_text("train:\n  max_steps: ten\n")
    code, _, err = run(["-c", str(path), "config", "show"], capsys)
    assert code == 2 and "train.max_steps = 'ten'" in err


def test_bad_override_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "vlmctl.yaml"
    path.write_text("project:\n  name: x\n")
    code, _, err = run(["config", "show", "-c", str(path), "notanoverride"], capsys)
    assert code == 2 and "section.key=value" in err


def test_runtime_error_exits_1_and_debug_shows_traceback(tmp_path, monkeypatch):
    # A runtime failure inside a command: exit 1, a panel, and the traceback only with --debug.
    bad = tmp_path / "vlmctl.yaml"
    bad.write_text("project:\n  name: x\n")
    script = (
        "import sys\n"
        "import vlmctl.cli.config as c\n"
        "def boom(*a, **k):\n    raise RuntimeError('disk on fire')\n"
        "c.load_project = boom\n"
        "from vlmctl.cli.app import main\n"
        f"main(sys.argv[1:] + ['config', 'show', '-c', {str(bad)!r}])\n"
    )
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert plain.returncode == 1
    assert "disk on fire" in plain.stderr and "Traceback" not in plain.stderr
    debug = subprocess.run([sys.executable, "-c", script, "--debug"], capture_output=True, text=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_missing_project_file_is_a_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["config", "show"], capsys)
    assert code == 2 and "vlmctl init" in err
