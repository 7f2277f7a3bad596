"""Float8 training (`train.fp8`, `vlmctl.distributed.float8`) on CPU, where torchao emulates the float8 matmuls:
which layers convert in each family's tiny preset (the language model's decoder-layer linears only), the plan's
decisions and refusals for GPUs described by hand, emulated float8 against fp32, the switch the probe's float8
trial uses, the trial's choice, the scale hook after each optimizer step under FSDP2's float8 all-gather, and
checkpoints / exports that stay plain weights across fp8 on and off.

Tolerance (emulated float8 against fp32, the tiny LLaVA's loss on the probe inputs): loss within 1% and a gradient
cosine similarity >= 0.99 over every parameter (measured: 0.2% and 0.998 for both recipes)."""

from __future__ import annotations

import copy

import pytest

from vlmctl.config import TrainSection
from vlmctl.config.plan import PROBE, DeviceFacts, RunPlan, build_plan, check_plan, settle_probe
from vlmctl.errors import ConfigError

GIB = 2**30
H100 = DeviceFacts(kind="cuda", memory_bytes=80 * GIB, torchao=True, triton=True, varlen=True, capability=(9, 0))
A100 = DeviceFacts(kind="cuda", memory_bytes=80 * GIB, torchao=True, triton=True, varlen=True, capability=(8, 0))
TEXTS = ["What color is the triangle? Answer with one word.", "red", "How many circles are there?", "3"] * 10
FAMILIES = ("llava", "qwen2_5_vl", "qwen3_vl_moe", "phi4_multimodal", "idefics3", "qwen2_audio")


# ------------------------------------------------------------------------------------------- which layers


def tiny(name: str):
    """(model, family) of a family's tiny preset, random init, fp32."""
    from vlmctl.config.model import ModelSection
    from vlmctl.families import FAMILIES as SPECS
    from vlmctl.models.build import make_model, make_processor, plan_build

    plan = plan_build(ModelSection(preset=SPECS[name].tiny_preset, init="random", dtype="fp32"))
    return make_model(plan, make_processor(plan, tokenizer_texts=TEXTS)), plan.family


