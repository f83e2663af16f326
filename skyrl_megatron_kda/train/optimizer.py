"""megatron-core's DDP and distributed-optimizer settings of a recipe: the one place that turns
``train``'s optimizer and gradient settings into megatron's configs (``trainer.RankTrainer``
builds with them; ``memory.py`` models the same settings).

- ``train.grad_reduce_in_fp32``: DDP's gradient buffer in fp32 (default) or in the parameters'
  dtype. With a bf16 buffer the distributed optimizer casts each rank's shard of it to fp32 at
  the step (Adam still runs in fp32).
- ``train.optimizer_offload_fraction``: megatron's ``HybridDeviceOptimizer`` keeps that share of
  the fp32 main parameters and Adam moments in host memory and runs their Adam step on the CPU
  (torch's fused AdamW), copying gradients to the host and updated parameters back each step.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from ..config import Recipe
from ..megatron_config import _DTYPES


def ddp_config(recipe: Recipe) -> DistributedDataParallelConfig:
    """DDP with the distributed optimizer's buffer layout and the recipe's gradient dtype."""
    return DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=recipe.train.grad_reduce_in_fp32)


def optimizer_config(recipe: Recipe) -> OptimizerConfig:
    """Adam (decoupled weight decay) in megatron's distributed optimizer, with the recipe's LR,
    clipping and host offload."""
    t = recipe.train
    dtype = _DTYPES[recipe.model.params_dtype]
    offload = t.optimizer_offload_fraction > 0
    return OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        clip_grad=t.grad_clip or 0.0, bf16=recipe.model.params_dtype == "bfloat16",
        params_dtype=dtype, use_distributed_optimizer=True,
        optimizer_cpu_offload=offload, optimizer_offload_fraction=t.optimizer_offload_fraction,
        # The hybrid optimizer runs on the precision-aware path: the distributed optimizer hands
        # it the model's own parameter shards and gradients and it keeps the fp32 main copies
        # itself (on the host for the offloaded share). Without the flag the distributed
        # optimizer would keep a second fp32 copy of every shard on the GPU.
        use_precision_aware_optimizer=offload)
