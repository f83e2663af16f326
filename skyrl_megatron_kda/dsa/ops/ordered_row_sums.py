"""``out[index[j]] += rows[j]`` with every row of ``out`` summed in one fixed order: the
deterministic latent gradient of the sparse-MLA backward
(``model.dsa.latent.deterministic_backward``).

The backward's latent gradient is a scatter-add: each (query, selected key) pair adds a [512]
row into the selected key's row. With fp32 atomics (our kernel's default, megatron-core's
kernels, ``index_add_`` on CUDA) the additions land in whatever order the thread blocks run, so
two runs differ in the last bits, and an RL run cannot be replayed bitwise. Here the kernel
writes each pair's row instead, and this pass sorts the pairs by key (a stable sort: ties keep
their order) and gives every key one program that sums its rows in that order and adds the sum
to ``out`` once: the same bits on every run, on every GPU of one kind.

torch has no deterministic CUDA scatter-add of rows that avoids materialising the sorted rows
(``index_add_`` under ``torch.use_deterministic_algorithms`` is a global switch, and
``segment_reduce`` wants the rows already grouped), so this is one Triton kernel of our own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8
"""Rows a program loads per step (summed in a fixed tree order): loads in flight per key."""
COLUMNS = 128
"""Columns per program: a key's row is split over width / COLUMNS programs."""


@triton.jit
def _ordered_row_sums(out_ptr, rows_ptr, order_ptr, keys_ptr, starts_ptr, width,
                      CHUNK: tl.constexpr, COLUMNS: tl.constexpr):
    run = tl.program_id(0)
    cols = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    inside = cols < width
    key = tl.load(keys_ptr + run)
    if key >= 0:  # pairs whose index is -1 (nothing selected) sort first and add nothing
        begin = tl.load(starts_ptr + run)
        end = tl.load(starts_ptr + run + 1)
        acc = tl.zeros([COLUMNS], tl.float32)
        for j in range(begin, end, CHUNK):
            at = j + tl.arange(0, CHUNK)
            row = tl.load(order_ptr + at, mask=at < end, other=0).to(tl.int64)
            part = tl.load(rows_ptr + row[:, None] * width + cols[None, :],
                           mask=(at < end)[:, None] & inside[None, :], other=0.0)
            acc += tl.sum(part, axis=0)
        dst = out_ptr + key.to(tl.int64) * width + cols
        tl.store(dst, tl.load(dst, mask=inside) + acc, mask=inside)


def add_rows_in_index_order(out: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    """``out[index[j]] += rows[j]`` for every ``index[j] >= 0`` (-1: skipped), in place; out
    [N, W] and rows [M, W] fp32 (contiguous), index [M] integer. Each row of ``out`` receives one
    addition: the fp32 sum of its rows in order of j, so the result depends only on the inputs."""
    if (out.dtype != torch.float32 or rows.dtype != torch.float32 or out.dim() != 2
            or rows.dim() != 2 or rows.shape[1] != out.shape[1] or index.shape != rows.shape[:1]
            or not out.is_contiguous()):
        raise ValueError(f"expected out [N, W] and rows [M, W] fp32 (out contiguous) and index "
                         f"[M], got {out.dtype} {list(out.shape)}, {rows.dtype} "
                         f"{list(rows.shape)}, {list(index.shape)}")
    if not index.numel():
        return
    keys, order = torch.sort(index.to(torch.int32), stable=True)
    runs, counts = torch.unique_consecutive(keys, return_counts=True)
    starts = torch.zeros(runs.numel() + 1, dtype=torch.int64, device=keys.device)
    torch.cumsum(counts, 0, out=starts[1:])
    width = out.shape[1]
    grid = (runs.numel(), triton.cdiv(width, COLUMNS))
    _ordered_row_sums[grid](out, rows.contiguous(), order, runs, starts, width,
                            CHUNK=CHUNK, COLUMNS=COLUMNS, num_warps=4)