@pytest.mark.parametrize("name", FAMILIES)
def test_only_the_language_models_decoder_linears_convert(name):
    import torch
    from torchao.float8.float8_linear import Float8Linear

    from vlmctl.distributed import float8
    from vlmctl.families import decoder_layers

    model, family = tiny(name)
    layers = decoder_layers(model, family)
    hidden = model.config.get_text_config().hidden_size
    # stand-ins in the first decoder layer: a Linear MoE router (as other transformers versions build it) and a
    # linear whose width is not a multiple of 16: neither may convert
    layers[0].router = torch.nn.Linear(hidden, 16, bias=False)
    layers[0].odd = torch.nn.Linear(hidden, 40)
    inside = {id(m) for layer in layers for m in layer.modules()}
    expected = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside} - {
        n for n, _ in layers[0].named_modules(prefix=_path(model, layers[0])) if n.endswith((".router", ".odd"))}
    before = {k: v.clone() for k, v in model.state_dict().items()}

    state = float8.convert(model, family, "tensorwise", emulate=True)

    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == expected == set(state.layers) and len(converted) >= 4 * len(layers)
    outside = [*(e.path for e in family.encoders.values()), *family.projector, family.lm_head]
    assert not any(n == p or n.startswith(p + ".") for n in converted for p in outside)
    assert not isinstance(model.get_input_embeddings(), Float8Linear)
    after = model.state_dict()  # the same parameter names and values: checkpoints do not change
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def _path(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def test_auto_converts_only_the_linears_torchaos_size_rule_keeps():
    import torch

    from vlmctl.distributed import float8
    from vlmctl.families import decoder_layers

    model, family = tiny("qwen2_5_vl")
    assert float8.convertible(model, family) and not float8.convertible(model, family, "tensorwise")  # tiny: too small
    layer = decoder_layers(model, family)[0]
    layer.wide = torch.nn.Linear(1024, 2048, bias=False)  # in_features 1024, out_features 2048 > 1024: kept
    assert [n for n, _ in float8.convertible(model, family, "tensorwise")] == [f"{_path(model, layer)}.wide"]


# ----------------------------------------------------------------------------------------------- the plan


def plan_of(device=H100, **train):
    section = TrainSection(**train)
    return build_plan(section, device), section


@pytest.mark.parametrize("device, train, reason", [
    (DeviceFacts(kind="cpu", torchao=True), {}, "need a CUDA GPU (this run is on CPU)"),
    (A100, {}, "compute capability >= 8.9 (H100, H200, L40S, B200; this GPU: 8.0)"),
    (DeviceFacts(kind="cuda", torchao=True, triton=True), {}, "this GPU: unknown"),
    (DeviceFacts(kind="cuda", triton=True, varlen=True, capability=(9, 0)), {}, "torchao is not installed"),
    (H100, {"strategy": "zero3"}, "DeepSpeed (zero3)"),
    (H100, {"lora": {"r": 8}}, "LoRA/QLoRA trains adapters"),
    (H100, {"lora": {"r": 8, "quantize": "4bit"}}, "LoRA/QLoRA trains adapters"),
    (H100, {"stage": "align"}, "the language model is frozen"),
    (H100, {"stage": "full", "freeze": ["llm"]}, "the language model is frozen"),
    (H100, {"precision": "fp32"}, "compute is fp32"),
    (H100, {"compile": "off"}, "train.compile is off"),
    (DeviceFacts(**{**H100.__dict__, "processes": 2}), {"sequence_parallel": 2, "tokens_per_batch": 4096},
     "no start-up probe to measure it with sequence parallelism"),
])
def test_auto_is_off_where_float8_cannot_run_or_be_measured_and_says_why(device, train, reason):
    plan, section = plan_of(device, **train)
    assert plan.fp8.value == "off" and plan.fp8.auto and reason in plan.fp8.reason
    assert "fp8" not in plan.probing
    assert plan.train_section(section).fp8 == "off"


def test_auto_leaves_float8_to_the_probe_on_a_float8_gpu_training_the_language_model():
    for train in ({}, {"stage": "full"}, {"strategy": "fsdp"}, {"tokens_per_batch": 8192, "activation_checkpointing": 2}):
        plan, section = plan_of(**train)
        assert plan.fp8.value == PROBE and plan.fp8.auto and "start-up probe" in plan.fp8.reason
        assert "fp8" in plan.probing  # the probe runs for it even where the batching is set
        assert plan.train_section(section).fp8 == "auto"  # pending until the probe settles it
    plan, section = plan_of(**{"tokens_per_batch": 8192, "activation_checkpointing": 2})
    choice = type("Choice", (), {"reason": "probe: fastest", "fp8": "tensorwise", "fp8_reason": "probe: 1.3x bf16"})()
    train = plan.train_section(section)
    plan, applied = settle_probe(plan, train, choice)
    assert train.fp8 == "tensorwise" and applied == ["fp8=tensorwise"]
    assert plan.fp8.value == "tensorwise" and plan.fp8.reason == "probe: 1.3x bf16" and plan.fp8.auto


def test_a_recipe_set_in_the_config_is_kept_and_refused_where_it_cannot_run():
    for recipe in ("tensorwise", "rowwise"):
        plan, section = plan_of(fp8=recipe)
        check_plan(plan, section)
        assert plan.fp8.value == recipe and not plan.fp8.auto and plan.compile.value == "on"
    for device, train, words in [
        (DeviceFacts(kind="cpu", torchao=True), {}, "need a CUDA GPU"),
        (A100, {}, "compute capability >= 8.9"),
        (H100, {"strategy": "zero2"}, "DeepSpeed (zero2)"),
        (H100, {"strategy": "zero3"}, "DeepSpeed (zero3)"),
        (H100, {"lora": {"r": 8}}, "LoRA/QLoRA"),
        (H100, {"compile": "off"}, "train.compile is off"),
        (H100, {"stage": "align"}, "the language model is frozen"),
    ]:
        plan, section = plan_of(device, fp8="tensorwise", **train)
        with pytest.raises(ConfigError, match="train.fp8=tensorwise cannot run") as err:
            check_plan(plan, section)
        assert words in err.value.message


def test_the_plan_records_float8_and_the_gpus_capability_in_plan_json():
    plan, _ = plan_of()
    again = RunPlan.from_json(__import__("json").loads(__import__("json").dumps(plan.to_json())))
    assert again.fp8 == plan.fp8 and again.device.capability == (9, 0) and again.device.same_decisions(H100)
    older = plan.to_json()
    del older["decisions"]["fp8"], older["device"]["capability"]  # a plan.json written before train.fp8
    assert RunPlan.from_json(older).fp8.value == "off"
    assert TrainSection(fp8=False).fp8 == "off"  # YAML's bare off
    with pytest.raises(ValueError, match="must name a recipe"):
        TrainSection(fp8=True)


# -------------------------------------------------------------------------------- emulated float8, the switch


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(model folder, probe inputs with labels) of the tiny LLaVA."""
    from convert_helpers import make_tiny_model
    from vlmctl.convert import probe_inputs
    from vlmctl.models import load_processor

    folder = make_tiny_model(tmp_path_factory.mktemp("fp8") / "model")
    inputs = probe_inputs(load_processor(folder))
    return folder, {**inputs, "labels": inputs["input_ids"].clone()}


def loss_and_grads(model, inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def cosine(got, want) -> float:
    import torch

    a, b = (torch.cat([g[n].flatten() for n in want]) for g in (got, want))
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_forward_and_backward_stay_close_to_fp32(llava, recipe):
    import torch

    from vlmctl.distributed import float8
    from vlmctl.models import load_model

    folder, inputs = llava
    model, _, family = load_model(folder, dtype=torch.float32)
    ref_loss, ref = loss_and_grads(model, inputs)
    converted = copy.deepcopy(model)
    assert float8.convert(converted, family, recipe, emulate=True).layers
    loss, grads = loss_and_grads(converted, inputs)
    assert loss != ref_loss and loss == pytest.approx(ref_loss, rel=1e-2)  # float8 rounds: close, not equal
    assert grads.keys() == ref.keys() and cosine(grads, ref) >= 0.99


def test_the_switch_computes_the_same_layers_in_high_precision_without_touching_a_weight(llava):
    import torch

    from vlmctl.distributed import float8
    from vlmctl.models import load_model

    folder, inputs = llava
    model, _, family = load_model(folder, dtype=torch.float32)
    plain = copy.deepcopy(model)
    float8.convert(model, family, "tensorwise", emulate=True)
    with torch.no_grad():
        want = plain(**inputs).logits
        assert float8.computes_float8(model) and not torch.equal(model(**inputs).logits, want)
        assert float8.use_float8(model, False) == len(float8.state_of(model).layers)
        assert not float8.computes_float8(model)
        torch.testing.assert_close(model(**inputs).logits, want, rtol=0, atol=0)
        float8.use_float8(model, True)
        assert float8.computes_float8(model) and not torch.equal(model(**inputs).logits, want)
    gathered = copy.deepcopy(plain)
    float8.convert(gathered, family, "tensorwise", all_gather=True, emulate=True)
    with pytest.raises(ValueError, match="all-gathers in float8"):
        float8.use_float8(gathered, False)
    rowwise = copy.deepcopy(plain)  # torchao all-gathers only tensorwise weights in float8
    assert not float8.convert(rowwise, family, "rowwise", all_gather=True, emulate=True).all_gather


# --------------------------------------------------------------------------------------------- the trial


def trial_model(llava):
    import torch

    from vlmctl.distributed import float8
    from vlmctl.models import load_model

    model, _, family = load_model(llava[0], dtype=torch.float32)
    float8.convert(model, family, "tensorwise", emulate=True)
    float8.use_float8(model, False)  # as parallelize leaves them for the trial
    return model


MIB = 2**20


def fake_run(model, bf16_s: float, fp8_s: float, fp8_per: float = 5 * MIB, oom: bool = False, calls=None):
    """Trials as the probe's `run` gives them: peak = 10 GiB + bytes per token x tokens (bf16: 5 MiB per token,
    float8: `fp8_per`), seconds per 8,192 tokens `bf16_s` / `fp8_s`, in whichever precision the layers compute."""
    from vlmctl.distributed import float8
    from vlmctl.train.autotune import Trial

    def run(mode, size, timed=False):
        on = float8.computes_float8(model)
        if calls is not None:
            calls.append((mode, size, timed, on))
        if on and oom:
            return Trial(mode, size, 0, 0.0, oom=True)
        peak = 10 * GIB + int((fp8_per if on else 5 * MIB) * size)
        return Trial(mode, size, peak, (fp8_s if on else bf16_s) * size / 8192)
    return run


BF16_TRIALS = [(2048, 10 * GIB + 2048 * 5 * MIB), (4096, 10 * GIB + 4096 * 5 * MIB)]  # the search's, of mode 2


@pytest.mark.parametrize("fp8_s, fp8_per, oom, chosen, words", [
    (0.7, 5 * MIB, False, "tensorwise", "probe: tensorwise float8 1.4"),
    (0.99, 5 * MIB, False, "off", "not more than 1.02x"),  # 1.01x: within the timing's noise
    (1.2, 5 * MIB, False, "off", "measured 0.83x bf16"),
    (0.7, 5 * MIB, True, "off", "did not fit in GPU memory"),
])
def test_the_float8_trial_keeps_float8_only_where_it_measured_faster(llava, fp8_s, fp8_per, oom, chosen, words):
    from vlmctl.distributed import float8
    from vlmctl.train.autotune import Choice, Trial, float8_trial

    model, calls = trial_model(llava), []
    choice = Choice(tokens_per_batch=8192, activation_checkpointing=2, rates={"2": 8192 / 1.05},
                    trials=[Trial(2, size, peak, 0.1) for size, peak in BF16_TRIALS])
    float8_trial(fake_run(model, 1.0, fp8_s, fp8_per, oom, calls), choice, model, budget=60 * GIB, state=5 * GIB,
                 overhead=0.0, floor=1024, step=512)
    assert choice.fp8 == chosen and words in choice.fp8_reason, choice.fp8_reason
    assert float8.computes_float8(model) is (chosen == "tensorwise")  # the layers are left as chosen
    assert calls == [(2, 8192, True, True), (2, 8192, True, False)]  # the chosen mode and size, float8 then bf16
    assert len(choice.trials) == 4 and choice.tokens_per_batch == 8192


def test_float8_that_needs_more_memory_is_measured_at_the_rows_that_fit(llava):
    from vlmctl.distributed import float8
    from vlmctl.train.autotune import Choice, Trial, float8_trial

    budget, state = 60 * GIB, 5 * GIB  # bf16: 10 GiB + 5 MiB x 8,192 = 50 GiB, with 5 GiB of state within 60 GiB
    # float8 at 6 MiB per token: 63 GiB, 3 GiB over: 615 tokens fewer at the bf16 trials' 5 MiB per token -> 7,168
    # (a multiple of 512), where it fits (57 GiB); at 9 MiB per token the size that fits is below the floor
    for fp8_per, chosen, size in ((6 * MIB, "tensorwise", 7168), (9 * MIB, "off", None)):
        model, calls = trial_model(llava), []
        choice = Choice(tokens_per_batch=8192, activation_checkpointing=2, rates={"2": 8192 / 1.0},
                        trials=[Trial(2, s, peak, 0.1) for s, peak in BF16_TRIALS])
        run = fake_run(model, 1.0, 0.7, fp8_per, calls=calls)
        floor = 6144 if chosen == "off" else 1024
        float8_trial(run, choice, model, budget=budget, state=state, overhead=0.0, floor=floor, step=512)
        assert choice.fp8 == chosen, choice.fp8_reason
        if chosen == "tensorwise":
            assert calls[1][:2] == (2, size) and choice.tokens_per_batch == size
            assert 10 * GIB + 6 * MIB * size + state <= budget and f"at {size} vs" in choice.fp8_reason
        else:
            assert len(calls) == 2 and "did not fit" in choice.fp8_reason and choice.tokens_per_batch == 8192


def test_the_float8_trial_is_off_without_a_layer_large_enough(llava):
    import torch

    from vlmctl.models import load_model
    from vlmctl.train.autotune import Choice, float8_trial

    model, _, _ = load_model(llava[0], dtype=torch.float32)  # nothing converted
    choice = Choice(tokens_per_batch=4096, activation_checkpointing="off")
    float8_trial(lambda *a, **k: pytest.fail("no trial runs"), choice, model, budget=GIB, state=0, overhead=0.0,
                 floor=1, step=512)
    assert choice.fp8 == "off" and "large enough" in choice.fp8_reason


# ------------------------------------------------------------------------ the engine: hook, checkpoints


def test_the_step_hooks_run_after_an_optimizer_step_that_changed_the_weights():
    import torch

    from vlmctl.distributed.engine import TorchEngine

    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    engine = TorchEngine(layer, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                         max_grad_norm=0.0, device=torch.device("cpu"))
    seen = []
    engine.step_hooks.append(lambda: seen.append(layer.weight.detach().clone()))
    for grad, skip in ((1.0, True), (float("nan"), False), (1.0, False)):
        before = layer.weight.detach().clone()
        for p in layer.parameters():
            p.grad = torch.full_like(p, grad)
        engine.step(skip=skip)
    assert len(seen) == 1 and torch.equal(seen[0], layer.weight) and not torch.equal(seen[0], before)  # after the update


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    from vlmctl.distributed.env import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fsdp_engine(folder, fp8: str, precision: str = "fp32"):
    """The tiny LLaVA through `parallelize` (FSDP2 on one gloo rank, train.fp8 = `fp8`) and `build_engine`: in fp32
    with torch's AdamW, or with `precision` bf16 in bf16 stepped by the AdamW with stochastic rounding that bf16
    master weights use (`optimizer.stochastic_adamw`)."""
    import torch

    from vlmctl.distributed.engine import build_engine, strategy_of
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.distributed.parallelize import parallelize
    from vlmctl.models import load_model
    from vlmctl.train.optimizer import stochastic_adamw
    from vlmctl.train.setup import model_parts

    # every aligned layer: the tiny model's are all below torchao's size rule
    train = TrainSection(strategy="fsdp", precision=precision, fp8=fp8, fp8_layers="all", compile="off",
                         activation_checkpointing="off")
    dims = ParallelDims.for_strategy("fsdp", 1, sharding="full")
    dims.build_mesh("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model, _, family = load_model(folder, dtype=dtype)
    cpu = torch.device("cpu")
    wrapped = parallelize(model, family=family, parts=model_parts(model, family), train=train, dims=dims, device=cpu,
                          dtype=dtype)
    def make_optimizer(m):
        trained = [p for p in m.parameters() if p.requires_grad]
        if precision == "bf16":
            groups = [{"params": trained, "lr": 1e-2, "weight_decay": 0.0}]
            return stochastic_adamw(groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
        return torch.optim.AdamW(trained, lr=1e-3)

    return build_engine(wrapped, strategy_of("fsdp"), max_grad_norm=1.0, device=cpu, dtype=dtype,
                        make_optimizer=make_optimizer,
                        make_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0))


@pytest.mark.parametrize("chunk", [1, None], ids=["each-parameter-alone", "parameters-concatenated"])
def test_stochastic_rounding_steps_the_weights_fsdp2_all_gathers_in_float8(llava, one_rank, tmp_path, monkeypatch, chunk):
    """The optimizer steps a float8 layer's shard alone (a parameter larger than `FLAT_CHUNK`, as a 7B's MLP
    weights are) or in a flat copy with others: either way through the float8 all-gather's weight wrapper."""
    import torch

    from vlmctl.distributed import float8
    from vlmctl.train import optimizer

    if chunk is not None:
        monkeypatch.setattr(optimizer, "FLAT_CHUNK", chunk)
    folder, inputs = llava
    engine = fsdp_engine(folder, "tensorwise", "bf16")
    state = float8.state_of(engine.module)
    assert state.all_gather and state.layers
    layers = dict(engine.module.named_modules())
    before = {name: layers[name].weight.full_tensor().detach().clone() for name in state.layers}
    for _ in range(2):
        train_step(engine, inputs)
    for name in state.layers:
        weight = layers[name].weight
        assert not torch.equal(float8.high_precision(weight.full_tensor()), float8.high_precision(before[name])), name
        moments = engine.optimizer.state[weight]
        # the moments are plain shards (no float8 wrapper): they are saved and loaded as any other optimizer state
        assert all(type(moments[k].to_local()) is torch.Tensor for k in ("exp_avg", "exp_avg_sq")), name
        assert moments["exp_avg_sq"].to_local().abs().sum() > 0, name
    for name, (got, want) in scales(engine).items():  # the scales follow the stepped weights
        torch.testing.assert_close(got, want, msg=name)
    engine.save(tmp_path / "sr", step=2)

    # resumed: the weights and moments come back, and the next step runs through the wrapper again
    again = fsdp_engine(folder, "tensorwise", "bf16")
    again.load(tmp_path / "sr")
    resumed = dict(again.module.named_modules())
    for name in state.layers:
        weight = resumed[name].weight
        assert torch.equal(float8.high_precision(weight.full_tensor()),
                           float8.high_precision(layers[name].weight.full_tensor())), name
        saved = engine.optimizer.state[layers[name].weight]["exp_avg_sq"]
        assert torch.equal(again.optimizer.state[weight]["exp_avg_sq"].full_tensor(), saved.full_tensor()), name
    train_step(again, inputs)
    for name, (got, want) in scales(again).items():
        torch.testing.assert_close(got, want, msg=name)


