"""Sequence-parallel KDA under CP: the sequence stays sharded, only state summaries cross ranks.

Every KDA token step is affine in the incoming state, so a rank's piece of a sequence collapses to
``S_out = M S_in + S_local`` (fp32, ``M`` [H, K, K], ``S_local`` [H, K, V]). Each rank summarises
its pieces, one all-gather shares the summaries, and each rank composes its predecessors' maps in
chain order to get the state entering each of its pieces. The short convolution needs the
``conv_size - 1`` tokens before each piece: the tails of every piece are all-gathered too.

Megatron's zigzag layout gives each rank two pieces of every sequence (chunks ``r`` and
``2cp-1-r``); a sequence's chain runs through chunks ``0 .. 2cp-1``, i.e. front pieces in
ascending rank order, then back pieces in descending rank order. Autograd carries the backward:
the all-gathers' backward reduce-scatters send each summary's and tail's gradient to its owner.

This is the reference implementation (our torch kernel; it builds ``M`` with a second pass); it
proves the numerics on CPU. Nothing crosses a sequence boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pieces:
    """This rank's pieces as a packed varlen batch of a ``[b, s_local]`` row layout.

    Pieces are ordered (batch element, sequence, front/back); ``cu`` are their boundaries in the
    flattened ``b * s_local`` rows, ``natural_start`` their first natural position (offset by
    ``batch_index * T`` so positions are unique across the batch) and ``seq_start`` the natural
    start of their sequence (same offset).
    """

    cu: torch.Tensor
    natural_start: torch.Tensor
    seq_start: torch.Tensor

    @property
    def count(self) -> int:
        return self.cu.numel() - 1


def rank_pieces(cu_seqlens: torch.Tensor, cp: int, cp_rank: int, batch: int) -> Pieces:
    """The zigzag pieces of ``cp_rank`` for ``batch`` rows of sequences ``cu_seqlens``."""
    cu = cu_seqlens.to(torch.long)
    total = int(cu[-1])
    chunk = cu.diff() // (2 * cp)
    front = cu[:-1] + cp_rank * chunk
    back = cu[:-1] + (2 * cp - 1 - cp_rank) * chunk
    natural = torch.stack([front, back], 1).reshape(-1)  # (sequence, front/back)
    seq_start = cu[:-1].repeat_interleave(2)
    lengths = chunk.repeat_interleave(2)
    offsets = torch.arange(batch, device=cu.device).repeat_interleave(natural.numel()) * total
    lengths_all = lengths.repeat(batch)
    cu_pieces = torch.zeros(lengths_all.numel() + 1, dtype=torch.long, device=cu.device)
    cu_pieces[1:] = lengths_all.cumsum(0)
    return Pieces(cu_pieces, natural.repeat(batch) + offsets, seq_start.repeat(batch) + offsets)


def chain_entry_states(M: torch.Tensor, L: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """State entering each of this rank's pieces, from every rank's summaries.

    ``M`` [cp, P, H, K, K], ``L`` [cp, P, H, K, V]: the all-gathered summaries, pieces ordered
    (batch, sequence, front/back) on every rank. Returns [P, H, K, V] fp32.
    """
    # Chain position j of each sequence: front piece of rank j (j < cp), back piece of rank 2cp-1-j.
    owners = list(range(cp)) + list(range(cp - 1, -1, -1))
    halves = [0] * cp + [1] * cp
    P = M.shape[1]
    shape = (cp, P // 2, 2) + M.shape[2:]
    M = M.reshape(shape)
    L = L.reshape((cp, P // 2, 2) + L.shape[2:])
    state = torch.zeros_like(L[0, :, 0])
    entries = []
    for owner, half in zip(owners, halves):
        entries.append(state)
        state = M[owner, :, half] @ state + L[owner, :, half]
    mine = torch.stack([entries[cp_rank], entries[2 * cp - 1 - cp_rank]], dim=1)  # front, back
    return mine.reshape((P,) + mine.shape[2:])


def _tail_rows(pieces: Pieces, width: int):
    lengths = pieces.cu.diff().unsqueeze(1)
    back = torch.arange(width, 0, -1, device=pieces.cu.device)  # width .. 1 rows before the end
    rows = pieces.cu[1:].unsqueeze(1) - back  # [P, width]
    return rows, back <= lengths, lengths, back


def tail_positions(pieces: Pieces, width: int) -> torch.Tensor:
    """Natural positions of the last ``width`` rows of every piece (-1 where it is shorter)."""
    _, valid, lengths, back = _tail_rows(pieces, width)
    return torch.where(valid, pieces.natural_start.unsqueeze(1) + lengths - back, -1).reshape(-1)


def piece_tails(x: torch.Tensor, pieces: Pieces, width: int) -> torch.Tensor:
    """The last ``width`` rows of every piece of ``x`` [rows, C] ([P*width, C]; zero rows where a
    piece is shorter than ``width``), in the order of ``tail_positions``."""
    rows, valid, _, _ = _tail_rows(pieces, width)
    return x[rows.clamp_min(0).reshape(-1)] * valid.reshape(-1, 1)


def halo_rows(tails: torch.Tensor, tail_positions: torch.Tensor, pieces: Pieces, width: int) -> torch.Tensor:
    """Rows [P, width, C] preceding each local piece in its sequence, looked up in the gathered
    tails of all pieces; zero before the sequence start (what a causal conv sees there)."""
    wanted = pieces.natural_start.unsqueeze(1) - torch.arange(width, 0, -1, device=tails.device)
    inside = wanted >= pieces.seq_start.unsqueeze(1)
    order = torch.argsort(tail_positions)
    sorted_pos = tail_positions[order]
    idx = torch.searchsorted(sorted_pos, wanted.clamp_min(0)).clamp_max(sorted_pos.numel() - 1)
    found = inside & (sorted_pos[idx] == wanted)
    if bool((inside & ~found).any()):
        raise RuntimeError("conv halo rows missing from the gathered piece tails (layout bug)")
    rows = tails[order[idx].reshape(-1)].reshape(wanted.shape + tails.shape[1:])
    return rows * found.unsqueeze(-1)


def with_halo(x: torch.Tensor, halo: torch.Tensor, pieces: Pieces) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Interleave ``halo`` [P, w, C] before each piece of ``x`` [rows, C]: (rows, cu, keep index)."""
    P, width = halo.shape[:2]
    lengths = pieces.cu.diff()
    parts = []
    for p in range(P):
        parts += [halo[p], x[pieces.cu[p]: pieces.cu[p + 1]]]
    cu = torch.zeros(P + 1, dtype=torch.long, device=x.device)
    cu[1:] = (lengths + width).cumsum(0)
    keep = torch.cat([torch.arange(int(cu[p]) + width, int(cu[p + 1]), device=x.device) for p in range(P)])
    return torch.cat(parts), cu, keep
