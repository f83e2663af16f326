"""Training: data, packing, the fine-tune loop, checkpoints and metrics."""
