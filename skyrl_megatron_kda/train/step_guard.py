"""The optimizer step with the rule for a non-finite loss or gradient norm (``train.on_nonfinite``).

megatron-core 0.19.2 looks for inf/NaN gradients only through a loss scaler, which an fp32 model
(and a bf16 one without ``loss_scale``) does not have: its ``optimizer.step()`` then applies a NaN
gradient and reports success. Its one other skip, ``grad_norm_skip_threshold``, tests
``norm > threshold``, which is false for NaN. So the guard decides before megatron's step:
``prepare_grads`` (the reduced gradients into the main ones) and ``get_grad_norm`` (megatron's
global norm), then one all-reduce of a flag over every rank, so that all ranks make the same
choice whatever they saw. Only then does ``optimizer.step()`` run; it computes the norm again
(one more read of this rank's gradient shard, small beside the step).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.train import TrainConfig

logger = logging.getLogger(__name__)


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient norm is not finite ended the run: one line with the step,
    the values and the rule that stopped it. Nothing of the step was applied."""


def finite_on_every_rank(finite: bool, device: torch.device) -> bool:
    """Whether every rank found its values finite (collective: one flag, all-reduced), so that
    all ranks make the same choice whatever each one saw."""
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def describe(loss: float | None, grad_norm: float) -> str:
    """``loss 4.35e+12, gradient norm nan``: the step's values, as a user reads them."""
    parts = [] if loss is None else [f"loss {loss:.4g}"]
    return ", ".join([*parts, f"gradient norm {grad_norm:.4g}"])


@dataclass
class StepGuard:
    """One rank's optimizer step under ``train.on_nonfinite`` (``stop`` or ``skip``), with the
    count of updates skipped in a row (reset by every applied one, and by a restart)."""

    on_nonfinite: str
    max_skipped_steps: int
    skipped_in_a_row: int = 0

    @classmethod
    def of(cls, train: TrainConfig) -> StepGuard:
        return cls(train.on_nonfinite, train.max_skipped_steps)

    def step(self, optimizer, step: int, loss: float | None, device: torch.device,
             cpu_mode=contextlib.nullcontext) -> tuple[bool, float]:
        """Run megatron's ``optimizer.step()`` for step number ``step`` unless the global ``loss``
        (None: not known to the caller) or the gradient norm is not finite on some rank; returns
        (applied, gradient norm before clipping). A non-finite step raises ``NonFiniteStep``
        under ``stop``, and under ``skip`` once ``max_skipped_steps`` are skipped in a row.
        Collective: every rank calls it."""
        with cpu_mode():
            found_inf = optimizer.prepare_grads()
            grad_norm = float(optimizer.get_grad_norm())
        finite = not found_inf and math.isfinite(grad_norm)
        finite = finite and (loss is None or math.isfinite(loss))
        if finite_on_every_rank(finite, device):
            with cpu_mode():
                ok, _, _ = optimizer.step()
            if not ok:
                raise RuntimeError(f"step {step}: megatron's optimizer step reported failure")
            self.skipped_in_a_row = 0
            return True, grad_norm
        values = describe(loss, grad_norm)
        if self.on_nonfinite == "stop":
            raise NonFiniteStep(f"step {step}: {values}: not finite; the update was not applied "
                                "(train.on_nonfinite=stop)")
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= self.max_skipped_steps:
            raise NonFiniteStep(
                f"step {step}: {values}: not finite, {self.skipped_in_a_row} updates skipped in a "
                f"row (train.max_skipped_steps={self.max_skipped_steps}); this one was not applied")
        if dist.get_rank() == 0:
            logger.warning("step %d: %s: not finite; update skipped (%d in a row, "
                           "train.on_nonfinite=skip)", step, values, self.skipped_in_a_row)
        return False, grad_norm
