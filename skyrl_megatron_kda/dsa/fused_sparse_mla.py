"""Sparse NoPE-MLA on a set of sparse-MLA programs (``SparseMLAOps``), in the absorbed layout:
the wrapper the ``fused`` and ``latent`` kernels share.

``FusedAbsorbedSparseMLA`` wraps the programs in the absorbed layout of ``sparse_mla.py``: the
queries are absorbed (``q_nope @ W_UK``) and the value projection applied (``@ W_UV^T``) around
the kernel, one block of ``query_block`` queries at a time, so forward keeps only what the torch
kernel keeps (q_nope, the latent, the weight, the indices) and the [block, H, width] kernel
inputs and outputs are transient. The latent and the queries are zero-padded to the programs'
``width`` (576 for megatron-core's: zero channels add nothing to q . k, and the value is the
first 512 channels: exact). Backward recomputes each block's forward for its output and
log-sum-exp (megatron's own ``SparseMLA`` autograd does the same rather than keep them) and sums
the blocks' latent gradients in fp32. With ``keep_output``
(``model.dsa.fused.keep_attention_output``) the forward keeps every block's latent-space output
[S, H, 512] and log-sum-exp [S, H] instead, and backward reads them: one kernel forward less per
step, for that memory until the backward (the value projection's weight gradient needs the
latent-space output itself, so the log-sum-exp alone cannot replace the recompute).

The programs come in as ``ops``: ``ops.fused.fused_sparse_mla_ops()`` (megatron-core's) or
``ops.latent.interface.latent_sparse_mla_ops()`` (ours) on CUDA; the CPU tests pass a torch
stand-in with the same contract to check the padding, absorption and blocking here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops.contract import SparseMLAOps
from .ops.fused import fused_sparse_mla_ops
from .sparse_mla import check_indices, split_kv_up_weight


def kernel_latent(latent: torch.Tensor, ops: SparseMLAOps) -> torch.Tensor:
    """The latent [Tk, R] as the sparse-MLA ops take it: [Tk, 1, width], zero channels
    after the latent's, in the ops' dtype."""
    t = latent.to(ops.dtype or latent.dtype)
    if t.shape[-1] != ops.width:
        t = F.pad(t, (0, ops.width - t.shape[-1]))
    return t.contiguous()[:, None]


def kernel_indices(indices: torch.Tensor) -> torch.Tensor:
    """A block's indices [b, k] as the sparse-MLA ops take them: [b, 1, k] int32."""
    return indices.to(torch.int32)[:, None].contiguous()


class FusedAbsorbedSparseMLA(torch.autograd.Function):
    """``sparse_mla.absorbed_sparse_mla`` on ``SparseMLAOps``, in query blocks."""

    @staticmethod
    def forward(ctx, q_nope, latent, kv_up_weight, indices, scale, v_head_dim, query_block,
                ops: SparseMLAOps, keep_output: bool = False):
        if latent.dim() != 2 or latent.shape[-1] > ops.value_width:
            raise ValueError(f"the fused kernel takes a latent [Tk, R <= {ops.value_width}], "
                             f"got {list(latent.shape)}")
        check_indices(q_nope.shape[0], latent, indices, query_block)
        num_heads, qk_head_dim = q_nope.shape[1], q_nope.shape[2]
        w_uk, w_uv = split_kv_up_weight(kv_up_weight, num_heads, qk_head_dim, v_head_dim)
        kv = kernel_latent(latent, ops)
        out = q_nope.new_empty(q_nope.shape[0], num_heads, v_head_dim)
        kept_out, kept_lse = [], []
        for b0 in range(0, q_nope.shape[0], query_block):
            b1 = b0 + query_block
            q = absorbed_queries(q_nope[b0:b1], w_uk, ops)
            out_latent, lse = _attend(ops, q, kv, indices[b0:b1], scale)
            if keep_output:  # the block's own tensors (copied only where they are views)
                kept_out.append(out_latent.contiguous())
                kept_lse.append(lse.contiguous())
            _per_head_product(out_latent[..., :latent.shape[-1]], w_uv.transpose(1, 2),
                              out[b0:b1])
        ctx.save_for_backward(q_nope, latent, kv_up_weight, indices, *kept_out, *kept_lse)
        ctx.scale, ctx.v_head_dim, ctx.query_block, ctx.ops = (scale, v_head_dim, query_block,
                                                               ops)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_nope, latent, kv_up_weight, indices, *kept = ctx.saved_tensors
        ops, scale, R = ctx.ops, ctx.scale, latent.shape[-1]
        num_heads, qk_head_dim = q_nope.shape[1], q_nope.shape[2]
        w_uk, w_uv = split_kv_up_weight(kv_up_weight, num_heads, qk_head_dim, ctx.v_head_dim)
        kv = kernel_latent(latent, ops)
        acc = torch.promote_types(latent.dtype, torch.float32)
        grad_q = torch.empty_like(q_nope)
        grad_latent = torch.zeros(latent.shape, dtype=acc, device=latent.device)
        # The kernel adds into grad_latent itself where it can (no zeroed buffer and sum per call).
        adds_dkv = (ops.backward_adds_dkv and acc == torch.float32
                    and ops.width == latent.shape[-1])
        grad_uk = torch.zeros(w_uk.shape, dtype=acc, device=w_uk.device)
        grad_uv = torch.zeros(w_uv.shape, dtype=acc, device=w_uv.device)
        blocks = len(kept) // 2  # the forward's kept outputs, then their log-sum-exps
        for block, b0 in enumerate(range(0, q_nope.shape[0], ctx.query_block)):
            b1 = b0 + ctx.query_block
            q = absorbed_queries(q_nope[b0:b1], w_uk, ops)
            idx = indices[b0:b1]
            if kept:
                out_latent, lse = kept[block], kept[blocks + block]
            else:
                out_latent, lse = _attend(ops, q, kv, idx, scale)
            g_out = grad_out[b0:b1]
            grad_uv += _head_products(g_out, out_latent[..., :R], acc)
            # dL/d(latent-space output), zero where the forward's output was forced to zero.
            g_latent = _per_head_product(g_out, w_uv, _padded_heads_buffer(
                g_out, ops.value_width, R)).to(ops.dtype or g_out.dtype)
            if not ops.zero_without_keys:
                g_latent = torch.where(_has_keys(idx)[:, None, None], g_latent, 0)
            delta = ops.delta(out_latent, g_latent)
            into = {"dkv": grad_latent[:, None]} if adds_dkv else {}
            dq, dkv = ops.backward(q, kv, None, g_latent, kernel_indices(idx),
                                       lse, sm_scale=scale, delta=delta, **into)
            if not adds_dkv:
                grad_latent += dkv[:, 0, :R].to(acc)
            dq = dq[..., :R]
            _per_head_product(dq, w_uk.transpose(1, 2), grad_q[b0:b1])
            grad_uk += _head_products(q_nope[b0:b1], dq, acc)
        grad_weight = torch.cat([grad_uk, grad_uv], dim=1).view(kv_up_weight.shape)
        return (grad_q, grad_latent.to(latent.dtype), grad_weight.to(kv_up_weight.dtype),
                None, None, None, None, None, None)


