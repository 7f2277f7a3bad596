"""`vlmctl serve` loads the model in the compute dtype and with the attention backend that training's run plan picks
for padded batches on the same machine (`vlmctl.config.plan.build_plan`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vlmctl.config.plan import DeviceFacts, build_plan
from vlmctl.config.train import TrainSection
from vlmctl.errors import UsageError
from vlmctl.serve.server import load_for_serving, serving_plan


def planned(train: TrainSection, cuda: bool) -> tuple[str, str]:
    plan = build_plan(train.model_copy(update={"packing": False}), DeviceFacts.here(cuda=cuda))
    return plan.precision.value, plan.attention.value


def test_auto_resolves_as_the_training_plan_on_cpu_and_for_a_gpu():
    assert serving_plan("cpu") == planned(TrainSection(), cuda=False) == ("fp32", "sdpa")
    # a GPU as the plan sees one from here (bf16 assumed, no flash-attn installed on this machine)
    gpu = serving_plan("cuda")
    assert gpu == planned(TrainSection(), cuda=True)
    assert gpu[0] == "bf16"


def test_the_projects_train_section_and_an_explicit_dtype_decide():
    assert serving_plan("cpu", train=TrainSection(precision="bf16", attn_implementation="eager")) == ("bf16", "eager")
    assert serving_plan("cpu", "fp16", train=TrainSection(precision="bf16")) == ("fp16", "sdpa")
    # the packed-row kernel attends within packed rows only: the engine's left-padded rows get sdpa, as GRPO's rollouts
    assert serving_plan("cuda", train=TrainSection(precision="bf16", attn_implementation="varlen"))[1] == "sdpa"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from vlmctl.config import ModelSection
    from vlmctl.models.build import build_model

    folder: Path = tmp_path_factory.mktemp("plan") / "tiny"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, dtype="fp32"),
                tokenizer_texts=["What color is the square?", "red blue green"] * 5)
    return folder


def test_the_loaded_model_holds_the_planned_dtype_and_attention(tiny):
    model, _, choice = load_for_serving(tiny, device="cpu")
    assert choice == {"dtype": "fp32", "attn_implementation": "sdpa"}
    model, _, choice = load_for_serving(tiny, device="cpu", train=TrainSection(precision="bf16", attn_implementation="eager"))
    assert choice == {"dtype": "bf16", "attn_implementation": "eager"}
    assert model.config.get_text_config()._attn_implementation == "eager"
    assert str(next(model.parameters()).dtype) == "torch.bfloat16"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_a_backend_this_machine_cannot_run_is_a_usage_error(tiny):
    with pytest.raises(UsageError, match="flash-attn"):
        load_for_serving(tiny, device="cpu", train=TrainSection(attn_implementation="flash_attn"))
