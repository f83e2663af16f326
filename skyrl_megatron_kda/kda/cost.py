"""The cost model behind ``kda.cp_exchange=auto``: per KDA layer and per rank, what each exchange
moves, how long it takes and what extra memory it holds.

No single exchange wins everywhere: the winner moves with
the CP degree, the heads per rank, the sequence length and whether the CP group leaves the node.
So ``auto`` estimates every registered exchange for the recipe and takes the fastest one it is allowed to use.

Time per layer, forward + backward, with communication and compute serialised except where the
code overlaps them on purpose:

- communication: the bytes of each exchange's own byte model (``bytes_moved`` forward,
  ``backward_bytes``: the mirror plus the projection's rows gathered again) over the link each
  group crosses, plus one latency per collective; the last collective of the backward row
  re-gather (``rows.py``) runs while the input-gradient GEMMs compute, and hides behind them up
  to their time (``regather_overlap``);
- KDA kernel: the segmented kernel at the rank's heads and tokens, slower per head-token when a
  rank has few heads (head-parallel exchanges split the heads over CP); ``state`` pays for its
  summaries and correction (a factor on its shard's kernel) and a fixed cost per call;
- projection GEMMs: the rank's FLOPs at the measured dense bf16 rate;
- elementwise: the rest of the layer (conv, gated norm, casts, copies, reorders) per head-token
  on the rank, CP1's and each exchange's own, from per-kernel profiles.

Every constant comes from kernel-level measurements (``calibration.py``), none from the layer
rows the model predicts; ``tests/test_cost.py`` checks ``auto``'s pick and the order of clearly
separated exchanges against stored layer runs per rank on one H200 (docs/benchmarks.md). Left
out: the o_proj reduce-scatter under SP, which every exchange pays alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ClusterConfig, LinkConfig, MeshRecipe
from . import exchanges
from .calibration import (
    DEFAULT_CALIBRATION,
    GEMM_FLOP_PER_S,
    KDA_EFFICIENCY_AT_4_HEADS,
    KDA_SATURATED_HEADS,
    Calibration,
)
from .exchanges import ExchangeMesh, ExchangeShape

__all__ = ["Calibration", "DEFAULT_CALIBRATION", "Estimate", "GEMM_FLOP_PER_S", "choose", "estimate",
           "elementwise_s_per_head_token", "exclusions", "gathered_gemm_flops", "head_tokens",
           "kda_efficiency", "kda_kernel_s", "projection_flops", "regather_hidden_s"]

GiB = 2**30


def kda_efficiency(heads: float, at_4_heads: float = KDA_EFFICIENCY_AT_4_HEADS) -> float:
    """Kernel throughput per head-token at ``heads`` heads per GPU, relative to 8 or more heads.

    Model: the kernel's time per token is ``c * (h + h0)`` below saturation: a part proportional to
    the heads plus a part ``h0`` (in head units) that does not shrink with fewer heads (a serial
    state pass runs on few SMs whatever the head count; the segments keep it short). Hence

        efficiency(h) = min(1, [h / (h + h0)] / [8 / (8 + h0)]),  h0 = 8 (e - 1) / (1 - 2e)

    with e = efficiency(4) from the calibration (``KDA_EFFICIENCY_AT_4_HEADS``).
    """
    h0 = KDA_SATURATED_HEADS * (at_4_heads - 1.0) / (1.0 - 2.0 * at_4_heads)
    sat = KDA_SATURATED_HEADS
    return min(1.0, heads * (sat + h0) / (sat * (heads + h0)))


def kda_kernel_s(heads: float, tokens: int, calibration: Calibration = DEFAULT_CALIBRATION) -> float:
    """Forward+backward seconds of the (segmented) kernel over ``tokens`` tokens of ``heads`` heads."""
    c = calibration
    rate = c.kda_head_tokens_per_s * kda_efficiency(heads, c.kda_efficiency_at_4_heads)
    return c.kda_call_overhead_s + heads * tokens / rate


def _projected_rows_and_heads(name: str, s: ExchangeShape) -> tuple[float, float]:
    """Rows this rank projects and the TP-local heads it projects them for."""
    local_heads = s.num_heads / s.tp
    if exchanges.get(name).projects_whole_sequence and s.cp > 1:
        return s.tokens * s.batch, local_heads / s.cp
    return s.tokens * s.batch / s.cp, local_heads


def gathered_gemm_flops(name: str, shape: ExchangeShape, gate_ranks: tuple[int, int] = (128, 128)) -> float:
    """Forward FLOPs of the GEMMs on the gathered rows (q, k, v, beta, f_a, g_a: ``rows.py``); their
    input gradient costs the same in backward, and the row re-gather runs beside it."""
    rows, heads = _projected_rows_and_heads(name, shape)
    return 2 * rows * shape.hidden * (3 * heads * shape.head_dim + heads + sum(gate_ranks))


def projection_flops(name: str, shape: ExchangeShape, gate_ranks: tuple[int, int] = (128, 128)) -> float:
    """Forward+backward GEMM FLOPs of one rank (backward = 2x forward).

    An exchange that ``projects_whole_sequence`` (``allgather``) projects every row of the
    sequence for its 1/cp head slice; the others (``a2a``, ``state``) project this CP rank's rows
    for all TP-local heads. The low-rank f_a/g_a are duplicated over TP and head-independent, so
    every rank runs them on all the rows it projects: this is where ``allgather`` does more work.
    o_proj runs on this CP rank's rows in every case.
    """
    s, (rf, rg) = shape, gate_ranks
    local_heads = s.num_heads / s.tp
    rows_cp = s.tokens * s.batch / s.cp
    rows, heads = _projected_rows_and_heads(name, s)
    K, D = s.head_dim, s.hidden
    fwd = gathered_gemm_flops(name, s, gate_ranks)  # q, k, v, beta, f_a, g_a
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
    elementwise_s: float  # the layer's other work (conv, norm, copies), per head-token on the rank
    extra_memory_bytes: int  # buffers only this exchange allocates (see ``extra_memory_bytes``)
    total_s: float  # comm + kernel + GEMMs + elementwise: the quantity auto minimises
    elementwise_profiled: bool = True  # False: no profile of this exchange, CP1's term used

    @property
    def comm_s(self) -> float:
        return self.cp_comm_s + self.tp_comm_s

    @property
    def compute_s(self) -> float:
        return self.kernel_s + self.gemm_s + self.elementwise_s


def _seconds(nbytes: int, bandwidth_gib_s: float) -> float:
    return nbytes / (bandwidth_gib_s * GiB)


def head_tokens(name: str, shape: ExchangeShape) -> float:
    """Heads x tokens this rank runs the recurrence (and the layer's elementwise work) on."""
    s, local_heads = shape, shape.num_heads / shape.tp
    if exchanges.get(name).splits_heads:
        return local_heads / s.cp * s.tokens * s.batch
    return local_heads * s.tokens * s.batch / s.cp


def elementwise_s_per_head_token(name: str, cp: int, calibration: Calibration) -> tuple[float, bool]:
    """The layer's elementwise work per head-token, and whether it was profiled for this case:
    CP1's, or the CP exchange's own (its reorders and copies differ; ``calibration.py``). An
    exchange whose rank has no profile (one registered later) gets CP1's term, flagged, and
    ``choose`` says so in its reason."""
    if cp == 1:
        return calibration.elementwise_s_per_head_token, True
    own = calibration.cp_elementwise_s_per_head_token.get(name)
    if own is None:
        return calibration.elementwise_s_per_head_token, False
    return own, True


def regather_hidden_s(name: str, shape: ExchangeShape, cp_link: LinkConfig, tp_link: LinkConfig,
                      gate_ranks: tuple[int, int], calibration: Calibration) -> tuple[str, float]:
    """The group ("cp" or "tp") and seconds of the backward row re-gather that hide behind the
    input-gradient GEMMs: only its last collective runs beside them (TP's under SP, else CP's;
    ``rows.py``), up to their time."""
    again = exchanges.get(name)._row_gather_bytes(shape)
    group, link = ("tp", tp_link) if again["tp"] else ("cp", cp_link)
    dgrad = gathered_gemm_flops(name, shape, gate_ranks) / calibration.gemm_flop_per_s
    return group, calibration.regather_overlap * min(_seconds(again[group], link.bandwidth_gib_s), dgrad)


def estimate(name: str, shape: ExchangeShape, spans_nodes: bool, cluster: ClusterConfig, *,
             gate_ranks: tuple[int, int] = (128, 128),
             calibration: Calibration = DEFAULT_CALIBRATION) -> Estimate:
    """Bytes, time and extra memory of exchange ``name`` for one KDA layer on one rank.

    ``spans_nodes``: whether the CP group crosses nodes (``ClusterConfig.cp_spans_nodes``); then
    all its traffic is costed at the inter-node link, since ring all-gathers and all-to-alls run
    at the pace of their slowest hop. The TP group crosses nodes only when tp > gpus_per_node.
    """
    if name not in exchanges.names():
        raise ValueError(f"no cost model for cp_exchange {name!r}; expected one of {exchanges.names()}")
    s, exchange = shape, exchanges.get(name)
    moved, moved_bwd = exchange.bytes_moved(s), exchange.backward_bytes(s)
    cp_out = exchange.output_bytes(s)
    cp_in, cp_in_bwd = moved["cp"] - cp_out, moved_bwd["cp"] - cp_out
    tp_bytes, tp_bytes_bwd = moved["tp"], moved_bwd["tp"]

    between = cluster.inter_node_per_gpu
    cp_link: LinkConfig = between if spans_nodes else cluster.intra_node
    tp_link: LinkConfig = between if cluster.tp_spans_nodes(s.tp) else cluster.intra_node
    cp_comm = tp_comm = 0.0
    if s.cp > 1:
        # Two CP collectives per pass each: a2a = all-to-all in and out; allgather = all-gather in,
        # all-to-all out; state = all-gather of conv halo tails and one of the summaries.
        in_bw = (cp_link.a2a_bandwidth_gib_s if exchange.cp_input_collective == "all_to_all"
                 else cp_link.bandwidth_gib_s)
        out_s = _seconds(cp_out, cp_link.a2a_bandwidth_gib_s) + 2 * cp_link.latency_us * 1e-6
        cp_comm = _seconds(cp_in, in_bw) + _seconds(cp_in_bwd, in_bw) + 2 * out_s
    if tp_bytes:
        # Forward: one gather; backward: the rows gathered again and the reduce-scatter.
        tp_comm = (_seconds(tp_bytes + tp_bytes_bwd, tp_link.bandwidth_gib_s)
                   + 3 * tp_link.latency_us * 1e-6)

    group, hidden = regather_hidden_s(name, s, cp_link, tp_link, gate_ranks, calibration)
    if group == "tp":
        tp_comm -= hidden
    else:
        cp_comm -= hidden
    local_heads = s.num_heads / s.tp
    if exchange.splits_heads:
        kernel = kda_kernel_s(local_heads / s.cp, s.tokens * s.batch, calibration)
    else:  # all local heads on this rank's shard, plus the state chain's pre-pass and call cost
        kernel = kda_kernel_s(local_heads, s.tokens * s.batch // s.cp, calibration)
        if s.cp > 1:
            kernel = kernel * (1.0 + calibration.state_prepass) + calibration.state_call_overhead_s
    gemm = projection_flops(name, s, gate_ranks) / calibration.gemm_flop_per_s
    per_head_token, profiled = elementwise_s_per_head_token(name, s.cp, calibration)
    elementwise = head_tokens(name, s) * per_head_token

    return Estimate(
        name=name, exact=exchange.exact, cp_in_bytes=cp_in, cp_out_bytes=cp_out,
        tp_bytes=tp_bytes, cp_comm_s=cp_comm, tp_comm_s=tp_comm, kernel_s=kernel, gemm_s=gemm,
        elementwise_s=elementwise, elementwise_profiled=profiled,
        extra_memory_bytes=exchange.extra_memory_bytes(s),
        total_s=cp_comm + tp_comm + kernel + gemm + elementwise,
    )


def exclusions(recipe: MeshRecipe) -> dict[str, str]:
    """Why ``auto`` may not pick an exchange for this recipe (absent: allowed):
    ``exchanges.refusals`` on the recipe's mesh."""
    return exchanges.refusals(ExchangeMesh.of(recipe))


def _where(recipe: MeshRecipe, spans_nodes: bool) -> str:
    c = recipe.cluster
    return (f"CP spans nodes over {c.inter_node_kind}" if spans_nodes
            else "CP inside one node over NVLink")


def choose(recipe: MeshRecipe, calibration: Calibration = DEFAULT_CALIBRATION
           ) -> tuple[str, str, list[Estimate]]:
    """The fastest allowed exchange for ``recipe``, a one-line reason, and the estimates of every
    registered exchange (in registration order).

    At cp=1 nothing crosses a CP group and every exchange runs the same code: the first registered.
    """
    p = recipe.parallel
    spans = recipe.cluster.cp_spans_nodes(p.tp, p.cp)
    shape = ExchangeShape.of(recipe)
    ranks = (recipe.kda.gate_low_rank, recipe.kda.output_gate_low_rank)
    table = [estimate(n, shape, spans, recipe.cluster, gate_ranks=ranks, calibration=calibration)
             for n in exchanges.names()]
    if p.cp == 1:
        first = table[0].name
        return first, f"{first}: cp=1, no CP exchange (every exchange runs the same code)", table
    excluded = exclusions(recipe)
    pickable = exchanges.allowed(ExchangeMesh.of(recipe))
    allowed = [e for e in table if e.name in pickable]
    # Ties go to an exact exchange, then to the earlier registered one.
    best = min(allowed, key=lambda e: (e.total_s, not e.exact))
    others = [f"{e.name} {e.total_s * 1e3:.1f} ms" for e in allowed if e is not best]
    others += [f"{name} excluded ({why})" for name, why in excluded.items()]
    unprofiled = [e.name for e in allowed if not e.elementwise_profiled]
    note = f"; elementwise term of CP1 for {', '.join(unprofiled)} (not profiled)" if unprofiled else ""
    reason = (f"{best.name}: {best.total_s * 1e3:.1f} ms vs {', '.join(others)} "
              f"({_where(recipe, spans)}, T={recipe.data.seq_len}{note})")
    return best.name, reason, table
