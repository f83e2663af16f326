"""The sequence split's balanced TP shares (``batch_rows.balanced_row_order``): every TP rank's
indexer queries sit, on average, where the CP rank's do, so no TP rank scores twice the pools of
another; contiguous TP slices (what SP holds) are the control."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.distributed.cp_layout import rank_rows
from skyrl_megatron_kda.dsa.batch_rows import balanced_row_order


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
