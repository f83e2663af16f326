"""``allgather``: all-gather the hidden-state shards over CP, then TP, and project only this rank's
``1/cp`` slice of the TP-local heads; the projected tensors are narrower than the hidden state
when the model has many heads per rank."""

from __future__ import annotations

import torch

from ...distributed.cp_layout import BatchIndexMaps
from .base import ComputeRows, Projection
from .head_parallel import HeadParallelExchange
from .shape import ExchangeMesh, ExchangeShape


class AllGatherExchange(HeadParallelExchange):
    """All-gather hidden shards over CP then TP; project only this rank's head slice."""

    name = "allgather"
    cp_input_collective = "all_gather"
    projects_whole_sequence = True

    @classmethod
    def refusal(cls, mesh: ExchangeMesh) -> str | None:
        heads = super().refusal(mesh)
        if heads is not None:
            return heads
        if mesh.tp > 1 and not mesh.sequence_parallel:
            return (f"allgather with tp={mesh.tp} needs sequence parallelism: it gathers the "
                    "sequence-parallel shards of the hidden state over CP then TP, and without "
                    "sequence parallelism there are none; set parallel.sequence_parallel=true, "
                    "or use kda.cp_exchange=a2a")
        return None

    @classmethod
    def _row_gather_bytes(cls, s: ExchangeShape) -> dict[str, int]:
        """The SP shards gathered over CP, then the CP-gathered rows over TP."""
        sp = s.tp if s.sequence_parallel else 1
        cp_in = s.rows_bytes(s.tokens // (s.cp * sp), s.hidden) * (s.cp - 1)
        tp_in = s.rows_bytes(s.tokens // s.tp, s.hidden) * (s.tp - 1) if s.sequence_parallel else 0
        return {"cp": cp_in, "tp": tp_in}

    @classmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        rows = cls._row_gather_bytes(s)
        return {"cp": rows["cp"] + cls.output_bytes(s), "tp": rows["tp"]}

    @classmethod
    def extra_memory_bytes(cls, s: ExchangeShape) -> int:
        """The full-length [T, D] hidden rows while the projection runs (forward, and again for
        its weight gradients: ``rows.py``; its head-slice projections have the size a sequence
        shard's would)."""
        return 0 if s.cp == 1 else s.rows_bytes(s.tokens, s.hidden)

    def to_compute_layout(self, x: torch.Tensor, layout: BatchIndexMaps, project: Projection,
                          num_local_heads: int) -> ComputeRows:
        heads = self.heads(num_local_heads)
        # CP first: when CP spans nodes, only the narrow SP shards cross the slow link.
        sections = project(*self._rows(x, over_cp=True), heads)
        if self.cp == 1:
            return ComputeRows(sections, heads)
        # Each section reordered on its own: the same bytes as one reorder of their
        # concatenation, without the concatenation.
        return ComputeRows([layout.from_gathered.apply(s) for s in sections], heads)
