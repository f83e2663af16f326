"""The indexer's exact top-k without a top-k over a whole row of scores.

The fused indexer picks the k best of up to 262,144 pool scores per query; ``torch.topk`` over
each whole row would be a large share of its time. The score kernel already holds every score
on chip once, so it also writes the maxima of consecutive groups of pools
(``index_scores.pool_scores``). The k-th largest of those maxima is a floor for the k-th largest
score: the k groups whose maxima reach it hold k distinct scores that do. So
every score of the top-k is at or above the floor, and so is every score equal to the k-th one
(the tie rule is then the final top-k's, as for a top-k over the whole row), and only groups
whose maximum reaches the floor hold such scores. Two Triton kernels, one program per row, keep
the scores at or above the floor in column order, up to ``capacity`` per row: the first lists
the groups whose maxima reach it (``_compact_at_least`` over the maxima), the second reads only
those groups (``_gather_at_least``); on random scores that is about k groups of 32 of the row's
8,192. The top-k then runs over the kept scores. A row with more than ``capacity`` such groups
or scores (its floor is -inf when fewer than k groups hold a visible pool; or ties crowd at the
floor) gets ``torch.topk`` over its whole row: the same answer, at that top-k's cost.
``floor_topk`` leaves those rows to its caller (flagged) instead of finding them with a host
sync: the fused indexer (``pool_topk.fused_block_topk``) reads the flags two blocks later
(``pool_topk.DeferredRows``) and redoes those rows, so its blocks queue on the GPU without
waiting for the host.

The floor (the k-th largest group maximum) and the final pick among the kept scores are one
Triton program per row each (``_kth_largest``, ``_pick``): the row sits in registers, its
values mapped to int32 keys of the same order, and the k-th largest key is built bit by bit
from the top (32 counts over the row). ``torch.topk`` takes a radix select of many small
kernels per call, whose launches would dominate the host's time per query block. The pick
keeps every value above the k-th and the first of the values equal to it in column order, so
ties resolve the same way on every run.

On CPU tensors the floor, the compaction and the pick are the kernels' torch references
(``kth_largest_reference``, ``compact_reference``, ``pick_reference``), so the CPU suite
checks the same selection, and the kernels themselves are checked against the references
under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CANDIDATES_PER_PICK = 8
"""Room per row in the compacted buffer, in multiples of k: random scores leave little more
than k candidates per row (``bench/pool_topk.py`` counts them); a crowded row is redone."""
COMPACT_BLOCK = 4096
"""Scores per step of a whole row's compaction (the group maxima's)."""
GATHER_BLOCK = 1024
"""Scores per step of the compaction over the listed groups: the fastest of
``bench/pool_topk.py --gather-sweep`` (docs/benchmarks.md)."""


def group_maxima(scores: torch.Tensor, group: int) -> torch.Tensor:
    """The maxima of rows [n, P] over consecutive groups of ``group`` columns -> [n, ceil(P /
    group)] (what the score kernel writes beside its scores; the last group may be short)."""
    n, width = scores.shape
    padded = scores.new_full((n, -(-width // group) * group), float("-inf"))
    padded[:, :width] = scores
    return padded.view(n, -1, group).amax(dim=-1)


@triton.jit
def _append_kept(values_ptr, ids_ptr, dst, count, s, cols, keep, CAP: tl.constexpr):
    """Store the kept scores (``keep`` 1) and their columns in the row's next slots, up to
    ``CAP``; returns the row's new count (all kept, stored or not)."""
    slot = count + tl.cumsum(keep, axis=0) - 1
    fits = (keep > 0) & (slot < CAP)
    tl.store(values_ptr + dst + slot, s, mask=fits)
    tl.store(ids_ptr + dst + slot, cols, mask=fits)
    return count + tl.sum(keep, axis=0)


