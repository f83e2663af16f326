"""Sparse NoPE-MLA attention in the absorbed layout, with memory linear in the query count.

Absorbed layout: with ``W = linear_kv_up_proj.weight`` viewed [H, dn + dv, R] (rows of head h:
its ``dn`` key channels, then its ``dv`` value channels; R = kv_lora_rank), head h's key and
value are ``c_kv @ W_UK[h].T`` and ``c_kv @ W_UV[h].T`` for the normalised KV latent ``c_kv``
[T, R]. So ``q . k = (q @ W_UK[h]) . c_kv`` and ``sum_j p_j v_j = (sum_j p_j c_kv_j) @ W_UV[h].T``:
the heads attend over the latent itself (one [T, R] tensor shared by every head) and the value
projection is applied once per query after attention. The softmax scale is the unabsorbed
layer's (megatron's MLA: ``mscale**2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``).

``SparseLatentAttention`` walks the queries in blocks. Forward gathers a block's selected latent
rows, computes all heads' scores, softmaxes in fp32 and keeps one log-sum-exp per
(query, head); backward gathers again, rebuilds the probabilities from the
log-sum-exp and scatters the latent gradient with ``index_add_``. What autograd keeps is the
inputs, the indices and the log-sum-exp (not the output: backward forms dL/dp anyway and takes
sum_j p_j dL/dp_j from it): nothing of size queries x top-k x R, which is what a
gather-then-softmax path (megatron's ``unfused_dsa_fn``) keeps per head.

``AbsorbedSparseMLA`` (what ``absorbed_sparse_mla`` and the DSA layer run) does the same with the
absorption ``q_nope @ W_UK`` and the value projection ``@ W_UV^T`` inside each block, so it keeps
q_nope [Tq, H, dn] rather than the absorbed queries and the latent-space output [Tq, H, R] each.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half inputs; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _check_inputs(q_abs, latent, indices, block_size) -> None:
    if q_abs.dim() != 3 or latent.dim() != 2 or q_abs.shape[-1] != latent.shape[-1]:
        raise ValueError(f"expected q_abs [Tq, H, R] and latent [Tk, R], got "
                         f"{list(q_abs.shape)} and {list(latent.shape)}")
    check_indices(q_abs.shape[0], latent, indices, block_size)


def check_indices(n_queries, latent, indices, block_size) -> None:
    if indices.dim() != 2 or indices.shape[0] != n_queries:
        raise ValueError(f"indices must be [Tq={n_queries}, topk], got {list(indices.shape)}")
    if indices.is_floating_point() or indices.is_complex():
        raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= latent.shape[0]):
        raise ValueError(f"indices must lie in [-1, {latent.shape[0]}), got "
                         f"[{int(indices.min())}, {int(indices.max())}]")


def _block_scores(q_block, latent, idx_block, scale, dtype):
    """Selected latent rows [n, k, R] and masked scores [n, H, k] of one query block."""
    n, k = idx_block.shape
    rows = latent.index_select(0, idx_block.clamp(min=0).reshape(-1).long())
    rows = rows.view(n, k, -1).to(dtype)
    scores = torch.bmm(q_block.to(dtype), rows.transpose(1, 2)) * scale
    scores.masked_fill_((idx_block < 0)[:, None, :], float("-inf"))
    return rows, scores


class SparseLatentAttention(torch.autograd.Function):
    """out [Tq, H, R] = softmax(scale * q_abs . latent[indices]) @ latent[indices], per head."""

    @staticmethod
    def forward(ctx, q_abs, latent, indices, scale, block_size):
        _check_inputs(q_abs, latent, indices, block_size)
        dtype = _compute_dtype(q_abs.dtype)
        out = torch.empty_like(q_abs)
        lse = torch.empty(q_abs.shape[:2], dtype=dtype, device=q_abs.device)
        for b0 in range(0, q_abs.shape[0], block_size):
            b1 = b0 + block_size
            rows, scores = _block_scores(q_abs[b0:b1], latent, indices[b0:b1], scale, dtype)
            block_lse = scores.logsumexp(dim=-1)
            # A query with nothing selected: exp(-inf - inf) = 0, so its probabilities and its
            # output are 0 rather than NaN, in backward too.
            block_lse = block_lse.masked_fill(block_lse == float("-inf"), float("inf"))
            probs = torch.exp(scores - block_lse[..., None])
            out[b0:b1] = torch.bmm(probs, rows)
            lse[b0:b1] = block_lse
        ctx.save_for_backward(q_abs, latent, indices, lse)
        ctx.scale, ctx.block_size = scale, block_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_abs, latent, indices, lse = ctx.saved_tensors
        scale, dtype = ctx.scale, lse.dtype
        grad_q = torch.empty_like(q_abs) if ctx.needs_input_grad[0] else None
        grad_latent = (torch.zeros(latent.shape, dtype=dtype, device=latent.device)
                       if ctx.needs_input_grad[1] else None)
        for b0 in range(0, q_abs.shape[0], ctx.block_size):
            b1 = b0 + ctx.block_size
            idx = indices[b0:b1]
            q_block = q_abs[b0:b1].to(dtype)
            rows, scores = _block_scores(q_block, latent, idx, scale, dtype)
            probs = torch.exp(scores - lse[b0:b1, :, None])
            g = grad_out[b0:b1].to(dtype)
            # d(score) = p * (dL/dp - sum_j p_j dL/dp_j); dL/dp is needed anyway, so its
            # p-weighted sum comes from it rather than from a saved output (g . out).
            grad_probs = torch.bmm(g, rows.transpose(1, 2))
            delta = (probs * grad_probs).sum(dim=-1, keepdim=True)
            grad_scores = probs * (grad_probs - delta)
            if grad_q is not None:
                grad_q[b0:b1] = torch.bmm(grad_scores, rows) * scale
            if grad_latent is not None:
                grad_rows = (torch.bmm(grad_scores.transpose(1, 2), q_block) * scale
                             + torch.bmm(probs.transpose(1, 2), g))
                # Masked entries have p = 0 and carry a zero gradient into row 0.
                grad_latent.index_add_(0, idx.clamp(min=0).reshape(-1).long(),
                                       grad_rows.reshape(-1, latent.shape[-1]))
        if grad_latent is not None:
            grad_latent = grad_latent.to(latent.dtype)
        return grad_q, grad_latent, None, None, None


def sparse_latent_attention(q_abs: torch.Tensor, latent: torch.Tensor, indices: torch.Tensor,
                            scale: float, block_size: int = 64) -> torch.Tensor:
    """Absorbed queries [Tq, H, R] attend over ``latent`` [Tk, R] rows ``indices`` [Tq, topk]
    (-1 = not selected) -> [Tq, H, R] in ``q_abs``'s dtype; softmax in fp32 (fp64 for fp64)."""
    return SparseLatentAttention.apply(q_abs, latent, indices, scale, block_size)


