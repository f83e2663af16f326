"""Seconds per training step of one rank, split by layer type and by compute vs communication.

Each part is the work one rank does in the recipe (its heads, rows, local experts and the rows
routed to them, its vocabulary slice, its optimizer shard) priced by a measured rate
(``calibration.py``), and the bytes its collectives move priced by the ``cluster`` section's
links (the KDA exchange by its own cost model, ``kda/cost.py``). One step is one packed row of
``data.seq_len`` tokens per micro-batch on every data-parallel rank.

Overlap: none. The step is the sum of every part's compute and communication: megatron's SP
gathers, the MoE dispatcher's gathers, DSA's all-to-alls and the optimizer's reduce-scatter run
on the compute stream's critical path in this code, and host-offload copies are ordered on the
compute stream (``model/host_offload.py``). The one overlap that is modelled is the KDA cost
model's own (the backward row re-gather behind the input-gradient GEMMs). ``overlapped_s`` is the
bound if every collective hid behind compute.

Recompute: under ``train.recompute=full`` a layer's forward runs twice (the checkpointed forward
and its rebuild in backward) and its backward once; its collectives run with each pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import LatentOptions, Recipe
from ..dsa import kernels as dsa_kernels
from ..kda import exchanges
from ..kda.cost import estimate as kda_estimate
from ..kda.cost import kda_kernel_s
from ..kda.exchanges import ExchangeShape
from ..memory.census import rank_parameters
from ..memory.dsa import dsa_projection_weights
from ..memory.rows import act_bytes, rows_of
from . import calibration as cal
from .common import (GiB, Part, forward_passes, gemm_s, group_link, recompute_share, scale,
                     seconds)
from .host import offload_part, optimizer_part
from .lora import frozen_gemms, lora_part_s
from .moe import (PRICED_DISPATCHERS, moe_dispatch_s, moe_pairs, moe_part, unpriced_dispatcher,
                  with_dispatcher)

__all__ = ["GiB", "Part", "moe_pairs", "moe_part", "unpriced_dispatcher"]


@dataclass(frozen=True)
class Lever:
    """A change and the step it would give (same model, one term changed)."""

    name: str
    step_s: float
    why: str


@dataclass(frozen=True)
class StepTime:
    parts: tuple[Part, ...]
    tokens: int  # tokens of one optimizer step over all data-parallel ranks
    gpus: int

    @property
    def compute_s(self) -> float:
        return sum(p.compute_s for p in self.parts)

    @property
    def comm_s(self) -> float:
        return sum(p.comm_s for p in self.parts)

    @property
    def step_s(self) -> float:
        """The prediction: compute and communication in series (the module docstring)."""
        return self.compute_s + self.comm_s

    @property
    def overlapped_s(self) -> float:
        """The bound if every collective and copy hid behind compute."""
        return max(self.compute_s, self.comm_s)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.step_s / self.gpus

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def dominant(self) -> tuple[str, float]:
        """The largest single term: (part and kind, seconds)."""
        terms = [(f"{p.name} {kind}", s) for p in self.parts
                 for kind, s in (("compute", p.compute_s), ("communication", p.comm_s))]
        return max(terms, key=lambda t: t[1])


# --- shapes of one rank -------------------------------------------------------------------------


def _layer_params(recipe: Recipe, component: str, layers: int) -> float:
    """Elements of one layer of ``component`` on this rank."""
    n = sum(g.numel for g in rank_parameters(recipe) if g.component == component)
    return n / layers if layers else 0.0


# --- the parts ------------------------------------------------------------------------------------


def kda_layer_s(recipe: Recipe) -> tuple[float, float]:
    """One KDA layer's (compute, communication) seconds per step as the KDA cost model prices it:
    its exchange, kernel, projection GEMMs and elementwise terms, the kernel over
    ``kda.kernel_head_group`` heads at a time, and the rebuilt forward under recompute."""
    k, p = recipe.kda, recipe.parallel
    shape = ExchangeShape.of(recipe)
    spans = recipe.cluster.cp_spans_nodes(p.tp, p.cp)
    est = kda_estimate(k.cp_exchange, shape, spans, recipe.cluster,
                       gate_ranks=(k.gate_low_rank, k.output_gate_low_rank))
    heads = k.num_heads / p.tp
    tokens = shape.tokens * shape.batch
    if exchanges.get(k.cp_exchange).splits_heads:
        heads /= p.cp  # head-parallel: 1/cp of the local heads over the whole sequence
    else:
        tokens //= p.cp  # the sequence stays sharded: all local heads on this rank's shard
    kernel = est.kernel_s
    group = k.kernel_head_group
    if group and group < heads:
        # One call per head group: each pays the per-call cost and runs fewer heads, at lower
        # per-head-token efficiency (kda/cost.py's kernel model).
        kernel *= (heads / group) * kda_kernel_s(group, tokens) / kda_kernel_s(heads, tokens)
    recurrent, gemm, comm = kernel + est.elementwise_s, est.gemm_s, est.comm_s
    if forward_passes(recipe, "kda") == 2:
        recurrent += cal.KDA_FORWARD_SHARE * recurrent
        gemm += gemm / 3
        comm += est.comm_s / 2  # the forward's half of the exchange's and the TP gather's bytes
    if frozen_gemms(recipe):  # the frozen projections' weight gradients (a third of est's)
        gemm -= est.gemm_s / 3
    hw = scale(recipe)
    return recurrent * hw.memory + gemm * hw.gemm, comm


def kda_part(recipe: Recipe) -> Part:
    """The KDA layers: the cost model's layer (``kda_layer_s``) and what the block around it
    costs per row (its norm, casts and copies: the measured per-element rates over the hidden
    width and the rank's head width)."""
    m, k, p = recipe.model, recipe.kda, recipe.parallel
    n = m.layer_types().count("kda")
    if n == 0:
        return Part("KDA attention", 0, 0.0, 0.0)
    compute, comm = kda_layer_s(recipe)
    head_width = k.num_heads / p.tp * k.head_dim
    compute += (rows_of(recipe).cp * (m.hidden_size * cal.KDA_S_PER_ROW_ELEMENT
                                      + head_width * cal.KDA_S_PER_ROW_HEAD_ELEMENT)
                * recompute_share(recipe, "kda") * scale(recipe).memory)
    spans = recipe.cluster.cp_spans_nodes(p.tp, p.cp)
    link = "CP " + ("between nodes" if spans else "inside a node") + f", {k.cp_exchange}"
    compute, comm = n * compute, n * comm
    if recipe.train.lora.enabled:
        extra = lora_part_s(recipe, "kda", cal.GEMM_FLOP_PER_S)
        compute, comm = compute + extra[0], comm + extra[1]
    return Part("KDA attention", n, compute, comm, f"{link}; TP row gathers")


def _mean_selected(topk: int, first: int, last: int) -> float:
    """Mean over query positions first..last-1 of min(topk, position + 1): the tokens each
    query attends to (a query sees at most its own prefix)."""
    total = 0.0
    lo, hi = first, min(last, topk)  # positions with fewer than topk predecessors
    if hi > lo:
        total += (hi - lo) * (lo + 1 + hi) / 2
    total += max(0, last - max(first, topk)) * topk
    return total / max(1, last - first)


def dsa_core_s(recipe: Recipe) -> dict[str, float]:
    """The DSA attention core of the slowest rank per layer and step: the indexer (once under
    ``train.keep_dsa_selection`` with full recompute, else in every forward), the sparse
    attention forward in each forward pass and its backward (without the backward's kernel
    forward under the kernel's ``keep_attention_output``; the indexer, the backward and the
    forward scaled by their measured shares under its ``indexer_scores=fp8``,
    ``deterministic_backward`` and ``attention_forward=flashmla``: ``model.dsa.fused.*`` or
    ``model.dsa.latent.*``).
    The rank indexes ``q`` query rows: under the sequence split its balanced share of its CP
    rank's rows with all heads (``dsa.batch_rows.balanced_row_order``), else all its CP rank's
    rows; either way their mean position is the CP rank's, so the slowest rank is the one of
    the CP rank whose rows sit latest on average (``_latest_cp_rank_mean_position``)."""
    m, p, a = recipe.model, recipe.parallel, recipe.model.dsa
    T = recipe.data.seq_len
    rows = rows_of(recipe)
    q = rows.sp if a.attends_by_rows(p.tp, p.sequence_parallel) else rows.cp
    visible_pools = _latest_cp_rank_mean_position(recipe) / a.index_kpool
    selected = _mean_selected(a.index_topk, T - q, T) * cal.DSA_SELECTED_PER_TOPK
    passes = forward_passes(recipe, "dsa")
    kernel = priced_dsa_kernel(recipe)
    options = kernel.options_of(a)
    indexer = (q * visible_pools * a.index_num_heads * a.index_head_dim
               * cal.DSA_INDEXER_S_PER_SCORE_DIM * _indexer_runs(recipe))
    if options.indexer_scores == "fp8":
        indexer *= cal.DSA_FP8_INDEXER_SHARE
    work = rows.cp * a.num_heads // p.tp * selected  # the rank's (query, head) pairs
    rates = cal.DSA_KEPT_OUTPUT_S if options.keep_attention_output else cal.DSA_ATTENTION_S
    fwd, bwd = rates[kernel.rate_key]
    if isinstance(options, LatentOptions) and options.deterministic_backward:
        bwd *= cal.DSA_ORDERED_BACKWARD_SHARE
    if isinstance(options, LatentOptions) and options.attention_forward == "flashmla":
        fwd *= cal.DSA_FLASHMLA_FORWARD_SHARE
    # The indexer's score GEMM and the sparse attention are multiply-add bound.
    g = scale(recipe).gemm
    return {"indexer": indexer * g, "attention_fwd": passes * work * fwd * g,
            "attention_bwd": work * bwd * g}


def _indexer_runs(recipe: Recipe) -> int:
    """Indexer passes per DSA layer and step: once under full recompute with
    ``train.keep_dsa_selection``, else in every forward pass."""
    passes = forward_passes(recipe, "dsa")
    return 1 if (passes == 2 and recipe.train.keep_dsa_selection) else passes


def _latest_cp_rank_mean_position(recipe: Recipe) -> float:
    """The mean position of the rows of the CP rank whose rows sit latest on average: T / 2 in
    the zigzag layout (every CP rank pairs an early piece with a late one), the last CP rank's
    T - T / (2 cp) in the contiguous one."""
    T, cp = recipe.data.seq_len, recipe.parallel.cp
    return T / 2 if recipe.parallel.cp_layout == "zigzag" and cp > 1 else T - T / (2 * cp)


def unpriced_dsa_kernel(recipe: Recipe) -> str | None:
    """Why the step-time model cannot price this recipe's DSA layers, or None: its kernel
    (resolved: ``auto`` is refused) has no measured rates (``DSAKernel.rate_key``)."""
    if "dsa" not in recipe.model.layer_types():
        return None
    name = recipe.model.dsa.kernel
    if dsa_kernels.get(name).rate_key is not None:
        return None
    priced = " or ".join(n for n, cls in dsa_kernels.REGISTRY.items() if cls.rate_key is not None)
    return (f"model.dsa.kernel={name} has no measured step-time rates (DSAKernel.rate_key): "
            f"price the step with model.dsa.kernel={priced}")


def priced_dsa_kernel(recipe: Recipe) -> type[dsa_kernels.DSAKernel]:
    """The recipe's DSA kernel, whose measured rates (``DSAKernel.rate_key``) and options price
    the attention; refused (``ValueError``) where it has none (``unpriced_dsa_kernel``)."""
    why = unpriced_dsa_kernel(recipe)
    if why is not None:
        raise ValueError(why)
    return dsa_kernels.get(recipe.model.dsa.kernel)


def dsa_part(recipe: Recipe) -> Part:
    """The DSA layers: the attention core (``dsa_core_s``), the MLA projections (the rank's
    projection weights over its CP rank's rows: forward in each pass, backward 2x), and the
    collectives: the KV latent gathered over TP and CP, and inside TP either (the sequence
    split, ``GlmDSASelfAttention.forward_by_rows``) the q latent's all-to-all to the rank's
    share and the output's back, the projections' whole weights gathered (their gradients
    reduce-scattered) and the indexer's head weights once per pass, or (the heads split) under
    SP the input rows gathered before the projections, the output reduce-scattered after them
    (as every TP layer) and the indexer's [q latent | head weights] gathered once per pass."""
    m, p, a = recipe.model, recipe.parallel, recipe.model.dsa
    n = m.layer_types().count("dsa")
    if n == 0:
        return Part("DSA attention", 0, 0.0, 0.0)
    rows = rows_of(recipe)
    passes = forward_passes(recipe, "dsa")
    core = sum(dsa_core_s(recipe).values())
    proj = 2 * rows.cp * _layer_params(recipe, "dsa", n) * (passes + 2 - frozen_gemms(recipe))
    indexer_proj = 2 * rows.cp * _layer_params(recipe, "dsa_indexer", n) * passes  # frozen
    compute = (core + gemm_s(recipe, proj + indexer_proj)
               + cal.DSA_OTHER_S_PER_ROW * rows.cp * (passes + 2) / 4 * scale(recipe).memory)
    e = act_bytes(recipe)
    comm = 0.0
    tp_link = group_link(recipe, 1, p.tp)
    cp_link = group_link(recipe, p.tp, p.cp)
    remote = (p.tp - 1) / p.tp  # of what a TP collective brings, what comes from other ranks
    latent = (a.kv_lora_rank + a.qk_rope_head_dim + a.index_head_dim) * e
    if p.tp > 1:
        comm += (passes + 1) * seconds(rows.cp * latent * remote, tp_link)
    if p.cp > 1:
        comm += (passes + 1) * seconds(rows.whole * latent * (p.cp - 1) / p.cp, cp_link)
    if a.attends_by_rows(p.tp, p.sequence_parallel):
        to_share, back = rows.sp * a.q_lora_rank * e, rows.sp * m.hidden_size * e
        comm += (passes + 1) * (seconds(to_share * remote, tp_link, a2a=True)
                                + seconds(back * remote, tp_link, a2a=True)
                                + seconds(dsa_projection_weights(recipe) * e * remote, tp_link))
        weights = rows.sp * a.index_num_heads * e
        comm += _indexer_runs(recipe) * seconds(weights * remote, tp_link, a2a=True)
        what = "q latent and output by all-to-all inside TP, whole weights gathered"
    elif p.tp > 1 and p.sequence_parallel:
        comm += (passes + 1) * 2 * seconds(rows.cp * m.hidden_size * e * remote, tp_link)
        queries = rows.cp * (a.q_lora_rank + a.index_num_heads) * e
        comm += _indexer_runs(recipe) * seconds(queries * remote, tp_link)
        what = "SP gather + reduce-scatter in TP, indexer queries gathered"
    else:
        what = "no TP collectives"
    compute, comm = n * compute, n * comm
    if recipe.train.lora.enabled:
        extra = lora_part_s(recipe, "dsa", cal.GEMM_FLOP_PER_S)
        compute, comm = compute + extra[0], comm + extra[1]
    return Part("DSA attention", n, compute, comm, f"KV latent gathered; {what}")


def dense_part(recipe: Recipe) -> Part:
    """The dense FFN layers: three GEMMs over the CP rank's rows with F/tp columns, and the SP
    gather and reduce-scatter around them."""
    m, p = recipe.model, recipe.parallel
    n = m.mlp_types().count("dense")
    if n == 0:
        return Part("dense MLP", 0, 0.0, 0.0)
    rows, D = rows_of(recipe), m.hidden_size
    passes = forward_passes(recipe, m.layer_types()[m.mlp_types().index("dense")])
    flops = 2 * rows.cp * 3 * D * (m.dense_ffn_hidden_size // p.tp) * (passes + 2 - frozen_gemms(recipe))
    comm = 0.0
    if p.tp > 1 and p.sequence_parallel:
        comm = (passes + 1) * 2 * seconds(rows.cp * D * act_bytes(recipe) * (p.tp - 1) / p.tp,
                                           group_link(recipe, 1, p.tp))
    hw = scale(recipe)
    compute = (flops / cal.DENSE_FLOP_PER_S * hw.gemm
               + rows.cp * D * cal.DENSE_S_PER_ROW_ELEMENT * (passes + 2) / 4 * hw.memory)
    compute, comm = n * compute, n * comm
    if recipe.train.lora.enabled:
        extra = lora_part_s(recipe, "dense", cal.DENSE_FLOP_PER_S)
        compute, comm = compute + extra[0], comm + extra[1]
    return Part("dense MLP", n, compute, comm, "SP gather + reduce-scatter in TP")


def mhc_part(recipe: Recipe) -> Part:
    """The hyper-connections, two per layer (maps, Sinkhorn, chunked projection, expand): per
    residual row at the measured rate, scaled by streams x hidden against the calibration's."""
    m = recipe.model
    rows = rows_of(recipe)
    N, D = m.hyper_connections.num_streams, m.hidden_size
    width = N * D / (cal.MHC_CALIBRATED_STREAMS * cal.MHC_CALIBRATED_HIDDEN)
    per_layer = []
    for kind in m.layer_types():
        passes = forward_passes(recipe, kind)
        # Measured under full recompute (two forwards, one backward); backward taken as 2x forward.
        per_layer.append(2 * rows.sp * width * cal.MHC_S_PER_ROW * (passes + 2) / 4
                         * scale(recipe).memory)
    return Part("mHC", m.num_layers, sum(per_layer), 0.0)


def head_part(recipe: Recipe) -> Part:
    """Embedding, final norm, output layer and loss: the loss over the CP rank's rows (gathered
    over TP under SP) and the rank's vocabulary shard, chunked (``train.loss_chunk_tokens``) or
    from the whole logits; the embedding per row."""
    m, p = recipe.model, recipe.parallel
    rows = rows_of(recipe)
    cells = rows.cp * (m.vocab_size / p.tp) * m.hidden_size / cal.HEAD_CALIBRATED_HIDDEN
    rate = cal.FUSED_LOSS_S_PER_CELL if recipe.train.loss_chunk_tokens else cal.UNFUSED_LOSS_S_PER_CELL
    hw = scale(recipe)
    compute = (cells * rate * hw.gemm
               + (rows.cp * m.hidden_size * cal.HEAD_S_PER_ROW_ELEMENT
                  + rows.sp * cal.EMBEDDING_S_PER_ROW) * hw.memory)
    comm = 0.0
    if p.tp > 1 and p.sequence_parallel:
        link = group_link(recipe, 1, p.tp)
        comm = 3 * seconds(rows.cp * m.hidden_size * act_bytes(recipe) * (p.tp - 1) / p.tp, link)
    return Part("embedding + head + loss", 0, compute, comm, "SP gathers in TP")


def estimate_step_time(recipe: Recipe) -> StepTime:
    """The step of one rank (every rank does the same work): parts, tokens and GPUs."""
    mb = recipe.data.micro_batch_size
    parts = [kda_part(recipe), dsa_part(recipe), moe_part(recipe), dense_part(recipe),
             mhc_part(recipe), head_part(recipe)]
    parts = [replace(x, compute_s=x.compute_s * mb, comm_s=x.comm_s * mb) for x in parts]
    parts += [optimizer_part(recipe), offload_part(recipe)]
    tokens = recipe.data_parallel_size * mb * recipe.data.seq_len
    return StepTime(parts=tuple(parts), tokens=tokens, gpus=recipe.run.num_workers)


def levers(recipe: Recipe, step: StepTime) -> list[Lever]:
    """What the next change would buy, each on the same model with one term changed, the
    largest saving first."""
    out = []
    moe = step.part("MoE")
    if moe.layers and recipe.parallel.ep * recipe.parallel.etp > 1:
        for name in PRICED_DISPATCHERS:
            if name == recipe.model.moe.dispatcher:
                continue
            other = with_dispatcher(recipe, name)
            alt = estimate_step_time(other)
            out.append(Lever(f"MoE {name} dispatcher", alt.step_s,
                             f"{moe_dispatch_s(other) * 1e3:.0f} ms per layer-pass against "
                             f"{moe_dispatch_s(recipe) * 1e3:.0f}"))
    dsa = step.part("DSA attention")
    if dsa.layers:
        core = sum(dsa_core_s(recipe).values()) * dsa.layers * recipe.data.micro_batch_size
        out.append(Lever("DSA attention core 2x faster", step.step_s - core / 2,
                         f"the core is {core:.1f} s of the step"))
    if step.comm_s:
        out.append(Lever("every collective hidden behind compute", step.overlapped_s,
                         f"communication {step.comm_s:.1f} s, compute {step.compute_s:.1f} s"))
    return sorted(out, key=lambda lever: lever.step_s)
