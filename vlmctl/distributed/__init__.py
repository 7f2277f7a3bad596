"""Parallelism: one device mesh per run, the one order a model is parallelized in, and the engine that trains it.

    env = init_distributed()                                # env.py: process group (NCCL on GPU, gloo on CPU)
    dims = ParallelDims.for_strategy("fsdp", env.world_size)  # mesh.py: dp_replicate x dp_shard x sp x tp
    mesh = dims.build_mesh(env.device.type)                  # one DeviceMesh with named dimensions
    model = parallelize(model, parts=..., dims=dims, ...)    # parallelize.py: split, checkpointing, compile, then
                                                             # fsdp.apply_fsdp / ddp.apply_ddp / DeepSpeed hand-off
    engine = build_engine(model, strategy_of(...), ...)      # engine.py: TorchEngine | DeepSpeedEngine

The step loop reduces its loss and token counts over `dims.dp_group`, the data-parallel ranks.
"""
