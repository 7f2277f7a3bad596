"""`distributed.parallelize.parallelize` on one gloo rank with the tiny LLaVA: a frozen model (`trainable=False`, a
reference model a run holds) is parallelized for forward only (no gradient, eval mode, no layer checkpointed, no
DDP wrapper) and computes the logits of the model as loaded; the trained model gets its checkpointing."""

from __future__ import annotations

import copy

import pytest

BASE_FORWARD = "_vlmctl_base_forward"  # where `distributed.checkpointing` keeps a wrapped layer's own forward


@pytest.mark.timeout(180)
def test_a_frozen_model_is_parallelized_for_forward_only_and_computes_the_loaded_logits(tmp_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from convert_helpers import make_tiny_model
    from vlmctl.config.train import TrainSection
    from vlmctl.convert import probe_inputs
    from vlmctl.distributed.env import free_port
    from vlmctl.distributed.mesh import ParallelDims
    from vlmctl.distributed.parallelize import parallelize
    from vlmctl.models import load_model
    from vlmctl.train.setup import model_parts

    model_dir = make_tiny_model(tmp_path / "model")
    cpu = torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for strategy in ("fsdp", "ddp"):
            train = TrainSection(strategy=strategy, activation_checkpointing="full", precision="fp32")
            dims = ParallelDims.for_strategy(strategy, 1, sharding="full")
            dims.build_mesh("cpu")
            model, processor, family = load_model(model_dir, dtype=torch.float32)
            trained_copy, reference = copy.deepcopy(model), copy.deepcopy(model).eval()
            inputs = probe_inputs(processor)

            parts = model_parts(model, family)
            frozen = parallelize(model, family=family, parts=parts, train=train, dims=dims, device=cpu,
                                 dtype=torch.float32, trainable=False)
            assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
            assert not any(BASE_FORWARD in layer.__dict__ for layer in [*parts.decoder_layers, *parts.vision_layers])
            assert not isinstance(frozen, DistributedDataParallel)
            assert isinstance(next(frozen.parameters()), DTensor) is (strategy == "fsdp")
            with torch.no_grad():
                torch.testing.assert_close(frozen(**inputs).logits, reference(**inputs).logits)

            trained_parts = model_parts(trained_copy, family)
            trained = parallelize(trained_copy, family=family, parts=trained_parts, train=train, dims=dims, device=cpu,
                                  dtype=torch.float32)
            assert all(BASE_FORWARD in layer.__dict__ for layer in trained_parts.decoder_layers)
            assert any(p.requires_grad for p in trained.parameters())
    finally:
        dist.destroy_process_group()
