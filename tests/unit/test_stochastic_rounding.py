"""bf16 master weights with stochastic rounding (`train.master_weights`, `train.stochastic_rounding`): what `auto`
resolves to, that small updates survive where round-to-nearest drops them, and that the optimizer state and the
tensor learning rates of torchao's AdamW come back from a checkpoint."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from vlmctl.config import TrainSection
from vlmctl.config.plan import DeviceFacts, build_plan, check_plan, resolve_master_weights, resolve_stochastic_rounding

pytest.importorskip("torchao")


@pytest.mark.parametrize("kwargs, expected", [
    ({"cuda": True, "precision": "auto", "strategy": "fsdp", "lora": False}, "bf16"),
    ({"cuda": True, "precision": "bf16", "strategy": "ddp", "lora": False}, "bf16"),
    ({"cuda": False, "precision": "auto", "strategy": "ddp", "lora": False}, "fp32"),  # CPU
    ({"cuda": True, "precision": "fp32", "strategy": "fsdp", "lora": False}, "fp32"),
    ({"cuda": True, "precision": "auto", "strategy": "zero3", "lora": False}, "fp32"),  # DeepSpeed's own master copy
    ({"cuda": True, "precision": "auto", "strategy": "fsdp", "lora": True}, "fp32"),  # adapters in fp32
])
def test_auto_master_weights_are_bf16_only_where_they_apply(kwargs, expected):
    assert resolve_master_weights("auto", **kwargs) == expected
    assert resolve_master_weights("fp32", **{**kwargs, "cuda": True, "strategy": "fsdp"}) == "fp32"  # set by hand: kept
    assert resolve_stochastic_rounding("auto", expected) == ("on" if expected == "bf16" else "off")
    assert resolve_stochastic_rounding("off", "bf16") == "off"


def test_without_torchao_auto_keeps_fp32_master_weights(monkeypatch):
    import vlmctl.config.plan as plan_module

    monkeypatch.setattr(plan_module, "has_torchao", lambda: False)
    assert resolve_master_weights("auto", cuda=True, precision="auto", strategy="fsdp", lora=False) == "fp32"
    assert resolve_stochastic_rounding("auto", "bf16") == "off"


def test_the_plan_resolves_auto_on_cpu_to_fp32_and_leaves_the_config_alone():
    train = TrainSection()
    plan = build_plan(train, DeviceFacts(kind="cpu", torchao=True))
    assert (plan.master_weights.value, plan.stochastic_rounding.value, plan.stored.value) == ("fp32", "off", "fp32")
    assert train.master_weights == "auto" and train.stochastic_rounding == "auto"  # the config keeps its words
    resolved = plan.train_section(train)
    assert (resolved.master_weights, resolved.stochastic_rounding) == ("fp32", "off")
    gpu = build_plan(train, DeviceFacts(kind="cuda", torchao=True))  # one GPU, bf16: pure bf16 with ddp
    assert (gpu.strategy.value, gpu.master_weights.value, gpu.stochastic_rounding.value, gpu.stored.value) == (
        "ddp", "bf16", "on", "bf16")
    no_bf16 = build_plan(train, DeviceFacts(kind="cuda", bf16=False, torchao=True))  # precision auto -> fp32
    assert (no_bf16.precision.value, no_bf16.master_weights.value) == ("fp32", "fp32")


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)  # bf16 spacing at 1.0 is 2^-7: every update below 2^-8 rounds back to 1.0 to nearest
    return model.to(torch.bfloat16)


def _optimizer(model, rounding: str):
    from vlmctl.train.setup import adamw_factory

    train = TrainSection(master_weights="bf16", stochastic_rounding=rounding, learning_rate=1e-4)
    groups = [{"params": list(model.parameters()), "lr": train.learning_rate, "weight_decay": 0.0}]
    return adamw_factory(train, torch.device("cpu"))(groups)


def test_stochastic_rounding_keeps_updates_that_round_to_nearest_loses():
    """Adam's first steps move each weight by about lr = 1e-4 per step, 1/78 of bf16's spacing at 1.0: after 40
    steps the fp32 result is 0.996. Rounded to nearest, every update is lost; rounded stochastically, the mean
    over 8,192 weights follows fp32."""
    steps, lr = 40, 1e-4
    means = {}
    for rounding in ("on", "off"):
        model = _model()
        opt = _optimizer(model, rounding)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        means[rounding] = torch.stack([p.float().mean() for p in model.parameters()]).mean().item()
    assert means["off"] == 1.0
    assert means["on"] == pytest.approx(1.0 - steps * lr, abs=2e-4)


def test_torchao_optimizer_state_and_tensor_lr_resume_from_a_checkpoint(tmp_path):
    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.train import checkpoint as ckpt
    from vlmctl.train.setup import build_scheduler

    train = TrainSection(lr_scheduler="linear", warmup_ratio=0.0, learning_rate=1e-4)

    def trained(steps):
        model = _model()
        opt = _optimizer(model, "on")
        sched = build_scheduler(opt, train, 10)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.5)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return model, opt, sched

    model, opt, sched = trained(3)
    saved = ckpt.save(tmp_path, 3, {"step": 3, "consumed_micro_batches": 3}, rank=0,
                      engine=TorchEngine(model, opt, sched, max_grad_norm=0.0))
    (saved / ckpt.STATE_FILE).write_text(json.dumps({"step": 3, "consumed_micro_batches": 3}))
    model2, opt2, sched2 = trained(0)
    ckpt.load(saved, rank=0, engine=TorchEngine(model2, opt2, sched2, max_grad_norm=0.0))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
        assert float(opt.state[p]["step"]) == float(opt2.state[q]["step"]) == 3
    lr = opt2.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(1e-4 * 7 / 10)
    assert sched2.last_epoch == 3


@pytest.mark.parametrize("chunk, small", [(None, None), (40, None), (None, 1), (40, 1)],
                         ids=["flat-copies", "flat-copies-small-chunks", "in-place-lists", "in-place-small-chunks"])
def test_the_one_compiled_step_matches_torchaos_own_adamw(chunk, small, monkeypatch):
    """`stochastic_adamw` steps every parameter size through one dynamic-shape compiled kernel: small parameters on
    flat copies of several at once (with chunk=40 the 7- and 30-element ones go one by one), the others in place, in
    lists of one size (small=1: every parameter; the three 30-element ones as a list of 2 and one of 1, or one by one
    with chunk=40); torchao's `_AdamW` compiles one per shape. Same gradients (one parameter without a gradient in
    some steps, so the step counts part) -> the same moments (rounded to nearest in both) and, after many steps,
    weights as far from torchao's as torchao's are from another torchao run's (the stochastic rounding's noise:
    each weight's rounded steps are a random walk of bf16 spacings)."""
    from torchao.optim import _AdamW

    from vlmctl.train import optimizer
    from vlmctl.train.optimizer import stochastic_adamw

    if chunk is not None:
        monkeypatch.setattr(optimizer, "FLAT_CHUNK", chunk)
    if small is not None:
        monkeypatch.setattr(optimizer, "SMALL_PARAM", small)

    torch.manual_seed(1)
    shapes = [(48, 32), (7,), (3, 5, 2), (30,), (30,), (30,)]
    start = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    grads = [[torch.randn(s).to(torch.bfloat16) for s in shapes] for _ in range(30)]
    for step in (4, 5, 11):  # the fifth parameter has no gradient in three steps: its step count falls behind
        grads[step][4] = None
    runs = {}
    for seed, name in enumerate(("ours", "torchao", "torchao again")):
        torch.manual_seed(seed)  # other random bits for the rounding
        params = [torch.nn.Parameter(t.clone()) for t in start]
        groups = [{"params": params[:1], "lr": 1e-3, "weight_decay": 0.1},
                  {"params": params[1:], "lr": 1e-3, "weight_decay": 0.0}]
        opt = (stochastic_adamw(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8) if name == "ours" else
               _AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, bf16_stochastic_round=True))
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = None if gi is None else gi.clone()
            opt.step()
        runs[name] = (params, opt)
    (ours, opt_a), (ref, opt_b) = runs["ours"], runs["torchao"]
    for i, (p, q, p0) in enumerate(zip(ours, ref, start)):
        assert p.shape == q.shape and p.dtype == torch.bfloat16
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])
        assert float(opt_a.state[p]["step"]) == float(opt_b.state[q]["step"]) == (27 if i == 4 else 30)
        assert not torch.equal(p.detach(), p0)

    def flat(params):
        return torch.cat([p.detach().float().reshape(-1) for p in params])

    # 30 steps of ~1e-3 each (0.03 of travel, about 2 bf16 spacings at |w| ~ 2): two torchao runs end 0.006 apart
    # on average, ours as far from torchao's (0.94-1.04x over four seeds and the four cases)
    noise = (flat(runs["torchao again"][0]) - flat(ref)).abs().mean()
    assert 0.002 < noise < 0.02
    assert (flat(ours) - flat(ref)).abs().mean() <= 1.25 * noise