def absorbed_queries(q_nope: torch.Tensor, w_uk: torch.Tensor, ops: SparseMLAOps) -> torch.Tensor:
    """[b, H, dn] @ W_UK [H, dn, R] -> the ops' [b, H, width] queries."""
    q = _per_head_product(q_nope, w_uk, _padded_heads_buffer(q_nope, ops.width,
                                                             w_uk.shape[-1]))
    return q.to(ops.dtype or q.dtype)


def _padded_heads_buffer(x: torch.Tensor, width: int, channels: int) -> torch.Tensor:
    """An empty [b, H, width] in x's dtype whose channels after ``channels`` are zero."""
    out = x.new_empty(*x.shape[:2], width)
    out[..., channels:].zero_()
    return out


def _per_head_product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[:, h, :n] = x[:, h] @ w[h] for x [b, H, k], w [H, k, n], out [b, H, >= n]
    (returned): one batched GEMM over the heads that writes the [b, H, n] layout where it lies
    (cuBLAS takes its row stride), in out's dtype; an einsum writes [H, b, n] and the layout
    needs a copy of it (a block's absorbed queries, the output, dq: each a [b, H, n] tensor per
    query block)."""
    n = w.shape[-1]
    torch.bmm(x.to(out.dtype).transpose(0, 1), w.to(out.dtype), out=out[..., :n].transpose(0, 1))
    return out


def _head_products(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """sum_q a[q, h, :]^T b[q, h, :] -> [H, x, y] in ``acc`` (a weight gradient's share of one
    call): one GEMM per head. bf16/fp16 operands on CUDA go in as they are with fp32 output
    (the tensor cores accumulate in fp32), not as fp32 copies through an fp32 GEMM, which
    would double the bytes read and run at the fp32 rate; elsewhere (CPU, fp32/fp64) in
    ``acc``."""
    a_t, b_t = a.permute(1, 2, 0), b.permute(1, 0, 2)
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a_t, b_t, out_dtype=acc)
    return torch.bmm(a_t.to(acc), b_t.to(acc))


def _has_keys(indices: torch.Tensor) -> torch.Tensor:
    """[b] queries with at least one selected key (the others' output is 0, as in torch's)."""
    return (indices >= 0).any(dim=-1)


def _attend(ops: SparseMLAOps, q, kv, indices, scale):
    """One block through the forward kernel -> latent-space output [b, H, 512] (0 for a query
    with no key) and log-sum-exp."""
    out, lse = ops.forward(q, kv, kernel_indices(indices), scale)
    if ops.zero_without_keys:
        return out, lse
    # A query with no key: its log-sum-exp is -inf; 0 keeps the backward's exp(score - lse)
    # at 0 for its masked keys instead of NaN (megatron's SparseMLA does the same).
    has_keys = _has_keys(indices)
    return torch.where(has_keys[:, None, None], out, 0), torch.where(has_keys[:, None], lse, 0)


def fused_absorbed_sparse_mla(q_nope: torch.Tensor, latent: torch.Tensor,
                              kv_up_weight: torch.Tensor, indices: torch.Tensor, scale: float,
                              v_head_dim: int, query_block: int,
                              ops: SparseMLAOps | None = None,
                              keep_output: bool = False) -> torch.Tensor:
    """``sparse_mla.absorbed_sparse_mla`` on sparse-MLA programs (``ops`` defaults to
    ``fused_sparse_mla_ops()``): queries [Tq, H, dn], latent [Tk, R <= 512], the kv
    up-projection weight [H * (dn + dv), R], indices [Tq, topk] -> [Tq, H, dv]. ``keep_output``:
    keep the kernel's output and log-sum-exp for the backward rather than recompute them; only
    where a backward will run (under ``no_grad``, as in a recomputed layer's first forward,
    nothing is kept)."""
    if q_nope.dim() != 3:
        raise ValueError(f"expected q_nope [Tq, H, dn], got {list(q_nope.shape)}")
    keep = keep_output and torch.is_grad_enabled() and any(
        t.requires_grad for t in (q_nope, latent, kv_up_weight))
    return FusedAbsorbedSparseMLA.apply(q_nope, latent, kv_up_weight, indices, scale, v_head_dim,
                                        query_block, ops or fused_sparse_mla_ops(), keep)
