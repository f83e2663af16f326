"""Sparse NoPE-MLA on megatron-core's TileLang DSA kernels (``model.dsa.kernel=fused``).

megatron-core 0.19.2 ships DeepSeek-V3.2's sparse-MLA kernels (forward, backward and the
backward's ``delta`` pre-pass) under ``experimental_attention_variant/ops``. They attend with
queries [S, H, 576] over one shared latent [T, 1, 576] at int32 indices [S, 1, topk] (-1 = not
selected) and return the latent-space output [S, H, 512] (the first 512 channels of the selected
rows) and a log-sum-exp. They are specialised for DeepSeek's 512 latent + 64 RoPE channels;
GLM's NoPE latent is 512 wide, so the absorbed queries and the latent are zero-padded to 576
(zero channels add nothing to q . k, and the value is the first 512 channels: exact). They pad
heads (to a power of two >= 16), rows and the top-k width (to 64) themselves.

``FusedAbsorbedSparseMLA`` wraps them in the absorbed layout of ``sparse_mla.py``: the queries
are absorbed (``q_nope @ W_UK``) and the value projection applied (``@ W_UV^T``) around the
kernel, one block of ``query_block`` queries at a time, so forward keeps only what the torch
kernel keeps (q_nope, the latent, the weight, the indices) and the [block, H, 576] kernel inputs
and outputs are transient. Backward recomputes each block's forward for its output and
log-sum-exp (megatron's own ``SparseMLA`` autograd does the same rather than keep them) and sums
the blocks' latent gradients in fp32. With ``keep_output`` (``model.dsa.keep_attention_output``)
the forward keeps every block's latent-space output [S, H, 512] and log-sum-exp [S, H] instead,
and backward reads them: one kernel forward less per step, for that memory until the backward
(the value projection's weight gradient needs the latent-space output itself, so the log-sum-exp
alone cannot replace the recompute).

The kernels are passed in as ``DSAKernels``: ``fused_dsa_kernels()`` on CUDA; the CPU tests
pass a torch stand-in with the same contract to check the padding, absorption and blocking here.
The same set carries the indexer-score kernel that the fused indexer
(``pool_topk.fused_block_topk``) uses: ours in Triton (``index_scores.py``). The fused kernel
(``kernels/fused.py``) runs both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.experimental_attention_variant.ops import (
    tilelang_sparse_mla_bwd,
    tilelang_sparse_mla_fwd,
)

from .index_scores import GROUP, INDEXER_SCORES, keys_as_they_are, pool_scores
from .sparse_mla import check_indices, split_kv_up_weight

KERNEL_WIDTH = 576
"""Query/latent channels the TileLang kernels are specialised for (512 latent + 64 RoPE)."""
KERNEL_VALUE_WIDTH = 512
"""Output channels of the kernels: the first 512 channels of the selected latent rows."""


@dataclass(frozen=True)
class DSAKernels:
    """megatron-core's TileLang DSA kernels, by their contract.

    Sparse MLA: ``forward(q [S, H, 576], kv [T, 1, 576], indices [S, 1, k] int32, sm_scale) ->
    (out [S, H, 512], lse [S, H])``; ``delta(out, grad_out) -> [S, H]``; ``backward(q, kv,
    None, grad_out, indices, lse, sm_scale, delta) -> (dq [S, H, 576], dkv [T, 1, 576])``.
    Indexer: ``index_scores(q [S, h, d], keys [P, d], weights [S, h] fp32, ks [S] int32,
    ke [S] int32) -> (scores [S, P], maxima [S, G])`` fp32: sum_h weights * relu(q . k), -inf
    outside [ks, ke), and the scores' maxima over consecutive groups of ``index_group`` pools
    (G = ceil(P / index_group); the exact top-k's floor, ``threshold_topk``); ``index_keys``
    prepares an indexer pass's pool keys [P, d] once for the scores of every query block (FP8:
    ``index_scores.FP8Keys``), which take ranges of its rows.
    ``dtype`` is what the inputs are cast to (None: left as they are); ``width`` the channels
    the sparse-MLA kernels take (576 above: the latent is zero-padded to it) and
    ``value_width`` those of their output. The log-sum-exp is the forward's to define and the
    backward's to read. ``backward_adds_dkv``: the backward also takes ``dkv=``, an fp32 [T, 1,
    width] accumulator that it adds its latent gradient to, so the calls of a layer share one
    buffer instead of each zeroing and adding a fresh one (ours; megatron-core's has no such
    argument). ``zero_without_keys``: for a query with no selected key the forward already
    gives output and log-sum-exp 0 and the backward dq 0 and no latent gradient, so the wrapper
    skips its masking copies (ours; megatron-core's gives a log-sum-exp of -inf)."""

    forward: Callable
    delta: Callable
    backward: Callable
    index_scores: Callable
    index_group: int = GROUP
    index_keys: Callable = keys_as_they_are
    dtype: torch.dtype | None = torch.bfloat16
    width: int = KERNEL_WIDTH
    value_width: int = KERNEL_VALUE_WIDTH
    backward_adds_dkv: bool = False
    zero_without_keys: bool = False


def fused_dsa_kernels(indexer_scores: str = "bf16") -> DSAKernels:
    """megatron-core's TileLang sparse-MLA kernels and our Triton indexer scores
    (``index_scores.pool_scores``: megatron's TileLang indexer kernel computes the same scores
    but was 9x slower on an H200, README.md), on the products ``indexer_scores`` names
    (``index_scores.INDEXER_SCORES``); a clear error where they cannot run."""
    if not torch.cuda.is_available():
        raise RuntimeError("model.dsa.kernel=fused needs CUDA (TileLang kernels); "
                           "use model.dsa.kernel=torch on CPU")
    if not tilelang_sparse_mla_fwd.HAVE_TILELANG:
        raise RuntimeError("model.dsa.kernel=fused needs the tilelang package "
                           "(pip install 'skyrl-megatron-kda[gpu]'), or use model.dsa.kernel=torch")
    return DSAKernels(forward=tilelang_sparse_mla_fwd.sparse_mla_fwd_interface,
                      delta=tilelang_sparse_mla_bwd.sparse_mla_delta,
                      backward=tilelang_sparse_mla_bwd.sparse_mla_bwd,
                      index_keys=INDEXER_SCORES[indexer_scores].keys,
                      index_scores=INDEXER_SCORES[indexer_scores].scores)


def kernel_latent(latent: torch.Tensor, kernels: DSAKernels) -> torch.Tensor:
    """The latent [Tk, R] as the sparse-MLA kernels take it: [Tk, 1, width], zero channels
    after the latent's, in the kernels' dtype."""
    t = latent.to(kernels.dtype or latent.dtype)
    if t.shape[-1] != kernels.width:
        t = F.pad(t, (0, kernels.width - t.shape[-1]))
    return t.contiguous()[:, None]


def kernel_indices(indices: torch.Tensor) -> torch.Tensor:
    """A block's indices [b, k] as the sparse-MLA kernels take them: [b, 1, k] int32."""
    return indices.to(torch.int32)[:, None].contiguous()


class FusedAbsorbedSparseMLA(torch.autograd.Function):
    """``sparse_mla.absorbed_sparse_mla`` on ``DSAKernels``, in query blocks."""

    @staticmethod
    def forward(ctx, q_nope, latent, kv_up_weight, indices, scale, v_head_dim, query_block,
                kernels: DSAKernels, keep_output: bool = False):
        if latent.dim() != 2 or latent.shape[-1] > kernels.value_width:
            raise ValueError(f"the fused kernel takes a latent [Tk, R <= {kernels.value_width}], "
                             f"got {list(latent.shape)}")
        check_indices(q_nope.shape[0], latent, indices, query_block)
        num_heads, qk_head_dim = q_nope.shape[1], q_nope.shape[2]
        w_uk, w_uv = split_kv_up_weight(kv_up_weight, num_heads, qk_head_dim, v_head_dim)
        kv = kernel_latent(latent, kernels)
        out = q_nope.new_empty(q_nope.shape[0], num_heads, v_head_dim)
        kept_out, kept_lse = [], []
        for b0 in range(0, q_nope.shape[0], query_block):
            b1 = b0 + query_block
            q = absorbed_queries(q_nope[b0:b1], w_uk, kernels)
            out_latent, lse = _attend(kernels, q, kv, indices[b0:b1], scale)
            if keep_output:  # the block's own tensors (copied only where they are views)
                kept_out.append(out_latent.contiguous())
                kept_lse.append(lse.contiguous())
            _per_head_product(out_latent[..., :latent.shape[-1]], w_uv.transpose(1, 2),
                              out[b0:b1])
        ctx.save_for_backward(q_nope, latent, kv_up_weight, indices, *kept_out, *kept_lse)
        ctx.scale, ctx.v_head_dim, ctx.query_block, ctx.kernels = (scale, v_head_dim,
                                                                   query_block, kernels)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_nope, latent, kv_up_weight, indices, *kept = ctx.saved_tensors
        kernels, scale, R = ctx.kernels, ctx.scale, latent.shape[-1]
        num_heads, qk_head_dim = q_nope.shape[1], q_nope.shape[2]
        w_uk, w_uv = split_kv_up_weight(kv_up_weight, num_heads, qk_head_dim, ctx.v_head_dim)
        kv = kernel_latent(latent, kernels)
        acc = torch.promote_types(latent.dtype, torch.float32)
        grad_q = torch.empty_like(q_nope)
        grad_latent = torch.zeros(latent.shape, dtype=acc, device=latent.device)
        # The kernel adds into grad_latent itself where it can (no zeroed buffer and sum per call).
        adds_dkv = (kernels.backward_adds_dkv and acc == torch.float32
                    and kernels.width == latent.shape[-1])
        grad_uk = torch.zeros(w_uk.shape, dtype=acc, device=w_uk.device)
        grad_uv = torch.zeros(w_uv.shape, dtype=acc, device=w_uv.device)
        blocks = len(kept) // 2  # the forward's kept outputs, then their log-sum-exps
        for block, b0 in enumerate(range(0, q_nope.shape[0], ctx.query_block)):
            b1 = b0 + ctx.query_block
            q = absorbed_queries(q_nope[b0:b1], w_uk, kernels)
            idx = indices[b0:b1]
            if kept:
                out_latent, lse = kept[block], kept[blocks + block]
            else:
                out_latent, lse = _attend(kernels, q, kv, idx, scale)
            g_out = grad_out[b0:b1]
            grad_uv += _head_products(g_out, out_latent[..., :R], acc)
            # dL/d(latent-space output), zero where the forward's output was forced to zero.
            g_latent = _per_head_product(g_out, w_uv, _padded_heads_buffer(
                g_out, kernels.value_width, R)).to(kernels.dtype or g_out.dtype)
            if not kernels.zero_without_keys:
                g_latent = torch.where(_has_keys(idx)[:, None, None], g_latent, 0)
            delta = kernels.delta(out_latent, g_latent)
            into = {"dkv": grad_latent[:, None]} if adds_dkv else {}
            dq, dkv = kernels.backward(q, kv, None, g_latent, kernel_indices(idx),
                                       lse, sm_scale=scale, delta=delta, **into)
            if not adds_dkv:
                grad_latent += dkv[:, 0, :R].to(acc)
            dq = dq[..., :R]
            _per_head_product(dq, w_uk.transpose(1, 2), grad_q[b0:b1])
            grad_uk += _head_products(q_nope[b0:b1], dq, acc)
        grad_weight = torch.cat([grad_uk, grad_uv], dim=1).view(kv_up_weight.shape)
        return (grad_q, grad_latent.to(latent.dtype), grad_weight.to(kv_up_weight.dtype),
                None, None, None, None, None, None)


def absorbed_queries(q_nope: torch.Tensor, w_uk: torch.Tensor, kernels: DSAKernels) -> torch.Tensor:
    """[b, H, dn] @ W_UK [H, dn, R] -> the kernels' [b, H, width] queries."""
    q = _per_head_product(q_nope, w_uk, _padded_heads_buffer(q_nope, kernels.width,
                                                             w_uk.shape[-1]))
    return q.to(kernels.dtype or q.dtype)


def _padded_heads_buffer(x: torch.Tensor, width: int, channels: int) -> torch.Tensor:
    """An empty [b, H, width] in x's dtype whose channels after ``channels`` are zero."""
    out = x.new_empty(*x.shape[:2], width)
    out[..., channels:].zero_()
    return out


def _per_head_product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:, h, :n] = x[:, h] @ w[h] for x [b, H, k], w [H, k, n], out [b, H, >= n]
    (returned): one batched GEMM over the heads that writes the [b, H, n] layout where it lies
    (cuBLAS takes its row stride), in out's dtype; an einsum writes [H, b, n] and the layout
    needs a copy of it (a block's absorbed queries, the output, dq: gigabytes a pass at the 1M
    share)."""
    n = w.shape[-1]
    torch.bmm(x.to(out.dtype).transpose(0, 1), w.to(out.dtype), out=out[..., :n].transpose(0, 1))
    return out


def _head_products(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """sum_q a[q, h, :]^T b[q, h, :] -> [H, x, y] in ``acc`` (a weight gradient's share of one
    call): one GEMM per head. bf16/fp16 operands on CUDA go in as they are with fp32 output
    (the tensor cores accumulate in fp32), not as fp32 copies through an fp32 GEMM, which cost
    tens of ms per layer at the 1M share; elsewhere (CPU, fp32/fp64) in ``acc``."""
    a_t, b_t = a.permute(1, 2, 0), b.permute(1, 0, 2)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a_t, b_t, out_dtype=acc)
    return torch.bmm(a_t.to(acc), b_t.to(acc))


def _has_keys(indices: torch.Tensor) -> torch.Tensor:
    """[b] queries with at least one selected key (the others' output is 0, as in torch's)."""
    return (indices >= 0).any(dim=-1)


def _attend(kernels: DSAKernels, q, kv, indices, scale):
    """One block through the forward kernel -> latent-space output [b, H, 512] (0 for a query
    with no key) and log-sum-exp."""
    out, lse = kernels.forward(q, kv, kernel_indices(indices), scale)
    if kernels.zero_without_keys:
        return out, lse
    # A query with no key: its log-sum-exp is -inf; 0 keeps the backward's exp(score - lse)
    # at 0 for its masked keys instead of NaN (megatron's SparseMLA does the same).
    has_keys = _has_keys(indices)
    return torch.where(has_keys[:, None, None], out, 0), torch.where(has_keys[:, None], lse, 0)


def fused_absorbed_sparse_mla(q_nope: torch.Tensor, latent: torch.Tensor,
                              kv_up_weight: torch.Tensor, indices: torch.Tensor, scale: float,
                              v_head_dim: int, query_block: int,
                              kernels: DSAKernels | None = None,
                              keep_output: bool = False) -> torch.Tensor:
    """``sparse_mla.absorbed_sparse_mla`` on megatron-core's TileLang kernels (``kernels``
    defaults to ``fused_dsa_kernels()``): queries [Tq, H, dn], latent [Tk, R <= 512], the kv
    up-projection weight [H * (dn + dv), R], indices [Tq, topk] -> [Tq, H, dv]. ``keep_output``:
    keep the kernel's output and log-sum-exp for the backward rather than recompute them; only
    where a backward will run (under ``no_grad``, as in a recomputed layer's first forward,
    nothing is kept)."""
    if q_nope.dim() != 3:
        raise ValueError(f"expected q_nope [Tq, H, dn], got {list(q_nope.shape)}")
    keep = keep_output and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q_nope, latent, kv_up_weight))
    return FusedAbsorbedSparseMLA.apply(q_nope, latent, kv_up_weight, indices, scale, v_head_dim,
                                        query_block, kernels or fused_dsa_kernels(), keep)
