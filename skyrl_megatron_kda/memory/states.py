"""What a rank holds for the whole step besides activations: gradients, optimizer state and
megatron's all-gather buffer.

- **Gradients**: megatron DDP's grad buffer holds every trainable parameter once, in fp32
  (``train.grad_reduce_in_fp32``, the default) or else in the parameter's dtype. The frozen DSA
  indexer has none. With a bf16 buffer the optimizer step casts the rank's shard of it to fp32
  (a phase of its own, ``phases.py``).
- **Optimizer**: megatron's DistributedOptimizer shards Adam's state over the data-parallel
  group of each parameter: dense parameters over DP x CP (``intra_dp_cp``), routed experts over
  the expert data-parallel group (world / (ep * etp)). Per element: fp32 main copy + exp_avg +
  exp_avg_sq = 12 bytes for bf16 parameters; 8 for fp32 ones (the main copy is the parameter).
  ``train.optimizer_offload_fraction`` f moves f of it to host memory (``optimizer_split``;
  modelled only: a run refuses it, see ``train/optimizer.py``).
- **Megatron's all-gather buffer** (``gather_buffer_bytes``): the sequence-parallel linears and
  the allgather MoE dispatcher gather into one global buffer, which keeps its largest size for
  the run (the alltoall dispatcher allocates its rows afresh).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Recipe
from .census import ParamGroup, rank_parameters
from .moe import dispatch_terms, moe_call_rows
from .rows import act_bytes, rows_of


HOST_OPTIMIZER_BYTES = 16
"""Host bytes per offloaded optimizer element (megatron's HybridDeviceOptimizer): the fp32 main
copy, exp_avg, exp_avg_sq, and the pinned fp32 copy of its gradient, for bf16 and fp32
parameters alike."""


def optimizer_shards(recipe: Recipe) -> tuple[int, int]:
    """(dense, expert) sizes of the groups the distributed optimizer shards Adam state over:
    DP x CP = world / (tp * pp) and the expert data-parallel group = world / (ep * etp * pp)."""
    p, world = recipe.parallel, recipe.run.num_workers
    return world // (p.tp * p.pp), world // (p.ep * p.etp * p.pp)


def grad_bytes(recipe: Recipe, group: ParamGroup) -> int:
    """Bytes per element of ``group``'s gradients in DDP's buffer: fp32, or the parameter's own
    dtype without ``train.grad_reduce_in_fp32``."""
    return 4 if recipe.train.grad_reduce_in_fp32 else group.dtype_bytes


@dataclass(frozen=True)
class OptimizerSplit:
    """Where one rank's optimizer memory lives (bytes)."""

    gpu: int  # fp32 main copies + Adam moments kept on the GPU
    host: int  # the offloaded share in host memory (HOST_OPTIMIZER_BYTES per element)
    step_casts: int  # on the GPU during the step: fp32 casts of the GPU share's bf16 gradients


def optimizer_split(recipe: Recipe) -> OptimizerSplit:
    """The distributed optimizer's memory on the GPU and on the host, per rank.

    With ``train.optimizer_offload_fraction`` f, megatron's HybridDeviceOptimizer offloads whole
    parameter shards in order until f of the shard elements are on the host; this takes exactly
    f of each term (exact at 0 and 1; in between it differs by less than one parameter shard).
    Offloaded, an element costs the GPU nothing and the host ``HOST_OPTIMIZER_BYTES``; its
    gradient is copied to the host as fp32 without a GPU cast."""
    dense_shard, expert_shard = optimizer_shards(recipe)
    state = host = casts = 0
    for g in rank_parameters(recipe):
        if not g.trainable:
            continue
        shard = expert_shard if g.expert else dense_shard
        state += g.numel * (12 if g.dtype_bytes != 4 else 8) // shard
        host += g.numel * HOST_OPTIMIZER_BYTES // shard
        if grad_bytes(recipe, g) != 4:
            casts += g.numel * 4 // shard
    f = recipe.train.optimizer_offload_fraction
    return OptimizerSplit(gpu=state - round(f * state), host=round(f * host),
                          step_casts=casts - round(f * casts))


def gather_buffer_bytes(recipe: Recipe) -> int:
    """Megatron's global all-gather buffer ("mpu", ``get_global_memory_buffer``), per rank. The
    sequence-parallel linears gather their input [S, D] into it (TP > 1 with SP) and the
    allgather MoE dispatcher its tokens [g, D] over EP x ETP (g = rows per call * ep * etp, a
    chunk's rows under ``train.moe_chunk_tokens``; the alltoall dispatcher requests none:
    ``DispatchTerms.gather_buffer_rows``); it grows to the largest request and stays allocated
    for the rest of the run, so it counts like a state."""
    m, p, w, r = recipe.model, recipe.parallel, act_bytes(recipe), rows_of(recipe)
    sp_gather = r.cp * m.hidden_size * w if p.sequence_parallel and p.tp > 1 else 0
    moe_gather = 0
    if "moe" in m.mlp_types():
        moe_gather = dispatch_terms(recipe).gather_buffer_rows(recipe, moe_call_rows(recipe))
    return max(sp_gather, moe_gather * m.hidden_size * w)
