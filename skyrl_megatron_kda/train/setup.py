"""What every rank does before it builds its model (``model.glm.build_model``): megatron's process
groups for the recipe's mesh and the seeds. Shared by the trainer (``train.trainer``) and the
export of a run's checkpoint (``train.export``), which must build the same model the same way."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from ..config import Recipe
from ..distributed.cpu import seed_cpu_rng_tracker


def init_parallel_state(recipe: Recipe) -> None:
    """Megatron's process groups for the recipe's mesh on the already-initialised world."""
    p = recipe.parallel
    world = dist.get_world_size()
    if world != recipe.run.num_workers:
        raise ValueError(f"torch.distributed has {world} ranks but run.num_workers="
                         f"{recipe.run.num_workers}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp, expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp)


def seed_everything(seed: int, use_cpu: bool) -> None:
    """The same seed on every rank: with CPU initialisation megatron draws each full weight from
    the CPU generator and slices it (the MoE layers draw each tensor from a seed of its own name,
    ``model.moe.build_moe_layer``), so the full weights are the same at every mesh. On GPU
    megatron's own ``model_parallel_cuda_manual_seed`` sets the per-TP/EP CUDA streams as in its
    trainer, and the weights depend on the mesh."""
    random.seed(seed)
    torch.manual_seed(seed)
    if use_cpu:
        seed_cpu_rng_tracker(seed)
    else:
        model_parallel_cuda_manual_seed(seed)

