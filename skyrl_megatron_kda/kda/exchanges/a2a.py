"""``a2a``: project this CP rank's rows for all TP-local heads, then one all-to-all of the projected
q/k/v/f/g/beta over CP; the rank then holds whole sequences, in natural token order, for its
``1/cp`` slice of the local heads."""

from __future__ import annotations

import torch

from ...distributed.cp_layout import CPLayout
from .base import ComputeRows, Projection, section_widths
from .head_parallel import HeadParallelExchange
from .shape import ExchangeShape


class A2AExchange(HeadParallelExchange):
    """Project this CP rank's rows for all local heads, then all-to-all over CP."""

    name = "a2a"
    cp_input_collective = "all_to_all"

    @classmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        cp_in = s.rows_bytes(s.tokens // s.cp, s.projected_width // s.tp) * (s.cp - 1) // s.cp
        return {"cp": cp_in + cls.output_bytes(s), "tp": cls._tp_gather_bytes(s)}

    @classmethod
    def extra_memory_bytes(cls, s: ExchangeShape) -> int:
        """The projected tensors received in head layout next to the sequence-layout ones it sent."""
        return 0 if s.cp == 1 else s.rows_bytes(s.tokens // s.cp, s.projected_width // s.tp)

    def to_compute_layout(self, x: torch.Tensor, layout: CPLayout, project: Projection,
                          num_local_heads: int) -> ComputeRows:
        qkv, *rest = project(*self._rows(x), slice(0, num_local_heads))
        heads = self.heads(num_local_heads)
        if self.cp == 1:
            return ComputeRows([qkv, *rest], heads)
        # One copy lays out [cp, S, b, W/cp]: block j is the j-th 1/cp of the heads of every
        # section (of q, k and v each), in section order, so one all-to-all hands rank j its heads
        # of all of them.
        blocks = [qkv.unflatten(-1, (3, self.cp, -1)).movedim(3, 0).flatten(-2)]
        blocks += [s.unflatten(-1, (self.cp, -1)).movedim(2, 0) for s in rest]
        received = self._a2a(torch.cat(blocks, dim=-1).flatten(0, 1), to_heads=True)  # rows CP-rank major
        natural = layout.from_rank_major.apply(received)  # [T, b, W/cp]
        head_dim = qkv.shape[-1] // (3 * num_local_heads)
        return ComputeRows(list(natural.split(section_widths(heads.stop - heads.start, head_dim), -1)), heads)
