"""Training: the launcher (launch), the per-rank worker and its set-up (setup: stage, LoRA, dtype, kernels,
optimizer), the step loop, checkpoints, metrics and the start-up report, the final export. Parallel wrapping over
the run's device mesh lives in vlmctl.distributed."""
