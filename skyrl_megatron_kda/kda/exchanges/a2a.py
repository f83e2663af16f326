"""``a2a``: project this CP rank's rows for all TP-local heads, then one all-to-all of the projected
q/k/v/f/g/beta over CP; the rank then holds whole sequences, in natural token order, for its
``1/cp`` slice of the local heads."""

from __future__ import annotations

import torch

from ...distributed.cp_layout import CPLayout
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

    def to_compute_layout(self, x: torch.Tensor, layout: CPLayout, project: Projection,
                          num_local_heads: int) -> ComputeRows:
        qkv, *rest = project(*self._rows(x), slice(0, num_local_heads))
        heads = self.heads(num_local_heads)
        if self.cp == 1:
            return ComputeRows([qkv, *rest], heads)
        widths = section_widths(heads.stop - heads.start, qkv.shape[-1] // (3 * num_local_heads))
        pad = whole_vectors(sum(widths), qkv.element_size()) - sum(widths)
        send = _PeerBlocks.apply(self.cp, pad, qkv, *rest)
        received = self._a2a(send.flatten(0, 1), to_heads=True)  # rows CP-rank major
        natural = layout.from_rank_major.apply(received)  # [T, b, block]
        return ComputeRows(list(natural.split([*widths, pad], -1)[:len(widths)]), heads)


class _PeerBlocks(torch.autograd.Function):
    """The all-to-all's send buffer [cp, S, b, block] from the projected sections [qkv, f, g,
    beta] ([S, b, w] each, q|k|v side by side): block j holds the j-th 1/cp of the heads of every
    section (of q, k and v each), in section order, then ``pad`` zero columns (whole 16-byte
    vectors), so one all-to-all hands rank j its heads of all of them. Each section is copied
    once, straight into its place (a concatenation of the head-split views copied q|k|v twice:
    its view cannot be flattened without a copy). Backward hands each section its columns of
    the gradient back in its own layout."""

    @staticmethod
    def forward(ctx, cp: int, pad: int, qkv: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        sections = [qkv.unflatten(-1, (3, cp, -1)).movedim(3, 0)]  # [cp, S, b, 3, w/cp]
        sections += [s.unflatten(-1, (cp, -1)).movedim(2, 0) for s in rest]  # [cp, S, b, w/cp]
        widths = [sections[0].shape[-2:].numel(), *(s.shape[-1] for s in sections[1:])]
        send = qkv.new_empty(sections[0].shape[:3] + (sum(widths) + pad,))
        parts = send.split([*widths, pad], dim=-1)
        parts[0].unflatten(-1, sections[0].shape[-2:]).copy_(sections[0])
        for part, section in zip(parts[1:], sections[1:]):
            part.copy_(section)
        parts[-1].zero_()
        ctx.split = [*widths, pad]
        return send

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = grad.split(ctx.split, dim=-1)[:-1]  # the pad's columns have no source
        qkv = parts[0].unflatten(-1, (3, -1)).movedim(0, 3).flatten(-3)
        rest = [part.movedim(0, 2).flatten(-2) for part in parts[1:]]
        return None, None, qkv, *rest
