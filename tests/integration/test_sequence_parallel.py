"""Sequence parallelism (`train.sequence_parallel`, `vlmctl.distributed.sequence`) on CPU gloo ranks.

- The split's arithmetic alone: slice bounds with padding, image runs, the targets a rank computes, the mesh.
- Gradients: on 4 ranks, the tiny Qwen2.5-VL and the tiny LLaVA presets, prepared and wrapped as `vlmctl train`
  does (`prepare_model`, `wrap_model`: `parallelize` and the engine), under FSDP2 and ZeRO-3 with SP=4 (one row over 4 ranks)
  and SP=2 (2 data-parallel groups of 2): the loss and every parameter's full gradient equal one process's on the
  same packed rows (SP=1), to fp32 rounding (rtol 1e-4, atol 1e-6).
- `vlmctl train` itself: SP=2 on 2 ranks gives the losses of 1 rank with the same rows, its DCP checkpoint
  resumes with SP=1, and the export loads in vanilla transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convert_helpers import TEXTS
from shapes_shards import build_tiny_models, packed_rows, write_shapes_shards
from train_runner import RunsAhead, run_train, start_train

TIMEOUT = 420
ROW_TOKENS = 420  # a packed row of several samples (several images for the vision split)


# ------------------------------------------------------------------------------------------------- the arithmetic


def test_bounds_pad_the_row_to_a_multiple_of_the_group():
    from vlmctl.distributed.sequence import SequenceShard

    shards = [SequenceShard(None, r, 4) for r in range(4)]
    assert [s.bounds(10) for s in shards] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert shards[0].padded(10) == 12 and shards[0].padded(12) == 12


@pytest.mark.parametrize("total", [12, 10])  # a multiple of the group, and a row the split pads
def test_a_rank_keeps_its_slice_of_the_row_embeddings_not_the_whole_row(total):
    # the language model's input is what its first layer keeps for backward: a view of the whole row's embeddings
    # would keep all T x E of them alive on every rank
    import weakref

    import torch

    from vlmctl.distributed.sequence import SequenceShard, split_sequence

    shard = SequenceShard(None, 1, 2)
    row = torch.randn(1, total, 8, requires_grad=True)
    whole = row * 2  # the embeddings with the visual tokens merged in (a non-leaf, as the model's)
    alive = weakref.ref(whole)
    _, kwargs = split_sequence(shard)(None, (), {"inputs_embeds": whole})
    local = kwargs["inputs_embeds"]
    start, end = shard.bounds(total)
    assert torch.equal(local, torch.nn.functional.pad(whole, (0, 0, 0, 12 - total))[:, start:end])
    del whole
    assert alive() is None  # nothing of this rank's holds the whole row any more
    assert local.untyped_storage().nbytes() == local.numel() * local.element_size()
    local.sum().backward()  # the gradient reaches the row's own positions only
    want = torch.zeros(1, total, 8)
    want[:, start:min(end, total)] = 2.0
    assert torch.equal(row.grad, want)


def test_image_runs_are_contiguous_balanced_and_cover_every_image():
    from vlmctl.distributed.sequence import image_runs

    patches = [64, 64, 256, 16, 16, 16, 64]
    for ranks in (1, 2, 3, 4, 7):
        runs = image_runs(patches, ranks)
        assert runs[0][0] == 0 and runs[-1][1] == len(patches)
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:])) and all(b > a for a, b in runs)
    assert image_runs([10, 10], 4) is None  # fewer images than ranks: every rank encodes all


def test_image_runs_have_the_smallest_largest_run():
    import itertools
    import random

    from vlmctl.distributed.sequence import image_runs

    rng = random.Random(0)
    for _ in range(200):
        patches = [rng.choice([16, 64, 256, 1024]) for _ in range(rng.randint(1, 8))]
        for ranks in range(1, len(patches) + 1):
            best = min(max(sum(patches[a:b]) for a, b in zip((0, *cut), (*cut, len(patches))))
                       for cut in itertools.combinations(range(1, len(patches)), ranks - 1))
            runs = image_runs(patches, ranks)
            assert len(runs) == ranks and max(sum(patches[a:b]) for a, b in runs) == best


def test_each_target_is_computed_by_the_rank_holding_its_predicting_position():
    import torch

    from vlmctl.distributed.sequence import SequenceShard, local_targets

    targets = torch.tensor([1, 3, 4, 6, 9])
    seen = []
    for r in range(2):
        mine, keep = local_targets(targets, 10, SequenceShard(None, r, 2))
        start = r * 5
        assert torch.equal(keep + 1 + start, mine) and bool(((keep >= 0) & (keep < 5)).all())
        seen += mine.tolist()
    assert sorted(seen) == targets.tolist()


def test_the_mesh_splits_data_and_sequence_ranks():
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.errors import ConfigError

    dims = ParallelDims.for_strategy("fsdp", 8, sharding="full", ranks_per_node=8, sp=2)
    assert (dims.dp_shard, dims.sp, dims.dp_size, dims.grad_size) == (4, 2, 4, 8)
    dims = ParallelDims.for_strategy("ddp", 4, sharding="full", ranks_per_node=4, sp=4)
    assert (dims.dp_replicate, dims.sp, dims.dp_size) == (1, 4, 1)
    with pytest.raises(ConfigError, match="train.sequence_parallel=3"):
        ParallelDims.for_strategy("fsdp", 4, sharding="full", ranks_per_node=4, sp=3)


def test_models_that_cannot_split_are_refused_with_the_key():
    from types import SimpleNamespace

    from vlmctl.distributed.sequence import check_sequence_parallel
    from vlmctl.errors import ConfigError

    config = SimpleNamespace(num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="6 attention heads"):
        check_sequence_parallel(4, config, packing=True)
    with pytest.raises(ConfigError, match="padded micro-batches") as exc:
        check_sequence_parallel(2, config, packing=False)
    assert "train.packing=true" in exc.value.hint
    check_sequence_parallel(2, config, packing=True)
    check_sequence_parallel(1, config, packing=False)


# ---------------------------------------------------------------------------------- gradients on 4 gloo ranks

CASES = [("fsdp", 4), ("fsdp", 2), ("zero3", 4), ("zero3", 2)]  # (strategy, sequence_parallel) on 4 ranks


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Tiny Qwen2.5-VL and LLaVA model folders and shapes-VQA shards (every third sample text-only)."""
    return build_tiny_models(tmp_path_factory.mktemp("sp"), 16)


