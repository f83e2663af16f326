"""A torch stand-in for the TileLang DSA kernels (sparse MLA and indexer scores) with their
contract (widths, shapes, int32 indices, -1 = not selected; the indexer's scores with their
maxima over groups of 4 pools): megatron-core's (576 channels in,
512 out) or ours (``ops/latent/``: the latent's own width in and out), so the fused and
latent paths' padding, absorption and blocking run on CPU. It computes in the inputs' dtype
(fp32/fp64), so it checks layout, not rounding."""

from __future__ import annotations

import torch

from skyrl_megatron_kda.dsa.ops.contract import KERNEL_VALUE_WIDTH, KERNEL_WIDTH, SparseMLAOps
from skyrl_megatron_kda.dsa.ops.threshold_topk import group_maxima
from skyrl_megatron_kda.dsa.sparse_mla import sparse_latent_attention


def _sparse_mla(width: int, value_width: int):
    def check(q, kv, indices):
        assert q.dim() == 3 and q.shape[-1] == width, q.shape
        assert kv.dim() == 3 and kv.shape[1:] == (1, width), kv.shape
        assert indices.dtype == torch.int32 and indices.shape[:2] == (q.shape[0], 1), indices.shape
        assert q.is_contiguous() and kv.is_contiguous() and indices.is_contiguous()

    def attend(q, kv, indices, sm_scale):
        return sparse_latent_attention(q, kv[:, 0], indices[:, 0], sm_scale)[..., :value_width]

    def forward(q, kv, indices, sm_scale):
        check(q, kv, indices)
        with torch.no_grad():
            out = attend(q, kv, indices, sm_scale)
            rows = kv[indices[:, 0].clamp(min=0).long(), 0]  # [S, k, width]
            scores = torch.einsum("shc,skc->shk", q, rows) * sm_scale
            scores = scores.masked_fill((indices[:, 0] < 0)[:, None, :], float("-inf"))
        return out, scores.logsumexp(-1)

    def delta(out, grad_out):
        assert out.shape == grad_out.shape and out.shape[-1] == value_width
        return (out * grad_out).sum(-1)

    def backward(q, kv, o, do, indices, lse, sm_scale=None, delta=None, dkv=None):
        check(q, kv, indices)
        assert do.shape == (*q.shape[:2], value_width) and lse.shape == q.shape[:2]
        q, kv_ = q.detach().requires_grad_(), kv.detach().requires_grad_()
        with torch.enable_grad():
            out = attend(q, kv_, indices, sm_scale)
            dq, grad_kv = torch.autograd.grad(out, (q, kv_), do)
        if dkv is None:
            return dq, grad_kv
        assert dkv.shape == kv.shape and dkv.dtype == torch.float32
        return dq, dkv.add_(grad_kv)

    return forward, delta, backward


STAND_IN_GROUP = 4
"""Pools per maximum of the stand-in's indexer scores."""


def _index_scores(q, keys, weights, ks, ke):
    assert ks.dtype == torch.int32 and ke.dtype == torch.int32 and weights.dtype == torch.float32
    scores = (torch.einsum("shd,pd->shp", q.float(), keys.float()).relu() * weights[..., None]).sum(1)
    cols = torch.arange(keys.shape[0], device=keys.device)
    outside = (cols[None] < ks[:, None].long()) | (cols[None] >= ke[:, None].long())
    scores = scores.masked_fill(outside, float("-inf"))
    return scores, group_maxima(scores, STAND_IN_GROUP)


def torch_sparse_mla_ops(width: int = KERNEL_WIDTH, value_width: int = KERNEL_VALUE_WIDTH,
                         backward_adds_dkv: bool = False) -> SparseMLAOps:
    """The stand-in: no dtype cast (fp32 or fp64 in, the same out); megatron-core's widths by
    default, ``width = value_width =`` the latent's for ours (whose backward can add its latent
    gradient into a given buffer: ``backward_adds_dkv``)."""
    forward, delta, backward = _sparse_mla(width, value_width)
    return SparseMLAOps(forward=forward, delta=delta, backward=backward,
                        index_scores=_index_scores, index_group=STAND_IN_GROUP, dtype=None,
                        width=width, value_width=value_width, backward_adds_dkv=backward_adds_dkv)
