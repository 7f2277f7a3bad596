"""`distributed.engine.generation_parameters` on one gloo rank with FSDP2 units: while open, every unit stays
gathered across forwards (decoding's one forward per token must not gather the model again each time); after it,
every unit is sharded again and keeps its own reshard-after-forward rule, and its forwards give the same outputs.
A unit's parameters are DTensors while it is sharded and plain tensors while it is gathered (FSDP2 swaps them)."""

from __future__ import annotations

import pytest


def _gathered(module) -> bool:
    from torch.distributed.tensor import DTensor

    return not isinstance(next(module.parameters()), DTensor)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recorded", [True, False])
def test_fsdp2_units_stay_gathered_for_generation_and_are_resharded_with_their_rules_after(recorded):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from vlmctl.distributed.engine import generation_parameters
    from vlmctl.distributed.env import free_port
    from vlmctl.distributed.fsdp import shard_unit

    shard = shard_unit if recorded else fully_shard  # a unit whose rule was not recorded: the per-layer gathers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
        for layer in (model[0], model[2]):
            shard(layer, reshard_after_forward=True)
        shard(model[4], reshard_after_forward=False)  # a unit whose own rule keeps it gathered after its forward
        shard(model, reshard_after_forward=False)
        x = torch.randn(3, 8)
        with torch.no_grad():
            expected = model(x)
        inner = [model[0], model[2]]
        assert not any(_gathered(m) for m in inner) and _gathered(model[4])

        with torch.no_grad(), generation_parameters(model):
            for _ in range(2):  # two "decoding steps"
                torch.testing.assert_close(model(x), expected)
                assert all(_gathered(m) for m in inner) == recorded

        assert not any(_gathered(m) for m in inner)
        assert _gathered(model[4]) != recorded  # resharded after the generation (else as its last forward left it)
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected)
        assert not any(_gathered(m) for m in inner) and _gathered(model[4])  # each unit's own rule is back
    finally:
        dist.destroy_process_group()
