"""One GLM-5.3-Flash DSA layer at a rank's share of the 1M recipe, on one GPU.

The 1M recipe (TP8 x CP2 +SP) gives each rank, per DSA layer, either (``--split heads``) all
524,288 query rows of its CP rank with its 8 heads, or (``--split sequence``, an all-to-all inside
TP) its own 65,536 rows with all 64 heads; the keys are the whole 1,048,576-token sequence. This
runs that rank's work with the model's own functions on random data of GLM's sizes, stage by
stage (measured unless said otherwise):

* indexer: pooled keys (``pools.pooled_keys``), per query block the indexer scores and
  top-k (``pool_topk.fused_block_topk`` on our Triton scores, ``ops/index_scores.py``, and
  the floor's exact top-k, ``ops/threshold_topk.py``; or the torch ``blocked_pool_topk``; the last
  block is also scored by megatron-core's TileLang indexer kernel and its top-k taken by
  ``torch.topk``, for their times) and the token indices (``pools.pool_token_indices``), the
  blocks queued without host syncs as in the layer (``pool_topk.DeferredRows``);
* sparse attention: ``fused_sparse_mla.fused_absorbed_sparse_mla`` on megatron-core's TileLang
  kernels (``--kernel fused``) or ours (``latent``, ``ops/latent/``), or
  ``sparse_mla.absorbed_sparse_mla`` (torch), forward and backward; the kv up projection and its
  absorption are inside it;
* projections: the layer's other linear layers at the rank's share, as
  ``torch.nn.functional.linear`` in bf16 in the layer's order (``projection_gemms``), forward
  and backward: under ``heads`` megatron's column-parallel q down, kv down and q up over the CP
  rank's rows with 1/8 of the widths and the row-parallel output projection; under
  ``sequence`` each with its whole weight on the rank's own 65,536 rows
  (``GlmDSASelfAttention.forward_by_rows``: the same FLOPs); and the frozen indexer's wq_b, wk,
  kpool gate and head weights, forward only, on the rank's own rows (all the CP rank's rows
  under ``heads``);
* TP exchanges of the sequence split, modelled (one GPU has no peers): in each forward the q
  latent's all-to-all to the rank's share, the output's back to the SP rows and the all-gathers
  of the five projections' whole weights; the backward moves the gradients the other way and
  reduce-scatters the weight gradients; once per step the indexer's head weights of the share
  (``exchange_bytes``). Each costs bytes / bandwidth (all-to-all or ring) + latency of
  ``glm53_flash_1m``'s ``cluster.intra_node`` link (as the step-time model prices it).

The rank is CP rank 0 of a zigzag layout (its rows: the first and the last quarter of the
sequence); with ``--split sequence`` it is the last TP rank's share of that CP rank's rows as the
layer takes them (``--tp-rows balanced``, ``batch_rows.balanced_row_order``: a piece of each
quarter, every TP rank's queries on average where the CP rank's are), or (``slice``, the layer
before it) its contiguous SP slice, the rows nearest the end (the most visible pools: that TP
rank set the step). One step under full recompute is the
checkpointed forward, the recompute forward and the backward. The attention core's step,
``step_ms_full_recompute``, is indexer + 2 x attention forward + attention backward (the indexer
has no backward, and the recompute attends with the forward's kept selection:
``train.keep_dsa_selection``; ``step_ms_reselecting`` adds the second indexer pass of a recompute
that selects again). The projections' step is 2 x their forward + their backward + the indexer's
projections once (they belong to the one indexer pass); the exchanges as above.
``layer_step_ms`` adds the three. Not included: under ``heads`` the collectives of megatron's TP
linears (per rank and pass: the all-gather of the input's SP rows before the down projections,
3.5 GiB received; the down projections' widths gathered and scattered to the SP rows; the
all-gather of q up's input rows, 1.3 GiB; the output projection's reduce-scatter, 3.5 GiB);
for both splits the KV latent's all-gathers over TP and CP, and the norms between the
projections.

FLOPs, for TFLOP/s: a GEMM's forward 2 x M x N x K, its backward (input and weight gradients)
twice that; the sparse attention, in the convention of megatron-core's 576-wide kernels
(512-wide latent + 64 rope), used for both kernel sets so they compare:
2 x heads x selected x (576 + 512) per query forward, 2 x heads x selected x (2 x 512 + 3 x 576)
backward, with selected the mean number of keys a query attends (``mean_selected``); the indexer,
its scores only: 2 x 32 x 128 per (query, visible pool), a query at position p seeing
floor((p + 1) / 4) complete pools.

After the timed iterations the forward kernel runs alone on what the layer's forward handed it
(absorbed queries, the kernels' latent, int32 indices, made beforehand; not for ``torch``):
``attn_fwd_kernel_ms`` in ``best`` and ``forward_over_kernel``, the layer's forward over it (what
the wrapper adds around the kernel), both from one process.

``--kernel`` takes a comma list: each kernel set runs in turn on the same inputs, and a table
gives each stage's ms and TFLOP/s per set and the ms ratio to the first. ``--json`` writes the
summary of one set, or ``{"runs": [summary, ...]}`` for several; a summary's ``best`` is the
iteration with the shortest ``layer_step_ms`` and ``tflop_s`` the TFLOP/s of its stages (keyed
as its ms).

``--indexer-scores fp8`` scores with FP8 products (``model.dsa.{fused,latent}.indexer_scores``)
and ``--deterministic`` runs our backward with its latent gradient summed in a fixed order
(``model.dsa.latent.deterministic_backward``). Each summary says whether the two timed passes
(the same inputs) gave bitwise-equal gradients (``gradients_repeat_bitwise``).
``--attention-forward tilelang,flashmla`` runs the latent set once per forward kernel
(``model.dsa.latent.attention_forward``; flashmla needs vLLM's FlashMLA build), labelled
``latent+flashmla``.

``--tp-rows balanced,slice`` runs every set on both row choices in turn (``@slice`` labels).
``--latent-configs '[{}, {"forward": {"warp_specialized": true, "ping_pong": true},
"backward": {"stacked": true, "channel_split": 4, "store_split": 1}}]'`` runs the latent set
(with our forward) once per entry, each with those tunings of our kernels (``latent#1``, ...);
``"ping_pong": true`` runs the ping-pong forward (``bench/experiments/``).

``--projection-shapes`` times only the projections' step, at megatron's head-split shapes and at
those of the layer on rows (``projection_shapes``), and stops.

Usage (CUDA + tilelang):  python3 bench/dsa_rank_share.py --split sequence [--kernel latent,fused]
                          [--keep-output] [--whole-row-topk] [--indexer-scores fp8] [--deterministic]
                          [--attention-forward tilelang,flashmla] [--tp-rows balanced,slice]
                          python3 bench/dsa_rank_share.py --projection-shapes [--json FILE]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from skyrl_megatron_kda.config import DSAConfig
from skyrl_megatron_kda.distributed.cp_layout import rank_rows
from skyrl_megatron_kda.dsa.batch_rows import balanced_row_order
from skyrl_megatron_kda.dsa.fused_sparse_mla import (
    absorbed_queries,
    fused_absorbed_sparse_mla,
    kernel_indices,
    kernel_latent,
)
from skyrl_megatron_kda.dsa.ops.fused import fused_sparse_mla_ops
from skyrl_megatron_kda.dsa.ops.latent.backward import backward_program
from skyrl_megatron_kda.dsa.ops.latent.forward import forward_program
from skyrl_megatron_kda.dsa.pools import (
    document_starts,
    index_violations,
    pool_starts,
    pooled_keys,
)
from skyrl_megatron_kda.dsa import pool_topk
from skyrl_megatron_kda.dsa.pool_topk import (
    DeferredRows,
    PoolCandidates,
    blocked_pool_topk,
    fused_block_topk,
)
from skyrl_megatron_kda.dsa.sparse_mla import absorbed_sparse_mla, split_kv_up_weight
from skyrl_megatron_kda.dsa.ops.threshold_topk import (
    CANDIDATES_PER_PICK,
    grouped_compact_kernel,
    threshold_topk,
)
from skyrl_megatron_kda.recipes import load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for its experiments
from experiments.ping_pong_forward import latent_ops  # noqa: E402

RECIPE = "glm53_flash_1m"
HEADS, TP, CP = 64, 8, 2
HIDDEN, Q_LORA, LATENT, DN, DV = 4096, 1536, 512, 256, 256
SCALE = DN ** -0.5  # the attention's softmax scale
IDX_HEADS, IDX_DIM, TOPK, KPOOL = 32, 128, 2048, 4
MEGATRON_QK_WIDTH = 576  # megatron-core's sparse MLA kernels: the 512-wide latent + 64 rope
BF16 = 2  # bytes
PASSES = 3  # a step under full recompute: the checkpointed forward, the recompute, the backward
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def rank_positions(keys: int, split: str, tp_rows: str = "balanced") -> torch.Tensor:
    """Natural positions of the rank's query rows: CP rank 0's (heads), or the last TP rank's
    share of them (sequence: ``tp_rows`` balanced, as the layer takes them, or its SP slice)."""
    cu = torch.tensor([0, keys])
    if split == "heads":
        return rank_rows(cu, CP, TP, 0, 0, False, "zigzag")
    if tp_rows == "slice":
        return rank_rows(cu, CP, TP, 0, TP - 1, True, "zigzag")
    rows = rank_rows(cu, CP, TP, 0, 0, False, "zigzag")
    return rows[balanced_row_order(rows.numel(), TP).view(TP, -1)[TP - 1]]


def make_inputs(keys: int, split: str, dev, tp_rows: str = "balanced") -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    pos = rank_positions(keys, split, tp_rows).to(dev)
    heads = HEADS // TP if split == "heads" else HEADS
    bf = dict(device=dev, dtype=torch.bfloat16)
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, device=dev) * s).to(torch.bfloat16)
    latent = rnd(keys, LATENT)
    latent = (latent.float() / latent.float().pow(2).mean(-1, keepdim=True).sqrt()).to(**bf)
    return dict(
        pos=pos, heads=heads,
        q_nope=rnd(pos.numel(), heads, DN, s=0.5).requires_grad_(),
        latent=latent.requires_grad_(),
        weight=rnd(heads * (DN + DV), LATENT, s=LATENT ** -0.5).requires_grad_(),
        idx_q=rnd(pos.numel(), IDX_HEADS, IDX_DIM),
        idx_w=torch.rand(pos.numel(), IDX_HEADS, generator=g, device=dev) * IDX_HEADS ** -0.5,
        idx_k=rnd(keys, IDX_DIM), gate=rnd(keys, IDX_DIM), ape=rnd(KPOOL, IDX_DIM),
    )


def indexer(x: dict, keys: int, kernel: str, block: int, kernels) -> torch.Tensor:
    """The layer's indexer loop (``AbsorbedKernel.indices``) on the share's inputs."""
    dev = x["pos"].device
    cu = torch.tensor([0, keys], device=dev)
    starts = pool_starts(cu, KPOOL)
    pool_k = pooled_keys(x["idx_k"], x["gate"], x["ape"], starts, KPOOL)
    if kernel != "torch":
        pool_k = kernels.index_keys(pool_k)  # once per pass, as the layer does
    candidates = PoolCandidates(starts, x["pos"], document_starts(cu, x["pos"]), KPOOL, block)
    n, n_select = x["pos"].numel(), TOPK // KPOOL
    out = torch.empty(n, TOPK + KPOOL - 1, dtype=torch.int32, device=dev)
    later = DeferredRows()
    for q0 in range(0, n, block):
        rows = slice(q0, min(q0 + block, n))
        q, w = x["idx_q"][rows], x["idx_w"][rows]
        pools = torch.empty(q.shape[0], n_select, dtype=torch.long, device=dev)
        if kernel != "torch":
            fused_block_topk(q, w, pool_k, candidates, rows, n_select, kernels.index_scores,
                             kernels.index_group, pools, later)
        else:
            pools.copy_(blocked_pool_topk(q, w, pool_k, starts, x["pos"][rows],
                                          candidates.doc_start[rows], KPOOL, n_select,
                                          query_block=block, pool_block=4096))
        later.then(partial(candidates.write_tokens, out[rows], pools, rows))
    later.finish()
    return out


def indexer_split(x: dict, keys: int, block: int, kernels) -> dict:
    """Where the fused indexer's time goes, on one block of queries at the sequence's last
    positions (the most visible pools; the rank's last queries of the indexer, as positions):
    the TileLang score kernel against ``torch.topk`` on its [block, pools] scores."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_fwd import (
        indexer_fwd_interface,  # needs CUDA and tilelang: imported here so the module loads on CPU
    )

    dev = x["pos"].device
    starts = pool_starts(torch.tensor([0, keys], device=dev), KPOOL)
    pool_k = pooled_keys(x["idx_k"], x["gate"], x["ape"], starts, KPOOL)
    q, w = x["idx_q"][-block:], x["idx_w"][-block:]
    pos = torch.arange(keys - q.shape[0], keys, device=dev)
    ke = torch.searchsorted(starts + KPOOL - 1, pos, right=True).to(torch.int32)
    ks = torch.zeros_like(ke)
    megatron, t_megatron = timed(lambda: indexer_fwd_interface(q, pool_k, w, ks, ke))
    k, group = TOPK // KPOOL, kernels.index_group
    for _ in range(2):  # the first call compiles
        (scores, maxima), t_scores = timed(lambda: kernels.index_scores(q, pool_k, w, ks, ke))
        megatron, t_megatron = timed(lambda: indexer_fwd_interface(q, pool_k, w, ks, ke))
        (best, ids), t_threshold = timed(lambda: threshold_topk(scores, maxima, group, k))
        _, t_topk = timed(lambda: scores.topk(k, dim=-1, sorted=False))
    floor = maxima.topk(k, dim=-1).values[:, -1]
    candidates = grouped_compact_kernel(scores, maxima, group, floor,
                                        CANDIDATES_PER_PICK * k)[2].float()
    same = torch.equal(best.sort(-1).values, scores.topk(k, dim=-1).values.sort(-1).values)
    finite = torch.isfinite(megatron)
    diff = float((scores[finite] - megatron[finite]).norm() / megatron[finite].norm())
    return dict(queries=block, pools=pool_k.shape[0], scores_ms=t_scores,
                megatron_tilelang_scores_ms=t_megatron, torch_topk_ms=t_topk,
                threshold_topk_ms=t_threshold, threshold_equals_topk=same,
                candidates_mean=float(candidates.mean()), candidates_max=float(candidates.max()),
                scores_vs_megatron_rel=diff,
                same_inf=bool(torch.equal(torch.isinf(scores), torch.isinf(megatron))))


