"""The cost model behind ``kda.cp_exchange=auto``: per KDA layer and per rank, what each exchange
moves, how long it takes and what extra memory it holds.

No single exchange wins everywhere (reference/kda-cp.md sections 4, 7, 8): the winner moves with
the CP degree, the heads per rank, the sequence length and whether the CP group leaves the node.
So ``auto`` estimates all three for the recipe and takes the fastest one it is allowed to use.

Time per layer, forward + backward, with communication and compute serialised (the model credits
no overlap; only the backward row re-gather of ``rows.py`` is issued asynchronously, and how much
of it hides behind the GEMMs is not measured):

- communication: the bytes of each exchange's own byte model (``bytes_moved`` forward,
  ``backward_bytes``: the mirror plus the projection's rows gathered again) over the link each
  group crosses, plus one latency per collective;
- KDA kernel: the segmented kernel at the rank's heads and tokens, slower per head-token when a
  rank has few heads (head-parallel exchanges split the heads over CP); ``state`` pays for its
  summaries and correction (a factor on its shard's kernel) and a fixed cost per call;
- projection GEMMs: the rank's FLOPs at the measured dense bf16 rate.

Terms that scale alike for every exchange (the o_proj reduce-scatter under SP, the gated norm,
the conv, elementwise work) are left out, so ``total_s`` is a floor, not the layer's wall time:
measured per rank on one H200 (8 heads, TP1 x CP2, T = 128K..1M, docs/benchmarks.md) the layer
took 1.44-1.51x this model with ``a2a`` and ``allgather``, and ``state`` the same ratio plus
its fixed call cost, which the model includes. The model's order of the three exchanges matched
the measured order at each length (tests/test_cost.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..config import EXACT_EXCHANGES, ClusterConfig, LayerRecipe, LinkConfig, merge
from .exchange import EXCHANGES, ExchangeShape

logger = logging.getLogger(__name__)

CONCRETE = ("a2a", "allgather", "state")
"""The exchanges ``auto`` chooses from, in order of preference on a tie (exact ones first)."""

GiB = 2**30

# --- calibration: measured on H200 (reference/environment.md, docs/benchmarks.md) -----------------

# The kernel terms describe the kernel every fla path runs: chunk_kda on segments of the sequence
# chained by our state-passing kernel (``kda.kernel_segments=16``, state_kernel.py). Measured on
# one H200, GLM dims, bf16, forward+backward (bench/results/session4/kernels_T*.json):
#   T         128K   256K   512K    1M
#   8 heads   24.2   38.0   72.9  145.6 ms
#   4 heads   14.2   20.9   39.5   75.6 ms

KDA_CALL_OVERHEAD_S = 2.1e-3
"""Fixed cost of one kernel forward+backward (launches, per-segment passes): the intercept of the
8-head line through T = 256K and 1M (38.0 and 145.6 ms)."""

KDA_HEAD_TOKENS_PER_S = 8 * 2**20 / (145.6e-3 - KDA_CALL_OVERHEAD_S)
"""The segmented kernel at 8 heads: T = 1M in 145.6 ms, 58.5 M head-tokens/s. T = 512K ran 72.9
ms (the model: 73.8). Below 256K each of the 16 segments is short and the model is optimistic:
T = 128K ran 24.2 ms against 20.1."""

KDA_SATURATED_HEADS = 8
"""Heads per GPU at and above which the kernel runs at ``KDA_HEAD_TOKENS_PER_S``."""

KDA_EFFICIENCY_AT_4_HEADS = 0.96
"""Per-head-token throughput at 4 heads (the head-parallel CP2 share of TP8) relative to 8: 0.95,
0.96 and 0.98 at T = 256K, 512K and 1M (20.9, 39.5, 75.6 ms against the 8-head line). The
segments give the kernel parallelism along the sequence, which fla's single pass over the
sequence lacks with few heads (its chunk_kda at 4 heads ran at 0.74 of its 8-head rate)."""

GEMM_FLOP_PER_S = 790e12
"""Dense bf16 GEMM on one H200 with random data (reference/environment.md); the profiled CP1
layer's projections ran at this floor (8.8 ms measured vs 9.0 ms predicted at T = 64K)."""

STATE_PREPASS = 82.7 / 73.5 - 1.0
"""Extra kernel time of ``state`` relative to the same kernel on its shard alone: at CP2, T = 1M,
8 heads, two H200s, the state exchange's recurrence took 82.7 ms per rank against 73.5 ms for
the segmented kernel on the 512K shard alone, in the same run (+0.125x: the summaries, their
all-gather and the correction for the incoming state). fla 0.6.0's own state passing
(``cp_context``) took 246.3 ms there, +2.35x over this shard's kernel; ``skyrl-kda plan
--state-prepass 2.35`` prices it."""


