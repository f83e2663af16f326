"""The measured steps the step-time model answers to, and the fit of each link kind to them.

The yardstick is the pull request this project started from: GLM-5.3-Flash at 1,048,576 tokens
per sequence on 64 B200s (8 nodes of 8), TP8 x CP2 with sequence parallelism, EP32 x ETP2,
megatron's all-to-all MoE dispatcher and TileLang DSA kernels, with its KDA layers exchanging
by all-to-all (``a2a``) or by the all-gather of hidden rows (``allgather``), run by SkyRL's SFT
benchmark script. ``SEED_ROWS`` holds its table; ``seed_recipe`` sets up each row in this
project's terms (``SEED_SETUP``: what the script runs, stated key by key).

One number per link kind is fitted (``fit_node_bandwidth``): what a node's GPUs together move
to other nodes, which each of them shares while all cross at once (``LinkConfig.shared_by``).
The step is the sum of compute, which the rates measured on one GPU price, and collectives,
whose seconds are bytes over the links. Each kind is fitted on the one row ``SeedRow.fitted``
names and must predict the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Recipe, parse_overrides
from ..memory.estimate import estimate_memory
from ..recipe_rules import load_recipe_dict
from .model import estimate_step_time

SEED_SETUP = (
    # The model is GLM-5.3-Flash as the config's defaults hold it.
    "parallel.tp=8", "parallel.cp=2", "parallel.ep=32", "parallel.etp=2",
    "parallel.sequence_parallel=true", "run.num_workers=64", "run.device=gpu",
    "cluster.gpus_per_node=8", "cluster.gpu=b200",
    "data.seq_len=1048576", "data.micro_batch_size=1",  # one 1M-token sequence per DP rank
    "model.moe.dispatcher=alltoall",  # moe_token_dispatcher_type=alltoall
    "model.dsa.kernel=fused",  # megatron-core's TileLang SparseMLA (dsa_kernel_backend=tilelang)
    "model.dsa.tp_split=heads",  # megatron's DSA layer splits heads over TP
    "train.keep_dsa_selection=false",  # megatron's recompute runs the indexer again
    "train.recompute=full",  # recompute_granularity=full, uniform, one layer
    "train.offload_activations=true",  # SKYRL_OFFLOAD_CHECKPOINT_INPUTS(_PINNED)=1
    "train.loss_chunk_tokens=1024",  # fused_lm_head_logprob, logprobs_chunk_size=1024
    "train.grad_reduce_in_fp32=true",  # "FP32 grads"
    "train.optimizer_offload_fraction=1.0",  # optimizer_cpu_offload, no D2H/H2D overlap
    "kda.kernel=fla",  # fla over all of the rank's heads in one call
)
"""What SkyRL's 1M SFT benchmark runs, key by key on the config's defaults; each row adds its
exchange, link kind and, for the slice, ``SLICE_SETUP``."""

SLICE_SETUP = (
    "model.num_layers=4",  # layers 0-3: three KDA + one DSA; three dense FFNs + one MoE
    "run.num_workers=2", "cluster.gpus_per_node=1",  # one GPU on each of two nodes: CP2
    "parallel.tp=1", "parallel.sequence_parallel=false", "parallel.ep=1", "parallel.etp=1",
)
"""The seed's 4-layer slice at 1M, "CP2 across 2 nodes": read as the two CP ranks alone, one
GPU per node (TP1, all experts on each rank). On 16 GPUs (TP8 x CP2) a rank would do an eighth
of this work, too little for the slice's measured step on any link that fits the full model
(``tests/test_step_time_seed.py``)."""


@dataclass(frozen=True)
class SeedRow:
    """One measured number of the seed's table."""

    name: str
    exchange: str  # kda.cp_exchange
    link: str  # cluster.inter_node_kind
    slice: bool  # the 4-layer slice on 2 GPUs, or the full model on 64
    optimizer: bool  # the whole step, or forward+backward only
    measured_s: float
    fitted: bool  # read by ``fit_node_bandwidth``; the others are predictions


SEED_ROWS = (
    SeedRow("full model, EFA, step", "a2a", "efa", False, True, 335.0, False),
    SeedRow("full model, EFA, step", "allgather", "efa", False, True, 307.0, True),
    SeedRow("4-layer slice, EFA, step", "a2a", "efa", True, True, 34.9, False),
    SeedRow("4-layer slice, EFA, step", "allgather", "efa", True, True, 32.8, False),
    SeedRow("full model, TCP, forward+backward", "a2a", "tcp", False, False, 1482.0, False),
    SeedRow("full model, TCP, forward+backward", "allgather", "tcp", False, False, 1251.0, True),
)
"""The seed's table: 64 B200, 1M tokens per sequence, NCCL over EFA or TCP sockets."""

SEED_PEAK_GIB = {"a2a": 144.6, "allgather": 144.5}
"""The seed's peak memory per GPU (full model over EFA), by KDA exchange."""


def seed_recipe(row: SeedRow, node_bandwidth_gib_s: float | None = None) -> Recipe:
    """The row's setup as a recipe; ``node_bandwidth_gib_s`` overrides the link preset's."""
    overrides = [*SEED_SETUP, f"kda.cp_exchange={row.exchange}",
                 f"cluster.inter_node_kind={row.link}"]
    if row.slice:
        overrides += SLICE_SETUP
    if node_bandwidth_gib_s is not None:
        overrides.append(f"cluster.inter_node.node_bandwidth_gib_s={node_bandwidth_gib_s}")
    return load_recipe_dict(parse_overrides(overrides), environ={})


def predicted_peak_gib(exchange: str) -> float:
    """``plan``'s memory model (states + the largest phase) for the full model's setup."""
    row = next(r for r in SEED_ROWS if r.exchange == exchange and not r.slice and r.link == "efa")
    return estimate_memory(seed_recipe(row)).total / 2**30


def predicted_s(row: SeedRow, node_bandwidth_gib_s: float | None = None) -> float:
    """The model's seconds for what the row measured (the step, or forward+backward)."""
    step = estimate_step_time(seed_recipe(row, node_bandwidth_gib_s))
    return step.step_s if row.optimizer else step.step_s - step.part("optimizer").total_s


def fit_node_bandwidth(kind: str, rows=SEED_ROWS) -> float:
    """The ``kind`` link's node bandwidth (GiB/s; the one number fitted per link kind) that makes
    the model meet the kind's fitted row: bisection, the step falling as the bandwidth grows."""
    fitted = [r for r in rows if r.link == kind and r.fitted]
    if len(fitted) != 1:
        raise ValueError(f"fit_node_bandwidth({kind!r}) needs one fitted row, has {len(fitted)}")
    row = fitted[0]
    lo, hi = 0.1, 10000.0
    if not predicted_s(row, hi) < row.measured_s < predicted_s(row, lo):
        raise ValueError(f"no node bandwidth in [{lo}, {hi}] GiB/s meets {row.name} "
                         f"({row.exchange}): {row.measured_s} s")
    while hi / lo > 1 + 1e-9:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if predicted_s(row, mid) > row.measured_s else (lo, mid)
    return (lo * hi) ** 0.5
