"""Training: launchers (launch), the per-rank worker, parallel wrappers, the step loop, checkpoints, metrics."""
