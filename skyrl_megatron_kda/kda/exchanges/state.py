"""``state``: the sequence stays sharded; only fp32 state summaries and conv halos cross the CP
group (``kda/state_pieces.py``). Not bitwise equal to CP=1: the incoming state is composed in fp32
from the summaries."""

from __future__ import annotations

import torch

from ...distributed.cp_layout import CPLayout, layout_kind, take_rows
from .. import state_pieces
from ..kernel import causal_conv_silu
from ..state_kernel import Segments, identity_summaries, state_passing_kda_on_segments
from .base import ComputeRows, CPExchange, KernelArgs, Projection
from .ledger import CountedRowGather
from .shape import ExchangeMesh, ExchangeShape


class StateExchange(CPExchange):
    """Every rank computes its own rows for all TP-local heads; the recurrence's incoming state and
    the conv's halo come from the other CP ranks."""

    name = "state"
    splits_heads = False
    exact = False  # the incoming state is composed from fp32 summaries
    cp_input_collective = "all_gather"

    @classmethod
    def refusal(cls, mesh: ExchangeMesh) -> str | None:
        if not mesh.allow_inexact:
            return "not exact, kda.allow_inexact=false"
        return None

    @classmethod
    def bytes_moved(cls, s: ExchangeShape) -> dict[str, int]:
        """Independent of T: per slot (``pieces_per_sequence`` per sequence per rank) one fp32
        [H_loc, K, K+V] summary and ``conv_size - 1`` rows of the q/k/v projections."""
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

    @classmethod
    def output_bytes(cls, s: ExchangeShape) -> int:
        return 0  # the output is already on this rank's rows

    @classmethod
    def extra_memory_bytes(cls, s: ExchangeShape) -> int:
        """The gathered fp32 summaries and conv halos of all CP ranks."""
        return 0 if s.cp == 1 else cls.bytes_moved(s)["cp"] * s.cp // (s.cp - 1)

    @staticmethod
    def _pieces_per_rank(s: ExchangeShape) -> int:
        return layout_kind(s.layout).pieces_per_sequence * s.sequences * s.batch

    @classmethod
    def _summary_bytes(cls, s: ExchangeShape, width: int) -> int:
        return cls._pieces_per_rank(s) * (s.num_heads // s.tp) * s.head_dim * width * 4

    @classmethod
    def _halo_bytes(cls, s: ExchangeShape) -> int:
        return cls._pieces_per_rank(s) * (s.conv_size - 1) * 3 * (s.num_heads // s.tp) * s.head_dim * s.element_size

    def to_compute_layout(self, x: torch.Tensor, layout: CPLayout, project: Projection,
                          num_local_heads: int) -> ComputeRows:
        """This rank's own rows (gathered over TP under SP), all local heads: nothing crosses CP."""
        heads = slice(0, num_local_heads)
        return ComputeRows(project(*self._rows(x), heads), heads)

    def to_sequence(self, o: torch.Tensor, layout: CPLayout) -> torch.Tensor:
        return o

    def _pieces(self, layout: CPLayout, batch: int, cp_rank: int) -> state_pieces.Pieces:
        return layout.derived(("state pieces", batch, cp_rank), lambda: state_pieces.rank_pieces(
            layout.cu_seqlens, self.cp, cp_rank, batch, layout.kind))

    def _halo_plan(self, layout: CPLayout, batch: int, width: int) -> state_pieces.HaloPlan:
        # Every rank's pieces follow from the layout, so the tails' positions need no exchange.
        return layout.derived(("state halo", batch, width, self.cp_rank), lambda: state_pieces.halo_plan(
            self._pieces(layout, batch, self.cp_rank),
            [self._pieces(layout, batch, r) for r in range(self.cp)], width))

    def _kernel_pieces(self, layout: CPLayout, batch: int, kernel: KernelArgs) -> tuple[torch.Tensor, Segments]:
        """Which of this rank's slots hold rows, and those pieces cut into the kernel's segments
        (the kernel only sees non-empty pieces: a sequence that misses this rank in the contiguous
        layout has an empty slot, whose summary is the identity map)."""
        def build():
            lengths = self._pieces(layout, batch, self.cp_rank).cu.diff()
            present = lengths > 0
            cu = torch.zeros(int(present.sum()) + 1, dtype=torch.long, device=lengths.device)
            cu[1:] = lengths[present].cumsum(0)
            return present, Segments.cut(cu, kernel.segments, kernel.chunk_size)
        key = ("state kernel pieces", batch, self.cp_rank, kernel.segments, kernel.chunk_size)
        return layout.derived(key, build)

    def conv(self, qkv: torch.Tensor, weight: torch.Tensor, layout: CPLayout,
             kernel: KernelArgs) -> list[torch.Tensor]:
        """One conv of q|k|v on this rank's pieces with their halos (one halo exchange for all
        three), then each of q, k, v taken out of it on its own."""
        if self.cp == 1:
            return super().conv(qkv, weight, layout, kernel)
        batch, rows, channels = qkv.shape
        width = weight.shape[-1] - 1
        x = qkv.reshape(batch * rows, channels)
        plan = self._halo_plan(layout, batch, width)
        all_tails = self._gather_rows(state_pieces.piece_tails(x, plan.pieces, width), self.groups.cp, "cp")
        halo = state_pieces.halo_rows(all_tails, plan)
        padded = state_pieces.with_halo(x, halo, plan)
        y = causal_conv_silu(padded.unsqueeze(0), weight.flatten(0, 1), cu_seqlens=plan.cu,
                             backend=kernel.backend)[0]
        return [take_rows(part, plan.keep).reshape(batch, rows, -1) for part in y.chunk(3, dim=-1)]

    def recurrence(self, q, k, v, f, b, A_log, dt_bias, layout: CPLayout, kernel: KernelArgs):
        if self.cp == 1:
            return super().recurrence(q, k, v, f, b, A_log, dt_bias, layout, kernel)
        batch, rows, heads, K = q.shape
        present, segments = self._kernel_pieces(layout, batch, kernel)
        q, k, v, f, b = (t.reshape((1, batch * rows) + t.shape[2:]) for t in (q, k, v, f, b))
        link = _CPChain(self, present, layout.kind)
        o = state_passing_kda_on_segments(q, k, v, f, b, A_log, dt_bias, pieces=segments, link=link,
                                          **kernel.kernel_kwargs())
        return o.reshape(batch, rows, heads, -1)


class _CPChain:
    """The state exchange's link between pieces on different CP ranks: one all-gather of the
    fp32 summaries forward, one of the entry-state gradients backward (both counted)."""

    def __init__(self, exchange: StateExchange, present: torch.Tensor, kind: str):
        self.exchange, self.present, self.kind = exchange, present, kind
        self.M = None

    def _all_gather(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        ex = self.exchange
        gathered = CountedRowGather([(ex.groups.cp, "cp")], ex.ledger).start_gather(x, phase)()
        return gathered.view((ex.cp,) + x.shape)

    def entry_states(self, summaries: torch.Tensor) -> torch.Tensor:
        heads, K = summaries.shape[1:3]
        V = summaries.shape[-1] - K
        mine = identity_summaries(self.present.numel(), heads, K, V, summaries.device)
        mine[self.present] = summaries
        gathered = self._all_gather(mine, "fwd")
        self.M = gathered[..., V:]
        entry = state_pieces.chain_entry_states(self.M, gathered[..., :V], self.exchange.cp,
                                                self.exchange.cp_rank, self.kind)
        return entry[self.present]

    def exit_grads(self, entry_grads: torch.Tensor) -> torch.Tensor:
        mine = entry_grads.new_zeros((self.present.numel(),) + entry_grads.shape[1:])
        mine[self.present] = entry_grads
        gathered = self._all_gather(mine, "bwd")
        exits = state_pieces.chain_exit_grads(self.M, gathered, self.exchange.cp, self.exchange.cp_rank,
                                              self.kind)
        return exits[self.present]