def _train_section(strategy: str, sp: int):
    from vlmctl.config.train import TrainSection

    return TrainSection(stage="full", strategy=strategy, precision="fp32", packing=True, tokens_per_batch=ROW_TOKENS,
                        attn_implementation="sdpa", sequence_parallel=sp, activation_checkpointing="off",
                        liger="off", compile_vision="off", balance="off", learning_rate=1e-3, warmup_ratio=0.0)


def _grads_rank(rank: int, port: int, folder: str, data: str, out: str) -> None:
    """One of 4 ranks: for each case, the loss and full gradients of its data-parallel group's row."""
    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    torch.set_num_threads(1)
    from vlmctl.distributed.env import init_distributed
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.models import load_model
    from vlmctl.config.plan import DeviceFacts, build_plan
    from vlmctl.train.loop import to_device
    from vlmctl.train.setup import RunContext, prepare_model
    from vlmctl.train.worker import build_objective, wrap_model

    env = init_distributed(deepspeed=True)
    rows = packed_rows(Path(folder), Path(data), 2)
    results = {}
    for strategy, sp in CASES:
        train = _train_section(strategy, sp)
        plan = build_plan(train, DeviceFacts.here(4))
        train = plan.train_section(train)
        dims = ParallelDims.for_strategy(strategy, 4, sharding="full", sp=sp)
        dims.build_mesh("cpu")
        ctx = RunContext(env=env, dims=dims, dtype=torch.float32, stored=torch.float32, plan=plan)
        model, _, family = load_model(folder, dtype=torch.float32)
        tm = prepare_model(model, family, train, env.device, plan=plan)
        engine, objective = wrap_model(tm, train, ctx, total_steps=1), build_objective(tm, train, ctx)
        mine = rows[:dims.dp_size][dims.dp_rank]
        labelled = sum(int((r["labels"][0, 1:] != -100).sum()) for r in rows[:dims.dp_size])
        loss = engine.forward(objective, to_device(mine, env.device)).loss
        engine.backward(loss, dims.grad_size / labelled)
        total = loss.detach().clone()
        dist.all_reduce(total)  # each of a group's ranks holds part of its row's loss
        deepspeed = engine.checkpoint_format == "deepspeed"  # ZeRO's partitioned gradients are read its way
        grads = {}
        for name, p in engine.module.named_parameters():
            if deepspeed:
                from deepspeed.utils import safe_get_full_grad

                g = safe_get_full_grad(p)
            else:
                g = p.grad.full_tensor() if p.grad is not None else None
            if g is not None:
                grads[name] = g.detach().clone()
        results[f"{strategy}/{sp}"] = {"loss": float(total) / labelled, "grads": grads, "rows": dims.dp_size}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _reference(folder: Path, data: Path, n_rows: int):
    """One process, SP=1: the mean loss over the labelled tokens of the first `n_rows` rows and its gradients."""
    import torch

    from vlmctl.models import load_model
    from vlmctl.train.kernels import token_losses

    model, _, family = load_model(folder, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    rows = packed_rows(folder, data, 2)[:n_rows]
    labelled = sum(int((r["labels"][0, 1:] != -100).sum()) for r in rows)
    total = sum(token_losses(model, {k: v for k, v in r.items() if k not in ("seq_lens",) and not k.startswith("num_")})[0].sum()
                for r in rows)
    (total / labelled).backward()
    return float(total.detach()) / labelled, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _ulysses_rank(rank: int, world: int, port: int) -> None:
    """One gloo rank of `test_ulysses_attention_equals_the_whole_rows_attention` (raises on a mismatch)."""
    import torch
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from vlmctl.distributed.sequence import SequenceShard, segment_attention, ulysses_attention

    shard = SequenceShard(dist.group.WORLD, rank, world)
    ulysses = ulysses_attention(segment_attention, shard)
    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)  # three packed samples, two crossing a split
    start, end = shard.bounds(16)
    for heads, kv in [(8, 8), (8, 4), (8, 2), (4, 1)]:  # kv heads fewer than the ranks are repeated
        g = torch.Generator().manual_seed(heads * 10 + kv)
        q, k, v = (torch.randn(1, h, 16, 4, generator=g, requires_grad=True) for h in (heads, kv, kv))
        want, _ = segment_attention(None, q, k, v, None, scaling=0.5, packed_cu_seqlens=cu)
        (want * torch.arange(16.0)[None, :, None, None]).sum().backward()  # a position-dependent loss
        mine = [x.detach()[:, :, start:end].clone().requires_grad_() for x in (q, k, v)]
        got, _ = ulysses(None, *mine, None, scaling=0.5, packed_cu_seqlens=cu)
        assert got.shape == (1, end - start, heads, 4)
        torch.testing.assert_close(got, want[:, start:end])
        # the ranks' losses sum to the whole row's: each slice's gradient is the row's, key/value ones included
        (got * torch.arange(start, end, dtype=torch.float32)[None, :, None, None]).sum().backward()
        for local, whole in zip(mine, (q, k, v)):
            torch.testing.assert_close(local.grad, whole.grad[:, :, start:end])
    # a compiled decoder layer traces through it inside an activation checkpoint: no graph break
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    q, k, v = (torch.randn(1, 8, end - start, 4, requires_grad=True) for _ in range(3))
    layer = torch.compile(lambda q, k, v: checkpoint(
        lambda a, b, c: ulysses(None, a, b, c, None, scaling=0.5, packed_cu_seqlens=cu)[0], q, k, v,
        use_reentrant=False), backend="aot_eager")
    eager = ulysses(None, q, k, v, None, scaling=0.5, packed_cu_seqlens=cu)[0]
    torch.testing.assert_close(layer(q, k, v), eager)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_attention_equals_the_whole_rows_attention(world):
    from vlmctl.distributed.env import free_port

    code = "import sys; from test_sequence_parallel import _ulysses_rank; _ulysses_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
    _run_ranks(code, world, [world, free_port()])


