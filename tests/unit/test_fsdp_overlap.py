"""FSDP2 overlap (`vlmctl.distributed.fsdp`): the `auto` rule for resharding after forward, the prefetch lists each
FSDP module gets, and, on two gloo ranks with the tiny LLaVA, that no setting changes the arithmetic (the same loss
and gradients over two optimizer steps) while each does what it says to the gathered weights."""

from __future__ import annotations

import json
import os

import pytest

from vlmctl.distributed.fsdp import prefetch_lists, resolve_prefetch, resolve_reshard
from vlmctl.errors import ConfigError

GIB = 2**30


# ------------------------------------------------------------------------------------------------ the rules alone


@pytest.mark.parametrize("ranks, gathered, memory, reshard", [
    (1, 8 * GIB, 80 * GIB, True),      # one GPU: no all-gather to save, only a second copy of the weights
    (2, 8 * GIB, 80 * GIB, False),     # two GPUs: the gathered copy fits
    (4, 15 * GIB, 141 * GIB, False),   # a 7B model on 4 H200s
    (8, 20 * GIB, 80 * GIB, False),    # a full node, exactly a quarter
    (8, 21 * GIB, 80 * GIB, True),     # over a quarter of the memory
    (16, 1 * GIB, 141 * GIB, True),    # full sharding over two nodes
])
def test_auto_keeps_layers_gathered_on_one_node_when_a_quarter_of_the_memory_holds_them(ranks, gathered, memory, reshard):
    value, reason = resolve_reshard("auto", shard_ranks=ranks, gathered_bytes=gathered, memory_bytes=memory)
    assert value is reshard and reason.startswith("auto: ")
    # true and false are taken as given, whatever the sizes
    assert resolve_reshard(True, shard_ranks=ranks, gathered_bytes=gathered, memory_bytes=memory) == (True, "as set")
    assert resolve_reshard(False, shard_ranks=ranks, gathered_bytes=gathered, memory_bytes=memory) == (False, "as set")


def test_settings_that_are_not_values_name_their_key():
    with pytest.raises(ConfigError, match="train.fsdp_reshard_after_forward"):
        resolve_reshard("sometimes", shard_ranks=2, gathered_bytes=1, memory_bytes=10)
    assert [resolve_prefetch(v) for v in ("auto", "off", 1, 3)] == [1, 0, 1, 3]
    for bad in (0, -2, "fast", True):
        with pytest.raises(ConfigError, match="train.fsdp_prefetch"):
            resolve_prefetch(bad)


