"""The indexer's pool-score kernel (``dsa/ops/index_scores.py``) and ``torch.topk`` at the 1M
recipe's rank share, per tile configuration, on one GPU.

One block of ``--queries`` indexer queries (32 heads x 128) nearest the end of a 1,048,576-token
sequence scores all 262,144 pools (the most a block of the rank sees); each configuration of
(query tile, pool tile, warps, stages) is timed after a compile call and checked against the
default configuration's bf16 scores; ``--precision bf16,fp8`` also sweeps the FP8 products
(``fp8_pool_scores``, ``model.dsa.latent.indexer_scores=fp8``, its quantisation included in its
time).
FLOPs: 2 x queries x pools x heads x head width (every pool is visible to the last block, so the
causal skip saves nothing here).

Usage (CUDA):  python3 bench/index_scores.py [--queries 1024] [--precision bf16,fp8] [--stages 3]
               [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from skyrl_megatron_kda.dsa.ops.index_scores import FP8_TILES, INDEXER_SCORES, TILES, pool_scores

HEADS, DIM, POOLS, TOPK_POOLS = 32, 128, 262144, 512
DEFAULTS = {"bf16": TILES, "fp8": FP8_TILES}


def timed(fn, repeats: int = 3) -> tuple[torch.Tensor, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return out, best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--precision", default="bf16", help="comma list of bf16, fp8")
    p.add_argument("--stages", default="3",
                   help="comma list of pipeline stages to sweep (two stages fit a second "
                        "program of 8 queries per SM)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    stages = tuple(int(n) for n in a.stages.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.queries, HEADS, DIM, generator=g, device="cuda").to(torch.bfloat16)
    keys = torch.randn(POOLS, DIM, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.rand(a.queries, HEADS, generator=g, device="cuda") * HEADS ** -0.5
    ks = torch.zeros(a.queries, dtype=torch.int32, device="cuda")
    ke = torch.full_like(ks, POOLS)
    flops = 2 * a.queries * POOLS * HEADS * DIM
    ref = pool_scores(q, keys, w, ks, ke)[0]
    _, t_topk = timed(lambda: ref.topk(TOPK_POOLS, dim=-1))
    ref_picks = ref.topk(TOPK_POOLS, dim=-1).indices.sort(-1).values
    rows = []
    for precision in a.precision.split(","):
        scorer = INDEXER_SCORES[precision].scores
        for tiles in itertools.product((2, 4, 8), (64, 128), (4, 8), stages):
            try:
                scorer(q, keys, w, ks, ke, tiles)  # compiles
                (out, _), ms = timed(lambda: scorer(q, keys, w, ks, ke, tiles))
            except Exception as err:  # noqa: BLE001 - a tile that does not fit in shared memory
                print(f"{precision} {tiles}: {type(err).__name__}: "
                      f"{str(err).splitlines()[0][:100]}", flush=True)
                continue
            picks = out.topk(TOPK_POOLS, dim=-1).indices.sort(-1).values
            same = torch.searchsorted(ref_picks, picks).clamp(max=TOPK_POOLS - 1)
            rows.append(dict(precision=precision, tiles=tiles, ms=ms, tflops=flops / ms / 1e9,
                             rel_vs_bf16_default=float((out - ref).norm() / ref.norm()),
                             same_picks_as_bf16=float((ref_picks.gather(-1, same) == picks)
                                                      .float().mean()),
                             default=tiles == DEFAULTS[precision]))
            print(json.dumps(rows[-1]), flush=True)
    per = {}
    for precision in a.precision.split(","):
        mine = [r for r in rows if r["precision"] == precision]
        best, default = min(mine, key=lambda r: r["ms"]), next(r for r in mine if r["default"])
        per[precision] = dict(default=default, best=best, best_speedup=default["ms"] / best["ms"])
    summary = dict(queries=a.queries, pools=POOLS, heads=HEADS, dim=DIM, topk_ms=t_topk, **per)
    print("summary " + json.dumps(summary), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(summary, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
