"""The state exchange's conv (``state._HaloConv``) in pieces, on one process: a conv over all of a
rank's rows at once, with the first rows of each piece computed again from their true window,
equals each piece convolved after its halo rows. (The exchange itself, with its all-gather of
the halos, is checked against CP=1 in test_kda_parity.py.)"""

import torch
import torch.nn.functional as F

from skyrl_megatron_kda.kda.kernel import causal_conv_silu
from skyrl_megatron_kda.kda.state_pieces import Pieces, halo_plan, head_windows, window_conv_silu, window_rows

C, W = 6, 4


def _conv_after(halo: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.Conv1d(padding=W-1) + SiLU of ``rows`` with ``halo`` in front, cut back to ``rows``."""
    seq = torch.cat([halo, rows]).T.unsqueeze(0)
    y = F.conv1d(seq, weight.unsqueeze(1), padding=W - 1, groups=C)[..., : seq.shape[-1]]
    return F.silu(y)[0].T[halo.shape[0]:]


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 2, 7]  # two pieces shorter than the halo
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    starts = cu[:-1] * 10  # each piece its own sequence, far apart: the halo is given, not looked up
    pieces = Pieces(cu, natural_start=starts, seq_start=starts, parts=1)
    plan = halo_plan(pieces, [pieces], W - 1)
    x = torch.randn(int(cu[-1]), C, generator=g, dtype=torch.float64)
    weight = torch.randn(C, W, generator=g, dtype=torch.float64)
    halo = torch.randn(len(lengths), W - 1, C, generator=g, dtype=torch.float64)
    expected = torch.cat([_conv_after(halo[p], x[cu[p]:cu[p + 1]], weight) for p in range(len(lengths))])
    return plan, x, weight, halo, expected


def test_whole_rank_conv_with_head_rows_equals_each_piece_after_its_halo():
    plan, x, weight, halo, expected = _case(0)
    assert plan.head_rows.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10]  # min(3, length) rows per piece
    y = causal_conv_silu(x.unsqueeze(0), weight, backend="torch")[0]
    read, true = head_windows(window_rows(x, plan), halo, plan)
    # What the conv over all rows computed at the head rows is the window it read.
    torch.testing.assert_close(window_conv_silu(read, weight).double(), y[plan.head_rows], rtol=1e-6, atol=1e-7)
    wrong = y.clone()
    y[plan.head_rows] = window_conv_silu(true, weight).double()
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-7)
    # Negative controls: the head rows left as the whole-rank conv read them, or the halo
    # rows in reverse order, are different convs.
    assert (wrong - expected).abs().max() > 1e-2
    y[plan.head_rows] = window_conv_silu(head_windows(window_rows(x, plan), halo.flip(1), plan)[1], weight).double()
    assert (y - expected).abs().max() > 1e-2
