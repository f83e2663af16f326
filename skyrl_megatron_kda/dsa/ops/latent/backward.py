"""The backward programs of our sparse attention over GLM's latent (TileLang).

Both take the forward's natural log-sum-exp and ``delta = sum(dO * O)`` per query and head from
their caller, rebuild each key block's probabilities, accumulate ``dq`` in registers and write
the latent gradient ``dS^T Q + P^T dO`` in fp32: added into ``dKV`` [Tk, D] by 16-byte atomics
staged through shared memory (so the calls over query blocks share one buffer), or, when
``ordered``, written to each query's rows ``dKV`` [S, K, D] for ``ordered_row_sums`` to add in a
fixed order (bitwise-equal gradients on every run).

* ``backward_program``: key blocks of ``key_block`` rows, its products on per-warp tiles; it
  fits any head group up to 64.
* ``_stacked_backward`` (``stacked=True``): ``[Q; dO]`` one operand, so each key block takes
  three warpgroup MMAs of 64-row tiles and the latent gradient comes out transposed; whole
  64-head groups take it by default (``interface.default_backward_config``).
"""

# No `from __future__ import annotations`: TileLang reads the kernels' annotations as objects.

from .common import (
    HEAD_BLOCK,
    LOG2E,
    SHARED_BYTES,
    backward_signature,
    block_gather_macro,
    load_tilelang,
    threads_for,
)

BACKWARD_KEY_BLOCK = 32
"""Selected keys per step of the backward programs (the top-k width is padded to a multiple):
the fastest block and staging that ``bench/latent_sparse_mla.py --backward-configs`` times."""


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
    one after the other (its accumulator is [dim / channel_split, key_block]: fewer registers,
    so fewer spills; ``bench/kernel_resources.py`` counts them)."""
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
    tilelang, T = load_tilelang()
    groups, steps = heads // BH, topk // BK
    log2_scale = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    S, t = backward_signature(T, heads, dim, topk, ordered)
    gather_block = block_gather_macro(T, BK, dim)
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
    tilelang, T = load_tilelang()
    threads = threads or threads_for(BH)
    groups, steps = heads // BH, topk // BK
    part = BK // store_split
    log2_scale = scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    S, t = backward_signature(T, heads, dim, topk, ordered)
    gather_block = block_gather_macro(T, BK, dim)
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