def attention(x: dict, idx: torch.Tensor, kernel: str, block: int, kernels,
              keep_output: bool = False) -> torch.Tensor:
    if kernel != "torch":
        return fused_absorbed_sparse_mla(x["q_nope"], x["latent"], x["weight"], idx, SCALE, DV,
                                         block, kernels, keep_output=keep_output)
    return absorbed_sparse_mla(x["q_nope"], x["latent"], x["weight"], idx, SCALE, DV, block)


def kernel_forward_inputs(x: dict, idx: torch.Tensor, block: int, kernels) -> list[tuple]:
    """What the layer's forward hands its forward kernel, per query block: (absorbed queries, the
    kernels' latent, int32 indices), made here once so that the kernel can be timed alone."""
    w_uk, _ = split_kv_up_weight(x["weight"], x["heads"], DN, DV)
    with torch.no_grad():
        kv = kernel_latent(x["latent"], kernels)
        return [(absorbed_queries(x["q_nope"][b0:b0 + block], w_uk, kernels), kv,
                 kernel_indices(idx[b0:b0 + block])) for b0 in range(0, idx.shape[0], block)]


def kernel_forward_ms(x: dict, idx: torch.Tensor, block: int, kernels) -> float:
    """The forward kernel alone over the layer's query blocks (the shorter of two timings), on
    inputs made beforehand: the layer's forward over it is what the wrapper adds around the
    kernel (absorption, value projection, kept tensors)."""
    inputs = kernel_forward_inputs(x, idx, block, kernels)

    def run():
        for q, kv, i in inputs:
            kernels.forward(q, kv, i, SCALE)

    return min(timed(run)[1] for _ in range(2))


