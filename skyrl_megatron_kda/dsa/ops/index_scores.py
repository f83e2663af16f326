"""GLM's lightning-indexer pool scores as one Triton kernel (the fused DSA kernel's indexer).

For queries q [n, heads, d] with head weights w [n, heads] and pooled keys k [P, d], the score of
pool p for query i is ``sum_h w[i, h] * relu(q[i, h] . k[p])``; pools outside the query's visible
range [ks[i], ke[i]) score -inf. A kernel program holds a few queries' heads (QT x heads rows of
q) in shared memory and walks the pools their ranges cover, PT at a time (loads pipelined): one
tensor-core product [PT pools x d] @ [d x QT * heads] per step puts the heads along the
product's columns, so the relu, the weight and the sum over a query's heads stay in the
registers of the threads that hold those columns (a few shuffles, no shared memory), and the
[queries x heads x pools] products are never written. Pools outside the walk only get -inf
written. Each program also writes the maxima of its rows over groups of ``GROUP`` pools
(``threshold_topk`` takes its exact top-k's floor from them, so the scores are not read again
for it). Holding the queries' heads along the columns means each query head is read once per
program, not once per pool tile.

megatron-core 0.19.2 has the same computation as a TileLang kernel (``indexer_fwd_interface``),
whose programs cover 4 queries each and write their scores one by one; this kernel replaces it
(docs/benchmarks.md compares them). It has the same contract (``SparseMLAOps.index_scores``) and
is tested against an fp32 torch reference on the GPU, its FP8 form also under Triton's CPU
interpreter (tests/test_fused_sparse_mla.py).

``fp8_pool_scores`` (``model.dsa.latent.indexer_scores=fp8``) runs the same kernel on FP8 (e4m3)
products, as DeepSeek-V3.2's lightning indexer does: each query head and each pool are scaled
to FP8's range by their own absolute maximum, and since ``relu(a * b * x) = a * b * relu(x)`` for
positive scales, the query heads' scales fold into the head weights and the pools' scales
multiply each finished score, so the kernel's inner loop is unchanged; the pool keys are
quantised once per indexer pass (``FP8Keys``), not once per query block. Hopper's FP8 tensor
cores run twice the bf16 rate; the scores carry FP8's rounding (3 mantissa bits per factor), so
pools that score close to the k-th may be chosen differently (docs/benchmarks.md measures how
often).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

TILES = (4, 64, 4, 3)
"""Queries per program, pools per step of its loop, its warps and pipeline stages (bf16): the
fastest of ``bench/index_scores.py``'s sweep (docs/benchmarks.md)."""
FP8_TILES = (4, 128, 4, 3)
"""The same for FP8 products (twice the pools per step for the same bytes)."""
GROUP = 32
"""Pools per maximum written beside the scores (a divisor of every tile's pool count)."""
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
FP8_STEP = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))
"""1 / FP8_MAX in fp32: a row's scale is its absolute maximum times this, one IEEE product that
torch on CPU and CUDA and our kernel all round alike (torch's CUDA division by a number
multiplies by its reciprocal, its CPU division divides)."""


