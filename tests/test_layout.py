"""CP layouts: zigzag shards, and the one-rank case that holds sequences of any length whole;
``take_rows`` against autograd's ``index_select``; one set of index maps per batch, shared; the
layout kinds' one registry."""

from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from skyrl_megatron_kda.config import ParallelConfig
from skyrl_megatron_kda.distributed.cp_layout import (
    LAYOUTS,
    LayoutKind,
    LayoutName,
    RowOrder,
    batch_index_maps,
    inverse_permutation,
    take_rows,
    zigzag_positions,
)


def test_zigzag_cp2_gives_each_rank_a_front_and_a_back_chunk():
    positions = zigzag_positions(torch.tensor([0, 8, 12]), 2)
    assert positions.tolist() == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]


def test_zigzag_at_cp1_is_the_identity_for_any_length():
    # Data packed for CP=1 pads documents to no multiple; the layout must accept odd lengths.
    assert zigzag_positions(torch.tensor([0, 3, 8, 9]), 1).tolist() == [list(range(9))]


def test_zigzag_refuses_lengths_it_cannot_split():
    with pytest.raises(ValueError, match="divide by 2\\*cp=4"):
        zigzag_positions(torch.tensor([0, 6]), 2)


def test_take_rows_equals_index_select_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, 5, generator=g, dtype=torch.float64)
    index = torch.randperm(12, generator=g)
    dy = torch.randn(12, 2, 5, generator=g, dtype=torch.float64)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = take_rows(ours, index, inverse_permutation(index))
    out.backward(dy)
    ref.index_select(0, index).backward(dy)
    assert torch.equal(out, x.index_select(0, index))
    assert torch.equal(ours.grad, ref.grad)


def test_row_order_is_the_sort_and_its_inverse_without_sorting():
    positions = zigzag_positions(torch.tensor([0, 8, 20]), 2).reshape(-1)
    order = RowOrder.to_natural(positions)
    assert torch.equal(order.index, torch.argsort(positions))
    assert torch.equal(order.inverse, positions)
    x = torch.arange(20.0).unsqueeze(1)[positions]  # rows carrying their natural positions
    assert order.apply(x).squeeze(1).tolist() == list(range(20))
    assert torch.equal(order.undo(order.apply(x)), x)


def test_take_rows_backward_uses_the_inverse_it_is_given():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 3, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(10, generator=g)
    dy = torch.randn(10, 3, generator=g, dtype=torch.float64)
    # Negative control: a wrong inverse must show up in the gradient (so it is the one used).
    take_rows(x, index, index).backward(dy)
    assert not torch.equal(x.grad, dy.index_select(0, inverse_permutation(index)))


def _thd(cu):
    return SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=torch.tensor(cu), cu_seqlens_q=None)


def test_batch_layout_is_built_once_per_batch_layout():
    """Every KDA layer of a forward asks for the layout; they must share one (its index maps,
    argsort-free inverses and exchange-derived plans are built once), and a new packing must not
    reuse the old one."""
    shard = torch.zeros(6, 1, 4)  # this rank's rows: 24 tokens over cp=2 x sp=2
    first = batch_index_maps(shard, _thd([0, 8, 24]), cp=2, tp=2, sequence_parallel=True, kind="zigzag")
    again = batch_index_maps(shard, _thd([0, 8, 24]), cp=2, tp=2, sequence_parallel=True, kind="zigzag")
    other = batch_index_maps(shard, _thd([0, 16, 24]), cp=2, tp=2, sequence_parallel=True, kind="zigzag")
    assert again is first
    assert other is not first
    assert other.cu_seqlens.tolist() == [0, 16, 24]
    assert first.from_rank_major is again.from_rank_major
    built = []
    assert first.derived("plan", lambda: built.append(1) or "x") == "x"
    assert first.derived("plan", lambda: built.append(1) or "y") == "x"
    assert built == [1]
    with pytest.raises(ValueError, match="cu_seqlens end at 20 but the CP/SP shards hold 24"):
        batch_index_maps(shard, _thd([0, 8, 20]), cp=2, tp=2, sequence_parallel=True, kind="zigzag")


def test_layout_names_come_from_the_registry_of_kinds():
    """Every registered kind is a ``LayoutKind`` under its own name, ``LayoutName`` lists exactly
    them, and ``parallel.cp_layout`` (config stays a leaf, so it spells the names itself) accepts
    the same ones."""
    assert all(isinstance(kind, LayoutKind) and kind.name == name for name, kind in LAYOUTS.items())
    assert get_args(LayoutName) == tuple(LAYOUTS)
    assert get_args(ParallelConfig.model_fields["cp_layout"].annotation) == tuple(LAYOUTS)