def timed(fn):
    """``fn()`` and its wall time in ms, the GPU's queued work drained before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


@dataclass(frozen=True)
class MLASizes:
    """One DSA layer's widths (GLM-5.3-Flash's by default) and the TP degree it is split over."""

    hidden: int = HIDDEN
    q_lora: int = Q_LORA
    kv_lora: int = LATENT
    heads: int = HEADS
    qk: int = DN
    v: int = DV
    idx_heads: int = IDX_HEADS
    idx_dim: int = IDX_DIM
    tp: int = TP


@dataclass(frozen=True)
class Gemm:
    """One linear layer: ``rows`` x ``fan_in`` -> ``fan_out`` on the input named ``source`` (the
    layers that read one tensor share it, from its first ``rows``); only trainable ones have a
    backward."""

    name: str
    source: str
    rows: int
    fan_in: int
    fan_out: int
    trainable: bool = True

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.fan_in * self.fan_out


def projection_gemms(cp_rows: int, own_rows: int, s: MLASizes = MLASizes(),
                     split: str = "heads") -> list[Gemm]:
    """The linear layers one rank runs for one DSA layer, in the layer's order, and the frozen
    indexer's on the rows it indexes (``own_rows``). ``heads``: megatron's column-parallel down
    and up projections over the CP rank's ``cp_rows`` with 1/tp of the widths, and the
    row-parallel output projection; ``sequence`` (``GlmDSASelfAttention.forward_by_rows``):
    every projection with its whole weight on the rank's own rows (the same FLOPs)."""
    if split == "sequence":
        rows, heads, q_lora, kv_lora = own_rows, s.heads, s.q_lora, s.kv_lora
    else:
        rows, heads, q_lora, kv_lora = cp_rows, s.heads // s.tp, s.q_lora // s.tp, s.kv_lora // s.tp
    return [
        Gemm("q_down", "hidden", rows, s.hidden, q_lora),
        Gemm("kv_down", "hidden", rows, s.hidden, kv_lora),
        Gemm("q_up", "q_compressed", rows, s.q_lora, heads * s.qk),
        Gemm("indexer_wq_b", "q_compressed", own_rows, s.q_lora, s.idx_heads * s.idx_dim, False),
        Gemm("indexer_wk", "hidden", own_rows, s.hidden, s.idx_dim, False),
        Gemm("indexer_kpool_gate", "hidden", own_rows, s.hidden, s.idx_dim, False),
        Gemm("indexer_weights", "hidden", own_rows, s.hidden, s.idx_heads, False),
        Gemm("out", "attention_output", rows, heads * s.v, s.hidden),
    ]