@triton.jit
def _store_scores(out_ptr, max_ptr, rows, row_ok, p0, scores, n_pools, n_groups,
                  PT: tl.constexpr, QT: tl.constexpr, GROUP: tl.constexpr):
    """Write the scores of pools p0 .. p0 + PT for the queries ``rows`` ([PT, QT]) to out [n, P]
    and their maxima over groups of GROUP pools."""
    pools = p0 + tl.arange(0, PT)
    pool_ok = pools < n_pools
    tl.store(out_ptr + rows[None, :].to(tl.int64) * n_pools + pools[:, None], scores,
             mask=row_ok[None, :] & pool_ok[:, None])
    groups = p0 // GROUP + tl.arange(0, PT // GROUP)
    group_max = tl.max(tl.reshape(scores, (PT // GROUP, GROUP, QT)), axis=1)
    tl.store(max_ptr + rows[None, :].to(tl.int64) * n_groups + groups[:, None], group_max,
             mask=row_ok[None, :] & (groups < n_groups)[:, None])


@triton.jit
def _pool_scores(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, kscale_ptr, out_ptr, max_ptr, n_queries,
                 n_pools, n_groups, HEADS: tl.constexpr, HP: tl.constexpr, DIM: tl.constexpr,
                 QT: tl.constexpr, PT: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr,
                 KEY_SCALES: tl.constexpr):
    first = tl.program_id(0) * QT
    rows = first + tl.arange(0, QT)
    row_ok = rows < n_queries
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=2147483647)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    # The program's queries' heads are the product's columns (HP: heads padded to a power of
    # two), so summing a query's heads adds columns each thread holds: no shared memory.
    col = tl.arange(0, QT * HP)
    query, head = first + col // HP, col % HP
    col_ok = (query < n_queries) & (head < HEADS)
    pair = query.to(tl.int64) * HEADS + head
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + pair[:, None] * DIM + dims[None, :], mask=col_ok[:, None], other=0.0)
    w = tl.load(w_ptr + pair, mask=col_ok, other=0.0)
    lo = tl.min(ks, axis=0) // PT * PT
    hi = tl.cdiv(tl.max(ke, axis=0), PT) * PT
    lo = tl.minimum(lo, hi)
    hidden = tl.full((PT, QT), float("-inf"), tl.float32)
    for p0 in range(0, lo, PT):
        _store_scores(out_ptr, max_ptr, rows, row_ok, p0, hidden, n_pools, n_groups, PT, QT, GROUP)
    for p0 in tl.range(lo, hi, PT, num_stages=STAGES):
        pools = p0 + tl.arange(0, PT)
        k = tl.load(k_ptr + pools[:, None].to(tl.int64) * DIM + dims[None, :],
                    mask=(pools < n_pools)[:, None], other=0.0)
        s = tl.maximum(tl.dot(k, tl.trans(q)), 0.0) * w[None, :]
        scores = tl.sum(tl.reshape(s, (PT, QT, HP)), axis=2)
        if KEY_SCALES:
            scores *= tl.load(kscale_ptr + pools, mask=pools < n_pools, other=0.0)[:, None]
        visible = (pools[:, None] >= ks[None, :]) & (pools[:, None] < ke[None, :])
        _store_scores(out_ptr, max_ptr, rows, row_ok, p0,
                      tl.where(visible, scores, float("-inf")), n_pools, n_groups, PT, QT, GROUP)
    for p0 in range(hi, n_pools, PT):
        _store_scores(out_ptr, max_ptr, rows, row_ok, p0, hidden, n_pools, n_groups, PT, QT, GROUP)


def pool_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, ks: torch.Tensor,
                ke: torch.Tensor, tiles: tuple[int, int, int, int] = TILES,
                group: int = GROUP, key_scales: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, heads, d] and keys [P, d] (bf16 on CUDA), weights [n, heads] fp32, ks/ke [n] int32
    -> fp32 scores [n, P]: sum over heads of weights * relu(q . k), -inf outside [ks, ke); and
    fp32 maxima [n, ceil(P / group)] of the scores over consecutive groups of ``group`` pools.
    ``tiles``: queries per program (a power of two; times the heads rounded up to a power of
    two, at least 16: the product's columns), pools per step, warps and pipeline stages
    (``bench/index_scores.py`` times them); ``group`` divides the pools per step.
    ``key_scales`` [P] fp32: q and keys are FP8 (e4m3) and each pool's score is multiplied by
    its scale (``fp8_pool_scores``)."""
    n, heads, dim = q.shape
    if keys.dim() != 2 or keys.shape[1] != dim or weights.shape != (n, heads):
        raise ValueError(f"expected q [n, h, d], keys [P, d], weights [n, h]; got "
                         f"{list(q.shape)}, {list(keys.shape)}, {list(weights.shape)}")
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"the index head width must be a power of two >= 16, got {dim}")
    query_tile, pool_tile, warps, stages = tiles
    columns = query_tile * triton.next_power_of_2(heads)
    if query_tile & (query_tile - 1) or columns < 16:
        raise ValueError(f"queries per program must be a power of two with queries x heads "
                         f"(rounded up to a power of two) >= 16, got {query_tile} x {heads}")
    if pool_tile % group:
        raise ValueError(f"the maxima's group ({group}) must divide the tile's pools ({pool_tile})")
    if key_scales is None:
        q, keys = q.to(torch.bfloat16).contiguous(), keys.to(torch.bfloat16).contiguous()
    elif q.dtype != FP8 or keys.dtype != FP8 or key_scales.shape != keys.shape[:1]:
        raise ValueError(f"key_scales [P] come with FP8 (e4m3) q and keys, got {q.dtype}, "
                         f"{keys.dtype}, scales {list(key_scales.shape)}")
    out = torch.empty(n, keys.shape[0], dtype=torch.float32, device=q.device)
    maxima = torch.empty(n, -(-keys.shape[0] // group), dtype=torch.float32, device=q.device)
    if n == 0 or keys.shape[0] == 0:
        return out, maxima
    scaled = key_scales is not None  # unscaled: the kernel never reads its scale pointer
    _pool_scores[(triton.cdiv(n, query_tile),)](
        q.contiguous(), keys.contiguous(), weights.float().contiguous(), ks.contiguous(),
        ke.contiguous(), key_scales.float().contiguous() if scaled else out, out, maxima, n,
        keys.shape[0], maxima.shape[1], HEADS=heads, HP=triton.next_power_of_2(heads), DIM=dim,
        QT=query_tile, PT=pool_tile, STAGES=stages, GROUP=group, KEY_SCALES=scaled,
        num_warps=warps)
    return out, maxima


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (x / scale as FP8 e4m3, scale [...] fp32): each row scaled by its absolute
    maximum to FP8's largest value (an all-zero row keeps scale 1). On CUDA one Triton program
    per ``FP8_ROWS`` rows (``fp8_rows_kernel``: the same bits, one launch where torch takes
    about eight per query block); elsewhere ``fp8_rows_reference``."""
    if x.is_cuda and _fp8_kernel_takes(x.shape[-1]):
        return fp8_rows_kernel(x)
    return fp8_rows_reference(x)


def fp8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(-1).float()
    scale = torch.where(amax > 0, amax * FP8_STEP, 1.0)
    return (x.float() / scale[..., None]).to(FP8), scale


FP8_ROWS = 16
"""Rows per program of ``fp8_rows_kernel``."""


def _fp8_kernel_takes(width: int) -> bool:
    """``fp8_rows_kernel`` holds a row as one Triton block: a power-of-two width of at least 16."""
    return width >= 16 and not width & (width - 1)


@triton.jit
def _fp8_rows(x_ptr, q_ptr, scale_ptr, n_rows, fp8_step, DIM: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DIM)
    inside = (r < n_rows)[:, None]
    x = tl.load(x_ptr + r[:, None] * DIM + d[None, :], mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # the reference's product and IEEE division: its scales and FP8 values bit for bit
    scale = tl.where(amax > 0, amax * fp8_step, 1.0)
    v = tl.math.div_rn(x, scale[:, None])
    # Rounded to e4m3's grid here (to nearest, ties to even, as torch's cast), so the cast below
    # only converts values it holds exactly, the same on the GPU and in Triton's interpreter
    # (whose own cast rounds otherwise): adding and taking away 2^(23 + g) rounds |v| to a
    # multiple of 2^g, the grid's step in |v|'s binade (3 mantissa bits; below 2^-6, the
    # subnormals' step 2^-9). Then v's sign bit, so -0.0 stays -0.0.
    bits = v.to(tl.int32, bitcast=True)
    binade = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((binade - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True)
    a = tl.abs(v)
    rounded = ((a + magic) - magic).to(tl.int32, bitcast=True) | (bits & -2147483648)
    q = rounded.to(tl.float32, bitcast=True).to(tl.float8e4nv)
    tl.store(q_ptr + r[:, None] * DIM + d[None, :], q, mask=inside)
    tl.store(scale_ptr + r, scale, mask=r < n_rows)


def fp8_rows_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_rows_reference`` in one Triton launch (rows of a power-of-two width >= 16)."""
    d = x.shape[-1]
    if not _fp8_kernel_takes(d):
        raise ValueError(f"fp8_rows_kernel takes rows of a power-of-two width >= 16, got {d}")
    flat = x.reshape(-1, d).contiguous()
    q = torch.empty(flat.shape, dtype=FP8, device=x.device)
    scale = torch.empty(flat.shape[0], dtype=torch.float32, device=x.device)
    if flat.shape[0]:
        _fp8_rows[(triton.cdiv(flat.shape[0], FP8_ROWS),)](flat, q, scale, flat.shape[0],
                                                         FP8_STEP, DIM=d, ROWS=FP8_ROWS, num_warps=4)
    return q.view(x.shape), scale.view(x.shape[:-1])


class FP8Keys(NamedTuple):
    """Pool keys quantised once per indexer pass (``fp8_keys``) for every query block that
    scores a range of them: FP8 (e4m3) rows [P, d] and their fp32 scales [P]. A pool's scale is
    its own row's, so a range of these is the range quantised alone."""

    values: torch.Tensor
    scales: torch.Tensor

    def __getitem__(self, pools: slice) -> FP8Keys:  # a range of pools, as a tensor's rows
        return FP8Keys(self.values[pools], self.scales[pools])


def fp8_keys(keys: torch.Tensor) -> FP8Keys:
    return FP8Keys(*fp8_rows(keys))


def fp8_pool_scores(q: torch.Tensor, keys: torch.Tensor | FP8Keys, weights: torch.Tensor,
                    ks: torch.Tensor, ke: torch.Tensor,
                    tiles: tuple[int, int, int, int] = FP8_TILES, group: int = GROUP
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool_scores`` on FP8 products (the module docstring): each query head's scale goes into
    its weight, each pool's multiplies its score; ``keys`` bf16 (quantised here) or
    ``FP8Keys``."""
    q8, q_scale = fp8_rows(q)
    keys = keys if isinstance(keys, FP8Keys) else fp8_keys(keys)
    return pool_scores(q8, keys.values, weights.float() * q_scale, ks, ke, tiles, group,
                       keys.scales)


def keys_as_they_are(keys: torch.Tensor) -> torch.Tensor:
    return keys


class Scoring(NamedTuple):
    """A score precision: ``keys`` prepares the pass's pool keys once
    (``SparseMLAOps.index_keys``), ``scores`` is the score kernel on them
    (``SparseMLAOps.index_scores``)."""

    keys: Callable
    scores: Callable


INDEXER_SCORES = {"bf16": Scoring(keys_as_they_are, pool_scores),
                  "fp8": Scoring(fp8_keys, fp8_pool_scores)}
"""``model.dsa.latent.indexer_scores`` -> the score kernel of the fused and latent kernel sets."""