def train_step(engine, inputs) -> None:
    engine.backward(engine.model(**inputs).loss, 1.0)
    engine.step(skip=False)


def scales(engine):
    """{layer path: (its precomputed scale, the scale of its current weight)} of the float8 all-gather layers
    (`float8_scales.weight_scales`), which must be every layer `convert` converted."""
    from float8_scales import weight_scales

    from vlmctl.distributed import float8

    out = weight_scales(engine.module)
    assert set(out) == set(float8.state_of(engine.module).layers)
    return out


def test_fsdp2_all_gathers_float8_weights_and_their_scales_follow_each_step_and_each_load(llava, one_rank, tmp_path):
    import torch
    from safetensors.torch import save_file

    from vlmctl.distributed import float8

    folder, inputs = llava
    engine = fsdp_engine(folder, "tensorwise")
    state = float8.state_of(engine.module)
    assert state.all_gather and state.layers and len(engine.step_hooks) == 1
    for name, (got, want) in scales(engine).items():  # before the first step: computed when the engine was built
        torch.testing.assert_close(got, want, msg=name)
    train_step(engine, inputs)
    for name, (got, want) in scales(engine).items():
        torch.testing.assert_close(got, want, msg=name)
    engine.save(tmp_path / "fp8", step=1)

    # fp8 off reads the float8 run's checkpoint: the same weights
    plain = fsdp_engine(folder, "off")
    assert float8.state_of(plain.module) is None and not plain.step_hooks
    plain.load(tmp_path / "fp8")
    trained = {k: v.full_tensor() for k, v in engine.module.state_dict().items()}
    for key, value in plain.module.state_dict().items():
        assert torch.equal(value.full_tensor(), float8.high_precision(trained[key])), key
    # and back: fp8 on reads a plain checkpoint, its scales computed from the loaded weights
    train_step(plain, inputs)
    plain.save(tmp_path / "plain", step=2)
    again = fsdp_engine(folder, "tensorwise")
    again.load(tmp_path / "plain")
    for name, (got, want) in scales(again).items():
        torch.testing.assert_close(got, want, msg=name)

    # the export: plain tensors (no float8 wrapper), safetensors-ready, equal to the trained weights
    exported = again.gather(0)
    assert all(type(v) is torch.Tensor for v in exported.values())
    for key, value in plain.module.state_dict().items():
        assert torch.equal(exported[key], value.full_tensor()), key
    exported.pop("lm_head.weight")  # tied to the embeddings: the export saves it once, through the model
    save_file(exported, tmp_path / "model.safetensors")


