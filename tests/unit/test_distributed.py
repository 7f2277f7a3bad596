"""vlmctl.distributed: parallel dimensions validated against the world, one gloo device mesh, and the step loop's
reductions over the data-parallel group (one process in-process, two through torch.multiprocessing)."""

from __future__ import annotations

import pytest

from vlmctl.distributed.mesh import ParallelDims
from vlmctl.errors import ConfigError


@pytest.mark.parametrize("kwargs, message", [
    ({"dp_replicate": 2, "dp_shard": 2, "world_size": 2}, r"dp_replicate=2 x dp_shard=2 x sp=1 x tp=1 = 4, but the world has 2 processes"),
    ({"dp_shard": 4, "sp": 2, "world_size": 4}, r"dp_replicate=1 x dp_shard=4 x sp=2 x tp=1 = 8, but the world has 4"),
    ({"dp_shard": 2, "tp": 2, "sp": 2, "world_size": 8}, r"tensor parallelism \(tp=2\) and sequence parallelism \(sp=2\) are not combined"),
    ({"dp_shard": 4, "tp": 2, "world_size": 4}, r"dp_replicate=1 x dp_shard=4 x sp=1 x tp=2 = 8, but the world has 4"),
    ({"dp_replicate": 0, "world_size": 2}, r"dp_replicate=0 must be at least 1"),
    ({"dp_replicate": 3, "world_size": 4}, r"dp_replicate=3 x sp=1 x tp=1 = 3 does not divide the 4 processes"),
    ({"world_size": 0}, r"world size must be at least 1"),
])
def test_parallel_dims_refuse_what_does_not_fit_the_world(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims(**kwargs)


def test_parallel_dims_fill_the_world_and_name_the_mesh():
    assert ParallelDims(world_size=8).dp_shard == 8
    hsdp = ParallelDims(dp_replicate=2, world_size=8)
    assert (hsdp.dp_shard, hsdp.dp_size) == (4, 8)
    assert hsdp.mesh_dims() == (("dp_replicate", "dp_shard"), (2, 4))
    ddp, fsdp = ParallelDims.for_strategy("ddp", 4), ParallelDims.for_strategy("zero3", 4)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.mesh_dims()) == (4, 1, (("dp_replicate",), (4,)))
    assert (fsdp.dp_replicate, fsdp.dp_shard, fsdp.mesh_dims()) == (1, 4, (("dp_shard",), (4,)))
    # one process still has a data-parallel dimension to reduce over
    assert ParallelDims.for_strategy("ddp", 1).mesh_dims() == (("dp_shard",), (1,))
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(world_size=1).dp_group  # noqa: B018
    # sequence parallelism keeps dp_shard in the mesh (flattened with sp for FSDP2 / ZeRO and gradients)
    sp = ParallelDims.for_strategy("ddp", 4, ranks_per_node=4, sp=2)
    assert (sp.dp_replicate, sp.dp_shard, sp.sp, sp.mesh_dims()) == (2, 1, 2, (("dp_replicate", "dp_shard", "sp"), (2, 1, 2)))


def _tiny_trainer(env, dims, label_tokens: int, flops_of=None):
    """A Trainer over a 2-parameter model whose batches carry `label_tokens` labelled tokens."""
    import torch

    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.train.loop import Trainer, TrainState
    from vlmctl.train.objectives import SFTObjective

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8)

        def forward(self, input_ids, attention_mask=None, use_cache=None):
            return type("Out", (), {"logits": self.head(self.emb(input_ids))})()

    def batch() -> dict:
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        labels = ids.clone()
        labels[0, : 5 - label_tokens] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, "num_label_tokens": label_tokens,
                "num_text_tokens": 5, "num_visual_tokens": 0, "num_dummy_images": 0}

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Trainer(engine=TorchEngine(model, opt, sched, max_grad_norm=0.0, device=env.device), objective=SFTObjective(),
                   batches=(batch() for _ in range(100)), env=env, state=TrainState(), total_steps=2, grad_accum=1,
                   batches_per_epoch=100, save_steps=100, logging_steps=1, max_bad_steps=0, save=lambda *a: None,
                   log=lambda row: None, progress=None, flops_of=flops_of, dp_group=dims.dp_group)


