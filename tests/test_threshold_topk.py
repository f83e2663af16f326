"""The indexer's exact top-k from a floor (``dsa/ops/threshold_topk.py``): the same values and ids as
``torch.topk`` over whole rows on the score shapes the indexer makes (ties of exact zeros, rows
that see nothing, best scores crowded into few groups), the Triton compaction equal to its torch
reference (Triton's interpreter on CPU, the kernel itself on a GPU), and controls that a floor
set too high, or a compaction that drops candidates, is caught."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.dsa.ops.threshold_topk import (
    compact_reference,
    group_maxima,
    grouped_compact_kernel,
    kth_largest_kernel,
    kth_largest_reference,
    pick_kernel,
    pick_reference,
    threshold_topk,
)
from tests.support.interpreted import run_interpreted


def _scores(kind: str, n: int = 48, width: int = 5000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, width, generator=g)
    if kind == "relu":  # a weighted ReLU of few heads: many exact zeros
        scores = scores.relu()
    elif kind == "crowded":  # every row's best scores in one run of columns
        scores[:, 1000:1300] += 10.0
    elif kind == "flat":  # fewer positive scores than picks: the floor is 0, every 0 ties
        scores = (scores - 2.5).relu()
    scores[:, -width // 10:] = float("-inf")  # a causal tail
    scores[0] = float("-inf")  # a query that sees nothing yet
    scores[1, 7:] = float("-inf")  # one that sees fewer pools than k
    return scores


def _same_topk(got, scores: torch.Tensor, k: int) -> None:
    """Equal to ``torch.topk``'s selection: the same sorted values per row, ids that hold those
    values, no id twice."""
    values, ids = got
    ref = scores.topk(k, dim=-1).values
    assert torch.equal(values.sort(-1, descending=True).values, ref)
    assert torch.equal(scores.gather(1, ids), values)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()


@pytest.mark.parametrize("kind", ["normal", "relu", "crowded", "flat"])
@pytest.mark.parametrize("group", [1, 8, 33])
def test_threshold_topk_equals_torch_topk(kind, group):
    scores, k = _scores(kind), 40
    got = threshold_topk(scores, group_maxima(scores, group), group, k)
    _same_topk(got, scores, k)


def test_the_floor_keeps_few_candidates_and_flat_rows_fall_back():
    """Random and crowded scores leave a small part of a row above the floor; rows of ties at
    the floor overflow the buffer and still get the exact top-k (the whole-row path)."""
    k, capacity = 40, 320
    for kind in ("normal", "crowded"):
        scores = _scores(kind)
        floor = group_maxima(scores, 8).topk(k, dim=-1).values[:, -1]
        count = compact_reference(scores, floor, capacity)[2]
        assert int(count[2:].max()) <= capacity < scores.shape[1], kind
    flat = _scores("flat")
    floor = group_maxima(flat, 8).topk(k, dim=-1).values[:, -1]
    count = compact_reference(flat, floor, capacity)[2]
    assert int((count > capacity).sum()) > len(count) // 2
    _same_topk(threshold_topk(flat, group_maxima(flat, 8), 8, k, capacity), flat, k)


def test_a_floor_set_too_high_is_caught():
    """Control: maxima raised by one leave out true picks, and the comparison sees it."""
    scores, k = _scores("normal"), 40
    wrong = threshold_topk(scores, group_maxima(scores, 8) + 1.0, 8, k)
    with pytest.raises(AssertionError):
        _same_topk(wrong, scores, k)


def test_compact_reference_keeps_column_order_and_counts_all():
    scores = torch.tensor([[3.0, -1.0, 5.0, 5.0, 0.0, 7.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    values, ids, count = compact_reference(scores, torch.tensor([3.0, 2.5]), 3)
    assert ids.tolist() == [[0, 2, 3], [2, 3, 4]]
    assert values.tolist() == [[3.0, 5.0, 5.0], [3.0, 4.0, 5.0]]
    assert count.tolist() == [4, 4]


def test_the_pick_keeps_every_value_above_the_kth_and_the_first_ties():
    values = torch.tensor([[1.0, 3.0, 5.0, 3.0, 3.0, float("-inf")],
                           [0.0, -0.0, 2.0, 0.0, -1.0, float("-inf")]])
    ids = torch.tensor([[10, 11, 12, 13, 14, -1], [20, 21, 22, 23, 24, -1]], dtype=torch.int32)
    best, picked = pick_reference(values, ids, 3)
    assert best.tolist() == [[3.0, 5.0, 3.0], [0.0, -0.0, 2.0]]
    assert picked.tolist() == [[11, 12, 13], [20, 21, 22]] and picked.dtype == torch.int64


def test_ties_at_the_kth_score_keep_the_first_columns():
    """Scores tied at the k-th go to the earliest columns (the stable torch path's rule), on
    rows the floor settles. Control: the ties' last columns are not picked."""
    scores = torch.randn(4, 4000, generator=torch.Generator().manual_seed(3)) - 10.0
    scores[:, 100:110] = 5.0  # 10 best
    tied = torch.tensor([700, 1500, 2300, 3100, 3900])
    scores[:, tied] = 4.0  # 5 tied at the 12th best: 2 of them picked
    _, ids = threshold_topk(scores, group_maxima(scores, 8), 8, 12, capacity=320)
    picked = set(ids[0].tolist())
    assert all(set(row.tolist()) == picked for row in ids)
    assert picked == set(range(100, 110)) | {700, 1500}


def test_the_kth_largest_counts_nan_as_minus_inf_and_zeros_as_one():
    rows = torch.tensor([[float("nan"), 1.0, 2.0, -0.0], [0.0, -0.0, -0.0, -1.0]])
    assert kth_largest_reference(rows, 3).tolist() == [0.0, 0.0]
    assert str(kth_largest_reference(rows, 3)[0].item()) == "0.0"  # +0, not -0
    assert kth_largest_reference(rows, 4).tolist() == [float("-inf"), -1.0]


def test_selection_kernels_refuse_rows_they_cannot_hold():
    wide = torch.zeros(2, 16385)
    with pytest.raises(ValueError, match="at most 16384"):
        kth_largest_kernel(wide, 5)
    with pytest.raises(ValueError, match="k in"):
        pick_kernel(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.int32), 9)


