"""Colocation (``trainer.placement.colocate_all=true``, SkyRL's default): a worker's state off the
GPU while the inference engines use it, and back.

SkyRL's own Megatron helpers (``distributed.megatron.megatron_utils``) do the moving; they take
megatron-core's objects, which are what ``RankTrainer`` holds:

- model: DDP's contiguous parameter buffers (dense and expert) go to a host copy and their GPU
  storage is freed; parameters outside them (the frozen DSA indexer) go to a host copy too (SkyRL's
  frozen-parameter path, file-backed when ``SKYRL_FROZEN_OFFLOAD_DIR`` allows) and are restored
  from it. A model without DDP (the reference worker's) moves parameter by parameter.
- optimizer: DDP's gradient buffers are freed (restored zeroed: SkyRL offloads between steps,
  never between ``forward_backward`` and ``optim_step``), the distributed optimizer's fp32 main
  parameters and Adam moments go to the host.

On a CPU rank (the tiny recipe) the state is already in host memory; the same helpers still run,
inside ``RankModel.cpu_mode`` (``pin_memory`` gives a copy), so the buffers' storage really is
freed and restored from the copy, which is what the CPU tests check. Parameters outside DDP and
optimizer state stay where they are there (SkyRL moves only CUDA tensors).
"""

from __future__ import annotations

import torch
from skyrl.backends.skyrl_train.distributed.megatron.megatron_utils import (
    load_megatron_grads_to_gpu,
    load_megatron_model_to_gpu,
    load_megatron_optimizer,
    offload_megatron_grads_to_cpu,
    offload_megatron_model_to_cpu,
    offload_megatron_optimizer,
)


def offload_to_cpu(rank, *, offload_optimizer: bool = True, offload_model: bool = True) -> None:
    """Move ``rank``'s model (``offload_model``) and gradient buffers + optimizer state
    (``offload_optimizer``) to host memory. ``rank``: a ``RankTrainer``, or a ``RankModel``
    (no optimizer: only the model moves)."""
    optimizer = getattr(rank, "optimizer", None)
    with rank.cpu_mode():
        if offload_model:
            offload_megatron_model_to_cpu([rank.model])
        if offload_optimizer:
            offload_megatron_grads_to_cpu([rank.model])
        if offload_optimizer and optimizer is not None:
            offload_megatron_optimizer(optimizer)
    if not rank.use_cpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def backload_to_gpu(rank, *, backload_optimizer: bool = True, backload_model: bool = True) -> None:
    """The inverse of ``offload_to_cpu``."""
    optimizer = getattr(rank, "optimizer", None)
    with rank.cpu_mode():
        if backload_model:
            load_megatron_model_to_gpu([rank.model])
        if backload_optimizer:
            load_megatron_grads_to_gpu([rank.model])
        if backload_optimizer and optimizer is not None:
            load_megatron_optimizer(optimizer)
    if not rank.use_cpu:
        torch.cuda.synchronize()
