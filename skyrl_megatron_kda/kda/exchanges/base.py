"""The contract every CP exchange of the KDA layer fulfils (``CPExchange``), and what it is given.

KDA is a recurrence over the whole sequence, so a CP rank cannot run it on its shard alone; an
exchange decides which rows and heads each rank computes and moves the data for it. The layer
calls ``to_compute_layout`` (the rows and heads this rank computes), ``conv`` and ``recurrence``
(on them) and ``to_sequence`` (back to this rank's rows, all local heads); the layer math never
branches on the exchange. The class side carries everything that needs no process group: the
rule that refuses a mesh (``refusal``: the recipe rules, the cost model and the layer all ask
it), the analytic byte model and the memory model the cost model of ``auto`` reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from ...distributed.cp_layout import BatchIndexMaps
from ..kernel import causal_conv_silu, kda
from ..rows import RowGather
from ..state_kernel import IsolatedPieces, Segments, state_passing_kda_on_segments
from .ledger import CommLedger, CountedRowGather, counted, nbytes
from .shape import ExchangeMesh, ExchangeShape

# project(shard [s, b, D], rows, heads) -> sections [q, k, v, f, g, beta] of those heads, each
# [s', b, w], for the rows that ``rows`` gathers from this rank's shard (None: the shard itself).
Projection = Callable[[torch.Tensor, RowGather | None, slice], list[torch.Tensor]]


@dataclass
class ExchangeGroups:
    """The process groups an exchange uses (passed in; nothing here reads global state)."""

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    sequence_parallel: bool


@dataclass(frozen=True)
class KernelArgs:
    """The kernel settings the layer hands to ``conv`` and ``recurrence``."""

    backend: str  # "fla" or "torch" (``kernel.resolve_backend``)
    lower_bound: float  # the safe forget gate's multiplier (``KDAConfig.gate_lower_bound``)
    l2norm_eps: float
    chunk_size: int
    segments: int  # segments per sequence on the fla backend (``KDAConfig.kernel_segments``)

    def kernel_kwargs(self) -> dict:
        """The keyword arguments of ``kernel.kda`` and ``state_kernel.state_passing_kda``."""
        return {"lower_bound": self.lower_bound, "l2norm_eps": self.l2norm_eps,
                "chunk_size": self.chunk_size, "backend": self.backend}


@dataclass(frozen=True)
class ComputeRows:
    """What ``to_compute_layout`` hands the layer: the projected sections ``[q, k, v, f, g, beta]``
    (each ``[s, b, w]``) of the rows this rank computes, and which TP-local heads they hold.

    The sections may be strided views (of the GEMM outputs, or of the exchanged rows): the conv
    reads them in place, and nothing concatenates them only for the layer to split them again."""

    sections: list[torch.Tensor]
    heads: slice


def section_widths(heads: int, head_dim: int) -> list[int]:
    """Widths of the sections [q, k, v, f, g, beta] of ``heads`` heads."""
    return [heads * head_dim] * 5 + [heads]


class CPExchange(ABC):
    """One way a KDA layer's data crosses the CP group. At CP=1 every exchange is the identity on
    the sequence axis, so CP=1 runs the same code.

    A subclass declares ``name``, ``exact``, ``splits_heads`` and ``cp_input_collective``, its
    ``refusal`` rule, byte and memory models, and the data movement; registering it
    (``kda.exchanges.register``) makes it a value of ``kda.cp_exchange`` and a candidate of
    ``auto``.
    """

    name: ClassVar[str]
    """The value of ``kda.cp_exchange`` that selects it."""
    exact: ClassVar[bool]
    """Outputs and gradients equal to CP=1 up to fp32 summation order (else within a tolerance)."""
    splits_heads: ClassVar[bool]
    """Whether each CP rank runs a 1/cp slice of the TP-local heads on whole sequences."""
    cp_input_collective: ClassVar[Literal["all_to_all", "all_gather"]]
    """The CP collective of its input side: the cost model prices it at that link bandwidth."""
    projects_whole_sequence: ClassVar[bool] = False
    """Whether each rank projects every row of the sequence (for its head slice) rather than its
    CP shard's rows: the cost model counts the GEMM FLOPs accordingly."""

    def __init__(self, groups: ExchangeGroups, ledger: CommLedger | None = None):
        self.groups = groups
        self.ledger = ledger if ledger is not None else CommLedger()
        self.cp = groups.cp.size()
        self.tp = groups.tp.size()
        self.cp_rank = groups.cp.rank()

    # --- rules and models (no process group needed) -------------------------------------------

    @classmethod
    @abstractmethod
    def refusal(cls, mesh: ExchangeMesh) -> str | None:
        """Why this exchange cannot run on ``mesh`` (one clause naming the values), or None."""

    @classmethod
    @abstractmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        """Analytic bytes each rank sends (= receives) per group ("cp", "tp"), forward."""

    @classmethod
    def backward_bytes(cls, s: ExchangeShape) -> dict[str, int]:
        """Backward bytes per rank per group: the mirror of the forward collectives, plus the
        projection's rows gathered again for the weight gradients (``rows.py``)."""
        forward, again = cls.bytes_moved(s), cls._row_gather_bytes(s)
        return {group: forward[group] + again[group] for group in forward}

    @classmethod
    @abstractmethod
    def output_bytes(cls, s: ExchangeShape) -> int:
        """The part of the forward CP bytes that brings the output back to sequence shards."""

    @classmethod
    @abstractmethod
    def extra_memory_bytes(cls, s: ExchangeShape) -> int:
        """Transient buffers per rank per layer that a sequence-sharded layer with no exchange
        would not allocate, alive only while the exchange's own step runs (none is kept between
        forward and backward)."""

    @staticmethod
    def _tp_gather_bytes(s: ExchangeShape) -> int:
        """The SP row gather of this CP rank's shard over TP (``_rows``), per rank, one pass."""
        return s.rows_bytes(s.tokens // (s.cp * s.tp), s.hidden) * (s.tp - 1) if s.sequence_parallel else 0

    @classmethod
    def _row_gather_bytes(cls, s: ExchangeShape) -> dict[str, int]:
        """The gather of the rows this rank projects, per rank, one pass."""
        return {"cp": 0, "tp": cls._tp_gather_bytes(s)}

    # --- data movement ------------------------------------------------------------------------

    @abstractmethod
    def to_compute_layout(self, x: torch.Tensor, layout: BatchIndexMaps, project: Projection,
                          num_local_heads: int) -> ComputeRows:
        """From this rank's shard ``x`` [s, b, D] to the projected rows and heads it computes."""

    @abstractmethod
    def to_sequence(self, o: torch.Tensor, layout: BatchIndexMaps) -> torch.Tensor:
        """The computed output back to this rank's rows, all local heads: [s, b, local_heads*V]."""

    def conv(self, qkv: list[torch.Tensor], weight: torch.Tensor, layout: BatchIndexMaps,
             kernel: KernelArgs) -> list[torch.Tensor]:
        """Causal short conv + SiLU of q, k and v on whole sequences in natural order: ``qkv``
        [q, k, v], each [b, T, C] (contiguous, or a strided view read in place), ``weight``
        [3, C, W] -> [q, k, v], each [b, T, C] and contiguous."""
        return [causal_conv_silu(x, w, cu_seqlens=layout.kernel_cu_seqlens, backend=kernel.backend)
                for x, w in zip(qkv, weight.unbind(0))]

    def recurrence(self, q, k, v, f, b, A_log, dt_bias, layout: BatchIndexMaps, kernel: KernelArgs):
        """The KDA recurrence on whole sequences in natural order ([b, T, H, K]); on the fla
        backend each sequence runs as ``kernel.segments`` chained segments."""
        if kernel.backend != "fla" or kernel.segments == 1:
            o, _ = kda(q, k, v, f, b, A_log, dt_bias, cu_seqlens=layout.kernel_cu_seqlens,
                       **kernel.kernel_kwargs())
            return o
        batch, rows = q.shape[:2]

        def cut() -> Segments:
            cu = layout.kernel_cu_seqlens
            if cu is None:
                cu = torch.arange(0, (batch + 1) * rows, rows, device=q.device)
            return Segments.cut(cu, kernel.segments, kernel.chunk_size)

        segments = layout.derived(("segments", batch, rows, kernel.segments, kernel.chunk_size), cut)
        q, k, v, f, b = (t.reshape((1, batch * rows) + t.shape[2:]) for t in (q, k, v, f, b))
        o = state_passing_kda_on_segments(q, k, v, f, b, A_log, dt_bias, pieces=segments, link=IsolatedPieces(),
                                          **kernel.kernel_kwargs())
        return o.reshape(batch, rows, *o.shape[2:])

    def _gather_rows(self, x: torch.Tensor, group: dist.ProcessGroup, name: str) -> torch.Tensor:
        """All-gather along rows (backward: reduce-scatter), counted."""
        n = group.size()
        if n == 1:
            return x
        out = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
        return counted(out, self.ledger, name, (n - 1) * nbytes(x))

    def _rows(self, x: torch.Tensor, *, over_cp: bool = False) -> tuple[torch.Tensor, RowGather | None]:
        """This rank's shard and how to gather the rows it projects: over CP first (when
        ``over_cp``), then over TP under SP. Without SP every TP rank holds the rows already, and
        Megatron's copy to the TP region all-reduces their gradient."""
        steps = [(self.groups.cp, "cp")] if over_cp and self.cp > 1 else []
        if self.groups.sequence_parallel and self.tp > 1:
            steps.append((self.groups.tp, "tp"))
        elif self.tp > 1:
            x = copy_to_tensor_model_parallel_region(x, group=self.groups.tp)
        return x, (CountedRowGather(steps, self.ledger) if steps else None)