def _run_ranks(code: str, world: int, args: list, **env) -> None:
    """Run `python -c code` as `world` processes with argv [rank, *args] (this folder and tests/ importable, one
    thread each, `env` added); fail the test on a timeout or a non-zero exit, with the ranks' logs."""
    here = Path(__file__).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env,
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), *map(str, args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"ranks did not finish within {TIMEOUT}s")
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny"])
def test_loss_and_every_gradient_match_one_process_under_fsdp2_and_zero3(built, tmp_path, preset):
    import torch

    from vlmctl.distributed.env import free_port

    out = tmp_path / "grads.pt"
    code = ("import sys; from test_sequence_parallel import _grads_rank; "
            "_grads_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])")
    _run_ranks(code, 4, [free_port(), built / preset, built / "data", out], DS_ACCELERATOR="cpu")
    results = torch.load(out)
    for n_rows in (1, 2):
        ref_loss, ref_grads = _reference(built / preset, built / "data", n_rows)
        for case, got in results.items():
            if got["rows"] != n_rows:
                continue
            assert got["loss"] == pytest.approx(ref_loss, rel=1e-5), case
            assert set(ref_grads) <= set(got["grads"]), case
            # ZeRO-3 hands zeros for weights no loss reaches (SigLIP's unused pooling head), FSDP2 None
            assert all(not bool(got["grads"][n].any()) for n in set(got["grads"]) - set(ref_grads)), case
            for name, grad in ref_grads.items():
                torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"{case}: gradient of {name}")