def time_projections(gemms: list[Gemm], dev) -> dict:
    """Each GEMM's forward in turn (the frozen ones without autograd), then the trainable ones'
    backward in one call, on random bf16 inputs (requiring grad) and weights of std fan_in**-0.5.
    Everything it allocates is freed on return."""
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape, s=1.0: torch.randn(*shape, generator=g, device=dev,
                                             dtype=torch.bfloat16).mul_(s)
    widths = {m.source: m.fan_in for m in gemms}
    rows = {src: max(m.rows for m in gemms if m.source == src) for src in widths}
    sources = {src: rnd(rows[src], width).requires_grad_() for src, width in widths.items()}
    weights = {m.name: rnd(m.fan_out, m.fan_in, s=m.fan_in ** -0.5).requires_grad_(m.trainable)
               for m in gemms}
    outs, t = [], dict(proj_fwd_ms=0.0, indexer_proj_ms=0.0)
    for m in gemms:
        x = sources[m.source]
        # A slice in the graph would copy the whole input's gradient in backward: slice only
        # what is read in part.
        x = x if m.rows == x.shape[0] else x[:m.rows]
        with torch.set_grad_enabled(m.trainable):
            out, ms = timed(lambda: F.linear(x, weights[m.name]))
        if m.trainable:
            outs.append(out)
        t["proj_fwd_ms" if m.trainable else "indexer_proj_ms"] += ms
    grads = [torch.ones_like(o) for o in outs]
    _, t["proj_bwd_ms"] = timed(lambda: torch.autograd.backward(outs, grads))
    return t


