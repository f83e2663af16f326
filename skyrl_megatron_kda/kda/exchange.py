"""How a KDA layer's data crosses the context-parallel (CP) group.

KDA is a recurrence over the whole sequence, so a CP rank cannot run it on its shard alone.

- ``A2AExchange`` (head-parallel): project on this CP rank's (TP-gathered) rows, then one
  all-to-all of the projected q/k/v/f/g/beta over CP; this rank then holds whole sequences, in
  natural token order, for its ``1/cp`` slice of the TP-local heads.
- ``AllGatherExchange`` (head-parallel): all-gather the hidden-state shards over CP, then TP, and
  project only this rank's head slice; the projected tensors are narrower than the hidden state
  when the model has many heads per rank.
- ``StateExchange`` (sequence-parallel): the rows stay where they are; fp32 state summaries and
  conv halos cross the CP group (``state.py``).

The layer calls ``to_heads`` (rows and heads this rank computes), ``conv`` and ``recurrence`` (on
them), and ``to_sequence`` (back to this rank's rows, all local heads). At CP=1 every exchange is
the identity on the sequence axis, so CP=1 runs the same code. Each collective is one
megatron-core autograd mapping, wrapped so that a ``CommLedger`` counts the bytes it moves
forward and backward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.ssm.gated_delta_net.common import tensor_a2a_hp2cp
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from . import state as state_passing
from .kernel import causal_conv_silu, kda
from ..distributed.cp_layout import CPLayout, sort_index, take_rows
from .rows import RowGather
from .state_kernel import IsolatedPieces, identity_summaries, state_passing_kda

# project(shard [s, b, D], rows, heads) -> sections [q, k, v, f, g, beta] of those heads, each
# [s', b, w], for the rows that ``rows`` gathers from this rank's shard (None: the shard itself).
Projection = Callable[[torch.Tensor, RowGather | None, slice], list[torch.Tensor]]


def _fuse(sections: list[torch.Tensor]) -> torch.Tensor:
    """The sections side by side, [s, b, W]: what the layer splits again after the exchange."""
    return torch.cat(sections, dim=-1)


class CommLedger:
    """Bytes this rank sends and receives per process group and pass ("fwd" / "bwd").

    Counts the logical payload of each collective (what leaves this rank for other ranks, and what
    arrives from them), which is what the analytic byte model in ``cost``-style tables counts.
    """

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, group: str, phase: str, sent: int, received: int) -> None:
        entry = self._bytes[(group, phase)]
        entry[0] += sent
        entry[1] += received

    def received(self, group: str, phase: str = "fwd") -> int:
        return self._bytes.get((group, phase), [0, 0])[1]

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {f"{g}/{p}": {"sent": s, "received": r} for (g, p), (s, r) in self._bytes.items()}


class _OnBackward(torch.autograd.Function):
    """Identity that runs a callback when the gradient passes (to count backward collectives)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def _counted(out: torch.Tensor, ledger: CommLedger, group: str, payload: int) -> torch.Tensor:
    """Record a symmetric collective moving ``payload`` bytes each way, now and in backward."""
    ledger.add(group, "fwd", payload, payload)
    if out.requires_grad:
        out = _OnBackward.apply(out, lambda: ledger.add(group, "bwd", payload, payload))
    return out


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class _CountedRowGather:
    """The ``RowGather`` of an exchange: all-gathers of rows over ``steps`` (group, ledger name) in
    order, reduce-scatters in reverse for the gradient, each counted in the ledger. The last
    collective of each runs asynchronously (``rows.RowGather``)."""

    def __init__(self, steps: list[tuple[dist.ProcessGroup, str]], ledger: CommLedger):
        self.steps, self.ledger = steps, ledger

    def _run(self, x: torch.Tensor, steps, phase: str, gather: bool):
        """Each step's collective on the previous one's result, the last one left running."""
        work = None
        for group, name in steps:
            if work is not None:
                work.wait()
            n = group.size()
            x = x.contiguous()
            out = x.new_empty((x.shape[0] * n if gather else x.shape[0] // n,) + x.shape[1:])
            payload = (n - 1) * _nbytes(x if gather else out)
            self.ledger.add(name, phase, payload, payload)
            collective = dist.all_gather_into_tensor if gather else dist.reduce_scatter_tensor
            work, x = collective(out, x, group=group, async_op=True), out

        def result() -> torch.Tensor:
            work.wait()
            return x
        return result

    def start_gather(self, shard: torch.Tensor, phase: str) -> Callable[[], torch.Tensor]:
        return self._run(shard, self.steps, phase, gather=True)

    def start_reduce_scatter(self, rows_grad: torch.Tensor) -> Callable[[], torch.Tensor]:
        return self._run(rows_grad, self.steps[::-1], "bwd", gather=False)


@dataclass
class ExchangeGroups:
    """The process groups an exchange uses (passed in; nothing here reads global state)."""

    tp: dist.ProcessGroup
    cp: dist.ProcessGroup
    sequence_parallel: bool


@dataclass(frozen=True)
class ExchangeShape:
    """What the byte model needs: one KDA layer's dims and the mesh, per micro-batch."""

    tokens: int  # T: tokens per batch row over the whole CP group (packed THD: all sequences)
    batch: int
    hidden: int
    num_heads: int  # heads of the whole model (before TP)
    head_dim: int
    tp: int
    cp: int
    sequence_parallel: bool
    element_size: int = 2  # bytes per activation element (bf16)
    sequences: int = 1  # sequences per batch row (packed THD)
    conv_size: int = 4
    layout: str = "zigzag"  # CP layout of the tokens: "zigzag" or "contiguous"

    @property
    def projected_width(self) -> int:
        """q, k, v, f, g (full width each) and beta of all heads."""
        return 5 * self.num_heads * self.head_dim + self.num_heads

    def rows_bytes(self, rows: int, width: int) -> int:
        return rows * self.batch * width * self.element_size


class _Exchange:
    """Shared parts: the TP row gather, counted row all-gathers, and the plain conv / recurrence
    on whatever rows and heads the exchange hands the layer."""

    name: str
    splits_heads: bool  # whether each CP rank runs a 1/cp slice of the TP-local heads
    exact: bool  # equal to CP=1 up to fp32 summation order (else: within a stated tolerance)

    def __init__(self, groups: ExchangeGroups, ledger: CommLedger | None = None):
        self.groups = groups
        self.ledger = ledger if ledger is not None else CommLedger()
        self.cp = groups.cp.size()
        self.tp = groups.tp.size()
        self.cp_rank = groups.cp.rank()

    @staticmethod
    def _tp_gather_bytes(s: ExchangeShape) -> int:
        """The SP row gather of this CP rank's shard over TP (``_rows``), per rank, one pass."""
        return s.rows_bytes(s.tokens // (s.cp * s.tp), s.hidden) * (s.tp - 1) if s.sequence_parallel else 0

    @classmethod
    def _row_gather_bytes(cls, s: ExchangeShape) -> dict[str, int]:
        """The gather of the rows this rank projects, per rank, one pass."""
        return {"cp": 0, "tp": cls._tp_gather_bytes(s)}

    @classmethod
    def backward_bytes(cls, s: ExchangeShape) -> dict[str, int]:
        """Backward bytes per rank per group: the mirror of the forward collectives, plus the
        projection's rows gathered again for the weight gradients (``rows.py``)."""
        forward, again = cls.bytes_moved(s), cls._row_gather_bytes(s)
        return {group: forward[group] + again[group] for group in forward}

    def _gather_rows(self, x: torch.Tensor, group: dist.ProcessGroup, name: str) -> torch.Tensor:
        """All-gather along rows (backward: reduce-scatter), counted."""
        n = group.size()
        if n == 1:
            return x
        out = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
        return _counted(out, self.ledger, name, (n - 1) * _nbytes(x))

    def _rows(self, x: torch.Tensor, *, over_cp: bool = False) -> tuple[torch.Tensor, RowGather | None]:
        """This rank's shard and how to gather the rows it projects: over CP first (when
        ``over_cp``), then over TP under SP. Without SP every TP rank holds the rows already, and
        Megatron's copy to the TP region all-reduces their gradient."""
        steps = [(self.groups.cp, "cp")] if over_cp and self.cp > 1 else []
        if self.groups.sequence_parallel and self.tp > 1:
            steps.append((self.groups.tp, "tp"))
        elif self.tp > 1:
            x = copy_to_tensor_model_parallel_region(x, group=self.groups.tp)
        return x, (_CountedRowGather(steps, self.ledger) if steps else None)

    def conv(self, qkv: torch.Tensor, weight: torch.Tensor, layout: CPLayout, *, backend: str):
        """Causal short conv + SiLU on whole sequences in natural order ([b, T, C])."""
        return causal_conv_silu(qkv, weight, cu_seqlens=layout.kernel_cu_seqlens, backend=backend)

    def recurrence(self, q, k, v, f, b, A_log, dt_bias, layout: CPLayout, *, segments: int, **kernel_args):
        """The KDA recurrence on whole sequences in natural order ([b, T, H, K]); on the fla
        backend each sequence runs as ``segments`` chained segments (``KDAConfig.kernel_segments``)."""
        if kernel_args["backend"] != "fla" or segments == 1:
            o, _ = kda(q, k, v, f, b, A_log, dt_bias, cu_seqlens=layout.kernel_cu_seqlens, **kernel_args)
            return o
        batch, rows = q.shape[:2]
        cu = layout.kernel_cu_seqlens
        if cu is None:
            cu = torch.arange(0, (batch + 1) * rows, rows, device=q.device)
        q, k, v, f, b = (t.reshape((1, batch * rows) + t.shape[2:]) for t in (q, k, v, f, b))
        o = state_passing_kda(q, k, v, f, b, A_log, dt_bias, piece_cu=cu, link=IsolatedPieces(),
                              segments=segments, **kernel_args)
        return o.reshape(batch, rows, *o.shape[2:])


class _HeadParallelExchange(_Exchange):
    """Head-parallel exchanges: whole sequences, 1/cp of the local heads, all-to-all back."""

    splits_heads = True
    exact = True  # the same kernel on the same rows and heads; only data movement differs

    @staticmethod
    def output_bytes(s: ExchangeShape) -> int:
        """The gated-norm output's all-to-all back to sequence shards (per rank, one pass)."""
        return s.rows_bytes(s.tokens // s.cp, s.num_heads * s.head_dim // s.tp) * (s.cp - 1) // s.cp

    def heads(self, num_local_heads: int) -> slice:
        """This CP rank's slice of the TP-local heads, run on the whole sequence."""
        per_rank = num_local_heads // self.cp
        return slice(self.cp_rank * per_rank, (self.cp_rank + 1) * per_rank)

    def _a2a(self, x: torch.Tensor, to_heads: bool) -> torch.Tensor:
        """to_heads: ``x`` [cp * S, b, w] holds rank j's share in rows [j*S, (j+1)*S), and the
        result holds every rank's share for this rank, rows CP-rank major. Else the reverse
        (megatron's hp2cp): [T, b, w] rows CP-rank major -> [T/cp, b, cp*w]."""
        payload = _nbytes(x) * (self.cp - 1) // self.cp
        if to_heads:
            out = all_to_all(self.groups.cp, x)
        else:
            out = tensor_a2a_hp2cp(x, 0, -1, self.groups.cp, redo_attention_load_balancing=False)
        return _counted(out, self.ledger, "cp", payload)

    def to_sequence(self, o_heads: torch.Tensor, layout: CPLayout) -> torch.Tensor:
        """[T, b, heads_slice*V] in natural order -> [T/cp, b, local_heads*V] on this CP rank's rows."""
        if self.cp == 1:
            return o_heads
        o_rank_major = take_rows(o_heads, layout.rank_major_positions())
        return self._a2a(o_rank_major, to_heads=False)


class A2AExchange(_HeadParallelExchange):
    """Project this CP rank's rows for all local heads, then all-to-all over CP."""

    name = "a2a"

    @classmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        """Analytic bytes each rank sends (= receives) per group, forward."""
        cp_in = s.rows_bytes(s.tokens // s.cp, s.projected_width // s.tp) * (s.cp - 1) // s.cp
        return {"cp": cp_in + cls.output_bytes(s), "tp": cls._tp_gather_bytes(s)}

    def to_heads(self, x: torch.Tensor, layout: CPLayout, project: Projection, num_local_heads: int):
        sections = project(*self._rows(x), slice(0, num_local_heads))
        if self.cp == 1:
            return _fuse(sections)
        # One copy lays out [cp, S, b, W/cp]: block j is the j-th 1/cp of the heads of every
        # section, in section order, so one all-to-all hands rank j its heads of all of them.
        blocks = torch.cat([s.unflatten(-1, (self.cp, -1)).movedim(2, 0) for s in sections], dim=-1)
        received = self._a2a(blocks.flatten(0, 1), to_heads=True)  # [T, b, W/cp], rows CP-rank major
        return take_rows(received, sort_index(layout.rank_major_positions()))


class AllGatherExchange(_HeadParallelExchange):
    """All-gather hidden shards over CP then TP; project only this rank's head slice."""

    name = "allgather"

    def __init__(self, groups: ExchangeGroups, ledger: CommLedger | None = None):
        if groups.tp.size() > 1 and not groups.sequence_parallel:
            raise ValueError(
                "cp_exchange='allgather' with tp > 1 needs sequence parallelism: the hidden shards "
                "it gathers are SP shards (set parallel.sequence_parallel=true or use 'a2a')"
            )
        super().__init__(groups, ledger)

    @classmethod
    def _row_gather_bytes(cls, s: ExchangeShape) -> dict[str, int]:
        """The SP shards gathered over CP, then the CP-gathered rows over TP."""
        sp = s.tp if s.sequence_parallel else 1
        cp_in = s.rows_bytes(s.tokens // (s.cp * sp), s.hidden) * (s.cp - 1)
        tp_in = s.rows_bytes(s.tokens // s.tp, s.hidden) * (s.tp - 1) if s.sequence_parallel else 0
        return {"cp": cp_in, "tp": tp_in}

    @classmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        """Analytic bytes each rank sends (= receives) per group, forward."""
        rows = cls._row_gather_bytes(s)
        return {"cp": rows["cp"] + cls.output_bytes(s), "tp": rows["tp"]}

    def to_heads(self, x: torch.Tensor, layout: CPLayout, project: Projection, num_local_heads: int):
        # CP first: when CP spans nodes, only the narrow SP shards cross the slow link.
        fused = _fuse(project(*self._rows(x, over_cp=True), self.heads(num_local_heads)))
        if self.cp == 1:
            return fused
        return take_rows(fused, sort_index(layout.gathered_positions()))


class StateExchange(_Exchange):
    """The sequence stays sharded; only fp32 state summaries and conv halos cross the CP group.

    Not bitwise equal to CP=1: the incoming state is composed in fp32 from the summaries.
    """

    name = "state"
    splits_heads = False
    exact = False  # the incoming state is composed from fp32 summaries

    @classmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        """Analytic bytes each rank sends (= receives) per group, forward.

        Independent of T: per slot (two per sequence per rank in the zigzag layout, one in the
        contiguous one) one fp32 [H_loc, K, K+V] summary and ``conv_size - 1`` rows of the q/k/v
        projections."""
        tp_in = cls._tp_gather_bytes(s)
        if s.cp == 1:
            return {"cp": 0, "tp": tp_in}
        return {"cp": (s.cp - 1) * (cls._summary_bytes(s, 2 * s.head_dim) + cls._halo_bytes(s)), "tp": tp_in}

    @classmethod
    def backward_bytes(cls, s: ExchangeShape) -> dict[str, int]:
        """Backward: the entry-state gradients ([H_loc, K, V] per piece) and the halo's gradient;
        over TP as the other exchanges."""
        out = super().backward_bytes(s)
        if s.cp > 1:
            out["cp"] = (s.cp - 1) * (cls._summary_bytes(s, s.head_dim) + cls._halo_bytes(s))
        return out

    @staticmethod
    def _pieces_per_rank(s: ExchangeShape) -> int:
        return (2 if s.layout == "zigzag" else 1) * s.sequences * s.batch

    @classmethod
    def _summary_bytes(cls, s: ExchangeShape, width: int) -> int:
        return cls._pieces_per_rank(s) * (s.num_heads // s.tp) * s.head_dim * width * 4

    @classmethod
    def _halo_bytes(cls, s: ExchangeShape) -> int:
        return cls._pieces_per_rank(s) * (s.conv_size - 1) * 3 * (s.num_heads // s.tp) * s.head_dim * s.element_size

    def heads(self, num_local_heads: int) -> slice:
        return slice(0, num_local_heads)

    def to_heads(self, x: torch.Tensor, layout: CPLayout, project: Projection, num_local_heads: int):
        return _fuse(project(*self._rows(x), slice(0, num_local_heads)))

    def to_sequence(self, o: torch.Tensor, layout: CPLayout) -> torch.Tensor:
        return o

    def _pieces(self, layout: CPLayout, batch: int, cp_rank: int) -> state_passing.Pieces:
        return state_passing.rank_pieces(layout.cu_seqlens, self.cp, cp_rank, batch, layout.kind)

    def conv(self, qkv: torch.Tensor, weight: torch.Tensor, layout: CPLayout, *, backend: str):
        if self.cp == 1:
            return super().conv(qkv, weight, layout, backend=backend)
        batch, rows, channels = qkv.shape
        width = weight.shape[-1] - 1
        x = qkv.reshape(batch * rows, channels)
        mine = self._pieces(layout, batch, self.cp_rank)
        all_tails = self._gather_rows(state_passing.piece_tails(x, mine, width), self.groups.cp, "cp")
        # Every rank's pieces follow from the layout, so the tails' positions need no exchange.
        all_positions = torch.cat([state_passing.tail_positions(self._pieces(layout, batch, r), width)
                                   for r in range(self.cp)])
        halo = state_passing.halo_rows(all_tails, all_positions, mine, width)
        padded, cu, keep = state_passing.with_halo(x, halo, mine)
        y = causal_conv_silu(padded.unsqueeze(0), weight, cu_seqlens=cu, backend=backend)[0]
        return take_rows(y, keep).reshape(batch, rows, channels)

    def recurrence(self, q, k, v, f, b, A_log, dt_bias, layout: CPLayout, *, segments: int, **kernel_args):
        if self.cp == 1:
            return super().recurrence(q, k, v, f, b, A_log, dt_bias, layout, segments=segments, **kernel_args)
        batch, rows, heads, K = q.shape
        pieces = self._pieces(layout, batch, self.cp_rank)
        q, k, v, f, b = (t.reshape((1, batch * rows) + t.shape[2:]) for t in (q, k, v, f, b))
        # The kernel only sees non-empty pieces (a sequence that misses this rank in the
        # contiguous layout has an empty slot, whose summary is the identity map).
        lengths = pieces.cu.diff()
        present = lengths > 0
        cu = torch.zeros(int(present.sum()) + 1, dtype=torch.long, device=q.device)
        cu[1:] = lengths[present].cumsum(0)
        link = _CPChain(self, present, layout.kind)
        o = state_passing_kda(q, k, v, f, b, A_log, dt_bias, piece_cu=cu, link=link, segments=segments,
                              **kernel_args)
        return o.reshape(batch, rows, heads, -1)


class _CPChain:
    """The state exchange's link between pieces on different CP ranks: one all-gather of the
    fp32 summaries forward, one of the entry-state gradients backward (both counted)."""

    def __init__(self, exchange: StateExchange, present: torch.Tensor, kind: str):
        self.exchange, self.present, self.kind = exchange, present, kind
        self.M = None

    def _all_gather(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        ex = self.exchange
        gathered = _CountedRowGather([(ex.groups.cp, "cp")], ex.ledger).start_gather(x, phase)()
        return gathered.view((ex.cp,) + x.shape)

    def entry_states(self, summaries: torch.Tensor) -> torch.Tensor:
        heads, K = summaries.shape[1:3]
        V = summaries.shape[-1] - K
        mine = identity_summaries(self.present.numel(), heads, K, V, summaries.device)
        mine[self.present] = summaries
        gathered = self._all_gather(mine, "fwd")
        self.M = gathered[..., V:]
        entry = state_passing.chain_entry_states(self.M, gathered[..., :V], self.exchange.cp,
                                                 self.exchange.cp_rank, self.kind)
        return entry[self.present]

    def exit_grads(self, entry_grads: torch.Tensor) -> torch.Tensor:
        mine = entry_grads.new_zeros((self.present.numel(),) + entry_grads.shape[1:])
        mine[self.present] = entry_grads
        gathered = self._all_gather(mine, "bwd")
        exits = state_passing.chain_exit_grads(self.M, gathered, self.exchange.cp, self.exchange.cp_rank,
                                               self.kind)
        return exits[self.present]


EXCHANGES = {cls.name: cls for cls in (A2AExchange, AllGatherExchange, StateExchange)}


def build_exchange(name: str, groups: ExchangeGroups, ledger: CommLedger | None = None):
    """The exchange object for a concrete ``cp_exchange`` value (``auto`` is resolved earlier)."""
    if name == "auto":
        raise ValueError("cp_exchange='auto' must be resolved to a concrete exchange before the layer "
                         "is built: use kda.cost.resolve_cp_exchange(recipe)")
    if name not in EXCHANGES:
        raise ValueError(f"unknown cp_exchange {name!r}; expected one of {sorted(EXCHANGES)}")
    return EXCHANGES[name](groups, ledger)