def test_maxima_of_the_wrong_shape_are_refused():
    scores = _scores("normal")
    with pytest.raises(ValueError, match="maxima"):
        threshold_topk(scores, group_maxima(scores, 8), 16, 40)


_INTERPRETED = """
import json
import torch
from skyrl_megatron_kda.dsa.ops.threshold_topk import (
    compact_kernel, compact_reference, group_maxima, grouped_compact_kernel, kth_largest_kernel,
    kth_largest_reference, pick_kernel, pick_reference)
from tests.support.interpreted import run_interpreted
g = torch.Generator().manual_seed(1)
rows = torch.randn(8, 3000, generator=g)
rows[1] = rows[1].relu()  # exact zeros tie
rows[2, 50:] = float("-inf")
rows[3, ::2] = -0.0
rows[3, 1::2] = 0.0
rows[4] = rows[4].round()  # few distinct values
rows[5, 10] = float("nan")
rows[6] = -rows[6].abs()
kth = {k: torch.equal(kth_largest_kernel(rows, k), kth_largest_reference(rows, k))
       for k in (1, 40, 1000, 3000)}
kth_wrong = torch.equal(kth_largest_kernel(rows, 41), kth_largest_reference(rows, 40))
values = torch.randn(5, 320, generator=g).round()
ids = torch.randperm(320, generator=g).int().repeat(5, 1)
values[2, 200:], ids[2, 200:] = float("-inf"), -1  # a row's unused slots
pick = {k: [torch.equal(a, b) for a, b in zip(pick_kernel(values, ids, k),
                                              pick_reference(values, ids, k))]
        for k in (1, 40, 200)}
scores = torch.randn(6, 9000, generator=g)
scores[1, 100:] = float("-inf")
floor = torch.tensor([2.0, float("-inf"), 1.5, 3.0, 10.0, 2.5])
ref = compact_reference(scores, floor, 400)
whole = compact_kernel(scores, floor, 400)
grouped = grouped_compact_kernel(scores, group_maxima(scores, 32), 32, floor, 400)
fits = ref[2] <= 400
print(json.dumps({"kth": kth, "kth_wrong": kth_wrong, "pick": pick,
                  "whole": [torch.equal(a, b) for a, b in zip(whole, ref)],
                  "grouped": [torch.equal(a[fits], b[fits]) for a, b in zip(grouped, ref)],
                  "over": torch.equal(grouped[2] > 400, ~fits), "counts": ref[2].tolist()}))
"""


def test_the_triton_kernels_equal_their_references_interpreted():
    """The Triton kernels under Triton's CPU interpreter. The k-th largest equals its reference
    on rows of ties, exact zeros of both signs, NaN and -inf, for k from 1 to the whole row
    (control: the 41st is not the 40th); the pick equals its reference, values and ids, on
    rounded (tied) candidates and a row with unused slots. The whole-row compaction equals the
    torch reference in every slot, id and count (rows over and under the buffer's 400, a row
    with a -inf floor, a row that 4,096-score steps do not divide); the grouped one equals it on
    every row that fits, and reports the others as over."""
    got = run_interpreted(_INTERPRETED)
    assert all(got["kth"].values()) and len(got["kth"]) == 4 and not got["kth_wrong"], got
    assert got["pick"] == {k: [True, True] for k in ("1", "40", "200")}, got
    assert got["whole"] == got["grouped"] == [True] * 3 and got["over"], got
    counts = got["counts"]
    assert counts[1] == 9000 and counts[4] == 0 and any(0 < c <= 400 for c in counts), counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
def test_threshold_topk_on_the_gpu_equals_torch_topk():
    """On CUDA: the floor's k-th largest and the grouped compaction equal their references
    (the compaction on the rows that fit), the pick equals its reference on the compacted
    candidates, and the top-k equals ``torch.topk`` at the indexer's block shape (1,024 queries,
    262,144 pools, k = 512, maxima of 32)."""
    dev = torch.device("cuda")
    for kind in ("normal", "relu", "crowded", "flat"):
        scores = _scores(kind, n=1024, width=262144).to(dev)
        maxima = group_maxima(scores, 32)
        floor = kth_largest_reference(maxima, 512)
        assert torch.equal(kth_largest_kernel(maxima, 512), floor), kind
        ref = compact_reference(scores, floor, 4096)
        got = grouped_compact_kernel(scores, maxima, 32, floor, 4096)
        fits = ref[2] <= 4096
        assert all(torch.equal(a[fits], b[fits]) for a, b in zip(got, ref)), kind
        assert torch.equal(got[2] > 4096, ~fits), kind
        picks = pick_kernel(got[0][fits], got[1][fits], 512)
        assert all(torch.equal(a, b) for a, b in zip(picks, pick_reference(got[0][fits],
                                                                           got[1][fits], 512)))
        _same_topk(threshold_topk(scores, maxima, 32, 512), scores, 512)
