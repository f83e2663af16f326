"""CP layouts: zigzag shards, and the one-rank case that holds sequences of any length whole."""

import pytest
import torch

from skyrl_megatron_kda.kda.layout import zigzag_positions


def test_zigzag_cp2_gives_each_rank_a_front_and_a_back_chunk():
    positions = zigzag_positions(torch.tensor([0, 8, 12]), 2)
    assert positions.tolist() == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]


def test_zigzag_at_cp1_is_the_identity_for_any_length():
    # Data packed for CP=1 pads documents to no multiple; the layout must accept odd lengths.
    assert zigzag_positions(torch.tensor([0, 3, 8, 9]), 1).tolist() == [list(range(9))]


def test_zigzag_refuses_lengths_it_cannot_split():
    with pytest.raises(ValueError, match="divide by 2\\*cp=4"):
        zigzag_positions(torch.tensor([0, 6]), 2)
