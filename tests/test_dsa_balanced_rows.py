"""The sequence split's balanced TP shares (``batch_rows.balanced_row_order``): every TP rank's
indexer queries sit, on average, where the CP rank's do, so no TP rank scores twice the pools of
another; contiguous TP slices (what SP holds) are the control. And the all-to-all that brings
each rank its share from the SP slices (``share_exchange``), played out here rank by rank; the
layer's mesh tests in ``test_dsa.py`` run it over gloo, both ways."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.distributed.cp_layout import rank_rows
from skyrl_megatron_kda.dsa.batch_rows import balanced_row_order, share_exchange


@pytest.mark.parametrize("rows,tp", [(16, 2), (24, 4), (30, 3), (10, 5), (8, 8)])
def test_the_order_is_a_permutation_of_front_and_back_pieces(rows, tp):
    order = balanced_row_order(rows, tp)
    assert torch.equal(order.sort().values, torch.arange(rows))
    share = rows // tp
    for t, mine in enumerate(order.view(tp, share)):
        front, back = share // 2, share - share // 2
        assert mine[:front].tolist() == list(range(t * front, (t + 1) * front))
        assert mine[front:].tolist() == list(range(rows - (t + 1) * back, rows - t * back))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_every_tp_rank_indexes_the_cp_ranks_mean_position(layout):
    """The 1M recipe's mesh, scaled down 64x (16,384 tokens, CP2 x TP8): each TP rank's mean
    query position equals its CP rank's; the SP slices' means spread by about 2x at CP rank 0."""
    tokens, cp, tp = 16384, 2, 8
    cu = torch.tensor([0, tokens])
    for cp_rank in range(cp):
        rows = rank_rows(cu, cp, tp, cp_rank, 0, False, layout).double()
        shares = rows[balanced_row_order(rows.numel(), tp)].view(tp, -1)
        assert torch.allclose(shares.mean(1), rows.mean().expand(tp), rtol=1e-12)
        slices = rows.view(tp, -1).mean(1)
        assert slices.max() / rows.mean() > (1.4 if layout == "zigzag" else 1.05)


def _exchange(rows: torch.Tensor, order: torch.Tensor, tp: int, arrange: bool = True):
    """Every TP rank's received share when rank t holds the t-th contiguous slice of ``rows``
    (SP), as ``ShareExchange.to_share`` moves them: what rank s sends to rank t is chunk t of
    its rows in ``send`` order, and rank t takes its chunks in rank order."""
    plans = [share_exchange(order, tp, r) for r in range(tp)]
    own = rows.view(tp, -1, *rows.shape[1:])
    chunks = [own[r][p.send.index].split(p.send_counts) for r, p in enumerate(plans)]
    out = []
    for t, plan in enumerate(plans):
        got = torch.cat([chunks[s][t] for s in range(tp)])
        assert [chunks[s][t].shape[0] for s in range(tp)] == plan.recv_counts
        out.append(got[plan.arrange.index] if arrange else got)
    return out


def _exchange_back(shares: list[torch.Tensor], order: torch.Tensor, tp: int) -> torch.Tensor:
    """``ShareExchange.from_share`` on every rank: the shares' rows back to their SP slices."""
    plans = [share_exchange(order, tp, r) for r in range(tp)]
    chunks = [share[p.arrange.inverse].split(p.recv_counts) for share, p in zip(shares, plans)]
    own = [torch.cat([chunks[t][s] for t in range(tp)])[p.send.inverse]
           for s, p in enumerate(plans)]
    return torch.cat(own)


@pytest.mark.parametrize("rows,tp", [(16, 2), (24, 4), (30, 3), (40, 8)])
@pytest.mark.parametrize("kind", ["balanced", "random"])
def test_the_exchange_brings_each_rank_its_share(rows, tp, kind):
    """Each rank ends with exactly ``order.view(tp, -1)[t]`` of the rows, in that order, and
    receives only that: for the balanced order (pieces from two SP slices) and for a random
    permutation, whose shares draw from every slice out of order; the way back restores every
    rank's rows. Leaving the received rows in arrival order is caught on the random one."""
    gen = torch.Generator().manual_seed(rows * tp)
    order = balanced_row_order(rows, tp) if kind == "balanced" else torch.randperm(rows, generator=gen)
    data = torch.randn(rows, 2, 3, generator=gen)
    shares = order.view(tp, -1)
    got = _exchange(data, order, tp)
    for t in range(tp):
        assert torch.equal(got[t], data[shares[t]])
    assert torch.equal(_exchange_back(got, order, tp), data)
    if kind == "random":
        unarranged = _exchange(data, order, tp, arrange=False)
        assert any(not torch.equal(u, data[s]) for u, s in zip(unarranged, shares))


def test_the_balanced_shares_come_from_two_sp_slices():
    """At the 1M recipe's TP 8, a rank's share is a front and a back piece, each inside one SP
    slice: every rank receives from at most two ranks, 1/tp of the rows in all."""
    rows, tp = 512, 8
    for rank in range(tp):
        plan = share_exchange(balanced_row_order(rows, tp), tp, rank)
        assert sum(plan.recv_counts) == sum(plan.send_counts) == rows // tp
        assert sum(c > 0 for c in plan.recv_counts) <= 2
