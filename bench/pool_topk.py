"""The indexer's top-k at the 1M share on one GPU: ``torch.topk`` over a query block's whole
[queries x pools] scores, sorted and not, against four exact candidates that never run one
top-k over a whole row: a Triton radix select per row (``radix_topk.row_topk_ids``),
``chunked_topk`` (the best chunks by their maxima, then the best columns of those; stable-sort
ties) at three chunk sizes, a two-stage top-k (each chunk's own top-k, then the top-k of those)
and the layer's ``threshold_topk.threshold_topk`` (a floor from group maxima that the score
kernel writes, a compaction of the groups that reach it and of their scores, a top-k over those)
at four group widths.
The first three lost to ``torch.topk`` on an H200 (bench/results/h200_pool_topk/).

Shape: one block of 1,024 queries over the 262,144 pools of a 1M-token sequence (fp32 scores,
the last 1% of pools -inf as a causal tail), top 512 pools. Two score distributions: ``relu``
(half the pools score exactly 0, as a weighted ReLU with few heads can) and ``sum`` (a sum of 32
ReLUs with random signs: few ties). Each variant's time is the median of ``--iters`` calls after
a warm-up. ``row_topk_ids`` and ``chunked_topk`` are compared with a stable descending sort
(their contract: the same ids, ascending for ``row_topk_ids``, by score for ``chunked_topk``);
``torch.topk`` and the two-stage top-k by their pool sets per query (they order equal scores in
any way).

Each ``threshold_topk`` row also times its steps: the floor and the final pick by our Triton
programs against ``torch.topk``, and the grouped compaction; ``--gather-sweep`` times that
compaction at other scores per step and warp counts (maxima of 32, the layer's), and
``--threshold-only`` leaves out the variants that lost.

Usage (CUDA):  python3 bench/pool_topk.py [--threshold-only] [--gather-sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from kda_layer import timed  # bench/ is on sys.path when run as a script
from radix_topk import reference_row_topk_ids, row_topk_ids

from skyrl_megatron_kda.dsa.ops.threshold_topk import (
    CANDIDATES_PER_PICK,
    compact_kernel,
    group_maxima,
    grouped_compact_kernel,
    kth_largest_kernel,
    kth_largest_reference,
    pick_kernel,
    threshold_topk,
)


def order_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is fp32 ``values`` descending, then ``ids`` (in
    [0, 2**32)) ascending: a total order, so a top-k over them keeps the earlier id among equal
    values, as a stable descending sort does. -0.0 counts as 0.0."""
    bits = (values.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # float order as int order
    return (ordered << 32) | (0xFFFFFFFF - ids.long())


def chunked_topk(scores: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly ``scores.sort(dim=-1, descending=True, stable=True)[..., :k]`` (values, ids) of
    fp32 ``scores`` [n, P], searching only the ``k`` chunks of ``chunk`` columns with the best
    maxima: no other chunk can hold one of the ``k`` best columns, since each of those chunks has
    a column that outranks its maximum. At 262,144 pools, k = 512 and chunks of 32 that is two
    top-ks over 8,192 and 16,384 keys instead of one over 262,144."""
    n, width = scores.shape
    n_chunks, full = -(-width // chunk), width // chunk
    chunk_max = scores.new_full((n, n_chunks), float("-inf"))
    chunk_max[:, :full] = scores.unfold(1, chunk, chunk).amax(dim=-1)  # a view, not a copy
    if full < n_chunks:
        chunk_max[:, full] = scores[:, full * chunk:].amax(dim=-1)
    chunk_ids = torch.arange(n_chunks, device=scores.device).expand(n, -1)
    best_chunks = order_keys(chunk_max, chunk_ids).topk(min(k, n_chunks), dim=-1).indices
    cols = (best_chunks[..., None] * chunk + torch.arange(chunk, device=scores.device)).flatten(1)
    # Columns past the row's end rank after every real one (-inf with larger ids), and the
    # candidates hold at least k real columns, so none is chosen.
    past_end = cols >= width
    values = scores.gather(1, cols.clamp(max=width - 1)).masked_fill(past_end, float("-inf"))
    best = order_keys(values, cols).topk(k, dim=-1).indices
    return values.gather(1, best), cols.gather(1, best)


def per_chunk_topk(scores: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k, dim=-1)``'s values and ids, exactly, in two stages: each run of
    ``chunk`` columns' own top-k, then the top-k of those candidates (every column of the top-k
    is in its chunk's top-k); ``scores``' width a multiple of ``chunk``."""
    n, width = scores.shape
    values, ids = scores.view(n, width // chunk, chunk).topk(k, dim=-1)
    ids = ids + torch.arange(0, width, chunk, device=scores.device)[:, None]
    best, order = values.flatten(1).topk(k, dim=-1)
    return best, ids.flatten(1).gather(1, order)


def make_scores(kind: str, queries: int, pools: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    if kind == "relu":
        scores = torch.randn(queries, pools, generator=g, device="cuda").relu_()
    else:
        scores = torch.zeros(queries, pools, device="cuda")
        for _ in range(32):
            w = torch.randn(queries, 1, generator=g, device="cuda")
            scores += w * torch.randn(queries, pools, generator=g, device="cuda").relu_()
    scores[:, -pools // 100:] = float("-inf")
    return scores


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--pools", type=int, default=262144)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--json", default="")
    p.add_argument("--threshold-only", action="store_true",
                   help="only torch.topk and threshold_topk")
    p.add_argument("--gather-sweep", action="store_true",
                   help="the grouped compaction at other scores per step and warp counts")
    a = p.parse_args()
    runs = []
    for kind in ("relu", "sum"):
        scores = make_scores(kind, a.queries, a.pools)
        stable = scores.sort(dim=-1, descending=True, stable=True)
        ref_values, ref_ids = stable.values[:, : a.k], stable.indices[:, : a.k]
        ref_sets = ref_ids.sort(-1).values
        del stable
        first = len(runs)
        if not a.threshold_only:
            losers(a, scores, kind, ref_values, ref_ids, ref_sets, runs)
        else:
            ms = timed(lambda: scores.topk(a.k, dim=-1, sorted=False), 1, a.iters)[0]
            runs.append({"scores": kind, "variant": "torch.topk, sorted=False", "ms": ms})
        threshold_rows(a, scores, kind, ref_values, ref_sets, runs)
        for r in runs[first:]:
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"queries": a.queries, "pools": a.pools, "k": a.k, "runs": runs}, f, indent=1)


def losers(a, scores, kind, ref_values, ref_ids, ref_sets, runs) -> None:
    """``torch.topk`` and the exact top-ks that lost to it."""
    ms = timed(lambda: scores.topk(a.k, dim=-1), 1, a.iters)[0]
    got = scores.topk(a.k, dim=-1).indices.sort(-1).values
    runs.append({"scores": kind, "variant": "torch.topk", "ms": ms,
                 "same_pool_sets": float((got == ref_sets).all(-1).float().mean())})
    ms = timed(lambda: row_topk_ids(scores, a.k), 1, a.iters)[0]
    runs.append({"scores": kind, "variant": "row_topk_ids (radix select)", "ms": ms,
                 "equals_stable_sort": bool(torch.equal(row_topk_ids(scores, a.k),
                                                        reference_row_topk_ids(scores, a.k)))})
    ms = timed(lambda: scores.topk(a.k, dim=-1, sorted=False), 1, a.iters)[0]
    got = scores.topk(a.k, dim=-1, sorted=False).indices.sort(-1).values
    runs.append({"scores": kind, "variant": "torch.topk, sorted=False", "ms": ms,
                 "same_pool_sets": float((got == ref_sets).all(-1).float().mean())})
    for chunk in (16, 32, 64):
        values, ids = chunked_topk(scores, a.k, chunk)
        ms = timed(lambda: chunked_topk(scores, a.k, chunk), 1, a.iters)[0]
        runs.append({"scores": kind, "variant": f"chunked_topk, chunks of {chunk}", "ms": ms,
                     "equals_stable_sort": bool(torch.equal(ids, ref_ids)
                                                and torch.equal(values, ref_values))})
    for chunk in (4096, 16384):
        _, ids = per_chunk_topk(scores, a.k, chunk)
        ms = timed(lambda: per_chunk_topk(scores, a.k, chunk), 1, a.iters)[0]
        runs.append({"scores": kind, "variant": f"two-stage, chunks of {chunk}", "ms": ms,
                     "same_pool_sets": float((ids.sort(-1).values == ref_sets)
                                             .all(-1).float().mean())})


def threshold_rows(a, scores, kind, ref_values, ref_sets, runs) -> None:
    """``threshold_topk`` at four group widths, its steps timed, and the gather sweep."""
    for group in (16, 32, 64, 128):  # the score kernel writes the maxima: not timed here
        maxima = group_maxima(scores, group)
        values, ids = threshold_topk(scores, maxima, group, a.k)
        ms = timed(lambda: threshold_topk(scores, maxima, group, a.k), 1, a.iters)[0]
        cap = CANDIDATES_PER_PICK * a.k
        floor = maxima.topk(a.k, dim=-1).values[:, -1]
        floor_ms = timed(lambda: maxima.topk(a.k, dim=-1).values[:, -1], 1, a.iters)[0]
        kept = grouped_compact_kernel(scores, maxima, group, floor, cap)
        kept_ms = timed(lambda: grouped_compact_kernel(scores, maxima, group, floor, cap), 1,
                        a.iters)[0]
        whole_ms = timed(lambda: compact_kernel(scores, floor, cap), 1, a.iters)[0]
        final_ms = timed(lambda: kept[0].topk(a.k, dim=-1, sorted=False), 1, a.iters)[0]
        floor_kernel_ms = timed(lambda: kth_largest_kernel(maxima, a.k), 1, a.iters)[0]
        pick_ms = timed(lambda: pick_kernel(kept[0], kept[1], a.k), 1, a.iters)[0]
        runs.append({"scores": kind, "variant": f"threshold_topk, maxima of {group}",
                     "ms": ms, "same_pool_sets": float((ids.sort(-1).values == ref_sets)
                                                       .all(-1).float().mean()),
                     "same_values": bool(torch.equal(values.sort(-1, descending=True).values,
                                                     ref_values)),
                     "floor_ms": floor_ms, "grouped_compaction_ms": kept_ms,
                     "whole_row_compaction_ms": whole_ms, "final_topk_ms": final_ms,
                     "floor_kernel_ms": floor_kernel_ms, "pick_kernel_ms": pick_ms,
                     "floor_kernel_equal": bool(torch.equal(
                         kth_largest_kernel(maxima, a.k), kth_largest_reference(maxima, a.k))),
                     "candidates_mean": float(kept[2].float().mean()),
                     "candidates_max": float(kept[2].max())})
        if group == 32 and a.gather_sweep:
            gather_sweep(a, scores, maxima, floor, kept, kind, runs)


def gather_sweep(a, scores, maxima, floor, kept, kind, runs) -> None:
    """The grouped compaction at maxima of 32 with other scores per step and warp counts, each
    against the default's output."""
    cap = CANDIDATES_PER_PICK * a.k
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            def compact():
                return grouped_compact_kernel(scores, maxima, 32, floor, cap, block, warps)
            got = compact()
            runs.append({"scores": kind, "variant": f"grouped compaction, {block} scores a step, "
                         f"{warps} warps", "ms": timed(compact, 1, a.iters)[0],
                         "equal": all(torch.equal(x, y) for x, y in zip(got, kept))})


if __name__ == "__main__":
    main()
