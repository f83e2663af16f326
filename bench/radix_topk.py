"""A candidate for the indexer's top-k that lost: one Triton radix select per row, the columns of
each row's ``k`` best scores, exact, ties at the k-th score to the earlier column.

``bench/pool_topk.py`` times it against ``torch.topk``. On one H200 it was exact (equal to a
stable sort on both score distributions) and 11.7x slower: 36.4 ms against 3.1 ms per block of
1,024 queries over 262,144 pools, and 2.65 s against 0.58 s for the indexer of the 1M share in
the layer (bench/results/h200_pool_topk/). One program per row streams the row four times with
a 2,048-bin ``tl.histogram`` per tile of 2,048 scores, about 120 GB/s, far below the memory's
rate: Triton builds a histogram inside each warp from one ballot per bit of the bin index and
one popcount per bin a thread owns, 64 bins per thread at 2,048 bins, so the counting, not the
reads, sets the time. A faster select needs counters in shared memory (atomics, as CUDA radix
selects use), which Triton does not expose. The algorithm, kept here with the measurement:

1. Each fp32 score becomes a uint32 key in the same order (sign bit flipped for positive values,
   all bits for negative ones; -0.0 first turned into 0.0, so the two tie).
2. Three radix passes (digits of 11, 11 and 10 bits) from the top down: a histogram of the
   digit over the keys that share the prefix found so far gives the digit of the k-th largest
   key and how many keys lie above it. After the last digit the k-th largest key ``T`` is
   known, and with it how many keys equal to ``T`` still belong to the top k.
3. One last pass writes, in column order, every column whose key is above ``T`` and the first
   of those equal to ``T``; a chosen column whose score is -inf is written as -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048
"""Scores a program reads per step of each pass."""


@triton.jit
def _ordered_keys(ptr, cols, n_cols):
    """uint32 keys whose unsigned order is the fp32 scores' order; past the row's end 0, which
    the callers mask out."""
    x = tl.load(ptr + cols, mask=cols < n_cols, other=0.0)
    sign = tl.full([], 0x80000000, tl.uint32)
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == sign, 0, bits)  # -0.0 as 0.0, on the bits: no float op to flush
    return tl.where((bits & sign) != 0, bits ^ tl.full([], 0xFFFFFFFF, tl.uint32), bits | sign), x


@triton.jit
def _radix_pass(scores_ptr, n_cols, prefix, prefix_mask, need, SHIFT: tl.constexpr,
                WIDTH: tl.constexpr, TILE: tl.constexpr):
    """One digit (``WIDTH`` bits from bit ``SHIFT`` up) of the k-th largest key among the keys
    with ``prefix`` in ``prefix_mask``: the prefix and mask grown by it, and how many keys equal
    to the grown prefix still belong to the top k."""
    BINS: tl.constexpr = 1 << WIDTH
    bins = tl.arange(0, BINS)
    hist = tl.zeros((BINS,), dtype=tl.int32)
    for start in range(0, n_cols, TILE):
        cols = start + tl.arange(0, TILE)
        key, _ = _ordered_keys(scores_ptr, cols, n_cols)
        in_prefix = (cols < n_cols) & ((key & prefix_mask) == prefix)
        digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=in_prefix)
    # Keys with a digit above b, then the k-th largest key's digit: the largest b with at least
    # ``need`` keys at or above it.
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
    digit = tl.max(tl.where(above + hist >= need, bins, -1), axis=0)
    need -= tl.sum(tl.where(bins == digit, above, 0), axis=0)
    prefix |= digit.to(tl.uint32) << SHIFT
    prefix_mask |= tl.full([], (BINS - 1) << SHIFT, tl.uint32)
    return prefix, prefix_mask, need


@triton.jit
def _row_topk(scores_ptr, out_ptr, n_cols, row_stride, out_stride, k, offset,
              TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    scores_ptr += row * row_stride
    out_ptr += row * out_stride
    prefix = tl.full([], 0, tl.uint32)
    prefix_mask = tl.full([], 0, tl.uint32)
    need = k  # how many keys with the current prefix still belong to the top k
    # Three digits of 11, 11 and 10 bits: 2,048-bin histograms.
    prefix, prefix_mask, need = _radix_pass(scores_ptr, n_cols, prefix, prefix_mask, need,
                                            21, 11, TILE)
    prefix, prefix_mask, need = _radix_pass(scores_ptr, n_cols, prefix, prefix_mask, need,
                                            10, 11, TILE)
    prefix, prefix_mask, need = _radix_pass(scores_ptr, n_cols, prefix, prefix_mask, need,
                                            0, 10, TILE)
    taken = 0
    equal_seen = 0
    for start in range(0, n_cols, TILE):
        cols = start + tl.arange(0, TILE)
        key, x = _ordered_keys(scores_ptr, cols, n_cols)
        valid = cols < n_cols
        equal = valid & (key == prefix)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        chosen = (valid & (key > prefix)) | (equal & (equal_rank < need))
        slot = taken + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        ids = tl.where(x == float("-inf"), -1, cols.to(tl.int64) + offset)
        tl.store(out_ptr + slot, ids, mask=chosen)
        taken += tl.sum(chosen.to(tl.int32), axis=0)
        equal_seen += tl.sum(equal.to(tl.int32), axis=0)


def row_topk_ids(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """For each row of fp32 ``scores`` [n, P] on CUDA, the columns (+ ``offset``) of its ``k``
    best scores, ties at the k-th score to the earlier column, in ascending column order; -1 for
    a chosen column that scores -inf: ``reference_row_topk_ids``' answer."""
    n, width = scores.shape
    if scores.dtype != torch.float32 or not 0 < k <= width:
        raise ValueError(f"need fp32 scores and 0 < k <= columns, got {scores.dtype}, k={k}, "
                         f"columns={width}")
    scores = scores.contiguous()
    out = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    if n:
        _row_topk[(n,)](scores, out, width, scores.stride(0), out.stride(0), k, offset,
                        TILE=TILE, num_warps=8)
    return out


def reference_row_topk_ids(scores: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """``row_topk_ids`` from a stable descending sort: its first ``k`` columns in ascending
    order, -1 where the score is -inf."""
    order = scores.sort(dim=-1, descending=True, stable=True)
    values, cols = order.values[:, :k], order.indices[:, :k]
    ids = (cols + offset).masked_fill(values == float("-inf"), -1)
    return ids.gather(1, cols.argsort(dim=-1))
