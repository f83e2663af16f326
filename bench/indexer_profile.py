"""Where the fused indexer's time goes at the 1M recipe's rank share: ``torch.profiler`` over one
pass of ``dsa_rank_share.py``'s indexer (65,536 queries, 64 blocks of 1,024 over 262,144 pools)
after a warm-up pass, per score precision, the CUDA kernels sorted by their total time. Then the
pass's wall time (synchronised, outside the profiler) against the sum of its kernels' times: the
difference is the time the GPU waits for the host. The FP8 pass runs three times: with the pool
keys quantised once per pass (``SparseMLAOps.index_keys``, the layer's way); for comparison, once
per query block inside the score kernel's call; with the top-k's floor and final pick by
``torch.topk`` (``threshold_topk``'s way before its own selection kernels); and with each
block's query quantisation and token indices by torch (``index_scores.fp8_rows_reference``,
``pools.pool_token_indices``: about 25 small kernels a block, where our Triton programs take
two). ``--gluon`` adds
passes with the Gluon score kernel of ``bench/index_scores_gluon.py`` in place of the Triton
one (each precision; its overlapped variant with groups of 32 and of 16 pools, the top-k then
taking groups of 16, and its plain variant).

Usage (CUDA + tilelang):  python3 bench/indexer_profile.py [--gluon]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from functools import partial

import torch
from dsa_rank_share import indexer, make_inputs  # bench/ is on sys.path when run as a script
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from skyrl_megatron_kda.dsa import pool_topk
from skyrl_megatron_kda.dsa.ops import index_scores
from skyrl_megatron_kda.dsa.ops.index_scores import fp8_rows, fp8_rows_reference, keys_as_they_are
from skyrl_megatron_kda.dsa.ops.latent.interface import latent_sparse_mla_ops
from skyrl_megatron_kda.dsa.pools import pool_token_indices, write_pool_tokens
from skyrl_megatron_kda.dsa.ops.threshold_topk import (
    CANDIDATES_PER_PICK,
    floor_topk,
    grouped_compact_kernel,
)

KEYS, BLOCK, WALL_PASSES = 1 << 20, 1024, 3
GLUON_VARIANTS = (dict(group=32, stages=4, overlap=True, query_tile=4),
                  dict(group=16, stages=4, overlap=True, query_tile=4),
                  dict(group=32, stages=3, overlap=False, query_tile=4))


def wall_ms(fn) -> float:
    """The fastest of WALL_PASSES synchronised passes."""
    best = float("inf")
    for _ in range(WALL_PASSES):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def write_tokens_by_torch(out, pool_ids, starts, q_pos, doc_start, kpool):
    """``pools.write_pool_tokens`` by the torch function on the GPU too."""
    out.copy_(pool_token_indices(pool_ids, starts, q_pos, doc_start, kpool, checked=False))


def floor_topk_by_torch(scores, group_max, group, k, capacity=None):
    """``threshold_topk.floor_topk`` with its floor and its final pick by ``torch.topk``."""
    capacity = capacity or CANDIDATES_PER_PICK * k
    if k > group_max.shape[1] or scores.shape[1] <= capacity:
        return floor_topk(scores, group_max, group, k, capacity)
    floor = group_max.topk(k, dim=-1).values[:, -1]
    values, ids, count = grouped_compact_kernel(scores, group_max, group, floor, capacity)
    best, slot = values.topk(k, dim=-1, sorted=False)
    return best, ids.gather(1, slot).long(), count > capacity


def gluon_variants(kernels: dict) -> dict:
    """The precisions' kernel sets with the Gluon score kernel's variants as their scorers."""
    from index_scores_gluon import gluon_fp8_pool_scores, gluon_pool_scores

    scorers = {"bf16": gluon_pool_scores, "fp8": gluon_fp8_pool_scores}
    return {f"{precision}, Gluon scores {variant}": replace(
                kernels[precision], index_scores=partial(scorers[precision], **variant),
                index_group=variant["group"])
            for precision in scorers for variant in GLUON_VARIANTS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gluon", action="store_true",
                   help="also the Gluon score kernel (bench/index_scores_gluon.py)")
    a = p.parse_args()
    x = make_inputs(KEYS, "sequence", torch.device("cuda"))
    base = {precision: latent_sparse_mla_ops(indexer_scores=precision) for precision in ("bf16", "fp8")}
    variants = {**base, "fp8, keys quantised per block": replace(base["fp8"],
                                                                 index_keys=keys_as_they_are)}
    variants["fp8, torch.topk's floor and pick"] = base["fp8"]
    variants["fp8, torch's quantisation and token indices"] = base["fp8"]
    if a.gluon:
        variants.update(gluon_variants(base))
    for name, kernels in variants.items():
        pool_topk.floor_topk = floor_topk_by_torch if "torch.topk" in name else floor_topk
        by_torch = "torch's quantisation" in name
        index_scores.fp8_rows = fp8_rows_reference if by_torch else fp8_rows
        pool_topk.write_pool_tokens = write_tokens_by_torch if by_torch else write_pool_tokens
        with torch.no_grad():
            def one_pass():
                indexer(x, KEYS, "latent", BLOCK, kernels)
            one_pass()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                one_pass()
                torch.cuda.synchronize()
            kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()
                            if e.device_type == DeviceType.CUDA) / 1e3
            wall = wall_ms(one_pass)
        print("==", name)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                        max_name_column_width=60))
        print(f"{name}: kernels {kernel_ms:.1f} ms, wall {wall:.1f} ms "
              f"(best of {WALL_PASSES}), GPU waits for the host {wall - kernel_ms:.1f} ms")


if __name__ == "__main__":
    main()
