"""``state``: the sequence stays sharded; only fp32 state summaries and conv halos cross the CP
group (``kda/state_pieces.py``). Not bitwise equal to CP=1: the incoming state is composed in fp32
from the summaries."""

from __future__ import annotations

import torch

from ...distributed.cp_layout import BatchIndexMaps, layout_kind
from .. import state_pieces
from ..kernel import causal_conv_silu, causal_conv_silu_backward
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

    def to_compute_layout(self, x: torch.Tensor, layout: BatchIndexMaps, project: Projection,
                          num_local_heads: int) -> ComputeRows:
        """This rank's own rows (gathered over TP under SP), all local heads: nothing crosses CP."""
        heads = slice(0, num_local_heads)
        return ComputeRows(project(*self._rows(x), heads), heads)

    def to_sequence(self, o: torch.Tensor, layout: BatchIndexMaps) -> torch.Tensor:
        return o

    def _pieces(self, layout: BatchIndexMaps, batch: int, cp_rank: int) -> state_pieces.Pieces:
        return layout.derived(("state pieces", batch, cp_rank), lambda: state_pieces.rank_pieces(
            layout.cu_seqlens, self.cp, cp_rank, batch, layout.kind))

    def _halo_plan(self, layout: BatchIndexMaps, batch: int, width: int) -> state_pieces.HaloPlan:
        # Every rank's pieces follow from the layout, so the tails' positions need no exchange.
        return layout.derived(("state halo", batch, width, self.cp_rank), lambda: state_pieces.halo_plan(
            self._pieces(layout, batch, self.cp_rank),
            [self._pieces(layout, batch, r) for r in range(self.cp)], width))

    def _kernel_pieces(self, layout: BatchIndexMaps, batch: int, kernel: KernelArgs) -> tuple[int, torch.Tensor, Segments]:
        """How many slots this rank has, the indices of those that hold rows, and those pieces cut
        into the kernel's segments (the kernel only sees non-empty pieces: a sequence that misses
        this rank in the contiguous layout has an empty slot, whose summary is the identity map)."""
        def build():
            pieces = self._pieces(layout, batch, self.cp_rank)
            present, cu = pieces.occupied()
            return pieces.count, present, Segments.cut(cu, kernel.segments, kernel.chunk_size)
        key = ("state kernel pieces", batch, self.cp_rank, kernel.segments, kernel.chunk_size)
        return layout.derived(key, build)

    def conv(self, qkv: list[torch.Tensor], weight: torch.Tensor, layout: BatchIndexMaps,
             kernel: KernelArgs) -> list[torch.Tensor]:
        """q, k and v each convolved on this rank's pieces, each piece starting from its halo (one
        halo exchange for all three)."""
        if self.cp == 1:
            return super().conv(qkv, weight, layout, kernel)
        batch, rows, channels = qkv[0].shape
        plan = self._halo_plan(layout, batch, weight.shape[-1] - 1)
        tails = CountedRowGather([(self.groups.cp, "cp")], self.ledger)
        outs = _HaloConv.apply(weight, plan, tails, kernel.backend,
                               *(x.reshape(batch * rows, channels) for x in qkv))
        return [out.reshape(batch, rows, -1) for out in outs]

    def recurrence(self, q, k, v, f, b, A_log, dt_bias, layout: BatchIndexMaps, kernel: KernelArgs):
        if self.cp == 1:
            return super().recurrence(q, k, v, f, b, A_log, dt_bias, layout, kernel)
        batch, rows, heads, K = q.shape
        slots, present, segments = self._kernel_pieces(layout, batch, kernel)
        q, k, v, f, b = (t.reshape((1, batch * rows) + t.shape[2:]) for t in (q, k, v, f, b))
        link = _CPChain(self, slots, present, layout.kind)
        o = state_passing_kda_on_segments(q, k, v, f, b, A_log, dt_bias, pieces=segments, link=link,
                                          **kernel.kernel_kwargs())
        return o.reshape(batch, rows, heads, -1)