def test_parallelize_leaves_auto_to_the_trial_and_a_frozen_model_unconverted(llava, one_rank):
    import torch

    from vlmctl.distributed import float8
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.distributed.parallelize import parallelize
    from vlmctl.families import decoder_layers
    from vlmctl.models import load_model
    from vlmctl.train.setup import model_parts

    dims = ParallelDims.for_strategy("fsdp", 1, sharding="full")
    dims.build_mesh("cpu")
    cpu = torch.device("cpu")
    for fp8, layers, wide, trainable in (("auto", "all", True, True), ("auto", "sized", True, True),
                                         ("auto", "all", False, True), ("tensorwise", "all", True, False)):
        model, _, family = load_model(llava[0], dtype=torch.float32)
        if wide:  # large enough for torchao's size rule: auto tries float8
            decoder_layers(model, family)[0].wide = torch.nn.Linear(1024, 2048, bias=False)
        train = TrainSection(strategy="fsdp", precision="fp32", fp8=fp8, fp8_layers=layers, compile="off",
                             activation_checkpointing="off")
        parallelize(model, family=family, parts=model_parts(model, family), train=train, dims=dims, device=cpu,
                    dtype=torch.float32, trainable=trainable)
        state = float8.state_of(model)
        if not trainable:
            assert state is None
            continue
        # pending auto: no float8 all-gather, in bf16 until the trial; the layers fp8_layers names where one layer
        # passes the size rule, none where none does (the trial then keeps bf16)
        expected = {("all", True): 28 + 1, ("sized", True): 1, ("all", False): 0}[layers, wide]
        assert len(state.layers) == expected and not state.all_gather, (layers, wide, state.layers)
        assert ("model.language_model.layers.0.wide" in state.layers) is wide
        assert not float8.computes_float8(model) and float8.scale_hook(model) is None


