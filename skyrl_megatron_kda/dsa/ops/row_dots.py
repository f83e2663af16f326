"""The sparse-MLA backward's ``delta = sum(dO * O)`` per query and head, as one Triton kernel.

The backward needs, for every query and head, the dot product of the latent-space output and
its gradient ([S, H, 512] bf16 each) in fp32. In torch that is two fp32 copies of both, their
product and a sum: several times the inputs' bytes of traffic. Here each program reads a few
rows of both once, multiplies in fp32 and writes the sums: the bytes of the inputs once.
megatron-core's TileLang ``sparse_mla_delta`` computes the same for its own kernel set
(``fused`` keeps it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 8
"""Rows (query x head) per program."""


@triton.jit
def _row_dots(a_ptr, b_ptr, out_ptr, n_rows, WIDTH: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    inside = (rows < n_rows)[:, None]
    at = rows[:, None].to(tl.int64) * WIDTH + cols[None, :]
    a = tl.load(a_ptr + at, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + at, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, tl.sum(a * b, axis=1), mask=rows < n_rows)


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a.float() * b.float()).sum(-1)`` for a, b [..., W] of one shape (W a power of two)."""
    if a.shape != b.shape or a.shape[-1] & (a.shape[-1] - 1):
        raise ValueError(f"expected two tensors of one shape [..., power of two], got "
                         f"{list(a.shape)} and {list(b.shape)}")
    width = a.shape[-1]
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty(a.shape[:-1], dtype=torch.float32, device=a.device)
    n = out.numel()
    if n:
        _row_dots[(triton.cdiv(n, ROWS),)](a, b, out, n, WIDTH=width, ROWS=ROWS, num_warps=4)
    return out