class _CPChain:
    """The state exchange's link between pieces on different CP ranks: one all-gather of the
    fp32 summaries forward, one of the entry-state gradients backward (both counted). ``slots``
    is how many pieces this rank has, ``present`` the indices of those that hold rows (the
    kernel's pieces)."""

    def __init__(self, exchange: StateExchange, slots: int, present: torch.Tensor, kind: str):
        self.exchange, self.slots, self.present, self.kind = exchange, slots, present, kind
        self.M = None

    def _all_gather(self, x: torch.Tensor, phase: str) -> torch.Tensor:
        ex = self.exchange
        gathered = CountedRowGather([(ex.groups.cp, "cp")], ex.ledger).start_gather(x, phase)()
        return gathered.view((ex.cp,) + x.shape)

    def entry_states(self, summaries: torch.Tensor) -> torch.Tensor:
        heads, K = summaries.shape[1:3]
        V = summaries.shape[-1] - K
        mine = identity_summaries(self.slots, heads, K, V, summaries.device).index_copy_(0, self.present, summaries)
        gathered = self._all_gather(mine, "fwd")
        self.M = gathered[..., V:]
        entry = state_pieces.chain_entry_states(self.M, gathered[..., :V], self.exchange.cp,
                                                self.exchange.cp_rank, self.kind)
        return entry.index_select(0, self.present)

    def exit_grads(self, entry_grads: torch.Tensor) -> torch.Tensor:
        mine = entry_grads.new_zeros((self.slots,) + entry_grads.shape[1:]).index_copy_(0, self.present, entry_grads)
        gathered = self._all_gather(mine, "bwd")
        exits = state_pieces.chain_exit_grads(self.M, gathered, self.exchange.cp, self.exchange.cp_rank,
                                              self.kind)
        return exits.index_select(0, self.present)


class _HaloConv(torch.autograd.Function):
    """Causal conv + SiLU of q, k and v ([rows, C] each, read in place; weight [3, C, W]) on this
    rank's pieces, each piece's first taps reading its halo.

    Each of q, k, v is convolved over all of the rank's rows at once, as one sequence: fla's
    fastest call (cutting the rows into the pieces, or starting each from its halo as fla's
    initial state, costs more: ``bench/conv_layouts.py``). That is right except for the first
    ``W - 1`` rows of each piece, whose taps reach before the piece start; those few rows are
    computed again from their true window, the halo being the piece tails all-gathered over CP
    (q|k|v side by side: one gather for the three). Backward runs the whole-rank conv's
    backward, then swaps those rows' contribution for their true window's, reduce-scatters the
    halos' gradients to their owners and adds them into the tail rows in place."""

    @staticmethod
    def forward(ctx, weight, plan: state_pieces.HaloPlan, tails: CountedRowGather, backend: str, *qkv):
        mine = torch.cat([state_pieces.piece_tails(x, plan) for x in qkv], dim=-1)
        all_tails = tails.start_gather(mine, "fwd")()
        outs = [causal_conv_silu(x.unsqueeze(0), w, backend=backend)[0] for x, w in zip(qkv, weight.unbind(0))]
        rows = torch.cat([state_pieces.window_rows(x, plan) for x in qkv], dim=-1)
        _, true = state_pieces.head_windows(rows, state_pieces.halo_rows(all_tails, plan), plan)
        heads = state_pieces.window_conv_silu(true, weight.flatten(0, 1))
        for out, head in zip(outs, heads.chunk(3, dim=-1)):
            out.index_copy_(0, plan.head_rows, head)
        ctx.save_for_backward(weight, all_tails, rows, *qkv)
        ctx.plan, ctx.tails, ctx.backend = plan, tails, backend
        return tuple(outs)

    @staticmethod
    def backward(ctx, *out_grads):
        weight, all_tails, rows, *qkv = ctx.saved_tensors
        plan = ctx.plan
        grads = [causal_conv_silu_backward(x.unsqueeze(0), w, dy.unsqueeze(0), backend=ctx.backend)
                 for x, w, dy in zip(qkv, weight.unbind(0), out_grads)]
        weight_grad = torch.stack([dw for _, dw in grads])
        heads_grad = torch.cat([dy.index_select(0, plan.head_rows) for dy in out_grads], dim=-1)
        with torch.enable_grad():  # the head rows are few: their correction by autograd
            leaves = [t.detach().requires_grad_() for t in (rows, all_tails, weight)]
            rows_leaf, tails_leaf, weight_leaf = leaves
            read, true = state_pieces.head_windows(rows_leaf, state_pieces.halo_rows(tails_leaf, plan), plan)
            w = weight_leaf.flatten(0, 1)
            true_y, read_y = state_pieces.window_conv_silu(torch.stack([true, read]), w)
            change = true_y - read_y
            rows_grad, all_tails_grad, weight_change = torch.autograd.grad(change, leaves, heads_grad)
        tails_grad = ctx.tails.start_reduce_scatter(all_tails_grad)
        x_grads = [dx[0] for dx, _ in grads]
        for x_grad, row_grad in zip(x_grads, rows_grad.chunk(3, dim=-1)):
            x_grad.index_add_(0, plan.window.flatten(), row_grad.flatten(0, 1))
        for x_grad, tail_grad in zip(x_grads, tails_grad().chunk(3, dim=-1)):
            state_pieces.add_tail_grads(x_grad, tail_grad, plan)
        return weight_grad + weight_change, None, None, None, *x_grads
