"""Sequence-parallel KDA under CP: the sequence stays sharded, only state summaries cross ranks.

Every KDA token step is affine in the incoming state, so a rank's piece of a sequence collapses to
``S_out = M S_in + S_local`` (fp32, ``M`` [H, K, K], ``S_local`` [H, K, V]). Each rank summarises
its pieces, one all-gather shares the summaries, and each rank composes its predecessors' maps in
chain order to get the state entering each of its pieces. The short convolution needs the
``conv_size - 1`` tokens before each piece: the tails of every piece are all-gathered too.

Megatron's zigzag layout gives each rank two pieces of every sequence (chunks ``r`` and
``2cp-1-r``); a sequence's chain runs through chunks ``0 .. 2cp-1``, i.e. front pieces in
ascending rank order, then back pieces in descending rank order. In the contiguous layout
(rank ``r`` holds rows ``[r*T/cp, (r+1)*T/cp)`` of the packed row) the chain runs through the
ranks in order. Both work on the shards as they are: no relayout of tokens.

Backward runs the same chain in reverse: each piece's entry-state gradient with no gradient at
its exit is all-gathered, and ``chain_exit_grads`` walks every chain backwards (through ``M^T``)
to the gradient reaching each piece's exit; the conv tails' all-gather reduce-scatters their
gradients to their owners. ``state_kernel.py`` runs the kernel passes around these two steps, so
nothing is differentiated through the summaries. Nothing crosses a sequence boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed.cp_layout import layout_kind
from .kernel import taps_by_lag


@dataclass(frozen=True)
class Pieces:
    """This rank's pieces as a packed varlen batch of a ``[b, s_local]`` row layout.

    One slot per (batch element, sequence, part), where the parts are (front, back) in the
    zigzag layout and a single one in the contiguous layout; a sequence that misses this rank
    (contiguous layout) has an empty slot, whose summary is the identity map. ``cu`` are the
    slots' boundaries in the flattened ``b * s_local`` rows, ``natural_start`` their first natural
    position (offset by ``batch_index * T`` so positions are unique across the batch) and
    ``seq_start`` the natural start of their sequence (same offset; equal to ``natural_start``
    for empty slots, so they ask for no conv halo).
    """

    cu: torch.Tensor
    natural_start: torch.Tensor
    seq_start: torch.Tensor
    parts: int

    @property
    def count(self) -> int:
        return self.cu.numel() - 1

    def occupied(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices of the slots that hold rows, and the boundaries of those slots alone: what
        a kernel runs on (an empty slot has no rows to run). Built once per batch layout: the
        layer then selects slots by index, never by a mask (a mask costs a device sync)."""
        lengths = self.cu.diff()
        present = (lengths > 0).nonzero().squeeze(1)
        cu = torch.zeros(present.numel() + 1, dtype=torch.long, device=lengths.device)
        cu[1:] = lengths[present].cumsum(0)
        return present, cu


def rank_pieces(cu_seqlens: torch.Tensor, cp: int, cp_rank: int, batch: int, kind: str) -> Pieces:
    """The pieces ``cp_rank`` holds of ``batch`` rows of sequences ``cu_seqlens`` in the CP layout
    ``kind`` (``distributed.cp_layout.LAYOUTS``)."""
    cu = cu_seqlens.to(torch.long)
    total = int(cu[-1])
    starts, lengths = layout_kind(kind).rank_pieces(cu, cp, cp_rank)
    parts = starts.shape[1]
    seq_start = torch.where(lengths > 0, cu[:-1].unsqueeze(1), starts).reshape(-1)
    starts, lengths = starts.reshape(-1), lengths.reshape(-1)
    offsets = torch.arange(batch, device=cu.device).repeat_interleave(starts.numel()) * total
    cu_pieces = torch.zeros(batch * starts.numel() + 1, dtype=torch.long, device=cu.device)
    cu_pieces[1:] = lengths.repeat(batch).cumsum(0)
    return Pieces(cu_pieces, starts.repeat(batch) + offsets, seq_start.repeat(batch) + offsets, parts)


def chain_order(cp: int, kind: str) -> list[tuple[int, int]]:
    """(rank, part) of each piece of a sequence, in natural order."""
    return layout_kind(kind).chain_order(cp)


