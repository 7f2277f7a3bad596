"""Usage errors of `vlmctl train`, `bench` and `eval` come out before any process starts: one panel, exit 2, no
traceback. Missing optional packages are hidden by patching `importlib.util.find_spec`."""

from __future__ import annotations

import importlib.util

import pytest

from cli_runner import run_cli


@pytest.fixture
def hide(monkeypatch):
    """hide("tensorboard", ...): find_spec answers None for those top-level modules."""
    real = importlib.util.find_spec

    def _hide(*names: str) -> None:
        def find_spec(name, package=None):
            return None if name.split(".")[0] in names else real(name, package)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return _hide


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if anything is launched or trained."""
    import vlmctl.bench
    import vlmctl.train.launch as L

    def fail(*args, **kwargs):
        raise AssertionError("a process was spawned (or a run started) before the usage error")

    for name in ("spawn", "run_in_process", "Running"):
        monkeypatch.setattr(L, name, fail)
    monkeypatch.setattr(vlmctl.bench, "run_bench", fail)


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\nmodel: {preset: tiny, init: random, output_dir: model}\n"
                                          "data: {prepared_dir: data/prepared}\ntrain: {launcher: torchrun}\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_panel(code: int, out: str, err: str) -> str:
    text = out + err
    assert code == 2, text
    assert "Traceback" not in text and "ChildFailedError" not in text
    assert text.count("╭") == 1, text  # one panel
    return " ".join(text.replace("│", " ").split())


CASES = [
    (["train.report_to=[tensorboard]"], "tensorboard", "vlmctl[tracking]"),
    (["train.report_to=[wandb]"], "wandb", "vlmctl[tracking]"),
    (["train.strategy=zero2"], "deepspeed", "vlmctl[deepspeed]"),
    (["train.strategy=zero3"], "deepspeed", "vlmctl[deepspeed]"),
    (["train.liger=\"on\""], "liger_kernel", "vlmctl[gpu]"),
    (["train.attn_implementation=flash_attn"], "flash_attn", "vlmctl[flash]"),
    (["train.lora.r=8"], "peft", "pip install peft"),
    (["train.lora.quantize=4bit"], "bitsandbytes", "pip install bitsandbytes"),
]


@pytest.mark.parametrize("overrides,module,install", CASES, ids=[c[1] + "-" + c[0][0] for c in CASES])
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate", "none"])
def test_train_missing_package_is_one_panel_before_spawning(project, hide, no_spawn, capsys, overrides, module, install, launcher):
    hide(module)
    code, out, err = run_cli(["train", "--launcher", launcher, *overrides], capsys)
    text = _one_panel(code, out, err)
    assert install in text and overrides[0].split("=")[0].split(".lora")[0] in text
    assert not (project / "runs").exists() or not any((project / "runs").rglob("config.yaml"))  # no run folder claimed


@pytest.mark.parametrize("overrides,module,install", CASES[:3] + CASES[4:6], ids=[c[1] for c in CASES[:3] + CASES[4:6]])
def test_bench_missing_package_is_one_panel_before_spawning(project, hide, no_spawn, capsys, overrides, module, install):
    hide(module)
    for nproc in ("1", "2"):
        code, out, err = run_cli(["bench", "--steps", "1", "--nproc-per-node", nproc, *overrides], capsys)
        assert install in _one_panel(code, out, err)


def test_eval_missing_backends_are_one_panel_before_loading(project, hide, monkeypatch, capsys):
    import subprocess

    import vlmctl.evaluation as evaluation

    def fail(*args, **kwargs):
        raise AssertionError("the evaluation started before the usage error")

    monkeypatch.setattr(evaluation, "run_eval", fail)
    monkeypatch.setattr(evaluation, "load_samples", fail)
    monkeypatch.setattr(subprocess, "run", fail)
    hide("vllm", "lmms_eval")
    model = project / "nothing-here"  # not even a model folder: the package check comes first
    code, out, err = run_cli(["eval", str(model), "--backend", "vllm"], capsys)
    assert "vllm" in _one_panel(code, out, err)
    code, out, err = run_cli(["eval", str(model), "--lmms-eval", "mmmu_val"], capsys)
    assert "lmms-eval" in _one_panel(code, out, err)


def test_installed_packages_pass_and_the_data_check_follows(project, hide, no_spawn, capsys):
    """With the packages there, preflight goes on to the data check (one panel, still before any spawn)."""
    code, out, err = run_cli(["train", "train.report_to=[tensorboard]"], capsys)
    text = " ".join((out + err).split())
    assert code != 0 and "no prepared training shards" in text and "Traceback" not in text


def test_validation_without_a_val_split_is_refused_before_spawning(project, no_spawn, capsys):
    (project / "data" / "prepared" / "train").mkdir(parents=True)
    (project / "data" / "prepared" / "train" / "train-00000.parquet").write_bytes(b"")
    code, out, err = run_cli(["train", "train.eval_steps=10"], capsys)
    text = " ".join((out + err).replace("│", " ").split())
    assert code != 0 and "train.eval_steps" in text and "holds no prepared samples" in text and "data.val_ratio" in text
    assert "Traceback" not in text