def test_a_recipe_converts_what_the_size_rule_keeps_and_is_refused_where_that_is_nothing(llava, one_rank):
    import torch

    from vlmctl.distributed import float8
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.distributed.parallelize import parallelize
    from vlmctl.families import decoder_layers
    from vlmctl.models import load_model
    from vlmctl.train.setup import model_parts

    dims = ParallelDims.for_strategy("fsdp", 1, sharding="full")
    dims.build_mesh("cpu")
    cpu = torch.device("cpu")

    def converted(layers: str, wide: bool, skip: tuple[str, ...] = (), fast_accum: str = "forward"):
        model, _, family = load_model(llava[0], dtype=torch.float32)
        if wide:  # torchao's tensorwise rule keeps in_features > 4096 or out_features > 1024
            decoder_layers(model, family)[0].wide = torch.nn.Linear(1024, 2048, bias=False)
        train = TrainSection(strategy="fsdp", precision="fp32", fp8="tensorwise", fp8_layers=layers, compile="off",
                             activation_checkpointing="off", fp8_skip=list(skip), fp8_fast_accum=fast_accum)
        parallelize(model, family=family, parts=model_parts(model, family), train=train, dims=dims, device=cpu,
                    dtype=torch.float32)
        return float8.state_of(model), model

    state, model = converted("sized", wide=True)  # the wide layer only, with the float8 all-gather
    assert state.layers == ("model.language_model.layers.0.wide",) and state.all_gather
    # torchao's GEMM settings: fast accumulation in the output matmul only, unless train.fp8_fast_accum=all
    accum = [(c.output.use_fast_accum, c.grad_input.use_fast_accum, c.grad_weight.use_fast_accum)
             for c in (m.linear_mm_config for m in float8.float8_layers(model))]
    assert accum == [(True, False, False)] and state.fast_accum == "forward"
    assert "fast accumulation" not in float8.describe(model)
    state, model = converted("all", wide=True, fast_accum="all")
    assert len(state.layers) == 28 + 1  # every aligned layer: 7 a decoder layer, and the wide one
    assert {(c.output.use_fast_accum, c.grad_input.use_fast_accum, c.grad_weight.use_fast_accum)
            for c in (m.linear_mm_config for m in float8.float8_layers(model))} == {(True, True, True)}
    assert state.fast_accum == "all" and float8.describe(model).endswith("fast accumulation in backward)")
    plain, _, family = load_model(llava[0], dtype=torch.float32)
    with pytest.raises(ValueError, match="fast_accum must be"):
        float8.convert(plain, family, "tensorwise", emulate=True, fast_accum="some")
    with pytest.raises(ConfigError, match="train.fp8=tensorwise: no linear layer") as err:
        converted("sized", wide=False)
    assert "train.fp8_layers=all" in err.value.hint and "train.fp8=off" in err.value.hint
    # train.fp8_skip: the attention's projections stay bf16, the MLPs' three linears and the wide one convert
    state, _ = converted("all", wide=True, skip=("q_proj", "k_proj", "v_proj", "o_proj"))
    assert len(state.layers) == 4 * 3 + 1 and all(".mlp." in n or n.endswith("wide") for n in state.layers)
    with pytest.raises(ConfigError, match=r"train.fp8_skip=\['layers'\]") as err:
        converted("all", wide=True, skip=("layers",))
    assert "fewer fragments in train.fp8_skip" in err.value.hint