@pytest.mark.parametrize("setting, master, expected", [
    ("auto", "bf16", "bf16"),  # the reduced shard is stored in bf16: an fp32 reduction only doubles the bytes
    ("auto", "fp32", "fp32"),  # fp32 gradient shards keep the fp32 sum
    ("fp32", "bf16", "fp32"),
    ("bf16", "fp32", "bf16"),
])
def test_gradients_reduce_in_bf16_where_the_master_weights_are_bf16(setting, master, expected, monkeypatch):
    """`train.fsdp_reduce_dtype`: the rule, the plan's decision and the MixedPrecisionPolicy `apply_fsdp` hands
    every `fully_shard` call (recorded on a one-rank mesh, no process group needed)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed.fsdp as torch_fsdp

    from vlmctl.config import TrainSection
    from vlmctl.config.plan import DeviceFacts, build_plan
    from vlmctl.distributed.fsdp import apply_fsdp, fsdp_plan_of, resolve_reduce_dtype

    value, why = resolve_reduce_dtype(setting, master)
    assert value == expected
    assert why == "set" if setting != "auto" else why.startswith("auto: ")
    train = TrainSection(strategy="fsdp", master_weights=master, fsdp_reduce_dtype=setting)
    decision = build_plan(train, DeviceFacts(kind="cuda", processes=2, torchao=True)).fsdp_reduce_dtype
    assert decision.value == expected and decision.auto == (setting == "auto")
    assert build_plan(train.model_copy(update={"strategy": "ddp"}), DeviceFacts(kind="cuda", processes=2, torchao=True)
                      ).fsdp_reduce_dtype.reason == "not used: ddp"

    policies = []
    monkeypatch.setattr(torch_fsdp, "fully_shard", lambda module, **kw: policies.append(kw["mp_policy"]))
    layers = [torch.nn.Linear(4, 4) for _ in range(2)]
    model = torch.nn.Sequential(*layers)
    mesh = SimpleNamespace(mesh_dim_names=None, shape=(1,))
    apply_fsdp(model, SimpleNamespace(vision_layers=[], decoder_layers=layers), mesh, param_dtype=torch.bfloat16,
               reshard_after_forward=True, prefetch="off", reduce_dtype=setting, master_weights=master)
    assert len(policies) == 3 and {p.reduce_dtype for p in policies} == {getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[expected])}
    assert f"gradients reduced in {expected}" in fsdp_plan_of(model).describe()
    policies.clear()
    apply_fsdp(model, SimpleNamespace(vision_layers=[], decoder_layers=layers), mesh, param_dtype=None,
               reshard_after_forward=True, prefetch="off", reduce_dtype=setting, master_weights=master)
    assert {p.reduce_dtype for p in policies} == {None}  # fp32 compute: no mixed precision, nothing to cast
    assert "reduced" not in fsdp_plan_of(model).describe()


@pytest.mark.parametrize("setting", ["auto", "bf16", "fp32"])
def test_the_plan_records_the_fp32_reduction_of_fp32_compute(setting):
    """With fp32 compute FSDP2 has no mixed precision and reduces in fp32 whatever `train.fsdp_reduce_dtype` says
    (`plan_fsdp`); the run plan records the same."""
    from vlmctl.config import TrainSection
    from vlmctl.config.plan import DeviceFacts, build_plan

    train = TrainSection(strategy="fsdp", precision="fp32", fsdp_reduce_dtype=setting)
    decision = build_plan(train, DeviceFacts(kind="cuda", processes=2, torchao=True)).fsdp_reduce_dtype
    assert decision.value == "fp32" and "fp32 compute" in decision.reason
    bf16 = build_plan(train.model_copy(update={"precision": "bf16"}), DeviceFacts(kind="cuda", processes=2, torchao=True))
    assert bf16.fsdp_reduce_dtype.value == ("bf16" if setting == "bf16" else "fp32" if setting == "fp32" else
                                            "bf16" if bf16.master_weights.value == "bf16" else "fp32")


def test_a_reduce_dtype_that_is_not_a_setting_names_its_key():
    from vlmctl.distributed.fsdp import resolve_reduce_dtype

    with pytest.raises(ConfigError, match="train.fsdp_reduce_dtype"):
        resolve_reduce_dtype("fp16", "bf16")


def _units(trained: list[bool]):
    import torch

    units = [torch.nn.Linear(2, 2) for _ in trained]
    for unit, on in zip(units, trained):
        unit.requires_grad_(on)
    return units


def test_prefetch_lists_follow_forward_order_and_skip_layers_without_backward():
    # 2 vision layers then 3 decoder layers; -1 is the root
    forward, backward = prefetch_lists(_units([True] * 5), 2, 1, backward=True)
    assert forward == {-1: [0], 0: [1], 1: [2], 2: [3], 3: [4]}
    # backward runs 4, 3, ..., 0; the root prefetches the last layer that was resharded (4 is kept gathered)
    assert backward == {-1: [3], 4: [3], 3: [2], 2: [1], 1: [0]}
    forward2, backward2 = prefetch_lists(_units([True] * 5), 2, 2, backward=True)
    assert forward2 == {-1: [0, 1], 0: [1, 2], 1: [2, 3], 2: [3, 4], 3: [4]}
    assert backward2 == {-1: [3, 2], 4: [3, 2], 3: [2, 1], 2: [1, 0], 1: [0]}
    # a frozen vision tower has no backward: the decoder does not prefetch it
    _, frozen = prefetch_lists(_units([False, False, True, True, True]), 2, 1, backward=True)
    assert frozen == {-1: [3], 4: [3], 3: [2]}
    # a frozen decoder still runs backward (the trained vision tower needs its gradient)
    _, llm_frozen = prefetch_lists(_units([True, True, False, False, False]), 2, 1, backward=True)
    assert llm_frozen == backward
    # layers kept gathered need no backward prefetch; off sets nothing (FSDP2's implicit prefetch)
    assert prefetch_lists(_units([True] * 5), 2, 1, backward=False) == (forward, {})
    assert prefetch_lists(_units([True] * 5), 2, 0, backward=True) == ({}, {})


@pytest.mark.parametrize("override, value", [
    ("train.fsdp_reshard_after_forward=auto", ("auto", "auto")),
    ("train.fsdp_reshard_after_forward=false", (False, "auto")),
    ("train.fsdp_reshard_after_forward=true", (True, "auto")),
    ("train.fsdp_prefetch=off", ("auto", "off")),
    ("train.fsdp_prefetch=2", ("auto", 2)),
])
def test_config_takes_the_new_values(tmp_path, override, value):
    from vlmctl.config import load_config

    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny\n  init: random\n")
    train = load_config(path).train
    assert (train.fsdp_reshard_after_forward, train.fsdp_prefetch) == ("auto", "auto")  # the defaults
    train = load_config(path, [override]).train
    assert (train.fsdp_reshard_after_forward, train.fsdp_prefetch) == value


@pytest.mark.parametrize("yaml_text, override, words", [
    ("", "train.fsdp_prefetch=0", ["train.fsdp_prefetch", "positive number of layers"]),
    ("", "train.fsdp_prefetch=fast", ["train.fsdp_prefetch", "'auto' or 'off'"]),
    ("", "train.fsdp_reshard_after_forward=sometimes", ["train.fsdp_reshard_after_forward", "true or false", "'auto'"]),
    ("  fsdp_prefetch: -1\n", None, ["train.fsdp_prefetch", "positive number of layers"]),
])
def test_config_refuses_other_values_naming_the_key(tmp_path, yaml_text, override, words):
    from vlmctl.config import load_config

    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny\n  init: random\ntrain:\n  stage: full\n" + yaml_text)
    with pytest.raises(ConfigError) as exc:
        load_config(path, [override] if override else None)
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_a_bare_yaml_off_means_off(tmp_path):
    from vlmctl.config import load_config

    path = tmp_path / "vlmctl.yaml"
    path.write_text("model:\n  preset: tiny\n  init: random\ntrain:\n  fsdp_prefetch: off\n  fsdp_reshard_after_forward: false\n")
    train = load_config(path).train
    assert (train.fsdp_prefetch, train.fsdp_reshard_after_forward) == ("off", False)


# ------------------------------------------------------------------------------- two gloo ranks, the tiny LLaVA

# (name, reshard_after_forward, prefetch, activation checkpointing); the first is the reference
VARIANTS = [
    ("reshard, implicit prefetch", True, "off", "off"),
    ("reshard, prefetch 1", True, 1, "off"),
    ("reshard, prefetch 2", True, 2, "off"),
    ("kept, prefetch 1", False, 1, "off"),
    ("auto", "auto", "auto", "off"),
    ("reshard, prefetch 2, checkpointing", True, 2, "full"),
]


def _fsdp_state_names(units: dict, module):
    """The unit names of `module`'s forward and backward prefetch lists, read from its FSDP2 state."""
    by_state = {id(m._get_fsdp_state()): name for name, m in units.items()}
    state = module._get_fsdp_state()
    return ([by_state[id(s)] for s in state._states_to_forward_prefetch],
            [by_state[id(s)] for s in state._states_to_backward_prefetch])