def projection_shapes(cp_rows: int, own_rows: int, dev, s: MLASizes = MLASizes(),
                      repeats: int = 2) -> dict:
    """The projections' step (2 x forward + backward + the indexer's once) at megatron's
    head-split shapes and at the shapes of the layer on rows, the same FLOPs; each the last of
    ``repeats`` runs (the first warms up cuBLAS's choices)."""
    out = {}
    for split in ("heads", "sequence"):
        gemms = projection_gemms(cp_rows, own_rows, s, split)
        for _ in range(repeats):
            t = time_projections(gemms, dev)
        out[split] = dict(t, projections_step_ms=projections_step(t))
    out["sequence_over_heads"] = (out["sequence"]["projections_step_ms"]
                                  / out["heads"]["projections_step_ms"])
    return out


def exchange_bytes(cp_rows: int, s: MLASizes = MLASizes()) -> dict[str, float]:
    """Bytes one rank receives inside TP in one pass of the sequence split's layer
    (``GlmDSASelfAttention.forward_by_rows``): its share's q latent (``rows_in``) and the
    output rows that come back to it (``rows_out``), each (tp - 1) / tp of its 1/tp of the CP
    rank's rows; the whole weights of the layer's five trainable projections gathered
    (``weights``, (tp - 1) / tp of each); and once per step the indexer's head weights of the
    share (``index_weights``, the recompute keeps the selection)."""
    share, remote = cp_rows / s.tp, (s.tp - 1) / s.tp
    weights = (s.hidden * (s.q_lora + s.kv_lora) + s.q_lora * s.heads * s.qk
               + s.kv_lora * s.heads * (s.qk + s.v) + s.heads * s.v * s.hidden)
    return dict(rows_in=share * s.q_lora * BF16 * remote, rows_out=share * s.hidden * BF16 * remote,
                weights=weights * BF16 * remote, index_weights=share * s.idx_heads * BF16 * remote)


def all_to_all_model(cp_rows: int, split: str, link, s: MLASizes = MLASizes()) -> dict:
    """The sequence split's exchanges inside TP per step, modelled: in each of the two
    forwards the q latent's all-to-all to the share, the output's back and the weights'
    all-gathers; in the backward the same rows the other way and the weight gradients'
    reduce-scatters (the same bytes); the indexer's head weights once. Each exchange costs
    bytes / bandwidth (all-to-all or ring) + ``link.latency_us``. The heads split's
    collectives are megatron's TP linears' (not counted here, as for every TP layer)."""
    if split == "heads":
        return dict(all_to_all_model_ms=0.0, all_to_all_gib=0.0)
    b = exchange_bytes(cp_rows, s)
    a2a = lambda n: n / (link.a2a_bandwidth_gib_s * 2**30) + link.latency_us * 1e-6
    ring = lambda n: n / (link.bandwidth_gib_s * 2**30) + link.latency_us * 1e-6
    seconds = PASSES * (a2a(b["rows_in"]) + a2a(b["rows_out"]) + ring(b["weights"]))
    seconds += a2a(b["index_weights"])
    total = PASSES * (b["rows_in"] + b["rows_out"] + b["weights"]) + b["index_weights"]
    return dict(all_to_all_model_ms=seconds * 1e3, all_to_all_gib=total / 2**30)


def attention_flops(queries: int, heads: int, selected: float) -> tuple[float, float]:
    """Forward and backward FLOPs of the sparse attention, counted as for megatron-core's 576-wide
    kernels (QK over 576, PV over 512; backward: dV and dP over 512, dQ, dK and QK again over
    576)."""
    per_key = 2.0 * queries * heads * selected
    return (per_key * (MEGATRON_QK_WIDTH + LATENT),
            per_key * (2 * LATENT + 3 * MEGATRON_QK_WIDTH))


