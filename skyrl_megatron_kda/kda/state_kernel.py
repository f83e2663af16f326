"""KDA on pieces of sequences whose entry states come from other pieces (state passing).

The ``state`` exchange needs each piece's summary ``S_out = M S_in + S_local`` *before* its main
pass, and in backward the gradient that later pieces send to each piece's exit state. Building
the summaries with a second differentiable kernel pass (and back-propagating through it) costs
more than the pass it parallelises. ``state_passing_kda`` instead runs, around one main pass:

- forward: the summaries (values ``[v | 0]`` from states ``[0 | I]``: ``S_local`` and ``M`` in one
  pass, no autograd), then the link (all-gather + chain over CP) gives the entry states, then the
  main pass from them;
- backward: a state-gradient pass with no gradient at the exit gives each piece's backward
  summary ``dS_in = M^T dS_out + dS_local``; the link turns those into the gradient at every
  exit; the main backward then runs from the true exit gradients. That is the exact gradient of
  the whole chain: nothing is differentiated through the summaries.

Pieces are further cut into segments that the kernel runs side by side, chained the same way.
On CUDA this is the point: fla's state pass walks a sequence's chunks one after another, so one
long sequence with few heads leaves most of the GPU idle, and segments side by side fill it
(``bench/kda_segments.py`` times them against fla's own chunk_kda). The fla backend calls
fla's kernels one by one (as fla's ``chunk_kda`` does) so that the intra-chunk work is done once
and only the cheap state passes run twice; the torch backend is the CPU reference (autograd
recompute) that proves the chaining in CI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .kernel import FLA_L2NORM_EPS, kda, l2_normalize


class Link(Protocol):
    """How a rank's pieces connect to pieces elsewhere (the CP all-gathers and chain)."""

    def entry_states(self, summaries: torch.Tensor) -> torch.Tensor:
        """[P, H, K, V+K] ``[S_local | M]`` of this rank's pieces -> their entry states [P, H, K, V]."""

    def exit_grads(self, entry_grads: torch.Tensor) -> torch.Tensor:
        """[P, H, K, V] each piece's entry-state gradient with no gradient at its exit -> the
        gradient later pieces send to each piece's exit state [P, H, K, V]."""