def test_the_probes_optimizer_timing_leaves_bf16_weights_bit_for_bit():
    """`autotune.measure_step` steps AdamW with stochastic rounding at learning rate 0 (a tensor here): a bf16 weight
    plus an update of 0 rounds to itself, so no weight moves by even one bf16 spacing."""
    from vlmctl.train.autotune import measure_step
    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.train.optimizer import stochastic_adamw

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 3)).to(torch.bfloat16)
    opt = stochastic_adamw([{"params": list(model.parameters()), "lr": 1e-3, "weight_decay": 0.1}], lr=1e-3,
                           betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    engine = TorchEngine(model, opt, sched, max_grad_norm=1.0, device=torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    assert measure_step(engine, torch.device("cpu")) > 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not opt.state and float(opt.param_groups[0]["lr"]) == pytest.approx(1e-3)


def test_strategy_auto_is_ddp_for_one_process_storing_bf16_weights():
    """FSDP2 on one GPU only pays off as the cast from fp32 master weights to bf16 compute copies; with bf16
    weights it would add a gathered copy of the model, so one process runs ddp (a plain model)."""
    from vlmctl.config.plan import resolve_strategy, single_bf16

    train = TrainSection()
    assert single_bf16(train, cuda=True, processes=1)
    assert resolve_strategy("auto", True, single_bf16=single_bf16(train, True, 1)) == "ddp"
    assert resolve_strategy("auto", True, single_bf16=single_bf16(train, True, 2)) == "fsdp"  # shards over 2 GPUs
    fp32 = TrainSection(master_weights="fp32")
    assert resolve_strategy("auto", True, single_bf16=single_bf16(fp32, True, 1)) == "fsdp"
    lora = TrainSection(lora={"r": 8})  # a frozen base in the compute dtype: nothing to cast on one GPU either
    assert resolve_strategy("auto", True, single_bf16=single_bf16(lora, True, 1)) == "ddp"
    assert resolve_strategy("auto", True, single_bf16=single_bf16(lora, True, 2)) == "fsdp"
    assert resolve_strategy("auto", False, single_bf16=single_bf16(train, False, 1)) == "ddp"  # CPU, as before
    assert resolve_strategy("fsdp", True, single_bf16=True) == "fsdp"  # set by hand: kept


def test_stochastic_rounding_without_torchao_is_a_config_error(monkeypatch):
    from vlmctl.errors import ConfigError

    train = TrainSection(master_weights="bf16", stochastic_rounding="on", precision="bf16")
    with pytest.raises(ConfigError, match="torchao") as err:
        check_plan(build_plan(train, DeviceFacts(kind="cuda", torchao=False)), train)
    assert "stochastic_rounding=off" in err.value.hint


def test_compile_auto_is_on_for_torch_strategies_on_a_gpu_except_qlora():
    from vlmctl.config.plan import resolve_compile

    assert resolve_compile("auto", cuda=True, strategy="ddp", quantized=False) == "on"
    assert resolve_compile("auto", cuda=True, strategy="fsdp", quantized=False) == "on"
    assert resolve_compile("auto", cuda=True, strategy="ddp", quantized=True) == "off"  # QLoRA's bitsandbytes layers
    assert resolve_compile("auto", cuda=True, strategy="zero3", quantized=False) == "off"
    assert resolve_compile("auto", cuda=False, strategy="ddp", quantized=False) == "off"
    assert resolve_compile("on", cuda=False, strategy="ddp", quantized=False) == "on"  # set by hand: kept
    # YAML booleans and the older bool key read as the switch words
    assert TrainSection(compile=True).compile == "on" and TrainSection(compile=False).compile == "off"
    assert TrainSection().compile == "auto"
    cpu = DeviceFacts(kind="cpu")
    plan = build_plan(TrainSection(strategy="ddp"), cpu)
    assert (plan.compile.value, plan.compile_vision.value) == ("off", "off")  # recorded in the plan, with reasons
    assert plan.compile.auto and plan.compile.reason
    plan = build_plan(TrainSection(strategy="ddp", compile="on"), cpu)
    assert plan.compile_vision.value == "blocks"  # the vision blocks follow the compiled decoder layers
    qlora = build_plan(TrainSection(lora={"r": 8, "quantize": "4bit"}), DeviceFacts(kind="cuda", triton=True))
    assert (qlora.strategy.value, qlora.compile.value, qlora.compile_vision.value) == ("ddp", "off", "kernels")


def test_compile_vision_auto_follows_the_decoder_layers():
    from vlmctl.config.plan import resolve_compile_vision

    assert resolve_compile_vision("auto", cuda=True, compile="on") == "blocks"
    assert resolve_compile_vision("auto", cuda=True, compile="off") == "kernels"  # QLoRA, DeepSpeed on a GPU
    assert resolve_compile_vision("auto", cuda=False, compile="off") == "off"
    assert resolve_compile_vision("kernels", cuda=True, compile="on") == "kernels"  # set by hand: kept
    assert TrainSection(compile_vision=True).compile_vision == "kernels"  # YAML's bare on, the older word


def test_probe_leaves_op_checkpointing_out_under_compiled_layers():
    from vlmctl.train.autotune import CANDIDATES, candidates

    assert "op" in candidates(TrainSection(compile="off")) and candidates(TrainSection(compile="off")) == CANDIDATES
    assert candidates(TrainSection(compile="on")) == ("off", "vision", 2, "full")


def _engine(max_grad_norm: float):
    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.train.optimizer import stochastic_adamw

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 5)).to(torch.bfloat16)
    opt = stochastic_adamw([{"params": list(model.parameters()), "lr": 1e-3, "weight_decay": 0.1}], lr=1e-3,
                           betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    return model, opt, TorchEngine(model, opt, sched, max_grad_norm=max_grad_norm, device=torch.device("cpu"))


def _set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def test_the_engine_clips_inside_the_update_as_torch_clips_the_gradients(monkeypatch):
    """With `stochastic_adamw` the engine passes the clipping coefficient into the update instead of scaling the
    gradients first (no pass of its own, no host sync before the update): the moments equal those of gradients
    clipped by torch's `clip_grads_with_norm_` and stepped unclipped, to bf16's precision (the scaled gradient is
    fp32 inside the update, bf16 after torch's clip); the norm returned is the unclipped one."""
    from vlmctl.distributed import engine as engine_module

    monkeypatch.setattr(engine_module, "clip_grads", lambda *a: pytest.fail("the gradients were scaled in a pass of their own"))
    model, opt, engine = _engine(max_grad_norm=0.5)
    ref_model, ref_opt, _ = _engine(max_grad_norm=0.0)
    grads = [torch.randn_like(p) for p in model.parameters()]  # norm ~ 40: clipped to 0.5
    norm = torch.nn.utils.get_total_norm(grads).item()
    _set_grads(model, grads)
    assert engine.step(skip=False) == pytest.approx(norm, rel=1e-2)
    _set_grads(ref_model, grads)
    torch.nn.utils.clip_grads_with_norm_(list(ref_model.parameters()), 0.5, torch.tensor(norm))
    ref_opt.step()
    for p, q, g in zip(model.parameters(), ref_model.parameters(), grads):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key].float(), ref_opt.state[q][key].float(), rtol=2e-2, atol=1e-9)
        # the first moment after one step: (1 - beta1) x the clipped gradient, not the unclipped one
        assert opt.state[p]["exp_avg"].float().norm().item() == pytest.approx(0.1 * g.float().norm().item() * 0.5 / norm, rel=2e-2)


