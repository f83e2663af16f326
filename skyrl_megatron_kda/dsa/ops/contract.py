"""``SparseMLAOps``: the callables the absorbed sparse-MLA wrapper and the fused indexer run.

One bundle per kernel set: megatron-core's TileLang programs (``fused.fused_sparse_mla_ops``),
ours (``latent.interface.latent_sparse_mla_ops``), or a torch stand-in with the same contract
(the CPU tests), so ``fused_sparse_mla.FusedAbsorbedSparseMLA`` and
``pool_topk.fused_block_topk`` are written once for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .index_scores import GROUP, keys_as_they_are

KERNEL_WIDTH = 576
"""Query/latent channels megatron-core's TileLang kernels are specialised for (512 latent +
64 RoPE channels): the default ``width``."""
KERNEL_VALUE_WIDTH = 512
"""Output channels of those kernels: the first 512 channels of the selected latent rows."""


@dataclass(frozen=True)
class SparseMLAOps:
    """The sparse-MLA and indexer-score callables of one kernel set, by their contract (the
    defaults are megatron-core's kernels').

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


