"""What every memory term is measured on: the rows one rank computes on for one packed row of
``data.seq_len`` tokens, and the bytes of an element.

The trainer runs forward+backward one packed row at a time, so ``micro_batch_size`` does not
multiply any term."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Recipe


DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes of an element of each ``model.params_dtype``."""


@dataclass(frozen=True)
class Rows:
    """Row counts of one forward on one rank (one packed row of seq_len tokens)."""

    whole: int  # T: tokens of the packed row (all CP ranks)
    cp: int  # S = T / cp: this CP rank's tokens (what TP-sharded layers compute on)
    sp: int  # s = S / tp under sequence parallelism, else S: rows of the residual stream


def rows_of(recipe: Recipe) -> Rows:
    p, T = recipe.parallel, recipe.data.seq_len
    S = T // p.cp
    return Rows(whole=T, cp=S, sp=S // p.tp if p.sequence_parallel else S)


def act_bytes(recipe: Recipe) -> int:
    """Bytes of an activation element: the model's parameter dtype."""
    return DTYPE_BYTES[recipe.model.params_dtype]
