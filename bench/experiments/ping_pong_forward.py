"""The ping-pong forward: an opt-in variant of our warp-specialised sparse-MLA forward that did
not beat it (bench/experiments/README.md), kept runnable for the benches.

``ping_pong_program`` is the TileLang program. ``forward_program`` and ``latent_forward`` take the
package's keywords plus ``ping_pong`` (with ``warp_specialized``), so the benches' JSON tunings
(``{"warp_specialized": true, "ping_pong": true}``) reach it; ``latent_ops`` is the package's
``latent_sparse_mla_ops`` with its forward swapped in when the forward tuning names it.
"""

# No `from __future__ import annotations`: TileLang reads the kernels' annotations as objects.

import dataclasses
from functools import lru_cache

import torch

from skyrl_megatron_kda.dsa.ops.latent import forward as package_forward
from skyrl_megatron_kda.dsa.ops.latent import interface
from skyrl_megatron_kda.dsa.ops.latent.common import (
    HEAD_BLOCK,
    LOG2E,
    forward_signature,
    load_tilelang,
    natural_lse_macro,
    pad_heads,
    pad_keys,
    padded_heads,
)
from skyrl_megatron_kda.dsa.ops.latent.forward import (
    FORWARD_KEY_BLOCK,
    FORWARD_PASS_CONFIGS,
    block_probabilities_macro,
    row_gathers_macro,
)


def forward_program(heads: int, dim: int, topk: int, scale: float, ping_pong: bool = False,
                    **config):
    """The package's ``forward_program``, or with ``ping_pong`` (and ``warp_specialized``, whose
    shapes it takes: 64-head groups, pairs of key blocks) ``ping_pong_program``."""
    if not ping_pong:
        return package_forward.forward_program(heads, dim, topk, scale, **config)
    key_block = _key_block(config)
    if topk % key_block:
        raise ValueError(f"the top-k width ({topk}) must be a multiple of the key block "
                         f"({key_block})")
    return ping_pong_program(heads, dim, topk, scale, key_block)


def _key_block(config: dict) -> int:
    """The ping-pong forward's key block from the other keywords of its tuning, which must
    name the warp-specialised forward and nothing it does not take."""
    if not config.get("warp_specialized"):
        raise ValueError("ping_pong is a warp-specialised forward: name warp_specialized too")
    if set(config) - {"warp_specialized", "key_block"}:
        raise ValueError("the warp-specialised forward has its own threads (384), two stages "
                         "and no deferred sums")
    return config.get("key_block", FORWARD_KEY_BLOCK)


@lru_cache(maxsize=None)
def forward_kernel(heads: int, dim: int, topk: int, scale: float, key_block: int):
    tilelang, _ = load_tilelang()
    passes = {getattr(tilelang.PassConfigKey, key): True for key in FORWARD_PASS_CONFIGS}
    return tilelang.compile(ping_pong_program(heads, dim, topk, scale, key_block),
                            out_idx=[-2, -1], pass_configs=passes)


def latent_forward(q, kv, indices, scale, ping_pong: bool = False, **config):
    """``interface.latent_forward``, or the ping-pong forward with its padding (heads as the
    package pads them, the top-k width to a pair of key blocks)."""
    if not ping_pong:
        return interface.latent_forward(q, kv, indices, scale, **config)
    S, H, D = q.shape
    heads, key_block = padded_heads(H), _key_block(config)
    idx = pad_keys(indices.to(torch.int32), 2 * key_block).contiguous()
    kernel = forward_kernel(heads, D, idx.shape[1], float(scale), key_block)
    out, lse = kernel(pad_heads(q, heads).contiguous(), kv.contiguous(), idx)
    return out[:, :H], lse[:, :H]


def latent_ops(forward_config: dict | None = None, **options):
    """``interface.latent_sparse_mla_ops(forward_config=..., **options)``; a forward tuning that
    names ``ping_pong`` swaps the ping-pong forward in."""
    config = dict(forward_config or {})
    if not config.pop("ping_pong", False):
        return interface.latent_sparse_mla_ops(forward_config=forward_config, **options)
    if options.get("attention_forward", "tilelang") != "tilelang":
        raise ValueError(f"forward_config tunes our forward, not "
                         f"{options['attention_forward']!r}'s")
    _key_block(config)
    ops = interface.latent_sparse_mla_ops(**options)

    def forward(q, kv, indices, sm_scale):
        return latent_forward(q, kv[:, 0], indices[:, 0], sm_scale, ping_pong=True, **config)

    return dataclasses.replace(ops, forward=forward)


def ping_pong_program(heads: int, dim: int, topk: int, scale: float, key_block: int):
    """``forward_program``'s attention with the two math warpgroups taking turns over the key
    blocks, so their work is even and one's softmax runs under the other's products: of each
    pair of key blocks, warpgroup 0 takes the first block's score product and softmax,
    warpgroup 1 the second's, and each then takes its half of the value channels (0 the left,
    1 the right) over both blocks, the other's probabilities coming through shared memory.
    The running maximum passes from 0 to 1 and back once a pair: 1 starts its softmax from
    0's maximum, and 0 rescales its block's probabilities to 1's before handing them over.
    Warpgroup 2 gathers each block's latent rows in two halves of channels, ordered so the
    halves the math warpgroups free first are refilled first (a block's left half serves only
    0, the second block's right half only 1). The package's warp-specialised forward gives
    warpgroup 0 the whole score product and softmax, and two thirds of the products."""
    BH, BK = HEAD_BLOCK, key_block
    if heads % BH or dim % 128 or BK % 16 or topk % (2 * BK):
        raise ValueError(f"the ping-pong forward takes heads in groups of {BH}, a width that 128 "
                         f"divides, a key block that 16 divides and a top-k width of pairs of "
                         f"key blocks, got {heads}, {dim}, {topk} (key block {BK})")
    tilelang, T = load_tilelang()
    groups, pairs, half = heads // BH, topk // (2 * BK), dim // 2
    log2_scale = scale * LOG2E
    natural_lse = natural_lse_macro(T, log2_scale)
    bf16, f32 = "bfloat16", "float32"
    S, t = forward_signature(T, heads, dim, topk)
    gather = row_gathers_macro(T, BK, half)
    probabilities = block_probabilities_macro(T, log2_scale, BH, BK, half)
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
