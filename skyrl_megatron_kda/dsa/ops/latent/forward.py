"""The forward programs of our sparse attention over GLM's latent (TileLang).

Both take ``q [S, H, D]``, the latent ``kv [T, D]`` and ``indices [S, K]`` int32 (-1: not
selected) and write the latent-space output and the natural log-sum-exp of ``scale * q . k``
(0 and 0 for a query with no key). One thread block per (query, head group) runs an online
softmax over the selected keys, a key block at a time:

* ``forward_program``: every warp gathers, multiplies and normalises in turn; the gathers of
  the next block are pipelined against the current block's products. It fits any head group
  up to 64 (fewer heads take fewer warps).
* ``_warp_specialized_forward`` (``warp_specialized=True``): three warpgroups, one gathering
  the next key blocks into two stages with cp.async while two take the products and the
  softmax, handing stages and probabilities over with mbarriers. Whole 64-head groups take it
  by default (``interface.default_forward_config``).
"""

# No `from __future__ import annotations`: TileLang reads the kernels' annotations as objects.

from .common import (
    HEAD_BLOCK,
    LOG2E,
    block_gather_macro,
    forward_signature,
    load_tilelang,
    natural_lse_macro,
    threads_for,
)

FORWARD_KEY_BLOCK = 64
"""Selected keys per step of the forward kernel (the top-k width is padded to a multiple)."""
FORWARD_PASS_CONFIGS = ("TL_DISABLE_TMA_LOWER", "TL_DISABLE_WARP_SPECIALIZED")
"""TileLang passes the forward turns off: its gathers are per-row loads, not bulk copies."""


def block_probabilities_macro(T, log2_scale: float, heads: int, key_block: int, width: int):
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


def row_gathers_macro(T, key_block: int, width: int):
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
                    deferred_sum: bool = False, warp_specialized: bool = False):
    """The forward for ``heads`` (as ``padded_heads`` gives), latent width ``dim`` and a top-k
    width ``topk`` (a multiple of ``key_block``): one thread block per (query, head group) runs
    an online softmax over the selected keys, ``key_block`` at a time, gathering their latent
    rows into shared memory (pipelined against the previous block's MMAs).

    ``deferred_sum`` (a tuning ``bench/latent_sparse_mla.py --forward-configs`` times) keeps
    the softmax denominators as running sums per score element (rescaled with the output) and
    adds them over the keys once at the end, so a block needs one exchange between the
    warpgroups (the maximum) instead of two. ``warp_specialized``: ``_warp_specialized_forward``
    instead (64-head groups, two stages, a top-k width of whole pairs of key blocks)."""
    if topk % key_block:
        raise ValueError(f"the top-k width ({topk}) must be a multiple of the key block "
                         f"({key_block})")
    if warp_specialized:
        if threads is not None or num_stages != 2 or deferred_sum:
            raise ValueError("the warp-specialised forward has its own threads (384), two "
                             "stages and no deferred sums")
        return _warp_specialized_forward(heads, dim, topk, scale, key_block)
    tilelang, T = load_tilelang()
    BH, BK = min(heads, HEAD_BLOCK), key_block
    threads = threads or threads_for(BH)
    groups, steps = heads // BH, topk // BK
    log2_scale = scale * LOG2E
    natural_lse = natural_lse_macro(T, log2_scale)
    gather_block = block_gather_macro(T, BK, dim)
    bf16, f32 = "bfloat16", "float32"
    S, t = forward_signature(T, heads, dim, topk)

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


def _warp_specialized_forward(heads: int, dim: int, topk: int, scale: float, key_block: int):
    """``forward_program``'s attention with its three jobs on three warpgroups (384 threads),
    so a block's gathers, score product and softmax, and value product overlap: warpgroup 0
    takes the score product, the online softmax and the left half of the value product,
    warpgroup 1 the right half, warpgroup 2 gathers the latent rows of the next key blocks
    into two stages with cp.async. mbarriers hand the stages, the probabilities and their
    rescale between them; the queries come by one TMA copy. The pipelined forward runs those
    jobs one after the other in every warp, with block-wide barriers and all-reduce steps
    between them every key block."""
    BH, BK, S2 = HEAD_BLOCK, key_block, 2
    if heads % BH or dim % 128 or BK % 16 or topk % (S2 * BK):
        raise ValueError(f"the warp-specialised forward takes heads in groups of {BH}, a width "
                         f"that 128 divides, a key block that 16 divides and a top-k width of "
                         f"pairs of key blocks, got {heads}, {dim}, {topk} (key block {BK})")
    tilelang, T = load_tilelang()
    groups, steps = heads // BH, topk // BK
    pairs = steps // S2
    half = dim // 2
    log2_scale = scale * LOG2E
    natural_lse = natural_lse_macro(T, log2_scale)
    bf16, f32 = "bfloat16", "float32"
    S, t = forward_signature(T, heads, dim, topk)
    gather = row_gathers_macro(T, BK, dim)
    probabilities = block_probabilities_macro(T, log2_scale, BH, BK, half)

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

