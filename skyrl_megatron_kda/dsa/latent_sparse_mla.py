"""Sparse attention over GLM's NoPE KV latent: our TileLang forward and backward kernels
(``model.dsa.kernel=latent``).

megatron-core 0.19.2's sparse-MLA kernels are DeepSeek-V3.2's: 512 latent + 64 RoPE channels,
so GLM's 512-wide NoPE latent and its absorbed queries are zero-padded to 576 around them, and
its 128-thread backward splits the 64 heads over two blocks that each gather the same latent
rows and each add their gradient. These kernels are written for GLM's shape instead:

* one width ``D`` (the latent, 512) for the scores and the values: no padding, no tail GEMMs;
* every head of a query in one thread block (up to 64; more in groups of 64), so each selected
  latent row is gathered once per query and its gradient added once;
* the forward, for whole 64-head groups, warp-specialised: one warpgroup gathers the selected
  latent rows while two take the products and the softmax (``_warp_specialized_forward``);
* the backward's gathers pipelined in two stages, its fp32 latent gradient staged through
  shared memory in parts for the atomics;
* the forward writes the log-sum-exp and the backward takes it and ``delta = sum(dO * O)``
  (``row_dots.py``, Triton) from its caller (the layer's wrapper keeps the forward's output or
  recomputes it in backward for them and for the value projection's gradient, which needs the
  latent-space output);
* the backward adds its latent gradient into a buffer it is given, so the layer's calls over
  query blocks share one fp32 buffer;
* ``ordered`` (``model.dsa.deterministic_backward``): the backward writes each query's rows of
  the latent gradient instead of adding them with atomics, and ``ordered_row_sums`` adds them
  up key by key in a fixed order, ORDERED_QUERY_BLOCK queries at a time: bitwise-equal
  gradients on every run, for the bytes of those rows.

They fill ``fused_sparse_mla.DSAKernels`` (``latent_dsa_kernels``) with ``width`` 512, so the
layer's wrapper (``FusedAbsorbedSparseMLA``: absorption, query blocks, masking) is the one the
``fused`` kernel uses. The kernels themselves take ``q [S, H, D]``, ``kv [T, D]``, ``indices
[S, K]`` int32 (natural positions, -1 = not selected); the forward returns the latent-space
output and the natural log-sum-exp of ``scale * q . k`` over the selected keys (0 for a query
with no key, whose output is 0), the backward ``dq`` and the fp32 ``dkv``. The interfaces pad
heads to a power of two >= 16 and the top-k width to the kernels' key block with -1.
"""

# No `from __future__ import annotations`: TileLang reads the kernels' annotations as objects.

import math
from functools import lru_cache, partial

import torch
import torch.nn.functional as F

from .flashmla_forward import flashmla_forward, sparse_prefill
from .fused_sparse_mla import DSAKernels
from .index_scores import INDEXER_SCORES
from .ordered_row_sums import add_rows_in_index_order
from .row_dots import row_dots

LOG2E = math.log2(math.e)
LATENT_WIDTH = 512
"""GLM-5.3-Flash's kv_lora_rank: the width the kernels are built for (scores and values)."""
FORWARD_KEY_BLOCK = 64
"""Selected keys per step of the forward kernel (the top-k width is padded to a multiple)."""
BACKWARD_KEY_BLOCK = 32
"""Selected keys per step of the backward kernel: at the 1M share 16-key blocks ran 1.16-1.22x
slower and 32 with one pipeline stage 1.30x (bench/results/h200_backward_ablation)."""
BACKWARD_ADDS_DKV = True
"""The backward takes ``dkv=``, an fp32 accumulator it adds the latent gradient to
(``DSAKernels.backward_adds_dkv``; ``kernels/latent.py`` models the memory by it)."""
HEAD_BLOCK = 64
"""Heads per thread block: the wider MMA tile; more heads run in groups of 64."""
SHARED_BYTES = 227 * 1024
"""Shared memory one Hopper thread block may hold (sm_90's opt-in limit)."""
ORDERED_QUERY_BLOCK = 1024
"""Queries per ordered backward call: its per-query latent gradient rows are ORDERED_QUERY_BLOCK
x top-k x 512 fp32 (4.4 GB at GLM's top-k) until ``ordered_row_sums`` has added them; 512 made
the backward 1.26x slower at the 1M share (more, smaller calls) for 4 GiB less peak."""


def padded_heads(heads: int) -> int:
    """Heads as the kernels take them: a power of two >= 16 up to 64, else a multiple of 64."""
    if heads > HEAD_BLOCK:
        return -(-heads // HEAD_BLOCK) * HEAD_BLOCK
    return max(16, 1 << (heads - 1).bit_length())


def _threads(head_block: int) -> int:
    """Threads per block: 8 warps for 64 heads; fewer heads leave 8 warps too few MMA tiles
    (each warp needs 16 rows and 8 columns of every GEMM), so 4."""
    return 256 if head_block >= HEAD_BLOCK else 128


def _pad_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, heads - t.shape[1])) if t.shape[1] != heads else t