def test_a_non_finite_norm_leaves_weights_moments_counts_and_schedule_as_they_were():
    """A gradient with an inf skips the step on the device (the host learns it only after the update was queued):
    weights and moments unchanged, step counts taken back, the schedule unmoved, None returned. The next finite
    step is the one a run without the bad step takes: same moments, same bias correction."""
    model, opt, engine = _engine(max_grad_norm=1.0)
    ref_model, ref_opt, ref_engine = _engine(max_grad_norm=1.0)
    good = [[torch.randn_like(p) * 0.01 for p in model.parameters()] for _ in range(2)]
    _set_grads(model, good[0])
    _set_grads(ref_model, good[0])
    engine.step(skip=False)
    ref_engine.step(skip=False)
    engine.optimizer.zero_grad()
    ref_engine.optimizer.zero_grad()
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in model.parameters()]
    lr = engine.lr
    bad = [g.clone() for g in good[1]]
    bad[0][0, 0] = float("inf")
    _set_grads(model, bad)
    assert engine.step(skip=False) is None
    for p, (w, m, v) in zip(model.parameters(), before):
        assert torch.equal(p, w) and torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert float(opt.state[p]["step"]) == 1.0
    assert engine.lr == lr and p.grad is None
    _set_grads(model, good[1])
    _set_grads(ref_model, good[1])
    assert engine.step(skip=False) == pytest.approx(ref_engine.step(skip=False))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], ref_opt.state[q][key])
    assert engine.lr == ref_engine.lr


