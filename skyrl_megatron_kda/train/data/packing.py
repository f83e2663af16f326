"""Documents laid into THD rows of exactly ``seq_len`` tokens. Every document is padded to a
multiple of ``pad_multiple`` (the CP layout cuts each packed sequence into pieces) and the row's
tail is one masked padding sequence, so ``cu_seqlens`` always end at ``seq_len``."""

from __future__ import annotations

import math
from collections.abc import Sequence
import torch

from ...config import ParallelConfig
from ...distributed.cp_layout import LayoutName, layout_kind
from ...distributed.rank_split import PackedRow


def pad_multiple(parallel: ParallelConfig, layout: LayoutName = "zigzag") -> int:
    """What every packed sequence's length must divide by, as the layout kind says: the zigzag
    layout cuts each sequence into 2*cp chunks; the contiguous one cuts the row anywhere."""
    return layout_kind(layout).sequence_multiple(parallel.cp)


def row_multiple(parallel: ParallelConfig, layout: LayoutName = "zigzag") -> int:
    """What ``seq_len`` must divide by: the per-sequence multiple (the tail padding sequence is one
    too), and, under SP, each CP rank's rows must split evenly over the TP group."""
    sp_ranks = parallel.cp * (parallel.tp if parallel.sequence_parallel else 1)
    return math.lcm(pad_multiple(parallel, layout), sp_ranks)


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def pack_row(docs: Sequence[torch.Tensor], seq_len: int, multiple: int, pad_id: int = 0) -> PackedRow:
    """Lay ``docs`` (which must fit once padded) one after the other into a row of ``seq_len``."""
    tokens = torch.full((seq_len,), pad_id, dtype=torch.long)
    labels = torch.full((seq_len,), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(seq_len, dtype=torch.float32)
    position_ids = torch.zeros(seq_len, dtype=torch.long)
    bounds, real_lengths, start = [0], [0], 0
    for doc in docs:
        n, padded = len(doc), padded_length(len(doc), multiple)
        if start + padded > seq_len:
            raise ValueError(f"documents need more than seq_len={seq_len} tokens once padded")
        tokens[start:start + n] = doc
        labels[start:start + n - 1] = doc[1:]
        loss_mask[start:start + n - 1] = 1.0
        position_ids[start:start + padded] = torch.arange(padded)
        real_lengths.append(n)
        start += padded
        bounds.append(start)
    if start < seq_len:  # the tail: one masked padding sequence
        position_ids[start:] = torch.arange(seq_len - start)
        real_lengths.append(0)
        bounds.append(seq_len)
    return PackedRow(tokens, labels, loss_mask, position_ids, torch.tensor(bounds, dtype=torch.int32),
                     torch.tensor(real_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32))
