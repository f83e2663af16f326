"""Counted collectives: what each exchange moves, recorded per process group and pass.

Every collective of an exchange goes through ``counted`` (megatron-core autograd mappings) or
``CountedRowGather`` (torch's asynchronous all-gather / reduce-scatter), so that a ``CommLedger``
holds the bytes it moved forward and backward, next to the analytic byte model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist


class CommLedger:
    """Bytes this rank sends and receives per process group and pass ("fwd" / "bwd").

    Counts the logical payload of each collective (what leaves this rank for other ranks, and what
    arrives from them), which is what the analytic byte model (``bytes_moved``) counts.
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


def counted(out: torch.Tensor, ledger: CommLedger, group: str, payload: int) -> torch.Tensor:
    """Record a symmetric collective moving ``payload`` bytes each way, now and in backward."""
    ledger.add(group, "fwd", payload, payload)
    if out.requires_grad:
        out = _OnBackward.apply(out, lambda: ledger.add(group, "bwd", payload, payload))
    return out


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class CountedRowGather:
    """The ``rows.RowGather`` of an exchange: all-gathers of rows over ``steps`` (group, ledger
    name) in order, reduce-scatters in reverse for the gradient, each counted in the ledger. The
    last collective of each runs asynchronously (``rows.RowGather``)."""

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
            payload = (n - 1) * nbytes(x if gather else out)
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
