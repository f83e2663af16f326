"""The indexer selects once per step under recompute: the checkpointed forward keeps its
selection and the recompute attends with it.

A recomputed DSA layer would otherwise run its indexer twice per step (in the checkpointed
forward and again when backward rebuilds the layer), and the indexer is the larger half of a DSA
layer's forward at long context. The model hands each checkpoint of a DSA layer one
``KeptSelection`` as a non-tensor argument; a reentrant checkpoint passes that same object to the
recompute, so the holder lives exactly as long as the checkpoint's graph (nothing outlives a
forward whose backward never runs, and nothing is matched by address). The layer installs it
for its attention (``kept_for``); the core attention asks ``select`` for its indices.

What is kept is the selection's compact form: a selection (``DSAKernel.indices``) is
``index_topk / kpool`` pools of ``kpool`` consecutive tokens each (a pool's tokens are all -1
when it is not chosen), then the query's ``kpool - 1`` tail; kept are the pools' first tokens and
the tail, int32, ``index_topk / kpool + kpool - 1`` per query row (``kept_bytes_per_row``),
``kpool`` times fewer than the token indices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_ACTIVE: ContextVar[KeptSelection | None] = ContextVar("kept_dsa_selection", default=None)


class KeptSelection:
    """One checkpointed DSA layer's selection, from its forward to its recompute."""

    def __init__(self) -> None:
        self.compact: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kpool, self.dtype = 0, torch.int32

    def select(self, selection: Callable[[], torch.Tensor], kpool: int, topk: int) -> torch.Tensor:
        """The kept selection if there is one (handed over once: the recompute's), else
        ``selection()``, kept for the recompute."""
        if self.compact is not None:
            out = expand(*self.compact, self.kpool).to(self.dtype)
            self.compact = None
            return out
        out = selection()
        self.compact, self.kpool, self.dtype = compact(out, kpool, topk), kpool, out.dtype
        return out


@contextmanager
def kept_for(holder: KeptSelection | None) -> Iterator[None]:
    """Make ``holder`` the selection of the DSA attention called inside (None: select anew)."""
    token = _ACTIVE.set(holder)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def select(selection: Callable[[], torch.Tensor], kpool: int, topk: int) -> torch.Tensor:
    """The DSA core attention's indices: through the active holder, or ``selection()``."""
    holder = _ACTIVE.get()
    return selection() if holder is None else holder.select(selection, kpool, topk)


def compact(indices: torch.Tensor, kpool: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices [..., topk + kpool - 1] -> (the pools' first tokens [..., topk / kpool],
    the tail [..., kpool - 1]), int32."""
    if indices.shape[-1] != topk + kpool - 1:
        raise ValueError(f"a DSA selection has index_topk + index_kpool - 1 = "
                         f"{topk + kpool - 1} indices per query, got {indices.shape[-1]}")
    return (indices[..., :topk:kpool].to(torch.int32).contiguous(),
            indices[..., topk:].to(torch.int32).contiguous())


def expand(first: torch.Tensor, tail: torch.Tensor, kpool: int) -> torch.Tensor:
    """The inverse of ``compact``: every chosen pool's ``kpool`` tokens, then the tail."""
    offsets = torch.arange(kpool, device=first.device, dtype=first.dtype)
    pools = (first[..., None] + offsets).masked_fill(first[..., None] < 0, -1)
    return torch.cat([pools.flatten(-2), tail], dim=-1)


def kept_bytes_per_row(kpool: int, topk: int) -> int:
    """Bytes a kept selection holds per query row (int32 pool starts and tail)."""
    return 4 * (topk // kpool + kpool - 1)