def test_stepped_inside_backward_the_update_gives_the_moments_of_a_step_after_it():
    """`OptimizerInBackward` with one `stochastic_adamw` per parameter (`train.optimizer_in_backward` with bf16 master
    weights) calls each one's `step` without a clipping coefficient or a skip flag: the update takes the shared
    defaults (1, True) and leaves the moments a step after backward leaves, gradients freed."""
    from vlmctl.train.optimizer import OptimizerInBackward, stochastic_adamw

    def make(groups):
        return stochastic_adamw(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)

    torch.manual_seed(4)
    x = torch.randn(6, 16).to(torch.bfloat16)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 3)).to(torch.bfloat16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    inside = OptimizerInBackward([{"params": list(models[0].parameters()), "lr": 1e-3, "weight_decay": 0.0}], make=make)
    after = make([{"params": list(models[1].parameters()), "lr": 1e-3, "weight_decay": 0.0}])
    for model in models:
        model(x).float().square().mean().backward()
    after.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert p.grad is None
        state = inside.optimizers[p].state[p]
        assert float(state["step"]) == 1.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], after.state[q][key])


def test_one_compiled_graph_per_list_length_whatever_the_sizes(monkeypatch):
    """The compiled step takes flat copies of small parameters as one graph, a parameter alone and lists of parameters
    of one size as one graph per list length: a new set of sizes compiles nothing more (Dynamo guards on a view's base and on
    requires_grad, which the flat aliases leave out; a recompilation costs seconds of a run's first step on a GPU)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from vlmctl.train import optimizer
    from vlmctl.train.optimizer import stochastic_adamw

    monkeypatch.setattr(optimizer, "SMALL_PARAM", 32)  # the 7- and 30-element parameters through one flat copy
    monkeypatch.setattr(optimizer, "_COMPILED", {})
    torch._dynamo.reset()

    def step_twice(shapes):
        params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
        opt = stochastic_adamw([{"params": params, "lr": 1e-3, "weight_decay": 0.1}], lr=1e-3, betas=(0.9, 0.999),
                               eps=1e-8)
        before = [p.detach().clone() for p in params]
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))  # each parameter stepped in place
        return counters["stats"]["unique_graphs"] - first

    first = counters["stats"]["unique_graphs"]  # graphs the process compiled before
    torch.manual_seed(3)
    # a 1,536-element weight alone, three 40-element ones as a list of 2 and one alone, a flat copy of the 7 and 30
    graphs = step_twice([(48, 32), (40,), (40,), (40,), (7,), (30,)])
    assert graphs == 3  # lists of 1 and of 2, and the flat copies
    assert step_twice([(64, 40), (50, 3), (150,), (9,)]) == graphs  # other sizes, the same list lengths


def test_a_loaded_state_is_the_one_the_next_step_uses():
    """The optimizer keeps the calls of its step between steps; after `load_state_dict` (a resumed run) the next step
    updates the loaded moments and counts, not the tensors the last step used: an optimizer that stepped on and was
    loaded back steps as a fresh one loaded with the same state."""
    from vlmctl.train.optimizer import stochastic_adamw

    torch.manual_seed(4)
    start = [torch.randn(s).to(torch.bfloat16) for s in [(16, 8), (5,)]]
    grads = [[torch.randn_like(t) for t in start] for _ in range(5)]

    def make():
        params = [torch.nn.Parameter(t.clone()) for t in start]
        return params, stochastic_adamw([{"params": params, "lr": 1e-2, "weight_decay": 0.0}], lr=1e-2,
                                        betas=(0.9, 0.999), eps=1e-8)

    def step(params, opt, g, seed):
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        torch.manual_seed(seed)  # the same random bits for the rounding
        opt.step()

    params, opt = make()
    for g in grads[:2]:
        step(params, opt, g, 0)
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    for g in grads[2:4]:
        step(params, opt, g, 0)
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    opt.load_state_dict(copy.deepcopy(saved))  # torch keeps the tensors it is given: one copy each
    fresh, other = make()
    with torch.no_grad():
        for p, w in zip(fresh, weights):
            p.copy_(w)
    other.load_state_dict(copy.deepcopy(saved))
    step(params, opt, grads[4], 7)
    step(fresh, other, grads[4], 7)
    for p, q in zip(params, fresh):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], other.state[q][key])
        assert float(opt.state[p]["step"]) == float(other.state[q]["step"]) == 3