def test_one_process_gloo_mesh_and_the_loss_reduced_over_the_dp_group(monkeypatch):
    import torch.distributed as dist

    from vlmctl.distributed.env import init_distributed

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed()
    try:
        dims = ParallelDims.for_strategy("fsdp", env.world_size)
        mesh = dims.build_mesh(env.device.type)
        assert mesh.mesh_dim_names == ("dp_shard",) and dims.build_mesh("cpu") is mesh  # built once
        assert (dims.dp_size, dims.dp_rank, dims.dp_mesh.size()) == (1, 0, 1)
        trainer = _tiny_trainer(env, dims, label_tokens=3, flops_of=lambda b: 1000.0)
        groups = []
        real = dist.all_reduce

        def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            groups.append((tuple(tensor.shape), op, group))
            return real(tensor, op=op, group=group, async_op=async_op)

        import torch

        model = trainer.engine.model
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.no_grad():  # the loss of the weights before the step: the mean over the 3 labelled tokens
            logits = model.head(model.emb(ids))[0, :-1]
            expected = float(torch.nn.functional.cross_entropy(logits, torch.tensor([-100, 3, 4, 5]), ignore_index=-100))
        monkeypatch.setattr(dist, "all_reduce", spy)
        result = trainer.train_step()
        assert result.loss == pytest.approx(expected, rel=1e-6)
        # one data-parallel rank: the label tokens and [loss, counts, flops, stop] are not reduced (no device round
        # trip); only the finiteness check runs over every rank
        assert [op for shape, op, g in groups] == [dist.ReduceOp.MIN]
        assert result.label_tokens == 3 and result.flops == 1000.0 and result.loss > 0
    finally:
        dist.destroy_process_group()


def _two_rank_step(rank: int, port: int, out: str) -> None:
    import json
    import os

    from vlmctl.distributed.env import init_distributed

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    env = init_distributed()
    dims = ParallelDims.for_strategy("ddp", env.world_size)
    dims.build_mesh("cpu")
    result = _tiny_trainer(env, dims, label_tokens=2 + rank, flops_of=lambda b: 10.0 * (rank + 1)).train_step()
    with open(f"{out}/{rank}.json", "w") as fh:
        json.dump({"dp_rank": dims.dp_rank, "dp_size": dims.dp_size, "label_tokens": result.label_tokens,
                   "text_tokens": result.text_tokens, "flops": result.flops}, fh)
    import torch.distributed as dist

    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_gloo_ranks_sum_tokens_and_flops_over_the_dp_group(tmp_path):
    import json

    import torch.multiprocessing as mp

    from vlmctl.distributed.env import free_port

    mp.spawn(_two_rank_step, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [r["dp_rank"] for r in ranks] == [0, 1] and {r["dp_size"] for r in ranks} == {2}
    for r in ranks:  # every rank sees the global batch: 2 + 3 labelled tokens, 2 x 5 text tokens, 10 + 20 FLOPs
        assert (r["label_tokens"], r["text_tokens"], r["flops"]) == (5, 10, 30.0)


def test_a_started_cuda_allocator_gets_the_setting_through_the_accelerator_call(monkeypatch):
    # where CUDA already started, the setting goes to the running allocator, through the call torch keeps (its
    # torch.cuda.memory._set_allocator_settings warns of deprecation on every rank)
    import torch

    from vlmctl.distributed.env import CUDA_ALLOC_CONF, configure_cuda_allocator

    calls = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: calls.append(("accelerator", conf)),
                        raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda conf: calls.append(("cuda", conf)))
    configure_cuda_allocator()
    assert calls == [("accelerator", CUDA_ALLOC_CONF)]
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")  # an older torch
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the user's own setting wins
    configure_cuda_allocator()
    assert calls[1:] == [("cuda", "expandable_segments:False")]
