"""Where a DSA layer's rows sit in natural token order, and how to gather them over SP and CP.

The DSA layer attends over the whole sequence in natural order: its KV latent and indexer keys
are gathered over the TP (SP) and CP groups and sorted by the project's CP layouts
(``distributed.cp_layout``: zigzag or contiguous, packed THD), while the queries stay local.
``DSABatchRows`` holds one batch's positions and the gathers (megatron's
``gather_from_sequence_parallel_region``: all-gather forward, reduce-scatter backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from ..config import DSAConfig
from ..distributed.cp_layout import (
    BatchIndexMaps,
    RowOrder,
    batch_index_maps,
    inverse_permutation,
    sort_index,
)


def balanced_row_order(rows: int, tp: int, device=None) -> torch.Tensor:
    """A CP rank's rows 0 .. rows - 1 in the order whose t-th contiguous 1/tp holds TP rank t's
    rows under the sequence split: a front piece counted from the first row and a back piece
    counted from the last (rank 0 the first and the last rows, rank tp - 1 the two middle
    pieces). A CP rank's rows rise in position within each piece of its layout, and a query's
    indexer work grows with its position (it scores every earlier pool): TP slices in row order
    would give the last TP rank the latest rows and set the step (at the 1M recipe's share about
    twice the average), where these pairs give every TP rank about the CP rank's mean position
    (exactly, for one sequence in the zigzag or contiguous layout)."""
    per_rank = rows // tp
    front, back = per_rank // 2, per_rank - per_rank // 2
    fronts = torch.arange(tp * front, device=device).view(tp, front)
    backs = (rows - 1 - torch.arange(tp * back, device=device)).view(tp, back).flip(-1)
    return torch.cat([fronts, backs], dim=1).reshape(-1)


@dataclass(frozen=True)
class ShareExchange:
    """One TP rank's part of the all-to-all between the SP slices and the attention shares
    (``share_exchange``); ``to_share`` and ``from_share`` run it either way."""

    send: RowOrder
    """This rank's own (SP) rows grouped by the rank that attends them, in rank order."""
    send_counts: list[int]
    recv_counts: list[int]
    arrange: RowOrder
    """The received rows (grouped by the rank that sent them) in the rank's share order."""

    def to_share(self, t: torch.Tensor, group) -> torch.Tensor:
        """[r, ...] this rank's own rows -> [r', ...] its share, differentiable (the backward
        sends the gradients back the other way)."""
        return _Exchange.apply(t, self, group, True)

    def from_share(self, t: torch.Tensor, group) -> torch.Tensor:
        """The inverse of ``to_share``: the share's rows back to the ranks whose SP slices hold
        them."""
        return _Exchange.apply(t, self, group, False)

    def move(self, t: torch.Tensor, group, to_share: bool) -> torch.Tensor:
        """One all-to-all: this rank's own rows to its share, or the share's rows back."""
        if to_share:
            take, place = self.send.index, self.arrange.index
            sent, received = self.send_counts, self.recv_counts
        else:
            take, place = self.arrange.inverse, self.send.inverse
            sent, received = self.recv_counts, self.send_counts
        rows = t.index_select(0, take)
        got = rows.new_empty(sum(received), *t.shape[1:])
        torch.distributed.all_to_all_single(got, rows, received, sent, group=group)
        return got.index_select(0, place)


class _Exchange(torch.autograd.Function):
    """``ShareExchange.move``, whose backward moves the gradient rows the other way (the
    exchange only moves rows, so its transpose is its inverse)."""

    @staticmethod
    def forward(ctx, t, plan: ShareExchange, group, to_share: bool):
        ctx.plan, ctx.group, ctx.to_share = plan, group, to_share
        return plan.move(t, group, to_share)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan.move(grad.contiguous(), ctx.group, not ctx.to_share), None, None, None


def share_exchange(order: torch.Tensor, tp: int, rank: int) -> ShareExchange:
    """How TP rank ``rank`` swaps rows so that every rank ends with its share of a CP rank's
    rows, ``order.view(tp, -1)[t]`` for rank t, when SP gave rank t the contiguous rows
    [t r, (t + 1) r) (r = rows / tp). Each rank holds 1/tp of the rows before and after, so
    the exchange moves at most that much, where an all-gather would give every rank all of them.
    Computed alike on every rank from ``order``; the row counts cross no process."""
    per = order.numel() // tp
    shares = order.view(tp, per)
    owner = shares.div(per, rounding_mode="floor")
    sends = [shares[t][owner[t] == rank] - rank * per for t in range(tp)]
    send = torch.cat(sends)
    arrival = torch.sort(owner[rank], stable=True).indices  # received row k is share row arrival[k]
    return ShareExchange(RowOrder(send, inverse_permutation(send)), [s.numel() for s in sends],
                         torch.bincount(owner[rank], minlength=tp).tolist(),
                         RowOrder(inverse_permutation(arrival), arrival))


