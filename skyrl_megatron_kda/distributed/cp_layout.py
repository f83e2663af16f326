"""Where each row of a CP rank's shard sits in the natural (whole-sequence) token order.

Megatron's load-balanced CP layout cuts every sequence into ``2*cp`` equal chunks; CP rank ``r``
holds chunks ``r`` and ``2cp-1-r`` of each sequence, sequences one after the other (packed THD is
zigzagged per sequence). Under sequence parallelism TP rank ``t`` holds the ``t``-th contiguous
slice of its CP rank's rows. Every exchange reduces to one index map built here, so the layout
logic lives in one place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Hashable, Literal, Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


def zigzag_positions(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
    """Natural token position of every local row of every CP rank: LongTensor ``[cp, T/cp]``.

    ``cu_seqlens`` [N+1] are the global (natural) sequence boundaries; each length must divide
    by ``2*cp`` when cp > 1 (one rank holds every sequence whole, in order, whatever its length).
    """
    cu = cu_seqlens.to(torch.long)
    if cp == 1:
        return torch.arange(int(cu[-1]), device=cu.device).unsqueeze(0)
    lens = cu.diff()
    if bool((lens % (2 * cp)).any()):
        raise ValueError(
            f"every sequence length must divide by 2*cp={2 * cp} for the load-balanced CP layout; "
            f"got lengths {lens.tolist()}"
        )
    total = int(cu[-1])
    pos = torch.arange(total, device=cu.device)
    seq = torch.bucketize(pos, cu[1:], right=True)
    chunk_len = (lens // (2 * cp))[seq]
    offset = pos - cu[:-1][seq]
    chunk = offset // chunk_len  # natural chunk index in [0, 2cp)
    rank = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
    second_half = (chunk >= cp).long()
    # Row on its rank: the rank's earlier sequences, then (front chunk, back chunk) of this one.
    local_row = cu[:-1][seq] // cp + second_half * chunk_len + offset % chunk_len
    out = torch.empty(cp, total // cp, dtype=torch.long, device=cu.device)
    out[rank, local_row] = pos
    return out


def contiguous_positions(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
    """Positions ``[cp, T/cp]`` of the contiguous layout: rank ``r`` holds rows
    ``[r*T/cp, (r+1)*T/cp)`` of the packed row, cutting sequences anywhere."""
    total = int(cu_seqlens[-1])
    if total % cp:
        raise ValueError(f"{total} tokens do not split evenly over cp={cp} (contiguous CP layout)")
    return torch.arange(total, device=cu_seqlens.device).view(cp, -1)


@runtime_checkable
class LayoutKind(Protocol):
    """A CP layout kind: how a packed row's tokens are laid over the CP ranks. Every rule that
    depends on the kind (padding, the rank's rows, the state exchange's pieces) asks it."""

    name: str
    pieces_per_sequence: int
    """Pieces of every sequence on each CP rank, at most (an absent piece is empty)."""

    def positions(self, cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
        """Natural position of every row of every CP rank: LongTensor ``[cp, T/cp]``."""
        ...

    def sequence_multiple(self, cp: int) -> int:
        """What every sequence's length must divide by."""
        ...

    def row_multiple(self, cp: int) -> int:
        """What a packed row's length must divide by."""
        ...

    def row_rule(self, cp: int) -> str:
        """The row multiple named, and why it is needed."""
        ...

    def rank_pieces(self, cu_seqlens: torch.Tensor, cp: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Natural starts and lengths ``[sequences, pieces_per_sequence]`` of ``cp_rank``'s pieces."""
        ...

    def chain_order(self, cp: int) -> list[tuple[int, int]]:
        """(rank, piece) of each piece of a sequence, in natural order."""
        ...


class ZigzagLayout(LayoutKind):
    """Megatron's load-balanced layout: each sequence cut into ``2*cp`` chunks, CP rank ``r``
    holding chunks ``r`` and ``2cp-1-r`` (its front and back piece of every sequence)."""

    name = "zigzag"
    pieces_per_sequence = 2
    """Pieces of every sequence on each CP rank (front, back)."""

    @staticmethod
    def positions(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
        return zigzag_positions(cu_seqlens, cp)

    @staticmethod
    def sequence_multiple(cp: int) -> int:
        return 2 * cp if cp > 1 else 1

    def row_multiple(self, cp: int) -> int:
        return self.sequence_multiple(cp)

    @staticmethod
    def row_rule(cp: int) -> str:
        return (f"2*cp={2 * cp}: Megatron's load-balanced (zigzag) CP layout cuts each sequence "
                "into 2*cp chunks")

    @staticmethod
    def rank_pieces(cu_seqlens: torch.Tensor, cp: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        cu = cu_seqlens.to(torch.long)
        chunk = cu.diff() // (2 * cp)
        starts = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp - 1 - cp_rank) * chunk], 1)
        return starts, torch.stack([chunk, chunk], 1)

    @staticmethod
    def chain_order(cp: int) -> list[tuple[int, int]]:
        """Chunks 0..cp-1 are front pieces of ascending ranks, cp..2cp-1 back pieces of
        descending ranks."""
        return [(r, 0) for r in range(cp)] + [(r, 1) for r in range(cp - 1, -1, -1)]


