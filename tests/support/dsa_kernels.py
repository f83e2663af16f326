"""A torch stand-in for megatron-core's TileLang DSA kernels (sparse MLA and indexer scores), with their contract (widths,
shapes, int32 indices, -1 = not selected), so the fused path's padding, absorption and blocking
run on CPU. It computes in the inputs' dtype (fp32/fp64), so it checks layout, not rounding."""

from __future__ import annotations

import torch

from skyrl_megatron_kda.dsa.fused_sparse_mla import (
    KERNEL_VALUE_WIDTH,
    KERNEL_WIDTH,
    DSAKernels,
)
from skyrl_megatron_kda.dsa.sparse_mla import sparse_latent_attention


def _check(q, kv, indices):
    assert q.dim() == 3 and q.shape[-1] == KERNEL_WIDTH, q.shape
    assert kv.dim() == 3 and kv.shape[1:] == (1, KERNEL_WIDTH), kv.shape
    assert indices.dtype == torch.int32 and indices.shape[:2] == (q.shape[0], 1), indices.shape
    assert q.is_contiguous() and kv.is_contiguous() and indices.is_contiguous()


def _attend(q, kv, indices, sm_scale):
    return sparse_latent_attention(q, kv[:, 0], indices[:, 0], sm_scale)[..., :KERNEL_VALUE_WIDTH]


def _forward(q, kv, indices, sm_scale):
    _check(q, kv, indices)
    with torch.no_grad():
        out = _attend(q, kv, indices, sm_scale)
        rows = kv[indices[:, 0].clamp(min=0).long(), 0]  # [S, k, 576]
        scores = torch.einsum("shc,skc->shk", q, rows) * sm_scale
        scores = scores.masked_fill((indices[:, 0] < 0)[:, None, :], float("-inf"))
    return out, scores.logsumexp(-1)


def _delta(out, grad_out):
    assert out.shape == grad_out.shape and out.shape[-1] == KERNEL_VALUE_WIDTH
    return (out * grad_out).sum(-1)


def _backward(q, kv, o, do, indices, lse, sm_scale=None, delta=None):
    _check(q, kv, indices)
    assert do.shape == (*q.shape[:2], KERNEL_VALUE_WIDTH) and lse.shape == q.shape[:2]
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    with torch.enable_grad():
        out = _attend(q, kv, indices, sm_scale)
        dq, dkv = torch.autograd.grad(out, (q, kv), do)
    return dq, dkv


def _index_scores(q, keys, weights, ks, ke):
    assert ks.dtype == torch.int32 and ke.dtype == torch.int32 and weights.dtype == torch.float32
    scores = (torch.einsum("shd,pd->shp", q.float(), keys.float()).relu() * weights[..., None]).sum(1)
    cols = torch.arange(keys.shape[0])
    outside = (cols[None] < ks[:, None].long()) | (cols[None] >= ke[:, None].long())
    return scores.masked_fill(outside, float("-inf"))


def torch_dsa_kernels() -> DSAKernels:
    """The stand-in: no dtype cast (fp32 or fp64 in, the same out)."""
    return DSAKernels(forward=_forward, delta=_delta, backward=_backward,
                      index_scores=_index_scores, dtype=None)
