"""`train.compile: on` (the default on GPUs): torch.compile'd decoder layers, and with `train.compile_vision: blocks`
(auto's choice under compiled layers) the vision blocks, train as the eager ones do, on packed rows with per-layer
activation checkpointing, as `vlmctl train` and `vlmctl bench` prepare the model (`prepare_model`, then
`parallelize`'s checkpointing and compile steps)."""

from __future__ import annotations

import copy

import pytest


@pytest.fixture
def duck_sizing_on():
    """Dynamo's default duck sizing for the test, so that `compile_layers` must turn it off itself; the value before
    is put back after (set by hand: pytest's monkeypatch would delete the key from torch's config module)."""
    import torch.fx.experimental._config as fx_config

    before = fx_config.use_duck_shape
    fx_config.use_duck_shape = True
    yield
    fx_config.use_duck_shape = before


def test_compiled_decoder_layers_and_vision_blocks_give_the_eager_loss_and_gradients(duck_sizing_on):
    import logging

    import torch

    from vlmctl.bench import WorkloadSpec, prepare, random_model
    from vlmctl.config.model import ModelSection
    from vlmctl.config.train import TrainSection
    from vlmctl.data.collate import PackedCollator
    from vlmctl.distributed.parallelize import checkpoint_layers, compile_layers
    from vlmctl.train.objectives import loss_sum
    from vlmctl.train.setup import prepare_model

    def train(compile_: str) -> TrainSection:
        return TrainSection(packing=True, strategy="ddp", compile=compile_, activation_checkpointing=2,
                            tokens_per_batch=1024, compile_vision="blocks" if compile_ == "on" else "off")

    plan = prepare(ModelSection(preset="tiny-qwen2.5-vl", init="random"), train("off"),
                   WorkloadSpec(image_sizes=(56, 112), text_tokens=(20, 120)), steps=1, warmup=0, dp_size=1)
    torch.manual_seed(0)
    base = random_model(plan.model.plan, plan.model.processor, device="cpu", dtype=torch.float32)
    family, cpu = plan.model.family, torch.device("cpu")
    eager = prepare_model(copy.deepcopy(base), family, train("off"), cpu)
    compiled = prepare_model(base, family, train("on"), cpu)
    for tm, section in ((eager, train("off")), (compiled, train("on"))):  # `parallelize`'s steps 3 and 4, unwrapped
        checkpoint_layers([tm.parts.decoder_layers, tm.parts.vision_layers], section.activation_checkpointing, section)
        compile_layers(tm.parts, section)
    layers = compiled.parts.decoder_layers
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in eager.parts.decoder_layers)
    blocks = compiled.parts.vision_layers
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)
    assert all(block._compiled_call_impl is None for block in eager.parts.vision_layers)

    torch._dynamo.reset()
    reasons = []  # the recompilations' reasons, from Dynamo's `recompiles` log
    keep = logging.Handler()
    keep.emit = lambda record: reasons.append(record.getMessage())
    recompiles = logging.getLogger("torch._dynamo.guards.__recompiles")
    recompiles.addHandler(keep)
    torch._logging.set_logs(recompiles=True)
    try:
        collate = PackedCollator(plan.model.processor, family, tokens_per_batch=1024)
        batches = [compiled.prepare(plan.workload.batch(list(rows), collate)) for rows in ((0, 1, 2), (3, 4))]
        assert batches[0]["input_ids"].shape[1] != batches[1]["input_ids"].shape[1]  # two row lengths: dynamic shapes
        named = dict(compiled.model.named_parameters())
        names = [next(n for n, p in named.items() if f"{part}.1." in n and p.ndim == 2) for part in (".layers", ".blocks")]
        references = dict(eager.model.named_parameters())
        for batch in batches:
            losses = []
            for tm in (eager, compiled):
                tm.model.zero_grad(set_to_none=True)
                loss = loss_sum(tm.model, batch)
                loss.backward()
                losses.append(float(loss.detach()))
            assert losses[1] == pytest.approx(losses[0], rel=1e-5)
            for name in names:  # a decoder layer and a vision block, neither checkpointed (stride 2 takes 0, 2, ...)
                torch.testing.assert_close(named[name].grad, references[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        recompiles.removeHandler(keep)
        torch._logging.set_logs()
    # The second batch has another row length and image count. Nothing may recompile for a size that only happened
    # to equal another one in the first batch (duck sizing: 4 frames did here before compile_layers turned it off).
    assert reasons, "no recompilation logged at all: the log capture does not work"
    assert not [r for r in reasons if "duck sizing" in r], reasons


def test_the_dynamic_compiles_take_only_the_inductor_settings_this_torch_has(monkeypatch):
    """`dynamic_compile_options`: torch.compile refuses an inductor setting it does not know, so a setting of
    `DYNAMIC_OPTIONS` that the installed torch lacks is left out, and the ones it has are passed on."""
    import torch

    from vlmctl.distributed import parallelize

    monkeypatch.setitem(parallelize.DYNAMIC_OPTIONS, "triton.no_such_setting", True)
    monkeypatch.setitem(parallelize.DYNAMIC_OPTIONS, "no_such_top_level_setting", 1)
    options = parallelize.dynamic_compile_options()
    assert "triton.no_such_setting" not in options and "no_such_top_level_setting" not in options
    assert options.get("triton.mix_order_reduction_non_strict_mode") is True  # torch 2.13 has it
    # what it returns compiles and runs (on CPU too)
    block = torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.Linear(8, 8))
    block.compile(dynamic=True, options=options)
    x = torch.randn(5, 8, requires_grad=True)
    block(x).sum().backward()
    assert x.grad is not None and x.grad.shape == (5, 8)
