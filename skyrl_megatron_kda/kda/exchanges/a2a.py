"""``a2a``: project this CP rank's rows for all TP-local heads, then one all-to-all of the projected
q/k/v/f/g/beta over CP; the rank then holds whole sequences, in natural token order, for its
``1/cp`` slice of the local heads."""

from __future__ import annotations

import torch

from ...distributed.cp_layout import BatchIndexMaps
from .base import ComputeRows, Projection, section_widths
from .head_parallel import HeadParallelExchange
from .shape import ExchangeShape, whole_vectors


class A2AExchange(HeadParallelExchange):
    """Project this CP rank's rows for all local heads, then all-to-all over CP."""

    name = "a2a"
    cp_input_collective = "all_to_all"

    @classmethod
    def block_width(cls, s: ExchangeShape) -> int:
        """Columns of the block each rank sends each peer: the peer's heads' share of the
        projected width, padded to whole 16-byte vectors (``whole_vectors``) so that the reorder
        of the received rows to natural order runs torch's vectorised gather."""
        return whole_vectors(s.projected_width // (s.tp * s.cp), s.element_size)

    @classmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        cp_in = s.rows_bytes(s.tokens // s.cp, s.cp * cls.block_width(s)) * (s.cp - 1) // s.cp
        return {"cp": cp_in + cls.output_bytes(s), "tp": cls._tp_gather_bytes(s)}

    @classmethod
    def extra_memory_bytes(cls, s: ExchangeShape) -> int:
        """The projected tensors received in head layout next to the sequence-layout ones it sent."""
        return 0 if s.cp == 1 else s.rows_bytes(s.tokens // s.cp, s.cp * cls.block_width(s))

    def to_compute_layout(self, x: torch.Tensor, layout: BatchIndexMaps, project: Projection,
                          num_local_heads: int) -> ComputeRows:
        sections = project(*self._rows(x), slice(0, num_local_heads))
        heads = self.heads(num_local_heads)
        if self.cp == 1:
            return ComputeRows(sections, heads)
        widths = section_widths(heads.stop - heads.start, sections[0].shape[-1] // num_local_heads)
        pad = whole_vectors(sum(widths), sections[0].element_size()) - sum(widths)
        send = _PeerBlocks.apply(self.cp, pad, *sections)
        received = self._a2a(send.flatten(0, 1), to_heads=True)  # rows CP-rank major
        natural = layout.from_rank_major.apply(received)  # [T, b, block]
        return ComputeRows(list(natural.split([*widths, pad], -1)[:len(widths)]), heads)


class _PeerBlocks(torch.autograd.Function):
    """The all-to-all's send buffer [cp, S, b, block] from the projected sections ([S, b, w]
    each): block j holds the j-th 1/cp of the heads of every section, in section order, then
    ``pad`` zero columns (whole 16-byte vectors), so one all-to-all hands rank j its heads of all
    of them. Each section is copied once, straight into its place (a concatenation of the
    head-split views would copy them into one tensor first). Backward hands each section its
    columns of the gradient back as a view."""

    @staticmethod
    def forward(ctx, cp: int, pad: int, *sections: torch.Tensor) -> torch.Tensor:
        blocks = [s.unflatten(-1, (cp, -1)).movedim(2, 0) for s in sections]  # [cp, S, b, w/cp]
        widths = [b.shape[-1] for b in blocks]
        send = sections[0].new_empty(blocks[0].shape[:3] + (sum(widths) + pad,))
        parts = send.split([*widths, pad], dim=-1)
        for part, block in zip(parts, blocks):
            part.copy_(block)
        parts[-1].zero_()
        ctx.split = [*widths, pad]
        return send

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = grad.split(ctx.split, dim=-1)[:-1]  # the pad's columns have no source
        return None, None, *(part.movedim(0, 2).flatten(-2) for part in parts)
