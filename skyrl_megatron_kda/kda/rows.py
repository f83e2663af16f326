"""The KDA layer's input projections, on hidden-state rows gathered from other ranks.

Every exchange projects rows gathered from sequence shards: the SP shards over TP, and for
``allgather`` the CP shards of the whole sequence too. As in megatron-core's sequence-parallel
linears, the gathered rows are not kept for the weight gradients: backward gathers them again from
this rank's shard. Between forward and backward a rank then holds only its own shard of the rows.
(Keeping them cost ``allgather`` the whole sequence's ``[T, D]`` rows per layer: 0.58 of CP=1's
memory per rank at CP2 instead of 0.5.)
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F


class RowGather(Protocol):
    """The collectives between a rank's shard of rows and the rows it projects (``kda/exchanges/``).

    The ``start_*`` calls issue their (last) collective asynchronously and return a function
    that waits for it and gives its result, so that backward can compute meanwhile."""

    def start_gather(self, shard: torch.Tensor, phase: str) -> Callable[[], torch.Tensor]:
        """All rows, from every rank's shard; ``phase`` ("fwd"/"bwd") is for byte accounting."""

    def start_reduce_scatter(self, rows_grad: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The gradient of the gathered rows summed back onto this rank's shard."""


class _GatheredLinears(torch.autograd.Function):
    """``[rows @ w.T for w in weights]`` with ``rows = gather(shard)``, saving only the shard.

    One gather serves all the weights forward, and one re-gather all their weight gradients.
    Backward overlaps as megatron's SP linears do: the input gradient (which needs no rows) is
    computed while the rows are gathered again, the weight gradients while the input gradient
    is reduce-scattered."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, rows: RowGather | None, *weights: torch.Tensor):
        ctx.rows = rows
        ctx.save_for_backward(shard, *weights)
        full = shard if rows is None else rows.start_gather(shard, "fwd")()
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        shard, *weights = ctx.saved_tensors
        rows = ctx.rows
        gathered = (lambda: shard) if rows is None else rows.start_gather(shard, "bwd")
        rows_shape = grads[0].shape[:-1] + weights[0].shape[1:]
        grads = [grad.flatten(0, -2) for grad in grads]
        # Each output's share accumulates in its GEMM's epilogue: no temporary, no extra add pass.
        full_grad = grads[0].mm(weights[0])
        for grad, weight in zip(grads[1:], weights[1:]):
            full_grad.addmm_(grad, weight)
        full_grad = full_grad.view(rows_shape)
        shard_grad = (lambda: full_grad) if rows is None else rows.start_reduce_scatter(full_grad)
        flat = gathered().flatten(0, -2)
        weight_grads = [grad.t().mm(flat) for grad in grads]
        return (shard_grad(), None, *weight_grads)


def _aligned(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
    """The weight ``parts`` stacked by rows, padded with zero rows to a multiple of 8 in the same
    concatenation (the padding's outputs are sliced off): cuBLAS runs its fast Hopper kernels only
    on 16-byte aligned bf16 widths; a 1540-column output otherwise ran at a third of the GEMM
    rate in forward and backward."""
    pad = -sum(p.shape[0] for p in parts) % 8
    if pad:
        parts = (*parts, parts[0].new_zeros(pad, parts[0].shape[1]))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), pad


def project_rows(shard: torch.Tensor, rows: RowGather | None,
                 *weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """One output per entry of ``weights`` (a tuple of weight parts stacked by rows), each
    ``[s, b, sum of the parts' rows]``, for the rows ``rows`` gathers from ``shard`` (None: the
    shard itself)."""
    aligned = [_aligned(parts) for parts in weights]
    outs = _GatheredLinears.apply(shard, rows, *(w for w, _ in aligned))
    return [out[..., : out.shape[-1] - pad] if pad else out for out, (_, pad) in zip(outs, aligned)]