# --------------------------------------------------------------------------------------------- vlmctl train


def _project(root: Path) -> Path:
    from vlmctl.config import ModelSection
    from vlmctl.models import build_model

    write_shapes_shards(root / "data", 12)
    build_model(ModelSection(preset="tiny-qwen2.5-vl", init="random", output_dir=root / "model", dtype="fp32"), tokenizer_texts=TEXTS)
    (root / "vlmctl.yaml").write_text("""
project: {name: sp}
data: {prepared_dir: data/prepared, max_length: 400}
model: {preset: tiny-qwen2.5-vl, init: random, output_dir: model}
train:
  stage: full
  strategy: fsdp
  precision: fp32
  learning_rate: 1.0e-2
  warmup_ratio: 0.0
  tokens_per_batch: 300
  max_steps: 2
  save_steps: 1
  logging_steps: 1
  num_workers: 0
  output_dir: runs
""")
    return root


def _launch(nproc: int, *overrides: str) -> tuple[str, ...]:
    return ("--launcher", "torchrun", "--nproc-per-node", str(nproc), f"train.nproc_per_node={nproc}", *overrides)


def _metrics(project: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (project / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_vlmctl_train_splits_rows_resumes_without_the_split_and_exports_a_plain_model(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    project = _project(tmp_path)
    config = project / "vlmctl.yaml"
    # the split run also recomputes its layers (full checkpointing) and tiles its MLPs: neither changes the arithmetic;
    # one process with the group's row budget packs the same rows. The two runs are independent: started together.
    runs = RunsAhead({
        "split": lambda: start_train(config, *_launch(2, "train.sequence_parallel=2", "train.activation_checkpointing=full",
                                                     "train.tiled_mlp=2", "train.run_name=split")),
        "whole": lambda: start_train(config, *_launch(1, "train.tokens_per_batch=600", "train.run_name=whole")),
    }, timeout=TIMEOUT)
    try:
        runs.output("split")
        runs.output("whole")
    finally:
        runs.close()
    split, whole = _metrics(project, "split"), _metrics(project, "whole")
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in whole], rel=1e-5)
    assert [r["grad_norm"] for r in split] == pytest.approx([r["grad_norm"] for r in whole], rel=1e-4)
    assert [r["text_tokens"] + r["visual_tokens"] for r in split] == [r["text_tokens"] + r["visual_tokens"] for r in whole]
    checkpoint = project / "runs" / "split" / "checkpoints" / "checkpoint-1"
    run_train(config, *_launch(1, "train.tokens_per_batch=600", "train.run_name=resumed", f"train.resume={checkpoint}"),
              timeout=TIMEOUT)
    resumed = _metrics(project, "resumed")
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == pytest.approx(split[1]["loss"], rel=1e-5)
    final = project / "runs" / "split" / "final"
    assert "ulysses" not in (final / "config.json").read_text()
    model = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32)
    ref = AutoModelForImageTextToText.from_pretrained(project / "runs" / "whole" / "final", dtype=torch.float32)
    # AdamW's first updates are about lr x sign(gradient): a gradient within rounding of zero may move a weight by
    # a fraction of lr (1e-2) either way, hence atol 1e-4 on the weights after two steps
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_training_says_how_many_gpus_a_sample_left_out_needs(capsys):
    from types import SimpleNamespace

    import numpy as np

    from vlmctl.config.train import TrainSection
    from vlmctl.train.data import build_sampler

    train = TrainSection(tokens_per_batch=1000, sequence_parallel=2, packing=True, balance="off")
    cfg = SimpleNamespace(train=train, data=SimpleNamespace(sources=[]))
    ctx = SimpleNamespace(dims=SimpleNamespace(dp_size=1, dp_rank=0, sp=2), env=SimpleNamespace(is_main=True))
    sampler = build_sampler(cfg, ctx, SimpleNamespace(), np.array([900, 1900, 3500]))
    assert sampler.too_long == 1  # 1900 tokens fit the group's 2 x 1000; 3500 do not
    err = capsys.readouterr().err
    assert "1 samples are longer than train.tokens_per_batch=1000 x sequence_parallel=2" in err and "needs 4 GPUs" in err
