"""`distributed.engine.generation_parameters` on one gloo rank with FSDP2 units: while open, every unit stays
gathered across forwards (decoding's one forward per token must not gather the model again each time); after it,
every unit is sharded again and keeps its own reshard-after-forward rule, and its forwards give the same outputs."""

from __future__ import annotations

import pytest


def _groups(model):
    from torch.distributed.fsdp import FSDPModule

    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]


@pytest.mark.timeout(120)
def test_fsdp2_units_stay_gathered_for_generation_and_are_resharded_with_their_rules_after():
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from vlmctl.distributed.engine import generation_parameters
    from vlmctl.distributed.env import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model[4], reshard_after_forward=False)  # a unit whose own rule keeps it gathered
        fully_shard(model)
        x = torch.randn(3, 8)
        with torch.no_grad():
            expected = model(x)
        rules = [g.post_forward_mesh_info for g in _groups(model)]
        inner = _groups(model)[:2]  # the two units resharded after each forward (the root holds no parameter)
        assert all(not g.is_unsharded for g in inner)

        with torch.no_grad(), generation_parameters(model):
            assert all(g.is_unsharded for g in _groups(model))
            for _ in range(2):  # two "decoding steps"
                torch.testing.assert_close(model(x), expected)
                assert all(g.is_unsharded for g in _groups(model))

        assert all(not g.is_unsharded for g in _groups(model))
        assert [g.post_forward_mesh_info for g in _groups(model)] == rules
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected)
        assert all(not g.is_unsharded for g in inner)  # their reshard-after-forward rule is back
    finally:
        dist.destroy_process_group()
