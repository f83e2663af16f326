"""megatron-core's DDP and distributed-optimizer settings of a recipe: the one place that turns
``train``'s optimizer and gradient settings into megatron's configs (``trainer.RankTrainer``
builds with them; ``memory.states`` models the same settings).

- ``train.grad_reduce_in_fp32``: DDP's gradient buffer in fp32 (default) or in the parameters'
  dtype. With a bf16 buffer the distributed optimizer casts each rank's shard of it to fp32 at
  the step (Adam still runs in fp32).
- ``train.optimizer_offload_fraction``: megatron's ``HybridDeviceOptimizer`` would keep that
  share of the fp32 main parameters and Adam moments in host memory and run their Adam step on
  the CPU. ``memory.states`` models it (``plan``), but building a trainer with it is refused
  (``OFFLOAD_REFUSED``): megatron-core 0.19.2's hybrid optimizer cannot hold fp32 model
  parameters, and this model always has some (the mHC maps, KDA's ``A_log`` and ``dt_bias``).
  The distributed optimizer hands it those parameters' shards as ``model_param.view(-1)[a:b]``
  (the bf16 branch detaches first, the fp32 branch does not), non-leaf tensors, which
  ``torch.optim.Optimizer`` refuses when ``DistributedOptimizer.__init__`` rebuilds the hybrid
  optimizer over its shard groups ("can't optimize a non-leaf Tensor"). Building under
  ``torch.no_grad()`` gets past that, but two more gaps of the same kind remain in megatron's
  code: its ``load_state_dict`` looks every parameter up among the fp32 copies it makes of
  16-bit ones (``_update_fp32_params_by_new_state``: KeyError for an fp32 parameter, so no
  checkpoint loads), and an fp32 shard left on the GPU (a fraction below 1) is stepped by torch's
  AdamW from ``.grad`` while the precision-aware distributed optimizer sets ``.decoupled_grad``,
  so it would silently never update. ``tests/test_optimizer_offload.py`` reproduces the first two
  on megatron's own classes; lift the refusal when that test starts failing (the configuration
  megatron intends is then ``optimizer_cpu_offload=True, optimizer_offload_fraction=f,
  use_precision_aware_optimizer=True``: the hybrid optimizer keeps the fp32 main copies itself).
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from ..config import Recipe
from ..megatron_config import PARAM_DTYPES

OFFLOAD_REFUSED = (
    "train.optimizer_offload_fraction>0 is not supported with megatron-core 0.19.2: its "
    "HybridDeviceOptimizer cannot hold fp32 model parameters (this model's mHC maps, A_log, "
    "dt_bias: non-leaf shard views at construction, KeyError on checkpoint load); use 0")


def ddp_config(recipe: Recipe) -> DistributedDataParallelConfig:
    """DDP with the distributed optimizer's buffer layout and the recipe's gradient dtype."""
    return DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=recipe.train.grad_reduce_in_fp32)


def optimizer_config(recipe: Recipe) -> OptimizerConfig:
    """Adam (decoupled weight decay) in megatron's distributed optimizer, with the recipe's LR
    and clipping. Refuses ``train.optimizer_offload_fraction`` > 0 (``OFFLOAD_REFUSED``)."""
    t = recipe.train
    if t.optimizer_offload_fraction > 0:
        raise ValueError(OFFLOAD_REFUSED)
    dtype = PARAM_DTYPES[recipe.model.params_dtype]
    return OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        clip_grad=t.grad_clip or 0.0, bf16=recipe.model.params_dtype == "bfloat16",
        params_dtype=dtype, use_distributed_optimizer=True)