def _variant(model0, family, batches, variant, dims, rank):
    """Wrap a copy of `model0` with one variant, train two SGD steps on this rank's `batches`; return the losses
    and full gradients of each step, which weights were gathered after the first forward, and the plan and the
    prefetch lists as the FSDP modules hold them."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vlmctl.distributed.fsdp import apply_fsdp, fsdp_plan_of
    from vlmctl.distributed.checkpointing import apply_activation_checkpointing
    from vlmctl.train.objectives import loss_sum
    from vlmctl.train.setup import model_parts

    name, reshard, prefetch, checkpointing = variant
    model = copy.deepcopy(model0)
    parts = model_parts(model, family)
    if checkpointing != "off":
        apply_activation_checkpointing([parts.decoder_layers, parts.vision_layers], checkpointing)
    model = apply_fsdp(model, parts, dims.world_mesh, reshard_after_forward=reshard, prefetch=prefetch)
    units = {**{f"vision.{i}": m for i, m in enumerate(parts.vision_layers)},
             **{f"decoder.{i}": m for i, m in enumerate(parts.decoder_layers)}}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": [], "grads": [], "plan": fsdp_plan_of(model).__dict__,
           "lists": {n: _fsdp_state_names({**units, "root": model}, m) for n, m in {**units, "root": model}.items()}}
    for step, batch in enumerate(batches):
        labelled = torch.tensor(float((batch["labels"] != -100).sum()))
        dist.all_reduce(labelled)
        loss = loss_sum(model, batch) * dims.dp_size / labelled
        if step == 0:  # which weights are gathered between forward and backward
            out["gathered"] = {n: not isinstance(next(m.parameters()), DTensor) for n, m in units.items()}
            out["gathered"]["embeddings"] = not isinstance(model.get_input_embeddings().weight, DTensor)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total)
        out["grads"].append({n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return out


def _overlap_rank(rank: int, port: int, out: str, folder: str, batches) -> None:
    import torch

    from vlmctl.distributed.env import init_distributed
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.models import load_model

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    init_distributed()
    dims = ParallelDims.for_strategy("fsdp", 2, sharding="full")
    dims.build_mesh("cpu")
    model0, _, family = load_model(folder, dtype=torch.float32, device="cpu")
    mine = batches[rank]
    runs = [_variant(model0, family, mine, v, dims, rank) for v in VARIANTS]
    frozen = model0
    for layer in frozen.model.vision_tower.parameters():
        layer.requires_grad_(False)
    frozen_run = _variant(frozen, family, mine[:1], ("frozen vision", True, 1, "off"), dims, rank)
    ref = runs[0]
    result = {"variants": {}}
    for variant, run in zip(VARIANTS, runs):
        result["variants"][variant[0]] = {
            "same_loss": all(torch.equal(a, b) for a, b in zip(run["losses"], ref["losses"])),
            "same_grads": all(g.keys() == r.keys() and all(torch.equal(g[k], r[k]) for k in g)
                              for g, r in zip(run["grads"], ref["grads"])),
            "grads": len(run["grads"][0]), "gathered": run["gathered"], "lists": run["lists"], "plan": run["plan"],
            "losses": [float(x) for x in run["losses"]],
        }
    result["frozen"] = {"lists": frozen_run["lists"], "plan": frozen_run["plan"]}
    with open(f"{out}/{rank}.json", "w") as fh:
        json.dump(result, fh)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_llava_runs(tmp_path_factory):
    """The tiny LLaVA preset (random init, tied embeddings: 3 vision layers, 4 decoder layers), two steps of one
    packed row per rank, every variant run on two gloo ranks. Returns rank 0's and rank 1's results."""
    import torch
    import torch.multiprocessing as mp

    from vlmctl import bench
    from vlmctl.config import ModelSection, TrainSection
    from vlmctl.data.collate import PackedCollator
    from vlmctl.distributed.env import free_port
    from vlmctl.models.build import save_model

    train = TrainSection(tokens_per_batch=160, attn_implementation="sdpa", stage="full")
    plan = bench.prepare(ModelSection(preset="tiny", init="random"), train,
                         bench.WorkloadSpec(image_sizes=(64,), text_tokens=(4, 12), kind="chat"), steps=2, warmup=0,
                         dp_size=2, check_device=False)
    torch.manual_seed(0)
    model = bench.random_model(plan.model.plan, plan.model.processor, device="cpu", dtype=torch.float32)
    collator = PackedCollator(plan.model.processor, plan.model.family, tokens_per_batch=160)
    batches = [[plan.workload.batch(ix, collator) for ix in bench.plan_batches(plan, train, dp_rank=r)] for r in (0, 1)]
    out = tmp_path_factory.mktemp("overlap")
    save_model(model, out / "model")
    plan.model.processor.save_pretrained(out / "model")
    mp.spawn(_overlap_rank, args=(free_port(), str(out), str(out / "model"), batches), nprocs=2, join=True)
    return [json.loads((out / f"{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(600)
def test_no_setting_changes_the_loss_or_the_gradients(tiny_llava_runs):
    for rank in tiny_llava_runs:
        losses = {name: v["losses"] for name, v in rank["variants"].items()}
        for name, v in rank["variants"].items():
            assert v["same_loss"] and v["same_grads"], (name, losses)
            assert v["grads"] > 20  # every trained parameter of the tiny LLaVA has a gradient
        assert losses["auto"][1] != losses["auto"][0]  # the first step changed the weights


@pytest.mark.timeout(600)
def test_each_setting_gathers_what_it_says_and_prefetches_its_lists(tiny_llava_runs):
    variants = tiny_llava_runs[0]["variants"]
    layers = [f"vision.{i}" for i in range(3)] + [f"decoder.{i}" for i in range(4)]
    # resharded: every layer is freed after its forward but the last decoder layer; kept: all stay gathered; the
    # root (embeddings tied to the LM head) is never resharded after forward
    resharded = variants["reshard, prefetch 1"]["gathered"]
    assert resharded == {**{n: n == "decoder.3" for n in layers}, "embeddings": True}
    assert variants["kept, prefetch 1"]["gathered"] == {**{n: True for n in layers}, "embeddings": True}
    # auto on two CPU ranks of a tiny model: kept, prefetch 1 layer
    auto = variants["auto"]["plan"]
    assert (auto["reshard_after_forward"], auto["prefetch"], auto["shard_ranks"]) == (False, 1, 2)
    assert variants["auto"]["gathered"] == variants["kept, prefetch 1"]["gathered"]
    # the FSDP modules hold the plan's lists: forward, the next layers in forward order (vision, then decoder)
    one = variants["reshard, prefetch 1"]["lists"]
    assert one["root"] == [["vision.0"], ["decoder.2"]]
    assert [one[n][0] for n in layers[:-1]] == [[n] for n in layers[1:]] and one["decoder.3"][0] == []
    assert [one[n][1] for n in layers] == [[]] + [[n] for n in layers[:-1]]
    two = variants["reshard, prefetch 2"]["lists"]
    assert two["vision.2"] == [["decoder.0", "decoder.1"], ["vision.1", "vision.0"]]
    assert two["root"] == [["vision.0", "vision.1"], ["decoder.2", "decoder.1"]]
    # layers kept gathered get no backward lists; off leaves every list empty (FSDP2's implicit prefetch)
    assert all(b == [] for _, b in variants["kept, prefetch 1"]["lists"].values())
    assert all(f == [] and b == [] for f, b in variants["reshard, implicit prefetch"]["lists"].values())
    # a frozen vision tower runs no backward: nothing prefetches its layers in backward
    frozen = tiny_llava_runs[0]["frozen"]["lists"]
    assert frozen["decoder.0"][1] == [] and all(frozen[f"vision.{i}"][1] == [] for i in range(3))
    assert frozen["decoder.1"][1] == ["decoder.0"] and frozen["vision.2"][0] == ["decoder.0"]
    assert tiny_llava_runs[1]["variants"]["reshard, prefetch 2"]["lists"] == two  # the same on every rank