def _chain_and_slots(cp: int, kind: str, *gathered: torch.Tensor):
    """The chain order, and gathered [cp, P, ...] tensors viewed as [cp, sequences, parts, ...]."""
    order = chain_order(cp, kind)
    parts = max(part for _, part in order) + 1
    return order, [x.reshape((cp, x.shape[1] // parts, parts) + x.shape[2:]) for x in gathered]


def chain_entry_states(M: torch.Tensor, L: torch.Tensor, cp: int, cp_rank: int, kind: str) -> torch.Tensor:
    """State entering each of this rank's pieces, from every rank's summaries.

    ``M`` [cp, P, H, K, K], ``L`` [cp, P, H, K, V]: the all-gathered summaries, slots ordered as
    in ``Pieces`` on every rank. Returns [P, H, K, V] fp32.
    """
    order, (M, L) = _chain_and_slots(cp, kind, M, L)
    state = torch.zeros_like(L[0, :, 0])
    entry = [None] * M.shape[2]
    for rank, part in order:
        if rank == cp_rank:
            entry[part] = state
        state = M[rank, :, part] @ state + L[rank, :, part]
    return torch.stack(entry, dim=1).flatten(0, 1)


def chain_exit_grads(M: torch.Tensor, entry_grads: torch.Tensor, cp: int, cp_rank: int, kind: str) -> torch.Tensor:
    """Gradient that later pieces send to the exit state of each of this rank's pieces.

    ``M`` [cp, P, H, K, K]: the gathered transitions; ``entry_grads`` [cp, P, H, K, V]: every
    piece's entry-state gradient with no gradient at its exit (gathered). Walks each chain
    backwards: a piece's full entry gradient is its own plus ``M^T`` times its exit gradient.
    Returns [P, H, K, V] fp32.
    """
    order, (M, D) = _chain_and_slots(cp, kind, M, entry_grads)
    grad = torch.zeros_like(D[0, :, 0])
    exits = [None] * M.shape[2]
    for rank, part in reversed(order):
        if rank == cp_rank:
            exits[part] = grad
        grad = D[rank, :, part] + M[rank, :, part].transpose(-1, -2) @ grad
    return torch.stack(exits, dim=1).flatten(0, 1)


def _tail_rows(pieces: Pieces, width: int):
    lengths = pieces.cu.diff().unsqueeze(1)
    back = torch.arange(width, 0, -1, device=pieces.cu.device)  # width .. 1 rows before the end
    rows = pieces.cu[1:].unsqueeze(1) - back  # [P, width]
    return rows, back <= lengths, lengths, back


def tail_positions(pieces: Pieces, width: int) -> torch.Tensor:
    """Natural positions of the last ``width`` rows of every piece (-1 where it is shorter)."""
    _, valid, lengths, back = _tail_rows(pieces, width)
    return torch.where(valid, pieces.natural_start.unsqueeze(1) + lengths - back, -1).reshape(-1)


@dataclass(frozen=True)
class HaloPlan:
    """How the conv of this rank's rows gets its halo: a function of the layout alone, built once
    per batch layout (``halo_plan``), indices and masks included, so that a layer's step only
    gathers and scatters rows.

    ``tail_rows`` [P * width] are the last ``width`` rows of every piece, in the order of
    ``tail_positions`` (``tail_valid`` false where a piece is shorter). ``source[p, i]`` is the
    row of the all-gathered tails (every rank's ``piece_tails``) that precedes piece ``p`` by
    ``width - i`` rows, ``inside[p, i]`` whether that row is in the sequence (else the conv sees
    a zero). The conv runs over all of this rank's rows at once as if they were one sequence;
    only the first ``width`` rows of each piece, ``head_rows`` [F], read taps from before the
    piece start, and they are computed again from their true window. Tap ``s`` of head row ``r``
    (``s`` rows back, ``width + 1`` taps) read row ``window[f, s] = r - s`` where ``window_read``
    (zero before row 0), and truly lies before the piece start where ``before_start``: then it
    is halo row ``from_halo[f, s]`` of [P * width]."""

    pieces: Pieces
    width: int
    tail_rows: torch.Tensor
    tail_valid: torch.Tensor
    source: torch.Tensor
    inside: torch.Tensor
    head_rows: torch.Tensor
    window: torch.Tensor
    window_read: torch.Tensor
    from_halo: torch.Tensor
    before_start: torch.Tensor


def halo_plan(mine: Pieces, every_rank: list[Pieces], width: int) -> HaloPlan:
    """The halo plan of this rank's pieces ``mine``, given every CP rank's pieces in rank order."""
    positions = torch.cat([tail_positions(p, width) for p in every_rank])
    wanted = mine.natural_start.unsqueeze(1) - torch.arange(width, 0, -1, device=positions.device)
    inside = wanted >= mine.seq_start.unsqueeze(1)
    order = torch.argsort(positions)
    sorted_pos = positions[order]
    idx = torch.searchsorted(sorted_pos, wanted.clamp_min(0)).clamp_max(sorted_pos.numel() - 1)
    found = sorted_pos[idx] == wanted
    if bool((inside & ~found).any()):
        raise RuntimeError("conv halo rows missing from the gathered piece tails (layout bug)")
    tail_rows, tail_valid, _, _ = _tail_rows(mine, width)
    # Row j < width of piece p (that exists), its taps s = 0..width: before the start when s > j.
    lengths = mine.cu.diff()
    j = torch.arange(width, device=lengths.device)
    piece, offset = (t[j.unsqueeze(0) < lengths.unsqueeze(1)]
                     for t in torch.broadcast_tensors(torch.arange(mine.count, device=j.device).unsqueeze(1), j))
    rows = mine.cu[:-1][piece] + offset
    taps = torch.arange(width + 1, device=j.device)
    window = rows.unsqueeze(1) - taps
    before = taps > offset.unsqueeze(1)
    from_halo = piece.unsqueeze(1) * width + width - taps + offset.unsqueeze(1)
    return HaloPlan(mine, width, tail_rows.clamp_min(0).reshape(-1), tail_valid.reshape(-1, 1), order[idx],
                    inside & found, rows, window.clamp_min(0), (window >= 0).unsqueeze(-1),
                    torch.where(before, from_halo, 0), before.unsqueeze(-1))


def piece_tails(x: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    """The last ``width`` rows of every piece of ``x`` [rows, C] ([P*width, C]; zero rows where a
    piece is shorter than ``width``), in the order of ``tail_positions``."""
    return x[plan.tail_rows] * plan.tail_valid


def add_tail_grads(x_grad: torch.Tensor, tails_grad: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    """``piece_tails``' backward, added into ``x_grad`` [rows, C] in place: a handful of rows,
    where autograd would build a zero gradient the size of ``x`` and add it."""
    return x_grad.index_add_(0, plan.tail_rows, tails_grad * plan.tail_valid)


def halo_rows(tails: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    """Rows [P, width, C] preceding each local piece in its sequence, looked up in the gathered
    tails of all pieces; zero before the sequence start (what a causal conv sees there)."""
    rows = tails[plan.source.reshape(-1)].reshape(plan.source.shape + tails.shape[1:])
    return rows * plan.inside.unsqueeze(-1)


def window_conv_silu(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal conv + SiLU of the rows whose taps are ``window`` [..., W, C] (tap ``s``: the row ``s``
    steps back), weight [C, W]: [..., C], fp32 inside as the kernel's torch conv, in the window's
    dtype. A few kernels for all the rows: they are only the pieces' first rows."""
    y = (window.float() * taps_by_lag(weight.float()).T).sum(-2)
    return torch.nn.functional.silu(y).to(window.dtype)


def window_rows(x: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    """The rows of ``x`` [rows, C] that the taps of ``plan.head_rows`` read: [F, width + 1, C]
    (row 0 where a tap lies before row 0; ``head_windows`` masks it)."""
    return x.index_select(0, plan.window.flatten()).view(plan.window.shape + x.shape[1:])


def head_windows(rows: torch.Tensor, halo: torch.Tensor, plan: HaloPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows [F, width + 1, C] of the rows ``plan.head_rows``, from their ``window_rows``:
    as the conv over all of the rank's rows read them (zero before row 0), and as they truly are
    (with ``halo`` [P, width, C] before each piece start)."""
    read = rows * plan.window_read
    return read, torch.where(plan.before_start, halo.reshape(-1, halo.shape[-1])[plan.from_halo], read)