def split_kv_up_weight(kv_up_weight: torch.Tensor, num_heads: int, qk_head_dim: int,
                       v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``linear_kv_up_proj.weight`` [H * (dn + dv), R] -> W_UK [H, dn, R], W_UV [H, dv, R]."""
    rows = num_heads * (qk_head_dim + v_head_dim)
    if kv_up_weight.dim() != 2 or kv_up_weight.shape[0] != rows:
        raise ValueError(f"kv up-projection weight must be [{rows}, kv_lora_rank], "
                         f"got {list(kv_up_weight.shape)}")
    w = kv_up_weight.view(num_heads, qk_head_dim + v_head_dim, -1)
    return w[:, :qk_head_dim], w[:, qk_head_dim:]


class AbsorbedSparseMLA(torch.autograd.Function):
    """``sparse_latent_attention`` with the absorption (q_nope @ W_UK) and the value projection
    (@ W_UV^T) done per query block inside: autograd keeps q_nope, the latent, the indices and
    the log-sum-exp; the absorbed queries and the latent-space output ([Tq, H, R] each, R = 512
    against dn = 256 at GLM sizes) are rebuilt per block in backward."""

    @staticmethod
    def forward(ctx, q_nope, latent, kv_up_weight, indices, scale, v_head_dim, block_size):
        num_heads, qk_head_dim = q_nope.shape[1], q_nope.shape[2]
        w_uk, w_uv = split_kv_up_weight(kv_up_weight, num_heads, qk_head_dim, v_head_dim)
        if latent.dim() != 2 or kv_up_weight.shape[-1] != latent.shape[-1]:
            raise ValueError(f"expected latent [Tk, R={kv_up_weight.shape[-1]}], got "
                             f"{list(latent.shape)}")
        check_indices(q_nope.shape[0], latent, indices, block_size)
        dtype = _compute_dtype(q_nope.dtype)
        w_uk, w_uv = w_uk.to(dtype), w_uv.to(dtype)
        out = q_nope.new_empty(q_nope.shape[0], num_heads, v_head_dim)
        lse = torch.empty(q_nope.shape[:2], dtype=dtype, device=q_nope.device)
        for b0 in range(0, q_nope.shape[0], block_size):
            b1 = b0 + block_size
            q_abs = torch.einsum("qhd,hdr->qhr", q_nope[b0:b1].to(dtype), w_uk)
            rows, scores = _block_scores(q_abs, latent, indices[b0:b1], scale, dtype)
            block_lse = scores.logsumexp(dim=-1)
            # Nothing selected: exp(-inf - inf) = 0, an output of 0 rather than NaN.
            block_lse = block_lse.masked_fill(block_lse == float("-inf"), float("inf"))
            probs = torch.exp(scores - block_lse[..., None])
            out[b0:b1] = torch.einsum("qhr,hvr->qhv", torch.bmm(probs, rows), w_uv)
            lse[b0:b1] = block_lse
        ctx.save_for_backward(q_nope, latent, kv_up_weight, indices, lse)
        ctx.scale, ctx.v_head_dim, ctx.block_size = scale, v_head_dim, block_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_nope, latent, kv_up_weight, indices, lse = ctx.saved_tensors
        scale, dtype = ctx.scale, lse.dtype
        num_heads, qk_head_dim = q_nope.shape[1], q_nope.shape[2]
        w_uk, w_uv = split_kv_up_weight(kv_up_weight, num_heads, qk_head_dim, ctx.v_head_dim)
        w_uk, w_uv = w_uk.to(dtype), w_uv.to(dtype)
        grad_q = torch.empty_like(q_nope) if ctx.needs_input_grad[0] else None
        grad_latent = (torch.zeros(latent.shape, dtype=dtype, device=latent.device)
                       if ctx.needs_input_grad[1] else None)
        grad_uk = torch.zeros_like(w_uk) if ctx.needs_input_grad[2] else None
        grad_uv = torch.zeros_like(w_uv) if ctx.needs_input_grad[2] else None
        for b0 in range(0, q_nope.shape[0], ctx.block_size):
            b1 = b0 + ctx.block_size
            idx, q_block = indices[b0:b1], q_nope[b0:b1].to(dtype)
            q_abs = torch.einsum("qhd,hdr->qhr", q_block, w_uk)
            rows, scores = _block_scores(q_abs, latent, idx, scale, dtype)
            probs = torch.exp(scores - lse[b0:b1, :, None])
            g_out = grad_out[b0:b1].to(dtype)
            if grad_uv is not None:
                grad_uv += torch.einsum("qhv,qhr->hvr", g_out, torch.bmm(probs, rows))
            g = torch.einsum("qhv,hvr->qhr", g_out, w_uv)  # dL/d(latent-space output)
            # d(score) = p * (dL/dp - sum_j p_j dL/dp_j).
            grad_probs = torch.bmm(g, rows.transpose(1, 2))
            delta = (probs * grad_probs).sum(dim=-1, keepdim=True)
            grad_scores = probs * (grad_probs - delta)
            grad_q_abs = torch.bmm(grad_scores, rows) * scale
            if grad_q is not None:
                grad_q[b0:b1] = torch.einsum("qhr,hdr->qhd", grad_q_abs, w_uk)
            if grad_uk is not None:
                grad_uk += torch.einsum("qhd,qhr->hdr", q_block, grad_q_abs)
            if grad_latent is not None:
                grad_rows = (torch.bmm(grad_scores.transpose(1, 2), q_abs) * scale
                             + torch.bmm(probs.transpose(1, 2), g))
                # Masked entries have p = 0 and carry a zero gradient into row 0.
                grad_latent.index_add_(0, idx.clamp(min=0).reshape(-1).long(),
                                       grad_rows.reshape(-1, latent.shape[-1]))
        grad_weight = None
        if grad_uk is not None:
            grad_weight = torch.cat([grad_uk, grad_uv], dim=1).view(kv_up_weight.shape)
            grad_weight = grad_weight.to(kv_up_weight.dtype)
        if grad_latent is not None:
            grad_latent = grad_latent.to(latent.dtype)
        return grad_q, grad_latent, grad_weight, None, None, None, None


def absorbed_sparse_mla(q_nope: torch.Tensor, latent: torch.Tensor, kv_up_weight: torch.Tensor,
                        indices: torch.Tensor, scale: float, v_head_dim: int,
                        block_size: int = 64) -> torch.Tensor:
    """NoPE-MLA sparse attention: queries [Tq, H, dn], normalised KV latent [Tk, R], the KV
    up-projection weight [H * (dn + dv), R] and token ``indices`` [Tq, topk] -> [Tq, H, dv] in
    q_nope's dtype; equal to attending with the up-projected keys and values, in the absorbed
    layout. Keeps O(Tq * H * dn) for backward (``AbsorbedSparseMLA``)."""
    if q_nope.dim() != 3:
        raise ValueError(f"expected q_nope [Tq, H, dn], got {list(q_nope.shape)}")
    return AbsorbedSparseMLA.apply(q_nope, latent, kv_up_weight, indices, scale, v_head_dim,
                                   block_size)