def indexer_score_flops(pos: torch.Tensor) -> float:
    """The indexer's score FLOPs: each query (at position ``pos`` of one document from 0) against
    each complete pool it sees, over all index heads."""
    pools = (pos.long() + 1) // KPOOL
    return 2.0 * IDX_HEADS * IDX_DIM * float(pools.sum())


def stage_flops(attn: tuple[float, float], indexer: float, gemms: list[Gemm]) -> dict:
    """FLOPs per stage, keyed by the stage's time in an iteration's results."""
    fwd, bwd = attn
    trainable = sum(m.flops for m in gemms if m.trainable)
    frozen = sum(m.flops for m in gemms if not m.trainable)
    core = indexer + 2 * fwd + bwd
    projections = 2 * trainable + 2 * trainable + frozen  # two forwards, a backward, the indexer's
    return dict(indexer_ms=indexer, attn_fwd_ms=fwd, attn_fwd_kernel_ms=fwd, attn_bwd_ms=bwd,
                step_ms_full_recompute=core,
                proj_fwd_ms=trainable, proj_bwd_ms=2 * trainable, indexer_proj_ms=frozen,
                projections_step_ms=projections, layer_step_ms=core + projections)


STAGES = (  # printed name, key of its time
    ("indexer", "indexer_ms"),
    ("attention forward", "attn_fwd_ms"),
    ("attention forward, kernel alone", "attn_fwd_kernel_ms"),
    ("attention backward", "attn_bwd_ms"),
    ("core step, full recompute", "step_ms_full_recompute"),
    ("projections forward", "proj_fwd_ms"),
    ("projections backward", "proj_bwd_ms"),
    ("indexer projections", "indexer_proj_ms"),
    ("projections step", "projections_step_ms"),
    ("TP exchanges step (modelled)", "all_to_all_model_ms"),
    ("layer step", "layer_step_ms"),
)


def projections_step(proj: dict) -> float:
    """The projections' step under full recompute: their forward twice, their backward and the
    indexer's projections once (the one indexer pass)."""
    return 2 * proj["proj_fwd_ms"] + proj["proj_bwd_ms"] + proj["indexer_proj_ms"]


def layer_step(core: dict, proj: dict, a2a: dict) -> dict:
    """The projections' and the layer's step under full recompute, from one iteration's times:
    ``projections_step``, the modelled TP exchanges and the attention core's step."""
    projections = projections_step(proj)
    return dict(projections_step_ms=projections, layer_step_ms=projections
                + a2a["all_to_all_model_ms"] + core["step_ms_full_recompute"])