STATE_CALL_OVERHEAD_S = 7.0e-3
"""Fixed cost of one ``state`` layer call beyond its kernel (host-side piece bookkeeping and the
syncs it needs, the halo conv's extra launches and copies). Measured per rank on one H200
(``bench/kda_layer.py --emulate-cp2``, 8 heads, CP2): the state layer exceeded the head-parallel
exchanges' common ratio of measured time to this model (1.44-1.51x) by 6.8, 6.8 and 7.9 ms at
T = 128K, 256K and 1M, a constant over an 8x range of T. It is what makes ``a2a`` the faster
exchange below about 256K tokens at CP2 inside a node."""


@dataclass(frozen=True)
class Calibration:
    """The measured constants above, bundled so a caller (``plan``, a benchmark) can swap one."""

    kda_head_tokens_per_s: float = KDA_HEAD_TOKENS_PER_S
    kda_efficiency_at_4_heads: float = KDA_EFFICIENCY_AT_4_HEADS
    kda_call_overhead_s: float = KDA_CALL_OVERHEAD_S
    gemm_flop_per_s: float = GEMM_FLOP_PER_S
    state_prepass: float = STATE_PREPASS
    state_call_overhead_s: float = STATE_CALL_OVERHEAD_S

    def __post_init__(self) -> None:
        if not 0.5 < self.kda_efficiency_at_4_heads <= 1.0:
            raise ValueError(
                f"kda_efficiency_at_4_heads={self.kda_efficiency_at_4_heads} must be in (0.5, 1]: "
                "4 heads cannot take longer than 8 heads")
        for name in ("kda_head_tokens_per_s", "gemm_flop_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("kda_call_overhead_s", "state_call_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if not self.state_prepass > -1:
            raise ValueError(f"state_prepass={self.state_prepass} must be > -1 (a positive kernel time)")


DEFAULT_CALIBRATION = Calibration()


def kda_efficiency(heads: float, at_4_heads: float = KDA_EFFICIENCY_AT_4_HEADS) -> float:
    """Kernel throughput per head-token at ``heads`` heads per GPU, relative to 8 or more heads.

    Model: the kernel's time per token is ``c * (h + h0)`` below saturation: a part proportional to
    the heads plus a part ``h0`` (in head units) that does not shrink with fewer heads (a serial
    state pass runs on few SMs whatever the head count; the segments keep it short). Hence

        efficiency(h) = min(1, [h / (h + h0)] / [8 / (8 + h0)]),  h0 = 8 (e - 1) / (1 - 2e)

    with e = efficiency(4) measured (0.96 -> h0 = 0.35, efficiency(2) = 0.89, efficiency(1) = 0.77).
    """
    h0 = KDA_SATURATED_HEADS * (at_4_heads - 1.0) / (1.0 - 2.0 * at_4_heads)
    sat = KDA_SATURATED_HEADS
    return min(1.0, heads * (sat + h0) / (sat * (heads + h0)))


def kda_kernel_s(heads: float, tokens: int, calibration: Calibration = DEFAULT_CALIBRATION) -> float:
    """Forward+backward seconds of the (segmented) kernel over ``tokens`` tokens of ``heads`` heads."""
    c = calibration
    rate = c.kda_head_tokens_per_s * kda_efficiency(heads, c.kda_efficiency_at_4_heads)
    return c.kda_call_overhead_s + heads * tokens / rate


def projection_flops(name: str, shape: ExchangeShape, gate_ranks: tuple[int, int] = (128, 128)) -> float:
    """Forward+backward GEMM FLOPs of one rank (backward = 2x forward).

    ``allgather`` projects every row of the sequence for its 1/cp head slice; ``a2a`` and
    ``state`` project this CP rank's rows for all TP-local heads. The low-rank f_a/g_a are
    duplicated over TP and head-independent, so every rank runs them on all the rows it projects:
    this is where ``allgather`` does more work. o_proj runs on this CP rank's rows in every case.
    """
    s, (rf, rg) = shape, gate_ranks
    local_heads = s.num_heads / s.tp
    rows_cp = s.tokens * s.batch / s.cp
    if name == "allgather" and s.cp > 1:
        rows, heads = s.tokens * s.batch, local_heads / s.cp
    else:
        rows, heads = rows_cp, local_heads
    K, D = s.head_dim, s.hidden
    fwd = 2 * rows * D * (3 * heads * K + heads)  # q, k, v, beta
    fwd += 2 * rows * D * (rf + rg)  # f_a, g_a
    fwd += 2 * rows * (rf + rg) * heads * K  # f_b, g_b
    fwd += 2 * rows_cp * local_heads * K * D  # o_proj
    return 3.0 * fwd


@dataclass(frozen=True)
class Estimate:
    """One exchange's cost per rank per KDA layer. Bytes are one forward pass (what each rank
    sends, equal to what it receives; see ``backward_bytes`` for the backward's); times are
    forward + backward."""

    name: str
    exact: bool  # outputs and gradients bitwise equal to CP=1 (up to fp32 summation order)
    cp_in_bytes: int  # over CP into the exchange's layout (heads or state summaries + halo)
    cp_out_bytes: int  # over CP: the output back to sequence shards
    tp_bytes: int  # over TP: the row gather under sequence parallelism
    cp_comm_s: float  # CP collectives: bytes over the CP link plus one latency each
    tp_comm_s: float  # the TP row gather (backward: gathered again, and the reduce-scatter)
    kernel_s: float  # the kernel at this rank's heads and tokens (state: + pre-pass, call overhead)
    gemm_s: float  # this rank's projection GEMMs
    extra_memory_bytes: int  # buffers only this exchange allocates (see ``extra_memory_bytes``)
    total_s: float  # comm + kernel + GEMMs: the quantity auto minimises

    @property
    def comm_s(self) -> float:
        return self.cp_comm_s + self.tp_comm_s

    @property
    def compute_s(self) -> float:
        return self.kernel_s + self.gemm_s


def extra_memory_bytes(name: str, shape: ExchangeShape) -> int:
    """Transient buffers per rank per layer that a sequence-sharded layer with no exchange
    would not allocate, alive only while the exchange's own step runs (none is kept between
    forward and backward; the plan adds it where no larger working set is alive).

    ``allgather``: the full-length [T, D] hidden rows while the projection runs (forward, and
    again for its weight gradients: ``rows.py``; its head-slice projections have the size a
    sequence shard's would). ``a2a``: the projected tensors received in head layout next to the
    sequence-layout ones it sent. ``state``: the gathered fp32 summaries and conv halos of all
    CP ranks.
    """
    s = shape
    if s.cp == 1:
        return 0
    if name == "allgather":
        return s.rows_bytes(s.tokens, s.hidden)
    if name == "a2a":
        return s.rows_bytes(s.tokens // s.cp, s.projected_width // s.tp)
    return EXCHANGES[name].bytes_moved(s)["cp"] * s.cp // (s.cp - 1)


def _seconds(nbytes: int, bandwidth_gib_s: float) -> float:
    return nbytes / (bandwidth_gib_s * GiB)


def estimate(name: str, shape: ExchangeShape, spans_nodes: bool, cluster: ClusterConfig, *,
             gate_ranks: tuple[int, int] = (128, 128),
             calibration: Calibration = DEFAULT_CALIBRATION) -> Estimate:
    """Bytes, time and extra memory of exchange ``name`` for one KDA layer on one rank.

    ``spans_nodes``: whether the CP group crosses nodes (``ClusterConfig.cp_spans_nodes``); then
    all its traffic is costed at the inter-node link, since ring all-gathers and all-to-alls run
    at the pace of their slowest hop. The TP group crosses nodes only when tp > gpus_per_node.
    """
    if name not in CONCRETE:
        raise ValueError(f"no cost model for cp_exchange {name!r}; expected one of {CONCRETE}")
    s = shape
    moved, moved_bwd = EXCHANGES[name].bytes_moved(s), EXCHANGES[name].backward_bytes(s)
    cp_out = EXCHANGES[name].output_bytes(s) if getattr(EXCHANGES[name], "splits_heads", False) else 0
    cp_in, cp_in_bwd = moved["cp"] - cp_out, moved_bwd["cp"] - cp_out
    tp_bytes, tp_bytes_bwd = moved["tp"], moved_bwd["tp"]

    cp_link: LinkConfig = cluster.inter_node if spans_nodes else cluster.intra_node
    tp_link: LinkConfig = cluster.inter_node if cluster.tp_spans_nodes(s.tp) else cluster.intra_node
    cp_comm = tp_comm = 0.0
    if s.cp > 1:
        # Two CP collectives per pass each: a2a = all-to-all in and out; allgather = all-gather in,
        # all-to-all out; state = all-gather of conv halo tails and one of the summaries.
        in_bw = cp_link.a2a_bandwidth_gib_s if name == "a2a" else cp_link.bandwidth_gib_s
        out_s = _seconds(cp_out, cp_link.a2a_bandwidth_gib_s) + 2 * cp_link.latency_us * 1e-6
        cp_comm = _seconds(cp_in, in_bw) + _seconds(cp_in_bwd, in_bw) + 2 * out_s
    if tp_bytes:
        # Forward: one gather; backward: the rows gathered again and the reduce-scatter.
        tp_comm = (_seconds(tp_bytes + tp_bytes_bwd, tp_link.bandwidth_gib_s)
                   + 3 * tp_link.latency_us * 1e-6)

    local_heads = s.num_heads / s.tp
    if name == "state":
        kernel = kda_kernel_s(local_heads, s.tokens * s.batch // s.cp, calibration)
        if s.cp > 1:
            kernel = kernel * (1.0 + calibration.state_prepass) + calibration.state_call_overhead_s
    else:
        kernel = kda_kernel_s(local_heads / s.cp, s.tokens * s.batch, calibration)
    gemm = projection_flops(name, s, gate_ranks) / calibration.gemm_flop_per_s

    return Estimate(
        name=name, exact=name in EXACT_EXCHANGES, cp_in_bytes=cp_in, cp_out_bytes=cp_out,
        tp_bytes=tp_bytes, cp_comm_s=cp_comm, tp_comm_s=tp_comm, kernel_s=kernel, gemm_s=gemm,
        extra_memory_bytes=extra_memory_bytes(name, s),
        total_s=cp_comm + tp_comm + kernel + gemm,
    )


def shape_of(recipe: LayerRecipe) -> ExchangeShape:
    """The byte model's view of a recipe: one micro-batch, bf16 activations."""
    return ExchangeShape(
        tokens=recipe.data.seq_len, batch=recipe.data.micro_batch_size,
        hidden=recipe.model.hidden_size, num_heads=recipe.kda.num_heads,
        head_dim=recipe.kda.head_dim, tp=recipe.parallel.tp, cp=recipe.parallel.cp,
        sequence_parallel=recipe.parallel.sequence_parallel, element_size=2,
        conv_size=recipe.kda.conv_size, layout=recipe.kda.cp_layout,
    )


def exclusions(recipe: LayerRecipe) -> dict[str, str]:
    """Why ``auto`` may not pick an exchange for this recipe (absent: allowed)."""
    out: dict[str, str] = {}
    p, kda = recipe.parallel, recipe.kda
    local_heads = kda.num_heads // p.tp
    if local_heads % p.cp:
        for name in ("a2a", "allgather"):
            out[name] = f"local heads {local_heads} not divisible by cp={p.cp}"
    if "allgather" not in out and p.tp > 1 and not p.sequence_parallel:
        out["allgather"] = f"needs sequence parallelism at tp={p.tp}"
    if not kda.allow_inexact:
        out["state"] = "not exact, kda.allow_inexact=false"
    return out


def _where(recipe: LayerRecipe, spans_nodes: bool) -> str:
    c = recipe.cluster
    return (f"CP spans nodes over {c.inter_node_kind}" if spans_nodes
            else "CP inside one node over NVLink")


def choose(recipe: LayerRecipe, calibration: Calibration = DEFAULT_CALIBRATION
           ) -> tuple[str, str, list[Estimate]]:
    """The fastest allowed exchange for ``recipe``, a one-line reason, and all three estimates.

    At cp=1 nothing crosses a CP group and every exchange runs the same code: a2a.
    """
    p = recipe.parallel
    spans = recipe.cluster.cp_spans_nodes(p.tp, p.cp)
    shape = shape_of(recipe)
    ranks = (recipe.kda.gate_low_rank, recipe.kda.output_gate_low_rank)
    table = [estimate(n, shape, spans, recipe.cluster, gate_ranks=ranks, calibration=calibration)
             for n in CONCRETE]
    if p.cp == 1:
        return "a2a", "a2a: cp=1, no CP exchange (every exchange runs the same code)", table
    excluded = exclusions(recipe)
    allowed = [e for e in table if e.name not in excluded]
    if not allowed:
        raise ValueError(f"kda.cp_exchange=auto has no exchange to pick: {excluded}")
    best = min(allowed, key=lambda e: e.total_s)  # ties keep CONCRETE order: exact first
    others = [f"{e.name} {e.total_s * 1e3:.1f} ms" for e in allowed if e is not best]
    others += [f"{name} excluded ({why})" for name, why in excluded.items()]
    reason = (f"{best.name}: {best.total_s * 1e3:.1f} ms vs {', '.join(others)} "
              f"({_where(recipe, spans)}, T={recipe.data.seq_len})")
    return best.name, reason, table


def resolve_cp_exchange(recipe: LayerRecipe, calibration: Calibration = DEFAULT_CALIBRATION
                        ) -> tuple[LayerRecipe, str]:
    """Resolve ``kda.cp_exchange=auto`` to a concrete exchange once, at model build, and log why.

    Returns the recipe (re-validated with the choice, as its own class: a ``LayerRecipe`` or a
    whole ``Recipe``; the environment is not re-applied) and the reason; a recipe with a concrete
    exchange comes back unchanged with the reason "configured".
    """
    if recipe.kda.cp_exchange != "auto":
        return recipe, "configured"
    choice, reason, _ = choose(recipe, calibration)
    logger.info("kda.cp_exchange=auto -> %s", reason)
    resolved = type(recipe).model_validate(
        merge(recipe.model_dump(), {"kda": {"cp_exchange": choice}}))
    return resolved, reason
