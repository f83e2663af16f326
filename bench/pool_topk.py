"""The indexer's top-k at the 1M share on one GPU: ``torch.topk`` over a query block's whole
[queries x pools] scores (what ``pool_topk.fused_pool_topk`` runs) against an exact two-stage
top-k (each chunk of pools' own top-k, then the top-k of those). The two-stage one lost at every
chunk size (bench/results/h200_pool_topk/), so the layer keeps ``torch.topk``.

Shape: one block of 1,024 queries over the 262,144 pools of a 1M-token sequence (fp32 scores,
the last 1% of pools -inf as a causal tail), top 512 pools. Each variant's time is the median of
``--iters`` calls after a warm-up; the selected pool sets are compared with ``torch.topk``'s
(as sets per query: the order among equal scores is not part of either).

Usage (CUDA):  python3 bench/pool_topk.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from kda_layer import timed  # bench/ is on sys.path when run as a script


def chunked_topk(scores: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k, dim=-1)``'s values and ids, exactly, in two stages: each run of
    ``chunk`` columns' own top-k, then the top-k of those candidates (every column of the top-k
    is in its chunk's top-k); ``scores``' width a multiple of ``chunk``."""
    n, width = scores.shape
    values, ids = scores.view(n, width // chunk, chunk).topk(k, dim=-1)
    ids = ids + torch.arange(0, width, chunk, device=scores.device)[:, None]
    best, order = values.flatten(1).topk(k, dim=-1)
    return best, ids.flatten(1).gather(1, order)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--pools", type=int, default=262144)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--json", default="")
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.randn(a.queries, a.pools, generator=g, device="cuda").relu_()  # weighted ReLU: many zeros
    scores[:, -a.pools // 100:] = float("-inf")
    reference = scores.topk(a.k, dim=-1)
    ref_sets = reference.indices.sort(-1).values
    runs = [{"variant": "torch.topk", "ms": timed(lambda: scores.topk(a.k, dim=-1), 1, a.iters)[0]}]
    for chunk in (2048, 4096, 8192, 16384):
        values, indices = chunked_topk(scores, a.k, chunk)
        same_values = torch.equal(values.sort(-1).values, reference.values.sort(-1).values)
        same_sets = float((indices.sort(-1).values == ref_sets).all(-1).float().mean())
        ms = timed(lambda: chunked_topk(scores, a.k, chunk), 1, a.iters)[0]
        runs.append({"variant": f"two-stage, chunks of {chunk}", "ms": ms,
                     "same_values": same_values, "same_pool_sets": same_sets})
    for r in runs:
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"queries": a.queries, "pools": a.pools, "k": a.k, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
