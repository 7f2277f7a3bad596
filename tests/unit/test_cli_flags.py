"""Global flags (--debug, -q/--quiet, -v/--verbose, -c/--config) are accepted before and after the command name."""

from __future__ import annotations

import pytest

from cli_runner import run_cli as run
from vlmctl.cli import _common
from vlmctl.cli.app import app


def _leaf_commands(typer_app, prefix=()):
    """Every command path of the app, e.g. ("data", "validate"), ("train",)."""
    for info in typer_app.registered_commands:
        yield (*prefix, info.name or info.callback.__name__)
    for group in typer_app.registered_groups:
        yield from _leaf_commands(group.typer_instance, (*prefix, group.name))


COMMANDS = sorted(_leaf_commands(app))


@pytest.fixture
def project(tmp_path, monkeypatch):
    cfg = tmp_path / "vlmctl.yaml"
    cfg.write_text("project: {name: flags}\n")
    monkeypatch.chdir(tmp_path)
    return cfg


@pytest.fixture
def seen(monkeypatch):
    """The global state as `config show` sees it while it runs."""
    import vlmctl.config

    got: dict = {}
    real = vlmctl.config.dump_config

    def spy(cfg):
        got.update(debug=_common.state.debug, quiet=_common.state.quiet, verbose=_common.state.verbose)
        return real(cfg)

    monkeypatch.setattr(vlmctl.config, "dump_config", spy)
    monkeypatch.delenv("VLMCTL_DEBUG", raising=False)
    return got


def test_every_command_lists_the_global_flags(capsys):
    assert ("data", "validate") in COMMANDS and ("train",) in COMMANDS and ("model", "build") in COMMANDS
    groups = {cmd[:1] for cmd in COMMANDS if len(cmd) > 1}
    for cmd in [*COMMANDS, *groups]:
        code, out, err = run([*cmd, "--help"], capsys)
        assert code == 0, (cmd, err)
        for flag in ("--debug", "--quiet", "-q", "--verbose", "-v"):
            assert flag in out, (cmd, flag)


@pytest.mark.parametrize("flag,key", [("--debug", "debug"), ("-q", "quiet"), ("--quiet", "quiet"), ("-v", "verbose"),
                                      ("--verbose", "verbose")])
@pytest.mark.parametrize("position", ["before", "between", "after", "after overrides"])
def test_flag_in_each_position(flag, key, position, project, seen, capsys):
    args = {"before": [flag, "config", "show"], "between": ["config", flag, "show"], "after": ["config", "show", flag],
            "after overrides": ["config", "show", "train.max_steps=5", flag]}[position]
    code, _, err = run(args, capsys)
    assert code == 0, err
    assert seen[key] is True
    assert [k for k, v in seen.items() if v] == [key]  # the others stay off


def test_flags_do_not_leak_into_the_next_invocation(project, seen, capsys):
    assert run(["config", "show", "-q", "--debug"], capsys)[0] == 0
    assert seen == {"debug": True, "quiet": True, "verbose": False}
    assert run(["config", "show"], capsys)[0] == 0
    assert seen == {"debug": False, "quiet": False, "verbose": False}


@pytest.mark.parametrize("position", ["before", "after"])
def test_quiet_keeps_only_the_result_line(position, tmp_path, capsys):
    folder = tmp_path / "p"
    args = ["-q", "init", str(folder), "--template", "llava"] if position == "before" else ["init", str(folder), "--template", "llava", "-q"]
    code, out, err = run(args, capsys)
    assert code == 0, err
    assert (folder / "vlmctl.yaml").is_file()
    assert out.count("\n") == 1 and "Created" in out and "Next:" not in out
    code, out, _ = run(["init", str(tmp_path / "q"), "--template", "llava"], capsys)
    assert code == 0 and "Created" in out and "Next:" in out


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_shows_the_traceback_in_either_position(position, project, monkeypatch, capsys):
    import vlmctl.config

    def boom(cfg):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(vlmctl.config, "dump_config", boom)
    monkeypatch.delenv("VLMCTL_DEBUG", raising=False)
    code, _, err = run(["config", "show"], capsys)
    assert code == 1 and "disk on fire" in err and "Traceback" not in err
    args = ["--debug", "config", "show"] if position == "before" else ["config", "show", "--debug"]
    code, _, err = run(args, capsys)
    assert code == 1 and "Traceback" in err and "RuntimeError: disk on fire" in err


@pytest.mark.parametrize("position", ["before", "after"])
def test_config_flag_in_either_position(position, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "elsewhere" / "vlmctl.yaml"
    cfg.parent.mkdir()
    cfg.write_text("project: {name: elsewhere}\n")
    monkeypatch.chdir(tmp_path)  # no project file here: only -c finds it
    args = ["-c", str(cfg), "config", "show", "--json"] if position == "before" else ["config", "show", "--json", "-c", str(cfg)]
    code, out, err = run(args, capsys)
    assert code == 0, err
    assert '"name": "elsewhere"' in out


def test_global_flags_after_a_subcommand_of_a_group(tmp_path, capsys, monkeypatch):
    # `vlmctl data validate -q`: the flag after a group's subcommand (the case that used to be a usage error).
    import json

    from PIL import Image

    (tmp_path / "img.png").write_bytes(b"")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "img.png")
    rows = [{"id": "a", "image": "img.png", "conversations": [{"from": "human", "value": "<image>\nWhat color?"},
                                                              {"from": "gpt", "value": "red"}]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "vlmctl.yaml").write_text("project: {name: v}\ndata:\n  sources:\n    - {path: d.json, format: llava}\n  num_proc: 1\n")
    monkeypatch.chdir(tmp_path)
    code, loud, err = run(["data", "validate"], capsys)
    assert code == 0, err
    code, quiet, err = run(["data", "validate", "-q"], capsys)
    assert code == 0, err
    assert len(quiet) <= len(loud)