@triton.jit
def _pad_from(values_ptr, ids_ptr, dst, count, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """-inf and -1 in the row's slots from ``count`` on (none when it is full), so the buffers
    need no fill before the kernel."""
    for start in range(0, CAP, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        rest = (slot >= count) & (slot < CAP)
        tl.store(values_ptr + dst + slot, float("-inf"), mask=rest)
        tl.store(ids_ptr + dst + slot, -1, mask=rest)


@triton.jit
def _compact_at_least(scores_ptr, floor_ptr, values_ptr, ids_ptr, count_ptr, n_cols,
                      CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    floor = tl.load(floor_ptr + row)
    src = scores_ptr + row.to(tl.int64) * n_cols
    dst = row.to(tl.int64) * CAP
    count = 0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(src + cols, mask=cols < n_cols, other=float("-inf"))
        keep = ((s >= floor) & (cols < n_cols)).to(tl.int32)
        count = _append_kept(values_ptr, ids_ptr, dst, count, s, cols, keep, CAP)
    _pad_from(values_ptr, ids_ptr, dst, count, CAP, BLOCK)
    tl.store(count_ptr + row, count)


@triton.jit
def _gather_at_least(scores_ptr, floor_ptr, group_ids_ptr, n_groups_ptr, values_ptr, ids_ptr,
                     count_ptr, n_cols, CAP: tl.constexpr, GROUP: tl.constexpr,
                     GROUPS: tl.constexpr):
    row = tl.program_id(0)
    floor = tl.load(floor_ptr + row)
    listed = tl.load(n_groups_ptr + row)
    n_groups = tl.minimum(listed, CAP)
    src = scores_ptr + row.to(tl.int64) * n_cols
    dst = row.to(tl.int64) * CAP
    count = 0
    for start in range(0, n_groups, GROUPS):
        at = start + tl.arange(0, GROUPS)
        group = tl.load(group_ids_ptr + dst + at, mask=at < n_groups, other=-1)
        cols = group[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        real = (group[:, None] >= 0) & (cols < n_cols)
        s = tl.load(src + cols, mask=real, other=float("-inf"))
        keep = tl.reshape((real & (s >= floor)).to(tl.int32), (GROUPS * GROUP,))
        count = _append_kept(values_ptr, ids_ptr, dst, count, tl.reshape(s, (GROUPS * GROUP,)),
                             tl.reshape(cols, (GROUPS * GROUP,)), keep, CAP)
    _pad_from(values_ptr, ids_ptr, dst, count, CAP, GROUPS * GROUP)
    # more groups than slots: their count (a lower bound of the row's scores) flags the row
    tl.store(count_ptr + row, tl.where(listed > CAP, listed, count))


def compact_reference(scores: torch.Tensor, floor: torch.Tensor, capacity: int):
    """Per row the scores >= ``floor`` in column order, the first ``capacity`` of them (values,
    -inf after; int32 column ids, -1 after), and how many there are."""
    keep = scores >= floor[:, None]
    slot = keep.long().cumsum(1) - 1
    row, col = (keep & (slot < capacity)).nonzero(as_tuple=True)
    values = scores.new_full((scores.shape[0], capacity), float("-inf"))
    ids = torch.full_like(values, -1, dtype=torch.int32)
    values[row, slot[row, col]] = scores[row, col]
    ids[row, slot[row, col]] = col.int()
    return values, ids, keep.sum(1).int()


def compact_kernel(scores: torch.Tensor, floor: torch.Tensor, capacity: int):
    """``compact_reference`` as one Triton program per row over the whole row (fp32 scores)."""
    n, width = scores.shape
    values = scores.new_empty(n, capacity)
    ids = torch.empty(n, capacity, dtype=torch.int32, device=scores.device)
    count = torch.empty(n, dtype=torch.int32, device=scores.device)
    if n:
        _compact_at_least[(n,)](scores.contiguous(), floor.float().contiguous(), values, ids,
                                count, width, CAP=capacity, BLOCK=COMPACT_BLOCK, num_warps=8)
    return values, ids, count


def grouped_compact_kernel(scores: torch.Tensor, group_max: torch.Tensor, group: int,
                           floor: torch.Tensor, capacity: int, gather_block: int = GATHER_BLOCK,
                           num_warps: int = 8):
    """``compact_reference`` for the rows whose groups of ``group`` columns with a maximum
    (``group_max``) at or above the floor number at most ``capacity``; the others' count is that
    number of groups (above ``capacity``, a lower bound of theirs), their scores partial.
    ``gather_block`` scores per step and ``num_warps`` tune the second program."""
    n, width = scores.shape
    _, group_ids, n_groups = compact_kernel(group_max, floor, capacity)
    values = scores.new_empty(n, capacity)
    ids = torch.empty(n, capacity, dtype=torch.int32, device=scores.device)
    count = torch.empty(n, dtype=torch.int32, device=scores.device)
    if n:
        _gather_at_least[(n,)](scores.contiguous(), floor.float().contiguous(), group_ids,
                               n_groups, values, ids, count, width, CAP=capacity, GROUP=group,
                               GROUPS=max(1, gather_block // group), num_warps=num_warps)
    return values, ids, count


MAX_SELECT_WIDTH = 16384
"""The widest row (group maxima, or a row's compacted candidates) that ``kth_largest_kernel`` and
``pick_kernel`` hold in one program's registers; wider rows take ``torch.topk``."""


@triton.jit
def _order_keys(x):
    """fp32 -> int32 keys in the same order (NaN as -inf, -0 as +0, so that equal values get
    equal keys)."""
    x = tl.where(x == x, x, float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _kth_key(keys, k):
    """The k-th largest of int32 ``keys``: the largest key t with at least k keys >= t, built
    bit by bit from the top in unsigned order (flipping the sign bit maps int32's order onto
    it)."""
    chosen = tl.zeros((), dtype=tl.int32)
    for i in tl.static_range(32):
        bit = tl.full((), 1, tl.int32) << (31 - i)
        trial = chosen | bit
        enough = tl.sum((keys >= (trial ^ -2147483648)).to(tl.int32), axis=0) >= k
        chosen = tl.where(enough, trial, chosen)
    return chosen ^ -2147483648


@triton.jit
def _kth_largest(x_ptr, out_ptr, n_cols, k, WIDTH: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, WIDTH)
    x = tl.load(x_ptr + row.to(tl.int64) * n_cols + cols, mask=cols < n_cols,
                other=float("-inf"))
    key = _kth_key(_order_keys(x), k)
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    tl.store(out_ptr + row, bits.to(tl.float32, bitcast=True))


@triton.jit
def _pick(values_ptr, ids_ptr, best_ptr, picked_ptr, capacity, k, WIDTH: tl.constexpr):
    row = tl.program_id(0)
    slots = tl.arange(0, WIDTH)
    src = row.to(tl.int64) * capacity + slots
    values = tl.load(values_ptr + src, mask=slots < capacity, other=float("-inf"))
    ids = tl.load(ids_ptr + src, mask=slots < capacity, other=-1)
    keys = _order_keys(values)
    kth = _kth_key(keys, k)
    above = keys > kth
    tied = keys == kth
    room = k - tl.sum(above.to(tl.int32), axis=0)
    keep = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    dst = row.to(tl.int64) * k + slot
    tl.store(best_ptr + dst, values, mask=keep)
    tl.store(picked_ptr + dst, ids.to(tl.int64), mask=keep)


def kth_largest_reference(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k-th largest value [n] (NaN counted as -inf; a zero is +0)."""
    rows = rows.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    return rows.topk(k, dim=-1).values[:, -1] + 0.0


def _check_selection(width: int, k: int) -> None:
    if not 0 < k <= width <= MAX_SELECT_WIDTH:
        raise ValueError(f"a row of {width} values (at most {MAX_SELECT_WIDTH}) and k in [1, "
                         f"width], got k = {k}")


def kth_largest_kernel(rows: torch.Tensor, k: int) -> torch.Tensor:
    """``kth_largest_reference`` as one Triton program per row of fp32 ``rows`` [n, width]
    (width at most ``MAX_SELECT_WIDTH``), without ``torch.topk``'s passes over the row."""
    n, width = rows.shape
    _check_selection(width, k)
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n:
        _kth_largest[(n,)](rows.contiguous(), out, width, k,
                           WIDTH=triton.next_power_of_2(width), num_warps=8)
    return out


def pick_reference(values: torch.Tensor, ids: torch.Tensor, k: int):
    """The k largest of each row of compacted candidates (values [n, c] fp32 in column order,
    their int32 ids) in that order: every value above the k-th largest, then the first of the
    values equal to it -> values [n, k], int64 ids [n, k]."""
    kth = kth_largest_reference(values, k)[:, None]
    above = values > kth
    tied = values == kth
    room = k - above.sum(1, keepdim=True)
    keep = above | (tied & (tied.cumsum(1) <= room))
    return values[keep].view(-1, k), ids[keep].view(-1, k).long()


def pick_kernel(values: torch.Tensor, ids: torch.Tensor, k: int):
    """``pick_reference`` as one Triton program per row (at most ``MAX_SELECT_WIDTH``
    candidates a row)."""
    n, capacity = values.shape
    _check_selection(capacity, k)
    best = values.new_empty(n, k)
    picked = torch.empty(n, k, dtype=torch.int64, device=values.device)
    if n:
        _pick[(n,)](values.contiguous(), ids.contiguous(), best, picked, capacity, k,
                    WIDTH=triton.next_power_of_2(capacity), num_warps=8)
    return best, picked


def threshold_topk(scores: torch.Tensor, group_max: torch.Tensor, group: int, k: int,
                   capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k, dim=-1, sorted=False)``'s values and ids (int64; of scores tied at the
    k-th, the first in column order, unless ``torch.topk`` takes the whole row) for fp32 scores
    [n, P] whose maxima over consecutive groups of ``group`` columns are ``group_max`` [n,
    ceil(P / group)]; ``capacity`` candidates per row (default ``CANDIDATES_PER_PICK * k``). NaN
    scores are never picked."""
    best, picked, crowded = floor_topk(scores, group_max, group, k, capacity)
    crowded = crowded.nonzero(as_tuple=True)[0]
    if crowded.numel():  # (a host sync: rare rows, exact either way)
        best[crowded], picked[crowded] = scores[crowded].topk(k, dim=-1, sorted=False)
    return best, picked


def floor_topk(scores: torch.Tensor, group_max: torch.Tensor, group: int, k: int,
               capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``threshold_topk`` without the host sync: its values and ids, exact except in the rows
    flagged in the bool [n] it also returns (more than ``capacity`` candidates), which the
    caller takes a whole-row top-k for (as ``threshold_topk`` does at once)."""
    n, width = scores.shape
    capacity = capacity or CANDIDATES_PER_PICK * k
    if not 0 < k <= width:
        raise ValueError(f"k must be in [1, {width}], got {k}")
    if group_max.shape != (n, -(-width // group)):
        raise ValueError(f"expected maxima [{n}, {-(-width // group)}] of groups of {group}, "
                         f"got {list(group_max.shape)}")
    if k > group_max.shape[1] or width <= capacity:  # no floor to take, or nothing to save
        best, picked = scores.topk(k, dim=-1, sorted=False)
        return best, picked, torch.zeros(n, dtype=torch.bool, device=scores.device)
    in_registers = scores.is_cuda and max(group_max.shape[1], capacity) <= MAX_SELECT_WIDTH
    floor = (kth_largest_kernel if in_registers else kth_largest_reference)(group_max, k)
    values, ids, count = (grouped_compact_kernel(scores, group_max, group, floor, capacity)
                          if scores.is_cuda else compact_reference(scores, floor, capacity))
    best, picked = (pick_kernel if in_registers else pick_reference)(values, ids, k)
    return best, picked, count > capacity
