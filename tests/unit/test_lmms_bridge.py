"""The lmms-eval bridge without running anything: adapter choice, --model_args for CPU and GPU, the adapter's
dependency check, the install command that keeps torch, and reading lmms-eval's errors out of its output. lmms-eval's
source is the stand-in of tests/lmms_stub.py, so none of this needs lmms-eval installed."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from lmms_stub import fake_model_dir, use_stub, write_stub
from vlmctl.errors import ModelError, UsageError
from vlmctl.evaluation import lmms

# lmms-eval 0.7.3's output when a Hub task runs offline (trimmed): a progress bar, a chained traceback on stderr,
# then the ERROR line its CLI logs on stdout before exiting 0.
OFFLINE_OUTPUT = """\
\x1b[32m2026-11-23 11:06:57\x1b[0m | \x1b[1mINFO    \x1b[0m | lmms_eval.models.simple.llava_hf:__init__:134 - Using single device: cpu
Loading weights: 100%|##########| 118/118 [00:00<00:00, 15553.01it/s]Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/datasets/load.py", line 1021, in dataset_module_factory
    raise ConnectionError(f"Couldn't reach '{path}' on the Hub ({e.__class__.__name__})") from e
ConnectionError: Couldn't reach 'lmms-lab-encoder/MME' on the Hub (OfflineModeIsEnabled)

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/tenacity/__init__.py", line 483, in exc_check
    raise retry_exc from fut.exception()
tenacity.RetryError: RetryError[<Future at 0x7f8c97f18e50 state=finished raised ConnectionError>]
\x1b[32m2026-11-23 11:07:05\x1b[0m | \x1b[31m\x1b[1mERROR   \x1b[0m | \x1b[36mlmms_eval.__main__\x1b[0m:\x1b[36mcli_evaluate\x1b[0m:\x1b[36m614\x1b[0m - \x1b[31m\x1b[1mError during evaluation: RetryError[<Future at 0x7f8c97f18e50 state=finished raised ConnectionError>]. Please set `--verbosity=DEBUG` to get more information.\x1b[0m
"""


@pytest.fixture
def stub(tmp_path, monkeypatch):
    """write(**kwargs): a stand-in lmms-eval (tests/lmms_stub.py) found by the bridge; returns its root."""

    def write(**kwargs):
        root = write_stub(tmp_path / "stub", **kwargs)
        use_stub(monkeypatch, root)
        return root

    return write


@pytest.fixture
def hide(monkeypatch):
    """hide("decord", ...): find_spec answers None for those top-level modules."""
    real = importlib.util.find_spec

    def _hide(*names: str) -> None:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, package=None: None if name.split(".")[0] in names else real(name, package))

    return _hide


def test_cpu_model_args_pass_device_device_map_and_dtype(stub, tmp_path):
    stub()
    model = fake_model_dir(tmp_path / "model")
    plan = lmms.plan_lmms_eval(model, "mme,shapes", tmp_path / "out", device="cpu", dtype="float32",
                               include_path=tmp_path / "tasks", limit=5)
    assert plan.adapter == "llava_hf"  # from config.json's model_type
    assert plan.model_args == {"pretrained": str(model), "device": "cpu", "device_map": "cpu", "dtype": "float32"}
    cmd = plan.command
    assert cmd[1:5] == ["-m", "lmms_eval", "--model", "llava_hf"]
    assert cmd[cmd.index("--model_args") + 1] == f"pretrained={model},device=cpu,device_map=cpu,dtype=float32"
    assert cmd[cmd.index("--tasks") + 1] == "mme,shapes" and cmd[cmd.index("--batch_size") + 1] == "1"
    assert cmd[cmd.index("--include_path") + 1] == str(tmp_path / "tasks") and cmd[cmd.index("--limit") + 1] == "5"
    assert plan.notes == []


def test_gpu_model_args_and_an_adapter_that_takes_no_dtype(stub, tmp_path):
    # lmms-eval's Qwen adapters take device and device_map but no dtype (they load in bfloat16 themselves), and
    # reject any other key: the bridge passes only what the adapter's __init__ declares, and says so.
    stub(adapter="qwen2_5_vl", params=("pretrained", "device", "device_map", "max_pixels"))
    model = fake_model_dir(tmp_path / "model", model_type="qwen2_5_vl")
    plan = lmms.plan_lmms_eval(model, "mme", tmp_path / "out", 2, device="cuda:0", dtype="float16")
    assert plan.adapter == "qwen2_5_vl"
    assert plan.model_args == {"pretrained": str(model), "device": "cuda:0", "device_map": "cuda:0"}
    assert plan.command[plan.command.index("--batch_size") + 1] == "2"
    assert "--include_path" not in plan.command and "--limit" not in plan.command
    assert len(plan.notes) == 1 and "takes no dtype" in plan.notes[0] and "float16" in plan.notes[0]


def test_adapter_params_follow_the_chat_class_to_its_simple_base(stub):
    root = stub(params=("pretrained", "revision", "device", "dtype", "device_map"), chat=True)
    assert lmms.adapter_files("llava_hf") == [root / "lmms_eval" / "models" / "chat" / "llava_hf.py"]
    assert lmms.adapter_params("llava_hf") == {"pretrained", "revision", "device", "dtype", "device_map"}
    assert lmms.adapter_params("no_such_adapter") is None and lmms.missing_modules("no_such_adapter") == []


def test_machine_device_and_dtype(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lmms.machine_device_dtype() == ("cpu", "float32")
    assert lmms.machine_device_dtype("cpu", "bf16") == ("cpu", "bfloat16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert lmms.machine_device_dtype() == ("cuda:0", "bfloat16")
    assert lmms.machine_device_dtype("auto", "fp16") == ("cuda:0", "float16")
    with pytest.raises(UsageError, match="unknown dtype"):
        lmms.machine_device_dtype("cpu", "int4")


def test_missing_adapter_module_is_named_with_an_install_command_that_keeps_torch(stub, hide):
    # The simple class imports decord at load time; the chat class (the one lmms-eval picks) only inherits it.
    stub(imports=("import json", "import decord", "from decord import VideoReader"), chat=True)
    hide("decord")
    assert lmms.missing_modules("llava_hf") == ["decord"]
    with pytest.raises(UsageError) as err:
        lmms.check_adapter("llava_hf")
    assert err.value.exit_code == 2
    assert "llava_hf adapter imports decord, which is not installed" in err.value.message
    assert err.value.hint.startswith(f'pip install decord "torch=={importlib.metadata.version("torch")}"')


def test_guarded_imports_are_not_required(stub, hide):
    stub(imports=("try:\n    import decord\nexcept ImportError:\n    decord = None",))
    hide("decord")
    assert lmms.missing_modules("llava_hf") == []
    lmms.check_adapter("llava_hf")


def test_install_command_names_the_installed_torch():
    version = importlib.metadata.version("torch")
    assert lmms.install_command("lmms-eval") == f'pip install lmms-eval "torch=={version}"'
    hint = lmms.install_hint()
    assert hint.startswith(f'pip install lmms-eval "torch=={version}"')
    assert ("CPU build" in hint) == ("+cpu" in version)


def test_not_installed_is_a_usage_error(hide):
    hide("lmms_eval")
    with pytest.raises(UsageError, match="needs the lmms-eval package") as err:
        lmms.check_installed()
    assert "torch==" in err.value.hint


def test_error_lines_and_hint_from_lmms_eval_output(tmp_path):
    lines = lmms.error_lines(OFFLINE_OUTPUT)
    assert lines == [
        "ConnectionError: Couldn't reach 'lmms-lab-encoder/MME' on the Hub (OfflineModeIsEnabled)",
        "tenacity.RetryError: RetryError[<Future at 0x7f8c97f18e50 state=finished raised ConnectionError>]",
        "Error during evaluation: RetryError[<Future at 0x7f8c97f18e50 state=finished raised ConnectionError>]. "
        "Please set `--verbosity=DEBUG` to get more information.",
    ]
    hint = lmms.failure_hint(OFFLINE_OUTPUT, tmp_path / "lmms_eval.log")
    assert "Hugging Face Hub" in hint and "--lmms-eval-include" in hint and str(tmp_path / "lmms_eval.log") in hint
    missing = "Traceback (most recent call last):\n  File \"x.py\", line 9, in <module>\nModuleNotFoundError: No module named 'decord'\n"
    assert lmms.error_lines(missing) == ["ModuleNotFoundError: No module named 'decord'"]
    assert lmms.failure_hint(missing).startswith('pip install decord "torch==')
    assert "--tasks list" in lmms.failure_hint("ValueError: Tasks not found: nope.")
    assert lmms.error_lines("a\n\nb\nc\n", limit=2) == ["b", "c"]  # no traceback nor ERROR line: the last lines


def test_folder_checks(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        lmms.choose_adapter(tmp_path)
    with pytest.raises(UsageError, match="comma"):
        lmms.plan_lmms_eval(fake_model_dir(tmp_path / "a,b"), "mme", tmp_path / "out")


def test_collect_scores_reads_only_the_given_files(tmp_path):
    import json

    old, new = tmp_path / "m" / "1_results.json", tmp_path / "m" / "2_results.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"results": {"mme": {"mme_perception_score,none": 900.0}}}))
    new.write_text(json.dumps({"results": {"mme": {"mme_perception_score,none": 1200.5, "alias": "mme", "x_stderr,none": 1.0}}}))
    assert lmms.result_files(tmp_path) == [old, new]
    assert lmms.collect_scores(tmp_path, [new]) == {"lmms_eval/mme/mme_perception_score": 1200.5}
    assert lmms.collect_scores(tmp_path) == {"lmms_eval/mme/mme_perception_score": 1200.5}  # later file wins