def _rank0_weights_rank(rank: int, port: int, folder: str, out: str) -> None:
    """One of two gloo ranks of `vlmctl train`'s shared read: rank 0 loads the tiny LLaVA, rank 1 builds it empty;
    the float8 model is sharded, rank 0's weights placed, one step trained; writes what rank 0 sees."""
    import os

    import torch

    from vlmctl.distributed import float8
    from vlmctl.distributed.env import init_distributed
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.distributed.parallelize import parallelize
    from vlmctl.models import load_model
    from vlmctl.models.load import build_empty_model
    from vlmctl.train.setup import defer_weights, match_rank0, model_parts

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    env = init_distributed()
    dims = ParallelDims.for_strategy("fsdp", 2, sharding="full")
    dims.build_mesh("cpu")
    train = TrainSection(strategy="fsdp", precision="fp32", fp8="tensorwise", fp8_layers="all", compile="off",
                         activation_checkpointing="off")
    source, _, _ = load_model(folder, dtype=torch.float32)
    model, _, family = load_model(folder, dtype=torch.float32) if rank == 0 else build_empty_model(folder, dtype=torch.float32)
    match_rank0(model, rank)
    deferred = defer_weights(model, train, env)
    wrapped = parallelize(model, family=family, parts=model_parts(model, family), train=train, dims=dims,
                          device=env.device, dtype=torch.float32, deferred=deferred)
    full = {k: float8.high_precision(v.full_tensor()) for k, v in wrapped.state_dict().items()}
    same = all(torch.equal(full[k], v) for k, v in source.state_dict().items())
    state = float8.state_of(wrapped)
    if rank == 0:
        torch.save({"same": same, "all_gather": state.all_gather, "layers": len(state.layers)}, f"{out}/rank0.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(300)
def test_rank0s_weights_reach_the_float8_shards_of_every_rank(llava, tmp_path):
    import torch
    import torch.multiprocessing as mp

    from vlmctl.distributed.env import free_port

    mp.spawn(_rank0_weights_rank, args=(free_port(), str(llava[0]), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt")
    assert got == {"same": True, "all_gather": True, "layers": 28}


def test_a_resumed_run_computes_in_the_precision_its_first_start_chose(llava, tmp_path):
    from types import SimpleNamespace

    from vlmctl.config.plan import read_plan
    from vlmctl.distributed import float8
    from vlmctl.train import autotune

    for recorded, want in (("tensorwise", True), ("off", False), (None, False)):
        plan, section = plan_of(activation_checkpointing="off")
        train = plan.train_section(section).model_copy(update={"resume": "auto"})
        model = trial_model(llava)  # converted, in bf16: as parallelize leaves a pending auto
        run_dir = tmp_path / str(recorded)
        run_dir.mkdir()
        autotune.save_record(run_dir, autotune.Choice(tokens_per_batch=4096, reason="probe: fastest", fp8=recorded,
                                                      fp8_reason=f"probe: {recorded}" if recorded else ""))
        ctx = SimpleNamespace(plan=plan, env=SimpleNamespace(is_main=True))
        tm = SimpleNamespace(parts=SimpleNamespace(decoder_layers=[], vision_layers=[]))
        autotune.tune(SimpleNamespace(train=train), run_dir, ctx, tm, SimpleNamespace(module=model), None, None, [],
                      log=lambda msg: None)
        assert train.fp8 == (recorded or "off") and float8.computes_float8(model) is want
        assert read_plan(run_dir).fp8.value == train.fp8 and train.tokens_per_batch == 4096
        if recorded is None:  # a record from before the float8 trial: its rows trained in bf16
            assert "no float8 trial" in read_plan(run_dir).fp8.reason