class IsolatedPieces:
    """Pieces that are whole sequences: nothing enters or leaves them."""

    def entry_states(self, summaries: torch.Tensor) -> torch.Tensor:
        return summaries.new_zeros(summaries.shape[:-1] + (summaries.shape[-1] - summaries.shape[-2],))

    def exit_grads(self, entry_grads: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(entry_grads)


@dataclass(frozen=True)
class Segments:
    """Pieces cut into segments of at most ``length`` rows (a multiple of the chunk size, so the
    kernel's chunks do not move). ``cu`` are segment boundaries; ``of_piece[p]`` the segment
    indices of piece ``p`` in order, and ``first`` / ``last`` each piece's first and last segment
    on the device (an index from a host list would cost a copy that waits for the GPU)."""

    cu: torch.Tensor
    of_piece: list[list[int]]
    first: torch.Tensor
    last: torch.Tensor

    @classmethod
    def cut(cls, piece_cu: torch.Tensor, target: int, chunk_size: int) -> Segments:
        """About ``target`` segments in total, each a whole number of chunks."""
        bounds = piece_cu.tolist()
        total = bounds[-1] - bounds[0]
        length = max(chunk_size, -(-max(total, 1) // max(target, 1) // chunk_size) * chunk_size)
        cu, of_piece = [bounds[0]], []
        for start, end in zip(bounds[:-1], bounds[1:]):
            first = len(cu) - 1
            cu.extend(range(start + length, end, length))
            cu.append(end)
            of_piece.append(list(range(first, len(cu) - 1)))

        def on_device(values):
            return torch.tensor(values, dtype=torch.long, device=piece_cu.device)

        return cls(on_device(cu), of_piece, on_device([segs[0] for segs in of_piece]),
                   on_device([segs[-1] for segs in of_piece]))


def _chain(buffer: torch.Tensor, step: Callable[[int, int], torch.Tensor], segments: Segments,
           backwards: bool = False) -> None:
    """Walk each piece's segments in order (or backwards), ``buffer[to] += step(frm, to) @
    buffer[frm]`` in place: one kernel per step, ``buffer[to]`` already holding the part it adds."""
    for segs in segments.of_piece:
        order = segs[::-1] if backwards else segs
        for frm, to in zip(order[:-1], order[1:]):
            buffer[to].baddbmm_(step(frm, to), buffer[frm])


def _compose_entries(summaries: torch.Tensor, segments: Segments, link: Link) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment summaries -> piece summaries -> (link) -> every segment's entry state; also M.

    Every step of a chain is one in-place ``baddbmm_`` on a buffer that already holds the part
    it adds (one kernel, where the out-of-place form copies that part first): at 128K tokens a
    step of the layer is short enough that the host's launches of these small kernels, not the
    GPU, set its pace."""
    V = summaries.shape[-1] - summaries.shape[-2]
    M = summaries[..., V:]
    # A piece's summary composes its segments': [L | M] <- [L_j | 0] + M_j [L | M].
    composed = torch.cat([summaries[..., :V], torch.zeros_like(M)], dim=-1)
    composed.index_copy_(0, segments.first, summaries.index_select(0, segments.first))
    _chain(composed, lambda frm, to: M[to], segments)
    entry = link.entry_states(composed.index_select(0, segments.last))
    # Segment j + 1 enters with segment j's exit, L_j + M_j (entry of j); a piece's first segment
    # with the piece's entry state.
    seg_entry = torch.empty_like(summaries[..., :V])
    seg_entry[1:] = summaries[:-1, ..., :V]
    seg_entry.index_copy_(0, segments.first, entry)
    _chain(seg_entry, lambda frm, to: M[frm], segments)
    return seg_entry, M


def _compose_exit_grads(local_grads: torch.Tensor, M: torch.Tensor, segments: Segments, link: Link) -> torch.Tensor:
    """Each segment's entry gradient with no exit gradient -> (link) -> every segment's exit
    gradient, by the same in-place steps as ``_compose_entries`` run backwards through ``M^T``."""
    Mt = M.transpose(-1, -2)
    # A piece's entry gradient with none at its exit: D <- D_j + M_j^T D, from its last segment.
    composed = local_grads.clone()
    _chain(composed, lambda frm, to: Mt[to], segments, backwards=True)
    exits = link.exit_grads(composed.index_select(0, segments.first))
    # Segment j - 1 exits with segment j's entry gradient, D_j + M_j^T (exit of j); a piece's last
    # segment with the gradient the link sends it.
    seg_exit = torch.empty_like(local_grads)
    seg_exit[:-1] = local_grads[1:]
    seg_exit.index_copy_(0, segments.last, exits)
    _chain(seg_exit, lambda frm, to: Mt[frm], segments, backwards=True)
    return seg_exit


def identity_summaries(count: int, heads: int, K: int, V: int, device) -> torch.Tensor:
    """``[0 | I]`` per segment: with values ``[v | 0]`` the final state is ``[S_local | M]``."""
    eye = torch.eye(K, device=device).expand(count, heads, K, K)
    return torch.cat([torch.zeros(count, heads, K, V, device=device), eye], dim=-1)


class _TorchBackend:
    """CPU reference: the same chaining, with autograd recompute for the two backward passes."""

    @staticmethod
    def forward(inputs, segments: Segments, entries: Callable, kernel_args: dict):
        q, k, v, f, b, A_log, dt_bias = inputs
        K, V = q.shape[-1], v.shape[-1]
        with torch.no_grad():
            values = torch.cat([v, v.new_zeros(v.shape[:-1] + (K,))], dim=-1)
            start = identity_summaries(segments.cu.numel() - 1, q.shape[-2], K, V, q.device)
            _, summaries = kda(q, k, values, f, b, A_log, dt_bias, cu_seqlens=segments.cu,
                               initial_state=start, output_final_state=True, **kernel_args)
            seg_entry, M = entries(summaries)
            o, _ = kda(q, k, v, f, b, A_log, dt_bias, cu_seqlens=segments.cu, initial_state=seg_entry,
                       **kernel_args)
        return o, (seg_entry, M)

    @staticmethod
    def backward(inputs, saved, segments: Segments, do, exit_grads: Callable, kernel_args: dict):
        seg_entry, M = saved
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
            start = seg_entry.detach().requires_grad_()
            o, final = kda(*leaves, cu_seqlens=segments.cu, initial_state=start, output_final_state=True,
                           **kernel_args)
            (local_grads,) = torch.autograd.grad(o, start, do, retain_graph=True)
            dht = exit_grads(local_grads, M)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad((o, final), wanted, (do, dht), allow_unused=True))
        return [next(grads) if t.requires_grad else None for t in leaves]


class _FlaBackend:
    """fla's Triton kernels, called one by one as fla's ``chunk_kda`` does (gate in kernel, safe
    gate, sigmoid beta, optional in-kernel q/k L2 norm), with the segment chaining in between."""

    @staticmethod
    def _gate(f, A_log, dt_bias, segments, chunk_indices, args):
        from fla.ops.kda.gate import kda_gate_chunk_cumsum
        from fla.ops.utils.constant import RCP_LN2

        return kda_gate_chunk_cumsum(g=f, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2,
                                     chunk_size=args["chunk_size"], cu_seqlens=segments.cu,
                                     chunk_indices=chunk_indices, lower_bound=args["lower_bound"])

    @staticmethod
    def _state_pass(kg, w, u, g, start, segments, chunk_indices, args, final: bool):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

        return chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=start, output_final_state=final,
                                            chunk_size=args["chunk_size"], cu_seqlens=segments.cu,
                                            chunk_indices=chunk_indices)

    @classmethod
    def forward(cls, inputs, segments: Segments, entries: Callable, args: dict):
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.gate import fused_beta_sigmoid
        from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
        from fla.ops.utils.index import prepare_chunk_indices

        q, k, v, f, b, A_log, dt_bias = inputs
        K, V = q.shape[-1], v.shape[-1]
        chunk_indices = prepare_chunk_indices(segments.cu, args["chunk_size"])
        q_rstd = k_rstd = None
        if args["norm_in_kernel"]:
            q, q_rstd = l2norm_fwd(q)
            k, k_rstd = l2norm_fwd(k)
        beta = fused_beta_sigmoid(x=b, scale=1.0)
        g = cls._gate(f, A_log, dt_bias, segments, chunk_indices, args)
        w, u, _, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g, beta=beta, scale=args["scale"],
                                                    cu_seqlens=segments.cu, chunk_size=args["chunk_size"],
                                                    chunk_indices=chunk_indices, safe_gate=True)
        start = identity_summaries(segments.cu.numel() - 1, q.shape[-2], K, V, q.device)
        u_wide = torch.cat([u, u.new_zeros(u.shape[:-1] + (K,))], dim=-1)
        _, _, summaries = cls._state_pass(kg, w, u_wide, g, start, segments, chunk_indices, args, final=True)
        del u_wide
        seg_entry, M = entries(summaries)
        h, v_new, _ = cls._state_pass(kg, w, u, g, seg_entry, segments, chunk_indices, args, final=False)
        o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=g, A=Aqk, h=h, scale=args["scale"], cu_seqlens=segments.cu,
                               chunk_size=args["chunk_size"], chunk_indices=chunk_indices).to(v.dtype)
        return o, (q, q_rstd, k, k_rstd, beta, Aqk, Akk, seg_entry, M, chunk_indices)

    @classmethod
    def backward(cls, inputs, saved, segments: Segments, do, exit_grads: Callable, args: dict):
        from fla.modules.norm.l2norm import l2norm_bwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        from fla.ops.common.gate import fused_beta_sigmoid_bwd
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
        from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
        from fla.ops.kda.gate import kda_gate_bwd
        from fla.ops.kda.wy_fast import recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum

        _, _, v, f, b, A_log, dt_bias = inputs
        q, q_rstd, k, k_rstd, beta, Aqk, Akk, seg_entry, M, chunk_indices = saved
        cs, scale, cu = args["chunk_size"], args["scale"], segments.cu
        do = do.contiguous()
        g = cls._gate(f, A_log, dt_bias, segments, chunk_indices, args)
        w, u, qg, kg = recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g, cu_seqlens=cu,
                                         chunk_indices=chunk_indices)
        h, v_new, _ = cls._state_pass(kg, w, u, g, seg_entry, segments, chunk_indices, args, final=False)
        dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, cu_seqlens=cu,
                                     chunk_size=cs, chunk_indices=chunk_indices)

        def dhu(dht):
            return chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, gk=g, h0=seg_entry, dht=dht, do=do, dv=dv,
                                                  scale=scale, cu_seqlens=cu, chunk_size=cs,
                                                  chunk_indices=chunk_indices)

        _, local_grads, _ = dhu(None)
        dh, _, dv = dhu(exit_grads(local_grads, M))
        dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(
            q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=Akk, h=h, do=do, dh=dh, dv=dv, scale=scale,
            cu_seqlens=cu, chunk_size=cs, chunk_indices=chunk_indices)
        dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk,
                                             db=db, dg=dg, cu_seqlens=cu, chunk_indices=chunk_indices,
                                             chunk_size=cs, safe_gate=True)
        dg = chunk_local_cumsum(dg, chunk_size=cs, reverse=True, cu_seqlens=cu, chunk_indices=chunk_indices)
        dg, dA, dbias = kda_gate_bwd(g=f, A_log=A_log, dt_bias=dt_bias, dyg=dg, lower_bound=args["lower_bound"])
        if args["norm_in_kernel"]:
            dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
        db = fused_beta_sigmoid_bwd(x=b, dy=db, scale=1.0)
        return [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(f.dtype), db.to(b.dtype), dA, dbias]


class _StatePassingKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, f, b, A_log, dt_bias, segments, link, backend, args):
        inputs = (q, k, v, f, b, A_log, dt_bias)
        o, saved = backend.forward(inputs, segments, lambda s: _compose_entries(s, segments, link), args)
        ctx.save_for_backward(*inputs)
        ctx.saved, ctx.segments, ctx.link, ctx.backend, ctx.args = saved, segments, link, backend, args
        return o

    @staticmethod
    def backward(ctx, do):
        inputs = ctx.saved_tensors
        segments, link = ctx.segments, ctx.link
        grads = ctx.backend.backward(inputs, ctx.saved, segments, do,
                                     lambda local, M: _compose_exit_grads(local, M, segments, link), ctx.args)
        return (*grads, None, None, None, None)


def state_passing_kda(q, k, v, f_raw, b_raw, A_log, dt_bias, *, piece_cu: torch.Tensor, link: Link,
                      lower_bound: float, backend: str, l2norm_eps: float = 1e-6, chunk_size: int = 64,
                      segments: int = 16) -> torch.Tensor:
    """KDA over the pieces ``piece_cu`` of a packed row ``[1, N, H, K]`` whose entry states come
    from ``link``; every piece is cut into about ``segments`` (in total) parallel segments.

    Same inputs and output as ``kernel.kda`` (raw gate / beta projections, pre-norm q/k)."""
    return state_passing_kda_on_segments(q, k, v, f_raw, b_raw, A_log, dt_bias,
                                         pieces=Segments.cut(piece_cu, segments, chunk_size), link=link,
                                         lower_bound=lower_bound, backend=backend, l2norm_eps=l2norm_eps,
                                         chunk_size=chunk_size)


def state_passing_kda_on_segments(q, k, v, f_raw, b_raw, A_log, dt_bias, *, pieces: Segments, link: Link,
                                  lower_bound: float, backend: str, l2norm_eps: float = 1e-6,
                                  chunk_size: int = 64) -> torch.Tensor:
    """``state_passing_kda`` on pieces already cut into segments (``Segments.cut``, which reads the
    boundaries on the host: a caller that runs many layers on one batch cuts once)."""
    if backend == "torch":
        args = {"lower_bound": lower_bound, "l2norm_eps": l2norm_eps, "chunk_size": chunk_size, "backend": "torch"}
        return _StatePassingKDA.apply(q, k, v, f_raw, b_raw, A_log, dt_bias, pieces, link, _TorchBackend, args)
    if backend != "fla":
        raise ValueError(f"unknown kernel backend {backend!r}")
    norm_in_kernel = l2norm_eps == FLA_L2NORM_EPS
    if not norm_in_kernel:
        q, k = l2_normalize(q, l2norm_eps).to(q.dtype), l2_normalize(k, l2norm_eps).to(k.dtype)
    args = {"lower_bound": lower_bound, "chunk_size": chunk_size, "norm_in_kernel": norm_in_kernel,
            "scale": q.shape[-1] ** -0.5}
    q, k, v, f_raw, b_raw = (t.contiguous() for t in (q, k, v, f_raw, b_raw))
    return _StatePassingKDA.apply(q, k, v, f_raw, b_raw, A_log, dt_bias, pieces, link, _FlaBackend, args)
