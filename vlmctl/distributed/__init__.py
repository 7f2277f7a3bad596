"""Parallelism: one device mesh per run and the functions that wrap a model over it.

    env = init_distributed()                                # env.py: process group (NCCL on GPU, gloo on CPU)
    dims = ParallelDims.for_strategy("fsdp", env.world_size)  # mesh.py: dp_replicate x dp_shard x sp x tp
    mesh = dims.build_mesh(env.device.type)                  # one DeviceMesh with named dimensions
    model = apply_fsdp(model, parts, mesh, param_dtype=...)  # fsdp.py (or ddp.apply_ddp, deepspeed.deepspeed_engine)

The step loop reduces its loss and token counts over `dims.dp_group`, the data-parallel ranks.
"""
