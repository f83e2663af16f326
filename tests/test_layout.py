"""CP layouts: zigzag shards, and the one-rank case that holds sequences of any length whole;
``take_rows`` against autograd's ``index_select``."""

import pytest
import torch

from skyrl_megatron_kda.distributed.cp_layout import take_rows, zigzag_positions


def test_zigzag_cp2_gives_each_rank_a_front_and_a_back_chunk():
    positions = zigzag_positions(torch.tensor([0, 8, 12]), 2)
    assert positions.tolist() == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]


def test_zigzag_at_cp1_is_the_identity_for_any_length():
    # Data packed for CP=1 pads documents to no multiple; the layout must accept odd lengths.
    assert zigzag_positions(torch.tensor([0, 3, 8, 9]), 1).tolist() == [list(range(9))]


def test_zigzag_refuses_lengths_it_cannot_split():
    with pytest.raises(ValueError, match="divide by 2\\*cp=4"):
        zigzag_positions(torch.tensor([0, 6]), 2)


@pytest.mark.parametrize("kind", ["permutation", "subset"])
def test_take_rows_equals_index_select_forward_and_backward(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, 5, generator=g, dtype=torch.float64)
    index = torch.randperm(12, generator=g)
    if kind == "subset":  # rows dropped, as the state conv drops its halo rows
        index = index[:7]
    dy = torch.randn(index.numel(), 2, 5, generator=g, dtype=torch.float64)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = take_rows(ours, index)
    out.backward(dy)
    ref.index_select(0, index).backward(dy)
    assert torch.equal(out, x.index_select(0, index))
    assert torch.equal(ours.grad, ref.grad)
    if kind == "subset":
        dropped = torch.ones(12, dtype=torch.bool)
        dropped[index] = False
        assert not ours.grad[dropped].any()