class ContiguousLayout(LayoutKind):
    """Rank ``r`` holds rows ``[r*T/cp, (r+1)*T/cp)`` of the packed row, cutting sequences anywhere."""

    name = "contiguous"
    pieces_per_sequence = 1
    """At most one piece of every sequence on each CP rank (empty where it misses the rank)."""

    @staticmethod
    def positions(cu_seqlens: torch.Tensor, cp: int) -> torch.Tensor:
        return contiguous_positions(cu_seqlens, cp)

    @staticmethod
    def sequence_multiple(cp: int) -> int:
        return 1

    @staticmethod
    def row_multiple(cp: int) -> int:
        return cp

    @staticmethod
    def row_rule(cp: int) -> str:
        return f"cp={cp}: the contiguous CP layout gives each rank an equal slice"

    @staticmethod
    def rank_pieces(cu_seqlens: torch.Tensor, cp: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        cu = cu_seqlens.to(torch.long)
        total = int(cu[-1])
        lo, hi = cp_rank * total // cp, (cp_rank + 1) * total // cp
        first = cu[:-1].clamp(lo, hi)
        return first.unsqueeze(1), (cu[1:].clamp(lo, hi) - first).unsqueeze(1)

    @staticmethod
    def chain_order(cp: int) -> list[tuple[int, int]]:
        return [(r, 0) for r in range(cp)]


LAYOUTS: dict[str, LayoutKind] = {kind.name: kind for kind in (ZigzagLayout(), ContiguousLayout())}
"""The CP layout kinds by name (``parallel.cp_layout``): every rule that depends on the kind asks it."""

LayoutName = Literal[tuple(LAYOUTS)]  # type: ignore[valid-type]  # derived here, not listed again
"""The name of a registered layout kind."""


def layout_kind(name: str) -> LayoutKind:
    """The layout kind called ``name``; unknown names are refused with the known ones."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown CP layout {name!r}; expected one of {sorted(LAYOUTS)}")
    return LAYOUTS[name]


def rank_rows(cu_seqlens: torch.Tensor, cp: int, tp: int, cp_rank: int, tp_rank: int,
              sequence_parallel: bool, kind: str = "zigzag") -> torch.Tensor:
    """Natural positions of the rows rank (cp_rank, tp_rank) holds: its CP rank's rows in layout
    ``kind``, then under SP its contiguous ``1/tp`` slice of them."""
    rows = layout_kind(kind).positions(cu_seqlens, cp)[cp_rank]
    if not sequence_parallel:
        return rows
    if rows.numel() % tp:
        raise ValueError(f"{rows.numel()} rows per CP rank do not split over tp={tp} under sequence "
                         "parallelism")
    return rows.view(tp, -1)[tp_rank]


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``index`` (a permutation of ``0..n-1``): one scatter, O(n),
    where an argsort would sort; for a permutation both give the same tensor."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return inverse


@dataclass(frozen=True)
class RowOrder:
    """A reordering of rows and the one that undoes it, built together once so that neither the
    reorder nor its backward sorts or inverts anything again."""

    index: torch.Tensor  # ``take_rows(x, index)`` reorders
    inverse: torch.Tensor  # ``take_rows(y, inverse)`` restores

    @classmethod
    def to_natural(cls, positions: torch.Tensor) -> "RowOrder":
        """From rows carrying natural ``positions`` (each once, all of them) to natural order: the
        index is the inverse permutation of ``positions``, whose own inverse is ``positions``."""
        return cls(inverse_permutation(positions), positions)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return take_rows(x, self.index, self.inverse)

    def undo(self, x: torch.Tensor) -> torch.Tensor:
        return take_rows(x, self.inverse, self.index)


@dataclass(frozen=True)
class BatchIndexMaps:
    """A batch's index maps between this mesh's shards and natural token order, built once per
    batch (``batch_index_maps``) and shared by every layer that runs on the batch.

    ``positions[c, j]`` is the natural position of row ``j`` of CP rank ``c`` (all its TP ranks
    together); ``cu_seqlens`` are the natural boundaries the kernel needs. The row orders below
    and anything an exchange derives with ``derived`` are computed on first use and kept.
    """

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    cp: int
    tp: int
    packed: bool  # THD: one row of several sequences; else each batch row is one sequence
    kind: str = "zigzag"  # a key of LAYOUTS

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, cp: int, tp: int, packed: bool, kind: str = "zigzag") -> "BatchIndexMaps":
        return cls(cu_seqlens, layout_kind(kind).positions(cu_seqlens, cp), cp, tp, packed, kind)

    @property
    def kernel_cu_seqlens(self) -> torch.Tensor | None:
        """Natural sequence boundaries for varlen kernels (None for [s, b, h] batches)."""
        return self.cu_seqlens if self.packed else None

    def rank_major_positions(self) -> torch.Tensor:
        """Positions of rows laid out CP rank after CP rank (what a CP all-to-all or all-gather of
        whole CP-rank shards produces)."""
        return self.positions.reshape(-1)

    def gathered_positions(self) -> torch.Tensor:
        """Positions of rows after an all-gather over CP and then over TP of SP shards: TP rank
        major, then CP rank, then the row within the SP shard."""
        per_tp = self.positions.view(self.cp, self.tp, -1).transpose(0, 1)
        return per_tp.reshape(-1)

    @cached_property
    def from_rank_major(self) -> RowOrder:
        """Rows CP rank after CP rank <-> natural order."""
        return RowOrder.to_natural(self.rank_major_positions())

    @cached_property
    def from_gathered(self) -> RowOrder:
        """Rows as gathered over CP then TP (``gathered_positions``) <-> natural order."""
        return RowOrder.to_natural(self.gathered_positions())

    @cached_property
    def _derived(self) -> dict:
        return {}

    def derived(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, once per layout and ``key``: what an exchange derives from the layout alone
        (index maps, piece boundaries), shared by every layer of the batch."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]


class _TakeRows(torch.autograd.Function):
    """``x.index_select(0, index)`` for a permutation ``index``, whose backward gathers the
    gradient rows back with ``inverse``: autograd's own backward accumulates with atomics
    (``index_add_``), which for bf16 on the GPU costs many times a copy of the same rows."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def take_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (a permutation of ``0..n-1``) of ``x`` along dim 0, differentiable without
    atomics; ``inverse`` is the permutation that undoes it (``RowOrder`` builds both once)."""
    return _TakeRows.apply(x, index, inverse)


def sort_index(positions: torch.Tensor) -> torch.Tensor:
    """Index that puts rows carrying ``positions`` into natural order: ``rows[sort_index(p)]``."""
    return torch.argsort(positions)


def batch_bounds(hidden_states: torch.Tensor, packed_seq_params, total: int) -> tuple[tuple[int, ...], bool]:
    """Natural (global) sequence boundaries of a batch whose CP/SP shards hold ``total`` tokens per
    row, as ints, and whether it is packed THD (b = 1, megatron's padded ``cu_seqlens`` when
    given). Reading packed boundaries is one device-to-host copy."""
    batch = hidden_states.shape[1]
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        if batch != 1:
            raise ValueError(f"packed THD input needs batch 1, got {batch}")
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        bounds = tuple(cu.tolist())
        if bounds[-1] != total:
            raise ValueError(f"cu_seqlens end at {bounds[-1]} but the CP/SP shards hold {total} tokens")
        return bounds, True
    return (0, total), False


def batch_sequences(hidden_states: torch.Tensor, packed_seq_params, total: int) -> tuple[torch.Tensor, bool]:
    """``batch_bounds`` as a LongTensor on the batch's device."""
    bounds, packed = batch_bounds(hidden_states, packed_seq_params, total)
    return torch.tensor(bounds, dtype=torch.long, device=hidden_states.device), packed


INDEX_MAPS_CACHE_SIZE = 2
"""Batches' index maps kept (``batch_index_maps``): the current micro-batch's and one more, so that a
recompute or a pipeline schedule that alternates two micro-batches does not rebuild. Each holds a
few int64 tensors of the sequence's length (8 MiB each at 1M tokens)."""


@functools.lru_cache(maxsize=INDEX_MAPS_CACHE_SIZE)
def _index_maps_of(bounds: tuple[int, ...], device: torch.device, cp: int, tp: int, packed: bool,
                   kind: str) -> BatchIndexMaps:
    return BatchIndexMaps.build(torch.tensor(bounds, dtype=torch.long, device=device), cp, tp, packed, kind)


def batch_index_maps(hidden_states: torch.Tensor, packed_seq_params, cp: int, tp: int,
                     sequence_parallel: bool, kind: str) -> BatchIndexMaps:
    """The index maps of this batch's rows (``hidden_states`` [s, b, D]: this rank's CP/SP shard).

    Every layer of a forward pass gets the same ``BatchIndexMaps`` object for the same boundaries and
    mesh, so its index maps (and what exchanges derive from it) are built once per batch, not once
    per layer."""
    total = hidden_states.shape[0] * (tp if sequence_parallel else 1) * cp
    bounds, packed = batch_bounds(hidden_states, packed_seq_params, total)
    return _index_maps_of(bounds, hidden_states.device, cp, tp, packed, kind)
