"""DistributedDataParallel over the data-parallel ranks of the run's mesh."""

from __future__ import annotations

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.


def apply_ddp(model, dp_mesh, device):
    """Wrap `model` (already on `device`) in DDP over `dp_mesh`'s process group (`ParallelDims.dp_mesh`).

    `find_unused_parameters=True`: VLMs carry parameters no loss reaches (a vision pooling head, layers after the
    selected feature layer), which DDP's reducer would otherwise wait for forever.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None,
               process_group=dp_mesh.get_group(), find_unused_parameters=True)