@dataclass(frozen=True)
class DSABatchRows:
    """Where this rank's rows sit in natural token order, and how to gather them.

    ``maps.positions[c, j]`` is the natural position of row ``j`` of CP rank ``c`` (its TP
    ranks' SP shards together); ``maps.cu_seqlens`` are the natural document boundaries.
    """

    maps: BatchIndexMaps
    tp_group: torch.distributed.ProcessGroup
    cp_group: torch.distributed.ProcessGroup
    sequence_parallel: bool

    @property
    def query_positions(self) -> torch.Tensor:
        """Natural positions of this CP rank's rows (the rows the attention queries cover)."""
        return self.maps.positions[self.cp_group.rank()]

    @property
    def query_document_starts(self) -> torch.Tensor:
        """Natural position of the first token of each query row's document."""
        cu = self.maps.cu_seqlens
        return cu[torch.bucketize(self.query_positions, cu[1:], right=True)]

    @property
    def splits_sequence(self) -> bool:
        """Whether this rank's rows are a TP slice of its CP rank's rows (SP with TP > 1)."""
        return self.sequence_parallel and self.tp_group.size() > 1

    def attends_by_rows(self, dsa: DSAConfig) -> bool:
        """``DSAConfig.attends_by_rows`` on this mesh."""
        return dsa.attends_by_rows(self.tp_group.size(), self.sequence_parallel)

    def attention_order(self) -> RowOrder:
        """This CP rank's rows reordered so that the t-th contiguous slice holds the rows TP rank
        t indexes and attends under the sequence split (``balanced_row_order``), and back; built
        once per batch."""
        def build() -> RowOrder:
            rows = self.maps.positions.shape[1]
            order = balanced_row_order(rows, self.tp_group.size(), self.maps.positions.device)
            return RowOrder(order, inverse_permutation(order))

        return self.maps.derived("dsa attention rows", build)

    def attention_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a [s, ...] tensor over this CP rank's rows that this rank indexes and
        attends under the sequence split (its slice of ``attention_order``; all of them without
        SP)."""
        if not self.splits_sequence:
            return t
        mine = self.attention_order().index.view(self.tp_group.size(), -1)[self.tp_group.rank()]
        return t.index_select(0, mine)

    def share_plan(self) -> ShareExchange:
        """This rank's part of the all-to-all between its SP rows and its share under the
        sequence split (``attention_rows``), built once per batch."""
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        return self.maps.derived(("dsa share exchange", rank),
                                 lambda: share_exchange(self.attention_order().index, tp, rank))

    def to_share(self, t: torch.Tensor) -> torch.Tensor:
        """[r, b, ...] this rank's own rows -> ``attention_rows`` of its CP rank's rows, by one
        all-to-all inside TP instead of a gather of all of them; differentiable. The rows
        themselves without SP."""
        if not self.splits_sequence:
            return t
        return self.share_plan().to_share(t, self.tp_group)

    def from_share(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_share``: this rank's share -> its own rows."""
        if not self.splits_sequence:
            return t
        return self.share_plan().from_share(t, self.tp_group)

    def cp_rank_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[r, b, ...] rows of this rank -> all rows of its CP rank: under SP the TP all-gather,
        whose backward reduce-scatters (sums the TP ranks' head-partial grads). TP > 1 without
        SP is refused when the layer is built."""
        if self.splits_sequence:
            return gather_from_sequence_parallel_region(t, group=self.tp_group)
        return t

    def whole_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """[r, b, ...] rows of this rank -> [T, b, ...] in natural order; backward sums each
        row's gradient over every rank that used it and returns this rank's share."""
        t = self.cp_rank_rows(t)
        if self.cp_group.size() > 1:
            t = gather_from_sequence_parallel_region(t, group=self.cp_group)
            t = t.index_select(0, sort_index(self.maps.rank_major_positions()))
        return t


def dsa_batch_rows(hidden_states: torch.Tensor, packed_seq_params: PackedSeqParams | None,
                   tp_group, cp_group, sequence_parallel: bool, kind: str) -> DSABatchRows:
    """The rows of a batch from this rank's input rows: [s, b, h] (every batch row one
    sequence) or packed THD (b = 1, global natural ``cu_seqlens``, padded ones if given). The
    index maps are the batch's (``batch_index_maps``), so what the layer derives from them (its
    balanced shares, their exchange plan) is built once per batch, not at every call."""
    if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
        raise ValueError(f"DSA supports packed qkv_format 'thd' only, got {packed_seq_params.qkv_format!r}")
    cp = cp_group.size()
    kind = kind if cp > 1 else "contiguous"  # one CP rank: every layout is the identity
    maps = batch_index_maps(hidden_states, packed_seq_params, cp, tp_group.size(),
                            sequence_parallel, kind)
    return DSABatchRows(maps, tp_group, cp_group, sequence_parallel)