def run_kernel(x: dict, a, kernel: str, forward: str, gemms: list[Gemm], a2a: dict,
               tp_rows: str = "balanced", tuning: tuple[int, dict] = (0, {})) -> dict:
    """``a.iters`` timed iterations (after one that compiles) of the layer's step on one kernel
    set (``forward``: the latent set's forward kernel; ``tuning``: the index and entry of
    ``--latent-configs`` it runs) for the rows ``tp_rows`` chose; its summary, with the best
    iteration's times and TFLOP/s."""
    options = {"indexer_scores": a.indexer_scores}
    if a.deterministic:
        options["ordered"] = True
    if kernel == "latent":
        options["attention_forward"] = forward
        options["forward_config"] = tuning[1].get("forward")
        options["backward_config"] = tuning[1].get("backward")
    kernels = ({"fused": fused_sparse_mla_ops, "latent": latent_ops}[kernel](**options)
               if kernel != "torch" else None)
    rows = x["pos"].numel()
    log(f"{kernel} kernel, split {a.split}: {rows} queries x {x['heads']} heads over {a.keys} keys")
    results, first_grads, repeat_equal = [], None, None
    for it in range(a.iters + 1):  # the first pass compiles the TileLang kernels
        core, idx, grads = core_step(x, a, kernel, kernels)
        # Do two timed passes (the same inputs) give bitwise-equal gradients?
        if it == 1:
            first_grads = grads
        elif it == 2:
            repeat_equal = all(torch.equal(g1, g2) for g1, g2 in zip(first_grads, grads))
            first_grads = None
        del grads
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        proj = time_projections(gemms, x["pos"].device)
        r = dict(iter=it, **core, **proj, **a2a, **layer_step(core, proj, a2a),
                 projections_peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)
        log(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
        results.append(r)
    split = indexer_split(x, a.keys, a.indexer_block, kernels) if kernels else {}
    violations = index_violations(idx.long(), x["pos"], torch.zeros_like(x["pos"]))
    kept = float((idx >= 0).sum(-1).float().mean())
    best = min(results[1:], key=lambda r: r["layer_step_ms"]) if a.iters else results[0]
    if kernels:
        best["attn_fwd_kernel_ms"] = kernel_forward_ms(x, idx, a.query_block, kernels)
    flops = stage_flops(attention_flops(rows, x["heads"], kept), indexer_score_flops(x["pos"]),
                        gemms)
    label = kernel if forward == "tilelang" else f"{kernel}+{forward}"
    label += f"#{tuning[0]}" if tuning[1] else ""
    return dict(kernel=kernel, attention_forward=forward, latent_config=tuning[1],
                label=label if tp_rows == "balanced" else f"{label}@{tp_rows}",
                split=a.split, tp_rows=tp_rows, keep_output=a.keep_output,
                whole_row_topk=a.whole_row_topk, indexer_scores=a.indexer_scores,
                deterministic=a.deterministic, gradients_repeat_bitwise=repeat_equal,
                queries=rows,
                heads=x["heads"], keys=a.keys,
                query_block=a.query_block, indexer_block=a.indexer_block,
                index_violations=violations, mean_selected=kept,
                visible_pools=float(((x["pos"].long() + 1) // KPOOL).sum()), best=best,
                forward_over_kernel=(best["attn_fwd_ms"] / best["attn_fwd_kernel_ms"]
                                     if kernels else None),
                tflop_s={k: f / (best[k] * 1e9) for k, f in flops.items() if k in best},
                last_indexer_block=split,
                first_ms=results[0]["step_ms_full_recompute"])


def core_step(x: dict, a, kernel: str, kernels) -> tuple[dict, torch.Tensor, list]:
    """One step of the attention core: its times, the selection and the inputs' gradients (taken
    off the inputs; the output is freed before it returns)."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        idx, t_index = timed(lambda: indexer(x, a.keys, kernel, a.indexer_block, kernels))
    out, t_fwd = timed(lambda: attention(x, idx, kernel, a.query_block, kernels, a.keep_output))
    grad = torch.ones_like(out)
    _, t_bwd = timed(lambda: out.backward(grad))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    grads = [x[t].grad for t in ("q_nope", "latent", "weight")]
    for t in ("q_nope", "latent", "weight"):
        x[t].grad = None
    # Under full recompute the forward runs twice; the indexer once (train.keep_dsa_selection
    # keeps its selection for the recompute) or twice (false).
    step = t_index + 2 * t_fwd + t_bwd
    return dict(indexer_ms=t_index, attn_fwd_ms=t_fwd, attn_bwd_ms=t_bwd,
                step_ms_full_recompute=step, step_ms_reselecting=step + t_index,
                peak_gib_above_inputs=peak, inputs_gib=base / 2**30), idx, grads


def stage_table(summaries: list[dict]) -> str:
    """Each stage's best ms and TFLOP/s per kernel set, and its ms over the first set's."""
    first = summaries[0]
    head = f"{'stage':<32}" + "".join(f"{s['label'] + ' ms':>18}{'TFLOP/s':>9}" for s in summaries)
    head += "".join(f"{s['label'] + '/' + first['label']:>24}" for s in summaries[1:])
    lines = [head]
    for name, key in STAGES:
        line = f"{name:<32}"
        for s in summaries:
            ms, tflops = s["best"].get(key), s["tflop_s"].get(key)
            line += f"{ms:>18.1f}" if ms is not None else f"{'-':>18}"
            line += f"{tflops:>9.1f}" if tflops and ms is not None else f"{'-':>9}"
        for s in summaries[1:]:
            base, ms = first["best"].get(key), s["best"].get(key)
            line += f"{ms / base:>24.3f}" if base and ms is not None else f"{'-':>24}"
        lines.append(line)
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1 << 20)
    p.add_argument("--split", choices=["heads", "sequence"], default="sequence")
    p.add_argument("--kernel", default="fused",
                   help="fused, latent or torch, or a comma list of them to run in turn")
    defaults = DSAConfig()
    p.add_argument("--query-block", type=int, default=defaults.fused.query_block,
                   help="attention queries per call (torch: per block)")
    p.add_argument("--indexer-block", type=int, default=defaults.indexer_query_block)
    p.add_argument("--queries", type=int, default=0,
                   help="only the first N rows (0: all); the projections and all-to-alls "
                        "shrink alike")
    p.add_argument("--keep-output", action="store_true",
                   help="model.dsa.{fused,latent}.keep_attention_output: the backward reads the "
                        "forward's kept kernel output instead of running the kernel forward again")
    p.add_argument("--whole-row-topk", action="store_true",
                   help="the indexer's top-k as torch.topk over each whole row of scores (what "
                        "threshold_topk replaced), for a comparison in one call")
    p.add_argument("--indexer-scores", choices=["bf16", "fp8"], default="bf16",
                   help="model.dsa.{fused,latent}.indexer_scores")
    p.add_argument("--deterministic", action="store_true",
                   help="model.dsa.latent.deterministic_backward")
    p.add_argument("--attention-forward", default="tilelang",
                   help="model.dsa.latent.attention_forward: tilelang, flashmla, or "
                        "a comma list of them to run in turn")
    p.add_argument("--latent-configs", default="[{}]",
                   help='the latent set once per entry of this JSON list, each {"forward": '
                        '{...}, "backward": {...}} with our forward and backward programs\' '
                        'tuning keywords (forward_program, backward_program; {}: the defaults), '
                        'labelled latent#N for the N-th entry that is not {}')
    p.add_argument("--tp-rows", default="balanced",
                   help="--split sequence: the rank's rows as the layer takes them (balanced) or "
                        "its contiguous SP slice (slice, the layer before), or both in turn")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--json", default="")
    p.add_argument("--projection-shapes", action="store_true",
                   help="only the projections' step at the heads split's shapes and at the "
                        "sequence split's (the layer on rows), then stop")
    a = p.parse_args()
    names = a.kernel.split(",")
    forwards = a.attention_forward.split(",")
    if unknown := set(forwards) - {"tilelang", "flashmla"}:
        p.error(f"--attention-forward {a.attention_forward}: {sorted(unknown)} not among "
                "tilelang, flashmla")
    if "flashmla" in forwards and "latent" not in names:
        p.error("--attention-forward flashmla needs --kernel latent")
    if unknown := set(names) - {"fused", "latent", "torch"}:
        p.error(f"--kernel {a.kernel}: {sorted(unknown)} not among fused, latent, torch")
    try:
        tunings = list(enumerate(json.loads(a.latent_configs)))
    except json.JSONDecodeError as e:
        p.error(f"--latent-configs is not JSON: {e}")
    programs = {"forward": forward_program, "backward": backward_program}
    for _, tuning in tunings:
        if not isinstance(tuning, dict) or set(tuning) - set(programs):
            p.error(f"--latent-configs entries are {{\"forward\": {{...}}, \"backward\": "
                    f"{{...}}}}, got {json.dumps(tuning)}")
        for part, keywords in tuning.items():
            known = set(inspect.signature(programs[part]).parameters) - {"heads", "dim", "topk",
                                                                         "scale"}
            known |= {"ping_pong"} if part == "forward" else set()  # bench/experiments/
            if unknown := set(keywords) - known:
                p.error(f"--latent-configs: {part} keywords {sorted(unknown)} not among "
                        f"{sorted(known)}")
    if "latent" not in names and tunings != [(0, {})]:
        p.error("--latent-configs needs --kernel latent")
    if a.whole_row_topk:
        pool_topk.floor_topk = lambda scores, maxima, group, k: (
            *scores.topk(k, dim=-1, sorted=False),
            torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device))
    if a.keep_output and "torch" in names:
        p.error("--keep-output needs --kernel fused or latent (the torch kernel keeps no output)")
    if a.deterministic and set(names) != {"latent"}:
        p.error("--deterministic needs --kernel latent")
    if a.indexer_scores == "fp8" and "torch" in names:
        p.error("--indexer-scores fp8 needs --kernel fused or latent")
    tp_rows = a.tp_rows.split(",")
    if unknown := set(tp_rows) - {"balanced", "slice"}:
        p.error(f"--tp-rows {a.tp_rows}: {sorted(unknown)} not among balanced, slice")
    if a.split == "heads" and tp_rows != ["balanced"]:
        p.error("--tp-rows takes the sequence split's rows; --split heads has every CP row")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernels and the timings are the GPU's)")
    if a.projection_shapes:
        result = projection_shapes(TP * (1 << 16), 1 << 16, torch.device("cuda"))
        log("projection shapes " + json.dumps(result))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    dev = torch.device("cuda")
    link = load_recipe(RECIPE, []).recipe.cluster.intra_node
    summaries = []
    for choice in tp_rows:
        x = make_inputs(a.keys, a.split, dev, choice)
        if a.queries:
            for k in ("pos", "q_nope", "idx_q", "idx_w"):
                x[k] = x[k][:a.queries].detach().requires_grad_(k == "q_nope")
        rows = x["pos"].numel()
        cp_rows = rows * TP if a.split == "sequence" else rows
        gemms = projection_gemms(cp_rows, rows, split=a.split)
        a2a = all_to_all_model(cp_rows, a.split, link)
        summaries += [run_kernel(x, a, name, forward, gemms, a2a, choice, tuning)
                      for name in names
                      for forward in (forwards if name == "latent" else ["tilelang"])
                      for tuning in (tunings if name == "latent" and forward == "tilelang"
                                     else [(0, {})])]
        del x
    for summary in summaries:
        log("summary " + json.dumps(summary))
    print(stage_table(summaries), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summaries[0] if len(summaries) == 1 else {"runs": summaries}, f, indent=1)


if __name__ == "__main__":
    main()