def padded_width(width: int, multiple: int) -> int:
    """A top-k width rounded up to the multiple a kernel takes (``forward_index_multiple``,
    ``backward_index_multiple``)."""
    return -(-width // multiple) * multiple


def _pad_keys(indices: torch.Tensor, multiple: int) -> torch.Tensor:
    width = padded_width(indices.shape[1], multiple)
    return F.pad(indices, (0, width - indices.shape[1]), value=-1)


# -- the TileLang kernels ------------------------------------------------------------------------

def _tilelang():
    try:
        import tilelang
        import tilelang.language as T
    except ImportError as e:
        raise RuntimeError("model.dsa.kernel=latent needs the tilelang package "
                           "(pip install 'skyrl-megatron-kda[gpu]'), or use model.dsa.kernel=torch") from e
    return tilelang, T


FORWARD_PASS_CONFIGS = ("TL_DISABLE_TMA_LOWER", "TL_DISABLE_WARP_SPECIALIZED")
"""TileLang passes the forward turns off: its gathers are per-row loads, not bulk copies."""


def _forward_signature(T, heads: int, dim: int, topk: int):
    """Both forward programs' query count S and tensors: q [S, heads, dim], the latent [Tk,
    dim], the indices [S, topk], the output and the log-sum-exp [S, heads]."""
    S, Tk = T.dynamic("S"), T.dynamic("Tk")
    return S, dict(Q=T.Tensor([S, heads, dim], "bfloat16"), KV=T.Tensor([Tk, dim], "bfloat16"),
                   Indices=T.Tensor([S, topk], "int32"), Out=T.Tensor([S, heads, dim], "bfloat16"),
                   Lse=T.Tensor([S, heads], "float32"))


def _natural_lse(T, log2_scale: float):
    """A TileLang macro: each head's row sum made the natural log-sum-exp of its scaled scores
    (from the sum and the running maximum, in place; 0 for a head with no key)."""
    ln2 = math.log(2.0)

    @T.macro
    def natural_lse(row_sum, row_max, heads):
        for h in T.Parallel(heads):
            row_sum[h] = T.if_then_else(
                row_sum[h] > 0, (T.log2(row_sum[h]) + row_max[h] * log2_scale) * ln2, 0)

    return natural_lse


def _block_gather(T, key_block: int, dim: int):
    """A TileLang macro: one key block's latent rows into ``kv_s`` [key_block, dim] and their
    flags (index >= 0) into ``valid``; a -1 index gathers row 0, masked by its flag. Inside
    ``T.Pipelined`` these become the stage's asynchronous copies."""

    @T.macro
    def gather_block(KV, Indices, s, key0, kv_s, valid):
        for k in T.Parallel(key_block):
            valid[k] = Indices[s, key0 + k] >= 0
        for k, d in T.Parallel(key_block, dim):
            kv_s[k, d] = KV[T.max(Indices[s, key0 + k], 0), d]

    return gather_block


def _backward_signature(T, heads: int, dim: int, topk: int, ordered: bool):
    """Both backward programs' query count S and tensors: q, dO and dq [S, heads, dim], the
    latent [Tk, dim], the indices [S, topk], the log-sum-exp and delta [S, heads], and the fp32
    latent gradient: [Tk, dim], or each slot's row [S, topk, dim] when ``ordered``."""
    S, Tk = T.dynamic("S"), T.dynamic("Tk")
    bf16, f32 = "bfloat16", "float32"
    return S, dict(Q=T.Tensor([S, heads, dim], bf16), KV=T.Tensor([Tk, dim], bf16),
                   dO=T.Tensor([S, heads, dim], bf16), Indices=T.Tensor([S, topk], "int32"),
                   Lse=T.Tensor([S, heads], f32), Delta=T.Tensor([S, heads], f32),
                   dQ=T.Tensor([S, heads, dim], bf16),
                   dKV=T.Tensor([S, topk, dim] if ordered else [Tk, dim], f32))


def _staged_adds(T, key_block: int, width: int, store_split: int, transposed: bool):
    """A TileLang macro: one key block's fp32 latent gradient (``acc`` [key_block, width], or
    [width, key_block] when ``transposed``) added to its keys' rows of ``dKV`` from channel
    ``c0`` by 16-byte atomics, staged through ``dkv_s`` [key_block / store_split, width] that
    many keys at a time; a -1 slot adds nothing."""
    part = key_block // store_split

    @T.macro
    def add_rows(dKV, Indices, s, key0, c0, acc, dkv_s):
        for r in T.serial(store_split):
            for k, d in T.Parallel(key_block, width):
                if k >= r * part and k < (r + 1) * part:
                    if transposed:
                        dkv_s[k - r * part, d] = acc[d, k]
                    else:
                        dkv_s[k - r * part, d] = acc[k, d]
            for k, d4 in T.Parallel(part, width // 4):
                if Indices[s, key0 + r * part + k] >= 0:
                    T.atomic_addx4(dKV[Indices[s, key0 + r * part + k], c0 + d4 * 4],
                                   dkv_s[k, d4 * 4])

    return add_rows


def _stacked_shared_bytes(dim: int, key_block: int, num_stages: int, part: int,
                          width: int) -> int:
    """The stacked backward's shared buffers: [Q; dO] and ``num_stages`` key blocks in bf16,
    [dS; P] in bf16, the fp32 probabilities and a store part of the latent gradient, the
    log-sum-exp and delta."""
    bh = HEAD_BLOCK
    return (2 * (2 * bh * dim + num_stages * key_block * dim + 2 * bh * key_block)
            + 4 * (bh * key_block + part * width + 2 * bh))


def _stacked_backward(heads: int, dim: int, topk: int, scale: float, num_stages: int,
                      store_split: int, ordered: bool, key_block: int, channel_split: int):
    """``backward_program``'s backward with the queries and the output gradient stacked in one
    [2 x heads, dim] operand, so each key block takes three Hopper MMAs (wgmma) of 64-row
    tiles: ``[Q; dO] K^T`` gives the scores and ``dP`` together (each warpgroup one of them,
    ``key_block`` wide), ``dS K`` adds to dq, and ``[Q; dO]^T [dS; P]`` gives the block's
    latent gradient transposed ([dim, key_block]: 512 rows, so its tiles are wgmma's; the
    key-major ``dS^T Q + P^T dO`` has ``key_block`` rows, fewer than a warpgroup's 64, and
    lowers to the older mma.sync with its operands loaded into registers). The probabilities
    pass from the warpgroup that holds the scores to the one that holds ``dP`` through shared
    memory, in fp32. ``channel_split``: the latent gradient in that many parts of channels,
    one after the other (its accumulator is [dim / channel_split, key_block]: fewer registers;
    at 2 the lowered kernel spills 64 bytes against 452 at 1)."""
    BH, BK = HEAD_BLOCK, key_block
    if heads % BH or dim % (64 * channel_split):
        raise ValueError(f"the stacked backward takes heads in groups of {BH} and a width that "
                         f"splits into channel_split parts of whole 64-channel tiles, got "
                         f"{heads} heads, width {dim}, channel_split {channel_split}")
    part, width = BK // store_split, dim // channel_split
    shared = _stacked_shared_bytes(dim, BK, num_stages, part, width)
    if shared > SHARED_BYTES:
        raise ValueError(f"the stacked backward's buffers take {shared // 1024} KiB of shared "
                         f"memory, more than a thread block's {SHARED_BYTES // 1024} KiB: "
                         f"raise store_split or channel_split, or lower num_stages")
    tilelang, T = _tilelang()
    groups, steps = heads // BH, topk // BK
    log2_scale = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    S, t = _backward_signature(T, heads, dim, topk, ordered)
    gather_block = _block_gather(T, BK, dim)
    add_rows = _staged_adds(T, BK, width, store_split, transposed=True)

    @T.prim_func
    def sparse_latent_bwd_stacked(Q: t["Q"], KV: t["KV"], dO: t["dO"], Indices: t["Indices"],
                                  Lse: t["Lse"], Delta: t["Delta"], dQ: t["dQ"], dKV: t["dKV"]):
        with T.Kernel(S * groups, threads=256) as bx:
            s = bx // groups
            h0 = (bx % groups) * BH
            qdo_s = T.alloc_shared([2 * BH, dim], bf16)  # rows: Q, then dO
            kv_s = T.alloc_shared([BK, dim], bf16)
            dsp_s = T.alloc_shared([2 * BH, BK], bf16)  # rows: dS, then P
            prob_s = T.alloc_shared([BH, BK], f32)
            dkv_s = T.alloc_shared([part, width], f32)
            lse_s = T.alloc_shared([BH], f32)
            delta_s = T.alloc_shared([BH], f32)
            valid = T.alloc_fragment([BK], "bool")
            acc_sdp = T.alloc_fragment([2 * BH, BK], f32)  # rows: scores, then dP
            acc_dq = T.alloc_fragment([BH, dim], f32)
            acc_dkv = T.alloc_fragment([width, BK], f32)
            T.copy(Q[s, h0:h0 + BH, :], qdo_s[0:BH, :])
            T.copy(dO[s, h0:h0 + BH, :], qdo_s[BH:2 * BH, :])
            for h in T.Parallel(BH):
                lse_s[h] = Lse[s, h0 + h] * LOG2E
                delta_s[h] = Delta[s, h0 + h]
            T.clear(acc_dq)
            for kb in T.Pipelined(steps, num_stages=num_stages):
                gather_block(KV, Indices, s, kb * BK, kv_s, valid)
                for r, k in T.Parallel(2 * BH, BK):
                    acc_sdp[r, k] = T.if_then_else(r < BH and not valid[k], -T.infinity(f32), 0)
                T.gemm(qdo_s, kv_s, acc_sdp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for r, k in T.Parallel(2 * BH, BK):
                    if r < BH:
                        prob_s[r, k] = T.exp2(acc_sdp[r, k] * log2_scale - lse_s[r])
                        dsp_s[BH + r, k] = T.exp2(acc_sdp[r, k] * log2_scale - lse_s[r])
                for r, k in T.Parallel(2 * BH, BK):
                    if r >= BH:
                        dsp_s[r - BH, k] = (prob_s[r - BH, k] * (acc_sdp[r, k] - delta_s[r - BH])
                                            * scale)
                T.gemm(dsp_s[0:BH, :], kv_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                for c in T.serial(channel_split):
                    c0 = c * width
                    T.gemm(qdo_s[:, c0:c0 + width], dsp_s, acc_dkv, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    if ordered:
                        for k, d in T.Parallel(BK, width):
                            dKV[s, kb * BK + k, c0 + d] = acc_dkv[d, k]
                    else:
                        add_rows(dKV, Indices, s, kb * BK, c0, acc_dkv, dkv_s)
            T.copy(acc_dq, dQ[s, h0:h0 + BH, :])

    return sparse_latent_bwd_stacked


def _block_probabilities(T, log2_scale: float, heads: int, key_block: int, width: int):
    """A TileLang macro, the online softmax's step once a block's row maxima are known: the
    block's scores made probabilities, their row sums added to the running ones (those first
    rescaled by ``rescale``, the old maximum's factor), and the output accumulator [heads,
    width] rescaled alike."""

    @T.macro
    def probabilities(acc_s, row_max, rescale, block_sum, row_sum, acc_o):
        for h, k in T.Parallel(heads, key_block):
            acc_s[h, k] = T.exp2((acc_s[h, k] - row_max[h]) * log2_scale)
        T.reduce_sum(acc_s, block_sum, dim=1)
        for h in T.Parallel(heads):
            row_sum[h] = row_sum[h] * rescale[h] + block_sum[h]
        for h, d in T.Parallel(heads, width):
            acc_o[h, d] *= rescale[h]

    return probabilities


def _row_gathers(T, key_block: int, width: int):
    """A TileLang macro: the producer warpgroup's (threads 256-383) cp.async gathers of one key
    block's latent rows, ``width`` channels from ``col0``, into stage ``st`` of ``kv_s``; eight
    threads a row, sixteen rows at a time, 16 bytes a copy. ``flags``: also write each row's
    validity (index >= 0) to ``valid[st, row]``. A -1 index gathers row 0, masked by that flag."""
    chunk, threads_per_row = 8, 8  # bf16 per 16-byte cp.async; 128 threads: 16 rows at a time
    row_passes = key_block // (128 // threads_per_row)
    per_thread = width // (threads_per_row * chunk)

    @T.macro
    def gather(KV, Indices, s, key0, kv_s, valid, st, col0, flags, tx):
        for r in T.serial(row_passes):
            row = r * (128 // threads_per_row) + (tx - 256) // threads_per_row
            index = Indices[s, key0 + row]
            if flags:
                valid[st, row] = index >= 0
            for u in T.serial(per_thread):
                col = col0 + (u * threads_per_row + (tx - 256) % threads_per_row) * chunk
                T.ptx_cp_async(T.access_ptr(kv_s[st, row, col], "w", chunk),
                               T.access_ptr(KV[T.max(index, 0), col], "r", chunk), chunk)

    return gather


def forward_program(heads: int, dim: int, topk: int, scale: float, threads: int | None = None,
                    num_stages: int = 2, key_block: int = FORWARD_KEY_BLOCK,
                    deferred_sum: bool = False, warp_specialized: bool = False,
                    ping_pong: bool = False):
    """The forward for ``heads`` (as ``padded_heads`` gives), latent width ``dim`` and a top-k
    width ``topk`` (a multiple of ``key_block``): one thread block per (query, head group) runs
    an online softmax over the selected keys, ``key_block`` at a time, gathering their latent
    rows into shared memory (pipelined against the previous block's MMAs).

    ``deferred_sum`` (a tuning ``bench/latent_sparse_mla.py --forward-configs`` times) keeps
    the softmax denominators as running sums per score element (rescaled with the output) and
    adds them over the keys once at the end, so a block needs one exchange between the
    warpgroups (the maximum) instead of two. ``warp_specialized``: ``_warp_specialized_forward``
    instead (64-head groups, two stages, a top-k width of whole pairs of key blocks); with
    ``ping_pong`` too, ``_ping_pong_forward`` (the same shapes)."""
    if topk % key_block:
        raise ValueError(f"the top-k width ({topk}) must be a multiple of the key block "
                         f"({key_block})")
    if warp_specialized:
        if threads is not None or num_stages != 2 or deferred_sum:
            raise ValueError("the warp-specialised forward has its own threads (384), two "
                             "stages and no deferred sums")
        if ping_pong:
            return _ping_pong_forward(heads, dim, topk, scale, key_block)
        return _warp_specialized_forward(heads, dim, topk, scale, key_block)
    if ping_pong:
        raise ValueError("ping_pong is a warp-specialised forward: name warp_specialized too")
    tilelang, T = _tilelang()
    BH, BK = min(heads, HEAD_BLOCK), key_block
    threads = threads or _threads(BH)
    groups, steps = heads // BH, topk // BK
    log2_scale = scale * LOG2E
    natural_lse = _natural_lse(T, log2_scale)
    gather_block = _block_gather(T, BK, dim)
    bf16, f32 = "bfloat16", "float32"
    S, t = _forward_signature(T, heads, dim, topk)

    @T.prim_func
    def sparse_latent_fwd(Q: t["Q"], KV: t["KV"], Indices: t["Indices"], Out: t["Out"],
                          Lse: t["Lse"]):
        with T.Kernel(S * groups, threads=threads) as bx:
            s = bx // groups
            h0 = (bx % groups) * BH
            q_s = T.alloc_shared([BH, dim], bf16)
            kv_s = T.alloc_shared([BK, dim], bf16)
            p_s = T.alloc_shared([BH, BK], bf16)
            valid = T.alloc_fragment([BK], "bool")
            acc_s = T.alloc_fragment([BH, BK], f32)
            acc_o = T.alloc_fragment([BH, dim], f32)
            row_max = T.alloc_fragment([BH], f32)
            prev_max = T.alloc_fragment([BH], f32)
            rescale = T.alloc_fragment([BH], f32)
            row_sum = T.alloc_fragment([BH], f32)
            # deferred_sum: each score element's running sum; else one block's sums per head
            sums = T.alloc_fragment([BH, BK] if deferred_sum else [BH], f32)
            T.fill(acc_o, 0)
            T.fill(row_sum, 0)
            if deferred_sum:
                T.fill(sums, 0)
            T.fill(row_max, -(2.0**30))  # finite: a first all-masked block gives exp2(-inf)
            T.copy(Q[s, h0:h0 + BH, :], q_s)
            for kb in T.Pipelined(steps, num_stages=num_stages):
                gather_block(KV, Indices, s, kb * BK, kv_s, valid)
                for h, k in T.Parallel(BH, BK):
                    acc_s[h, k] = T.if_then_else(valid[k], 0, -T.infinity(f32))
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(row_max, prev_max)
                T.reduce_max(acc_s, row_max, dim=1, clear=False)
                for h in T.Parallel(BH):
                    rescale[h] = T.exp2((prev_max[h] - row_max[h]) * log2_scale)
                for h, k in T.Parallel(BH, BK):
                    acc_s[h, k] = T.exp2((acc_s[h, k] - row_max[h]) * log2_scale)
                if deferred_sum:
                    for h, k in T.Parallel(BH, BK):
                        sums[h, k] = sums[h, k] * rescale[h] + acc_s[h, k]
                else:
                    T.reduce_sum(acc_s, sums, dim=1)
                    for h in T.Parallel(BH):
                        row_sum[h] = row_sum[h] * rescale[h] + sums[h]
                for h, d in T.Parallel(BH, dim):
                    acc_o[h, d] = acc_o[h, d] * rescale[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
            if deferred_sum:
                T.reduce_sum(sums, row_sum, dim=1)
            for h, d in T.Parallel(BH, dim):
                acc_o[h, d] = T.if_then_else(row_sum[h] > 0, acc_o[h, d] / row_sum[h], 0)
            natural_lse(row_sum, row_max, BH)
            T.copy(acc_o, Out[s, h0:h0 + BH, :])
            T.copy(row_sum, Lse[s, h0:h0 + BH])

    return sparse_latent_fwd


def backward_program(heads: int, dim: int, topk: int, scale: float, threads: int | None = None,
                     num_stages: int = 2, store_split: int = 4, ordered: bool = False,
                     key_block: int = BACKWARD_KEY_BLOCK, stacked: bool = False,
                     channel_split: int = 1):
    """The backward for ``heads`` (as ``padded_heads`` gives), width ``dim``, top-k width
    ``topk`` (a multiple of ``key_block``): one thread block per (query, head group) rebuilds
    each block of ``key_block`` keys' probabilities from the kept log-sum-exp, accumulates dq in
    registers and adds the block's latent gradient ``dS^T Q + P^T dO`` to ``dKV`` [Tk, dim]
    (fp32 atomics, staged through shared memory in ``store_split`` parts); ``ordered`` (one head
    group): writes it to the query's rows of ``dKV`` [S, topk, dim] instead, one row per
    selected slot (zero where the slot is -1), for ``ordered_row_sums``. ``stacked``:
    ``_stacked_backward`` instead (64-head groups; its ``channel_split``)."""
    BH, BK = min(heads, HEAD_BLOCK), key_block
    if ordered and heads > BH:
        raise ValueError(f"the ordered backward takes up to {HEAD_BLOCK} heads, got {heads}")
    if topk % BK or BK % store_split:
        raise ValueError(f"the top-k width ({topk}) must be a multiple of the key block ({BK}), "
                         f"and the key block of its store parts ({store_split})")
    if channel_split != 1 and not stacked:
        raise ValueError("channel_split is the stacked backward's: name stacked too")
    if stacked:
        if threads is not None:
            raise ValueError("the stacked backward has its own threads (256)")
        return _stacked_backward(heads, dim, topk, scale, num_stages, store_split, ordered, BK,
                                 channel_split)
    tilelang, T = _tilelang()
    threads = threads or _threads(BH)
    groups, steps = heads // BH, topk // BK
    part = BK // store_split
    log2_scale = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    S, t = _backward_signature(T, heads, dim, topk, ordered)
    gather_block = _block_gather(T, BK, dim)
    add_rows = _staged_adds(T, BK, dim, store_split, transposed=False)

    @T.prim_func
    def sparse_latent_bwd(Q: t["Q"], KV: t["KV"], dO: t["dO"], Indices: t["Indices"],
                          Lse: t["Lse"], Delta: t["Delta"], dQ: t["dQ"], dKV: t["dKV"]):
        with T.Kernel(S * groups, threads=threads) as bx:
            s = bx // groups
            h0 = (bx % groups) * BH
            q_s = T.alloc_shared([BH, dim], bf16)
            do_s = T.alloc_shared([BH, dim], bf16)
            kv_s = T.alloc_shared([BK, dim], bf16)
            p_s = T.alloc_shared([BH, BK], bf16)
            ds_s = T.alloc_shared([BH, BK], bf16)
            dkv_s = T.alloc_shared([part, dim], f32)
            lse_s = T.alloc_shared([BH], f32)
            delta_s = T.alloc_shared([BH], f32)
            valid = T.alloc_fragment([BK], "bool")
            acc_p = T.alloc_fragment([BH, BK], f32)
            acc_dp = T.alloc_fragment([BH, BK], f32)
            acc_dq = T.alloc_fragment([BH, dim], f32)
            acc_dkv = T.alloc_fragment([BK, dim], f32)
            T.copy(Q[s, h0:h0 + BH, :], q_s)
            T.copy(dO[s, h0:h0 + BH, :], do_s)
            for h in T.Parallel(BH):
                lse_s[h] = Lse[s, h0 + h] * LOG2E
                delta_s[h] = Delta[s, h0 + h]
            T.clear(acc_dq)
            for kb in T.Pipelined(steps, num_stages=num_stages):
                gather_block(KV, Indices, s, kb * BK, kv_s, valid)
                for h, k in T.Parallel(BH, BK):
                    acc_p[h, k] = T.if_then_else(valid[k], 0, -T.infinity(f32))
                T.gemm(q_s, kv_s, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for h, k in T.Parallel(BH, BK):
                    acc_p[h, k] = T.exp2(acc_p[h, k] * log2_scale - lse_s[h])
                T.copy(acc_p, p_s)
                T.gemm(do_s, kv_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullCol,
                       clear_accum=True)
                for h, k in T.Parallel(BH, BK):
                    acc_dp[h, k] = acc_p[h, k] * (acc_dp[h, k] - delta_s[h]) * scale
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, kv_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, q_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol,
                       clear_accum=True)
                T.gemm(p_s, do_s, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                if ordered:
                    T.copy(acc_dkv, dKV[s, kb * BK:(kb + 1) * BK, :])
                else:
                    add_rows(dKV, Indices, s, kb * BK, 0, acc_dkv, dkv_s)
            T.copy(acc_dq, dQ[s, h0:h0 + BH, :])

    return sparse_latent_bwd


def _warp_specialized_forward(heads: int, dim: int, topk: int, scale: float, key_block: int):
    """``forward_program``'s attention with its three jobs on three warpgroups (384 threads),
    so a block's gathers, score product and softmax, and value product overlap: warpgroup 0
    takes the score product, the online softmax and the left half of the value product,
    warpgroup 1 the right half, warpgroup 2 gathers the latent rows of the next key blocks
    into two stages with cp.async. mbarriers hand the stages, the probabilities and their
    rescale between them; the queries come by one TMA copy. The pipelined forward runs those
    jobs one after the other in every warp (its lowered source: 6 barriers and 4 all-reduce
    steps a block)."""
    BH, BK, S2 = HEAD_BLOCK, key_block, 2
    if heads % BH or dim % 128 or BK % 16 or topk % (S2 * BK):
        raise ValueError(f"the warp-specialised forward takes heads in groups of {BH}, a width "
                         f"that 128 divides, a key block that 16 divides and a top-k width of "
                         f"pairs of key blocks, got {heads}, {dim}, {topk} (key block {BK})")
    tilelang, T = _tilelang()
    groups, steps = heads // BH, topk // BK
    pairs = steps // S2
    half = dim // 2
    log2_scale = scale * LOG2E
    natural_lse = _natural_lse(T, log2_scale)
    bf16, f32 = "bfloat16", "float32"
    S, t = _forward_signature(T, heads, dim, topk)
    gather = _row_gathers(T, BK, dim)
    probabilities = _block_probabilities(T, log2_scale, BH, BK, half)

    @T.prim_func
    def sparse_latent_fwd_ws(Q: t["Q"], KV: t["KV"], Indices: t["Indices"], Out: t["Out"],
                             Lse: t["Lse"]):
        with T.Kernel(S * groups, threads=384) as bx:
            s = bx // groups
            h0 = (bx % groups) * BH
            q_s = T.alloc_shared([BH, dim], bf16)
            kv_s = T.alloc_shared([S2, BK, dim], bf16)
            valid = T.alloc_shared([S2, BK], "bool", scope="shared")
            p_s = T.alloc_shared([BH, BK], bf16)
            rescale_s = T.alloc_shared([BH], f32, scope="shared")
            sum_s = T.alloc_shared([BH], f32, scope="shared")
            acc_s = T.alloc_fragment([BH, BK], f32)
            acc_l = T.alloc_fragment([BH, half], f32)
            acc_r = T.alloc_fragment([BH, half], f32)
            row_max = T.alloc_fragment([BH], f32)
            prev_max = T.alloc_fragment([BH], f32)
            rescale = T.alloc_fragment([BH], f32)
            block_sum = T.alloc_fragment([BH], f32)
            row_sum = T.alloc_fragment([BH], f32)

            bar_q = T.alloc_barrier(arrive_count=384)
            bar_kv_ready = T.alloc_barrier(arrive_count=[128] * S2)
            bar_kv_free = T.alloc_barrier(arrive_count=[256] * S2)
            bar_p_ready = T.alloc_barrier(arrive_count=256)
            bar_p_free = T.alloc_barrier(arrive_count=256)
            bar_sums = T.alloc_barrier(arrive_count=256)

            tx = T.get_thread_binding()
            T.tma_copy(Q[s, h0:h0 + BH, :], q_s, barrier=bar_q)
            T.barrier_arrive(bar_q)

            if tx < 128:
                T.set_max_nreg(240, 1)
                T.fill(acc_l, 0)
                T.fill(row_sum, 0)
                T.fill(row_max, -(2.0**30))
                T.barrier_wait(bar_q, 0)
                for i in T.serial(pairs):
                    for st in T.unroll(S2):
                        T.barrier_wait(bar_kv_ready[st], i & 1)
                        T.fence_proxy_async()  # the gathered rows, for the async-proxy MMAs
                        for h, k in T.Parallel(BH, BK):
                            acc_s[h, k] = T.if_then_else(valid[st, k], 0, -T.infinity(f32))
                        T.wgmma_gemm(q_s, kv_s[st, :, :], acc_s, transpose_B=True)
                        T.wait_wgmma(0)
                        if i != 0 or st != 0:  # warpgroup 1 is done with the last p_s
                            T.barrier_arrive(bar_p_free)
                            T.barrier_wait(bar_p_free, ((i * S2 + st) & 1) ^ 1)
                        T.copy(row_max, prev_max)
                        T.reduce_max(acc_s, row_max, dim=1, clear=False)
                        for h in T.Parallel(BH):
                            rescale[h] = T.exp2((prev_max[h] - row_max[h]) * log2_scale)
                        probabilities(acc_s, row_max, rescale, block_sum, row_sum, acc_l)
                        T.copy(rescale, rescale_s)
                        T.copy(acc_s, p_s)
                        T.gemm(p_s, kv_s[st, :, 0:half], acc_l)
                        T.barrier_arrive(bar_p_ready)
                        T.barrier_arrive(bar_kv_free[st])
                T.copy(row_sum, sum_s)
                T.barrier_arrive(bar_sums)
                for h, d in T.Parallel(BH, half):
                    acc_l[h, d] = T.if_then_else(row_sum[h] > 0, acc_l[h, d] / row_sum[h], 0)
                natural_lse(row_sum, row_max, BH)
                T.copy(acc_l, Out[s, h0:h0 + BH, 0:half])
                T.copy(row_sum, Lse[s, h0:h0 + BH])
            elif tx < 256:
                T.set_max_nreg(168, 1)
                T.fill(acc_r, 0)
                for i in T.serial(pairs):
                    for st in T.unroll(S2):
                        T.barrier_arrive(bar_p_ready)
                        T.barrier_wait(bar_p_ready, (i * S2 + st) & 1)
                        T.fence_proxy_async()
                        for h, d in T.Parallel(BH, half):
                            acc_r[h, d] *= rescale_s[h]
                        T.gemm(p_s, kv_s[st, :, half:dim], acc_r)
                        T.barrier_arrive(bar_kv_free[st])
                        if st != S2 - 1 or i != pairs - 1:
                            T.barrier_arrive(bar_p_free)
                T.barrier_arrive(bar_sums)  # warpgroup 0's row sums are in sum_s
                T.barrier_wait(bar_sums, 0)
                for h, d in T.Parallel(BH, half):
                    acc_r[h, d] = T.if_then_else(sum_s[h] > 0, acc_r[h, d] / sum_s[h], 0)
                T.copy(acc_r, Out[s, h0:h0 + BH, half:dim])
            else:
                T.set_max_nreg(80, 0)
                for i in T.serial(pairs):
                    for st in T.unroll(S2):
                        T.barrier_wait(bar_kv_free[st], (i & 1) ^ 1)
                        gather(KV, Indices, s, (i * S2 + st) * BK, kv_s, valid, st, 0, True, tx)
                        T.cp_async_barrier_noinc(bar_kv_ready[st])

    return sparse_latent_fwd_ws


def _ping_pong_forward(heads: int, dim: int, topk: int, scale: float, key_block: int):
    """``forward_program``'s attention with the two math warpgroups taking turns over the key
    blocks, so their work is even and one's softmax runs under the other's products: of each
    pair of key blocks, warpgroup 0 takes the first block's score product and softmax,
    warpgroup 1 the second's, and each then takes its half of the value channels (0 the left,
    1 the right) over both blocks, the other's probabilities coming through shared memory.
    The running maximum passes from 0 to 1 and back once a pair: 1 starts its softmax from
    0's maximum, and 0 rescales its block's probabilities to 1's before handing them over.
    Warpgroup 2 gathers each block's latent rows in two halves of channels, ordered so the
    halves the math warpgroups free first are refilled first (a block's left half serves only
    0, the second block's right half only 1). ``_warp_specialized_forward`` gives warpgroup 0
    the whole score product and softmax, and two thirds of the products."""
    BH, BK = HEAD_BLOCK, key_block
    if heads % BH or dim % 128 or BK % 16 or topk % (2 * BK):
        raise ValueError(f"the ping-pong forward takes heads in groups of {BH}, a width that 128 "
                         f"divides, a key block that 16 divides and a top-k width of pairs of "
                         f"key blocks, got {heads}, {dim}, {topk} (key block {BK})")
    tilelang, T = _tilelang()
    groups, pairs, half = heads // BH, topk // (2 * BK), dim // 2
    log2_scale = scale * LOG2E
    natural_lse = _natural_lse(T, log2_scale)
    bf16, f32 = "bfloat16", "float32"
    S, t = _forward_signature(T, heads, dim, topk)
    gather = _row_gathers(T, BK, half)
    probabilities = _block_probabilities(T, log2_scale, BH, BK, half)
    # The gathered halves (block of the pair, channel half) in the order the producer fills
    # them: the halves only one warpgroup reads are freed (and refilled) first.
    fill_order = ((0, 0), (1, 1), (0, 1), (1, 0))

    @T.macro
    def block_scores(w, q_s, kv_s, valid, acc_s, bar_kv_ready, i):
        """Warpgroup w's block of the pair: its scores over both channel halves, its own
        half first (the one the producer refills first, with the rows' flags: read only after
        it arrived), -inf where a slot is -1."""
        for c in (w, 1 - w):
            T.barrier_wait(bar_kv_ready[w * 2 + c], i & 1)
            T.fence_proxy_async()  # the gathered rows, for the async-proxy MMAs
            if c == w:
                for h, k in T.Parallel(BH, BK):
                    acc_s[h, k] = T.if_then_else(valid[w, k], 0, -T.infinity(f32))
            T.wgmma_gemm(q_s[:, c * half:(c + 1) * half], kv_s[w, :, c * half:(c + 1) * half],
                         acc_s, transpose_B=True)
        T.wait_wgmma(0)

    @T.macro
    def block_softmax(w, acc_s, acc_o, row_max, rescale, block_sum, row_sum, max_s, bar_max):
        """The block's probabilities from the running maximum (warpgroup 1: from warpgroup 0's,
        already in max_s), the new maximum handed on, the sums and the output rescaled."""
        for h in T.Parallel(BH):
            rescale[h] = row_max[h]
            if w == 1:
                row_max[h] = max_s[0, h]
        T.reduce_max(acc_s, row_max, dim=1, clear=False)
        for h in T.Parallel(BH):
            rescale[h] = T.exp2((rescale[h] - row_max[h]) * log2_scale)
            max_s[w, h] = row_max[h]
        T.barrier_arrive(bar_max[w])
        probabilities(acc_s, row_max, rescale, block_sum, row_sum, acc_o)

    @T.macro
    def normalised(w, acc_o, row_sum, sum_s, bar_sums, Out, s, h0):
        """Both warpgroups' row sums added (each kept its own blocks'), warpgroup w's channels
        of the output divided by them and written."""
        for h in T.Parallel(BH):
            sum_s[w, h] = row_sum[h]
        T.barrier_arrive(bar_sums)
        T.barrier_wait(bar_sums, 0)
        for h in T.Parallel(BH):
            row_sum[h] = sum_s[0, h] + sum_s[1, h]
        for h, d in T.Parallel(BH, half):
            acc_o[h, d] = T.if_then_else(row_sum[h] > 0, acc_o[h, d] / row_sum[h], 0)
        T.copy(acc_o, Out[s, h0:h0 + BH, w * half:(w + 1) * half])

    @T.prim_func
    def sparse_latent_fwd_pp(Q: t["Q"], KV: t["KV"], Indices: t["Indices"], Out: t["Out"],
                             Lse: t["Lse"]):
        with T.Kernel(S * groups, threads=384) as bx:
            s = bx // groups
            h0 = (bx % groups) * BH
            q_s = T.alloc_shared([BH, dim], bf16)
            kv_s = T.alloc_shared([2, BK, dim], bf16)
            p_s = T.alloc_shared([2, BH, BK], bf16)
            valid = T.alloc_shared([2, BK], "bool", scope="shared")
            max_s = T.alloc_shared([2, BH], f32, scope="shared")
            sum_s = T.alloc_shared([2, BH], f32, scope="shared")
            acc_s0 = T.alloc_fragment([BH, BK], f32)
            acc_s1 = T.alloc_fragment([BH, BK], f32)
            acc_p0 = T.alloc_fragment([BH, BK], bf16)
            acc_p1 = T.alloc_fragment([BH, BK], bf16)
            acc_o0 = T.alloc_fragment([BH, half], f32)
            acc_o1 = T.alloc_fragment([BH, half], f32)
            row_max0 = T.alloc_fragment([BH], f32)
            row_max1 = T.alloc_fragment([BH], f32)
            rescale0 = T.alloc_fragment([BH], f32)
            rescale1 = T.alloc_fragment([BH], f32)
            block_sum0 = T.alloc_fragment([BH], f32)
            block_sum1 = T.alloc_fragment([BH], f32)
            row_sum0 = T.alloc_fragment([BH], f32)
            row_sum1 = T.alloc_fragment([BH], f32)

            bar_q = T.alloc_barrier(arrive_count=384)
            # [block of the pair * 2 + channel half]
            bar_kv_ready = T.alloc_barrier(arrive_count=[128] * 4)
            bar_kv_free = T.alloc_barrier(arrive_count=[128] * 4)
            bar_max = T.alloc_barrier(arrive_count=[128] * 2)  # [warpgroup whose max is in max_s]
            bar_p = T.alloc_barrier(arrive_count=[128] * 2)  # [warpgroup whose p_s is written]
            bar_sums = T.alloc_barrier(arrive_count=256)

            tx = T.get_thread_binding()
            T.tma_copy(Q[s, h0:h0 + BH, :], q_s, barrier=bar_q)
            T.barrier_arrive(bar_q)

            if tx < 128:
                T.set_max_nreg(216, 1)
                T.fill(acc_o0, 0)
                T.fill(row_sum0, 0)
                T.fill(row_max0, -(2.0**30))  # finite: a first all-masked block gives exp2(-inf)
                T.barrier_wait(bar_q, 0)
                for i in T.serial(pairs):
                    block_scores(0, q_s, kv_s, valid, acc_s0, bar_kv_ready, i)
                    block_softmax(0, acc_s0, acc_o0, row_max0, rescale0, block_sum0, row_sum0,
                                  max_s, bar_max)
                    T.copy(acc_s0, acc_p0)
                    T.wgmma_gemm(acc_p0, kv_s[0, :, 0:half], acc_o0)
                    T.wait_wgmma(0)
                    T.barrier_arrive(bar_kv_free[0])
                    # warpgroup 1's maximum: this block's probabilities rescaled to it
                    T.barrier_wait(bar_max[1], i & 1)
                    for h in T.Parallel(BH):
                        rescale0[h] = T.exp2((row_max0[h] - max_s[1, h]) * log2_scale)
                        row_max0[h] = max_s[1, h]
                        row_sum0[h] *= rescale0[h]
                    for h, k in T.Parallel(BH, BK):
                        acc_s0[h, k] *= rescale0[h]
                    T.copy(acc_s0, p_s[0, :, :])
                    T.fence_proxy_async()  # the probabilities, for warpgroup 1's MMA
                    T.barrier_arrive(bar_p[0])
                    for h, d in T.Parallel(BH, half):
                        acc_o0[h, d] *= rescale0[h]
                    T.barrier_wait(bar_p[1], i & 1)
                    T.wgmma_gemm(p_s[1, :, :], kv_s[1, :, 0:half], acc_o0)
                    T.wait_wgmma(0)
                    T.barrier_arrive(bar_kv_free[2])
                normalised(0, acc_o0, row_sum0, sum_s, bar_sums, Out, s, h0)
                natural_lse(row_sum0, row_max0, BH)
                T.copy(row_sum0, Lse[s, h0:h0 + BH])
            elif tx < 256:
                T.set_max_nreg(216, 1)
                T.fill(acc_o1, 0)
                T.fill(row_sum1, 0)
                T.fill(row_max1, -(2.0**30))
                T.barrier_wait(bar_q, 0)
                for i in T.serial(pairs):
                    block_scores(1, q_s, kv_s, valid, acc_s1, bar_kv_ready, i)
                    # the second block's softmax from warpgroup 0's maximum (at least the
                    # running one)
                    T.barrier_wait(bar_max[0], i & 1)
                    block_softmax(1, acc_s1, acc_o1, row_max1, rescale1, block_sum1, row_sum1,
                                  max_s, bar_max)
                    T.copy(acc_s1, acc_p1)
                    T.wgmma_gemm(acc_p1, kv_s[1, :, half:dim], acc_o1)
                    T.copy(acc_s1, p_s[1, :, :])
                    T.fence_proxy_async()  # the probabilities, for warpgroup 0's MMA
                    T.barrier_arrive(bar_p[1])
                    T.barrier_wait(bar_p[0], i & 1)
                    T.wgmma_gemm(p_s[0, :, :], kv_s[0, :, half:dim], acc_o1)
                    T.wait_wgmma(1)
                    T.barrier_arrive(bar_kv_free[3])
                    T.wait_wgmma(0)
                    T.barrier_arrive(bar_kv_free[1])
                normalised(1, acc_o1, row_sum1, sum_s, bar_sums, Out, s, h0)
            else:
                T.set_max_nreg(72, 0)
                for i in T.serial(pairs):
                    for b, c in fill_order:
                        # block b of the pair, channel half c; a block's first half also
                        # writes its rows' flags
                        T.barrier_wait(bar_kv_free[b * 2 + c], (i & 1) ^ 1)
                        gather(KV, Indices, s, (i * 2 + b) * BK, kv_s, valid, b, c * half,
                               c == b, tx)
                        T.cp_async_barrier_noinc(bar_kv_ready[b * 2 + c])

    return sparse_latent_fwd_pp


@lru_cache(maxsize=None)
def forward_kernel(heads: int, dim: int, topk: int, scale: float, **config):
    tilelang, _ = _tilelang()
    passes = {getattr(tilelang.PassConfigKey, key): True for key in FORWARD_PASS_CONFIGS}
    return tilelang.compile(forward_program(heads, dim, topk, scale, **config), out_idx=[-2, -1],
                            pass_configs=passes)


@lru_cache(maxsize=None)
def backward_kernel(heads: int, dim: int, topk: int, scale: float, ordered: bool = False,
                    **config):
    """Compiled once per shape; ``ordered`` also returns its per-query latent gradient rows."""
    tilelang, _ = _tilelang()
    return tilelang.compile(backward_program(heads, dim, topk, scale, ordered=ordered, **config),
                            out_idx=[-2, -1] if ordered else [-2])


def default_forward_config(heads: int) -> dict:
    """``forward_program``'s keywords for ``heads`` (as ``padded_heads`` gives) when the caller
    names none: whole 64-head groups take the warp-specialised forward (1.28x faster at the 1M
    share, bench/results/h200_ws_forward), fewer heads the pipelined one, whose smaller MMA
    tiles they fit."""
    return {"warp_specialized": True} if heads % HEAD_BLOCK == 0 else {}


def default_backward_config(heads: int) -> dict:
    """``backward_program``'s keywords for ``heads`` (as ``padded_heads`` gives) when the caller
    names none: whole 64-head groups take the stacked backward (its latent gradient in four
    channel parts, each added at once), with atomic adds and ordered alike: at the 1M share
    0.73x the atomic backward's time in the layer (bench/results/h100_stacked_backward) and
    0.86x the ordered one's (bench/results/h100_ordered_stacked); fewer heads the backward of
    ``key_block`` rows, whose smaller MMA tiles they fit."""
    if heads % HEAD_BLOCK:
        return {}
    return {"stacked": True, "channel_split": 4, "store_split": 1}


def forward_index_multiple(heads: int, config: dict | None = None) -> int:
    """What ``latent_forward`` pads the top-k width to (with -1) for ``heads`` under
    ``config`` (``default_forward_config`` when None): its key block, or a pair of them for the
    warp-specialised forward, whose two stages take a pair per loop step."""
    config = default_forward_config(heads) if config is None else config
    block = config.get("key_block", FORWARD_KEY_BLOCK)
    return 2 * block if config.get("warp_specialized") else block


def backward_index_multiple(config: dict) -> int:
    """What ``latent_backward`` pads the top-k width to (with -1) under ``config``: its key
    block."""
    return config.get("key_block", BACKWARD_KEY_BLOCK)


def latent_forward(q, kv, indices, scale, **config):
    """The forward kernel on the contract's tensors (padding heads and the top-k width);
    ``config``: ``forward_program``'s tuning keywords (``default_forward_config`` when none
    are given)."""
    S, H, D = q.shape
    heads = padded_heads(H)
    config = config or default_forward_config(heads)
    idx = _pad_keys(indices.to(torch.int32), forward_index_multiple(heads, config)).contiguous()
    kernel = forward_kernel(heads, D, idx.shape[1], float(scale), **config)
    out, lse = kernel(_pad_heads(q, heads).contiguous(), kv.contiguous(), idx)
    return out[:, :H], lse[:, :H]


def latent_backward(q, kv, grad_out, indices, lse, delta, scale, dkv=None, ordered=False,
                    **config):
    """The backward kernel on the contract's tensors -> (dq, dkv fp32); ``dkv``: an fp32
    accumulator of kv's shape that the kernel adds the latent gradient to (and returns), so that
    calls over query blocks share one buffer; ``ordered``: add it in a fixed order (bitwise
    reproducible; ORDERED_QUERY_BLOCK queries per kernel call, then ``ordered_row_sums``)
    instead of with atomics; ``config``: ``backward_program``'s tuning keywords
    (``default_backward_config`` when none are given)."""
    S, H, D = q.shape
    heads = padded_heads(H)
    config = config or default_backward_config(heads)
    idx = _pad_keys(indices.to(torch.int32), backward_index_multiple(config)).contiguous()
    kernel = backward_kernel(heads, D, idx.shape[1], float(scale), ordered=ordered, **config)
    if dkv is None:
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    elif dkv.shape != kv.shape or dkv.dtype != torch.float32 or not dkv.is_contiguous():
        raise ValueError(f"dkv must be a contiguous fp32 {list(kv.shape)}, got "
                         f"{dkv.dtype} {list(dkv.shape)}")
    q, kv, grad_out = (_pad_heads(q, heads).contiguous(), kv.contiguous(),
                       _pad_heads(grad_out, heads).contiguous())
    lse, delta = (_pad_heads(t[..., None], heads)[..., 0].contiguous() for t in (lse, delta))
    if not ordered:
        return kernel(q, kv, grad_out, idx, lse, delta, dkv)[:, :H], dkv
    dq = q.new_empty(S, H, D)
    for b0 in range(0, S, ORDERED_QUERY_BLOCK):
        b = slice(b0, b0 + ORDERED_QUERY_BLOCK)
        dq_block, rows = kernel(q[b], kv, grad_out[b], idx[b], lse[b], delta[b])
        add_rows_in_index_order(dkv, rows.view(-1, D), idx[b].view(-1))
        dq[b] = dq_block[:, :H]
        del rows  # before the next call allocates its own: one call's rows alive at a time
    return dq, dkv


def latent_dsa_kernels(ordered: bool = False, indexer_scores: str = "bf16",
                       attention_forward: str = "tilelang", forward_config: dict | None = None,
                       backward_config: dict | None = None) -> DSAKernels:
    """Our sparse-MLA kernels and the Triton indexer scores in the ``DSAKernels`` contract
    (``kv [T, 1, 512]``, ``indices [S, 1, K]``); ``ordered``: the backward's latent gradient
    summed in a fixed order (``latent_backward``); ``indexer_scores``: the score products'
    precision (``index_scores.INDEXER_SCORES``); ``attention_forward``: ``tilelang`` (ours) or
    ``flashmla`` (``flashmla_forward``); a clear error where they cannot run.
    ``forward_config`` / ``backward_config``: tuning keywords of our forward and backward
    programs (``forward_program``, ``backward_program``) for benchmarks; the layer takes the
    defaults."""
    if forward_config and attention_forward != "tilelang":
        raise ValueError(f"forward_config tunes our forward, not {attention_forward!r}'s")
    if not torch.cuda.is_available():
        raise RuntimeError("model.dsa.kernel=latent needs CUDA (TileLang kernels); "
                           "use model.dsa.kernel=torch on CPU")
    _tilelang()
    attend = {"tilelang": partial(latent_forward, **(forward_config or {})),
              "flashmla": flashmla_forward}[attention_forward]
    if attention_forward == "flashmla":
        sparse_prefill()  # its one-line error now, not at the first layer

    def forward(q, kv, indices, sm_scale):
        return attend(q, kv[:, 0], indices[:, 0], sm_scale)

    def backward(q, kv, out, grad_out, indices, lse, sm_scale, delta, dkv=None):
        dq, dkv = latent_backward(q, kv[:, 0], grad_out, indices[:, 0], lse, delta, sm_scale,
                                  None if dkv is None else dkv[:, 0], ordered=ordered,
                                  **(backward_config or {}))
        return dq, dkv[:, None]

    return DSAKernels(forward=forward, delta=row_dots, backward=backward,
                      index_keys=INDEXER_SCORES[indexer_scores].keys,
                      index_scores=INDEXER_SCORES[indexer_scores].scores, width=LATENT_WIDTH,
                      value_width=LATENT_WIDTH,
                      backward_adds_dkv=BACKWARD_ADDS_DKV, zero_without_keys=True)
