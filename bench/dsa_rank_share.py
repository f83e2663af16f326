"""One GLM-5.3-Flash DSA layer's attention core at a rank's share of the 1M recipe, on one GPU.

The 1M recipe (TP8 x CP2 +SP) gives each rank, per DSA layer, either (``--split heads``) all
524,288 query rows of its CP rank with its 8 heads, or (``--split sequence``, an all-to-all inside
TP) its own 65,536 rows with all 64 heads; the keys are the whole 1,048,576-token sequence. This
runs that rank's work with the model's own functions on random data of GLM's sizes:

* indexer: pooled keys (``pools.pooled_keys``), per query block the indexer scores and
  top-k (``pool_topk.fused_pool_topk`` on our Triton scores, ``index_scores.py``, and the
  floor's exact top-k, ``threshold_topk.py``; or the torch ``blocked_pool_topk``; the last
  block is also scored by megatron-core's TileLang indexer kernel and its top-k taken by
  ``torch.topk``, for their times) and the token indices (``pools.pool_token_indices``);
* sparse attention: ``fused_sparse_mla.fused_absorbed_sparse_mla`` on megatron-core's TileLang
  kernels (``--kernel fused``) or ours (``latent``, ``latent_sparse_mla.py``), or
  ``sparse_mla.absorbed_sparse_mla`` (torch), forward and backward.

The rank is CP rank 0 of a zigzag layout (its rows: the first and the last quarter of the
sequence); with ``--split sequence`` it is that CP rank's last TP slice, the rows nearest the end
(the most visible pools: the slowest TP rank sets the step). One step under full recompute is the
checkpointed forward, the recompute forward and the backward: indexer + 2 x attention forward +
attention backward (the indexer has no backward, and the recompute attends with the forward's
kept selection: ``train.keep_dsa_selection``; ``step_ms_reselecting`` adds the second indexer
pass of a recompute that selects again). Not included: the MLA projections and the
all-to-all / all-gathers (per rank: a few GEMMs over 65,536 rows and ~2 GiB over NVLink).

``--indexer-scores fp8`` scores with FP8 products (``model.dsa.indexer_scores``; fused and latent)
and ``--deterministic`` runs our backward with its latent gradient summed in a fixed order
(``model.dsa.deterministic_backward``; latent).

Usage (CUDA + tilelang):  python3 bench/dsa_rank_share.py --split sequence [--kernel fused|latent]
                          [--keep-output] [--whole-row-topk] [--indexer-scores fp8] [--deterministic]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_fwd import (
    indexer_fwd_interface,
)

from skyrl_megatron_kda.config import DSAConfig
from skyrl_megatron_kda.distributed.cp_layout import rank_rows
from skyrl_megatron_kda.dsa.fused_sparse_mla import fused_absorbed_sparse_mla, fused_dsa_kernels
from skyrl_megatron_kda.dsa.latent_sparse_mla import latent_dsa_kernels
from skyrl_megatron_kda.dsa.pools import (
    document_starts,
    index_violations,
    pool_starts,
    pool_token_indices,
    pooled_keys,
)
from skyrl_megatron_kda.dsa import pool_topk
from skyrl_megatron_kda.dsa.pool_topk import blocked_pool_topk, fused_pool_topk
from skyrl_megatron_kda.dsa.sparse_mla import absorbed_sparse_mla
from skyrl_megatron_kda.dsa.threshold_topk import (
    CANDIDATES_PER_PICK,
    grouped_compact_kernel,
    threshold_topk,
)

HEADS, TP, CP = 64, 8, 2
LATENT, DN, DV = 512, 256, 256
IDX_HEADS, IDX_DIM, TOPK, KPOOL = 32, 128, 2048, 4
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def rank_positions(keys: int, split: str) -> torch.Tensor:
    cu = torch.tensor([0, keys])
    if split == "heads":
        return rank_rows(cu, CP, TP, 0, 0, False, "zigzag")
    return rank_rows(cu, CP, TP, 0, TP - 1, True, "zigzag")


def make_inputs(keys: int, split: str, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    pos = rank_positions(keys, split).to(dev)
    heads = HEADS // TP if split == "heads" else HEADS
    bf = dict(device=dev, dtype=torch.bfloat16)
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, device=dev) * s).to(torch.bfloat16)
    latent = rnd(keys, LATENT)
    latent = (latent.float() / latent.float().pow(2).mean(-1, keepdim=True).sqrt()).to(**bf)
    return dict(
        pos=pos, heads=heads,
        q_nope=rnd(pos.numel(), heads, DN, s=0.5).requires_grad_(),
        latent=latent.requires_grad_(),
        weight=rnd(heads * (DN + DV), LATENT, s=LATENT ** -0.5).requires_grad_(),
        idx_q=rnd(pos.numel(), IDX_HEADS, IDX_DIM),
        idx_w=torch.rand(pos.numel(), IDX_HEADS, generator=g, device=dev) * IDX_HEADS ** -0.5,
        idx_k=rnd(keys, IDX_DIM), gate=rnd(keys, IDX_DIM), ape=rnd(KPOOL, IDX_DIM),
    )


def indexer(x: dict, keys: int, kernel: str, block: int, kernels) -> torch.Tensor:
    dev = x["pos"].device
    cu = torch.tensor([0, keys], device=dev)
    starts = pool_starts(cu, KPOOL)
    pool_k = pooled_keys(x["idx_k"], x["gate"], x["ape"], starts, KPOOL)
    first = document_starts(cu, x["pos"])
    out = torch.empty(x["pos"].numel(), TOPK + KPOOL - 1, dtype=torch.int32, device=dev)
    for q0 in range(0, x["pos"].numel(), block):
        q1 = min(q0 + block, x["pos"].numel())
        args = (x["idx_q"][q0:q1], x["idx_w"][q0:q1], pool_k, starts, x["pos"][q0:q1],
                first[q0:q1], KPOOL, TOPK // KPOOL)
        if kernel != "torch":
            pools = fused_pool_topk(*args, block, kernels.index_scores, kernels.index_group)
        else:
            pools = blocked_pool_topk(*args, query_block=block, pool_block=4096)
        out[q0:q1] = pool_token_indices(pools, starts, x["pos"][q0:q1], first[q0:q1], KPOOL)
    return out


def indexer_split(x: dict, keys: int, block: int, kernels) -> dict:
    """Where the fused indexer's time goes, on the rank's last query block (the most visible
    pools): the TileLang score kernel against ``torch.topk`` on its [block, pools] scores."""
    dev = x["pos"].device
    starts = pool_starts(torch.tensor([0, keys], device=dev), KPOOL)
    pool_k = pooled_keys(x["idx_k"], x["gate"], x["ape"], starts, KPOOL)
    q, w, pos = x["idx_q"][-block:], x["idx_w"][-block:], x["pos"][-block:]
    ke = torch.searchsorted(starts + KPOOL - 1, pos, right=True).to(torch.int32)
    ks = torch.zeros_like(ke)
    megatron, t_megatron = timed(lambda: indexer_fwd_interface(q, pool_k, w, ks, ke))
    k, group = TOPK // KPOOL, kernels.index_group
    for _ in range(2):  # the first call compiles
        (scores, maxima), t_scores = timed(lambda: kernels.index_scores(q, pool_k, w, ks, ke))
        megatron, t_megatron = timed(lambda: indexer_fwd_interface(q, pool_k, w, ks, ke))
        (best, ids), t_threshold = timed(lambda: threshold_topk(scores, maxima, group, k))
        _, t_topk = timed(lambda: scores.topk(k, dim=-1, sorted=False))
    floor = maxima.topk(k, dim=-1).values[:, -1]
    candidates = grouped_compact_kernel(scores, maxima, group, floor,
                                        CANDIDATES_PER_PICK * k)[2].float()
    same = torch.equal(best.sort(-1).values, scores.topk(k, dim=-1).values.sort(-1).values)
    finite = torch.isfinite(megatron)
    diff = float((scores[finite] - megatron[finite]).norm() / megatron[finite].norm())
    return dict(queries=block, pools=pool_k.shape[0], scores_ms=t_scores,
                megatron_tilelang_scores_ms=t_megatron, torch_topk_ms=t_topk,
                threshold_topk_ms=t_threshold, threshold_equals_topk=same,
                candidates_mean=float(candidates.mean()), candidates_max=float(candidates.max()),
                scores_vs_megatron_rel=diff,
                same_inf=bool(torch.equal(torch.isinf(scores), torch.isinf(megatron))))


def attention(x: dict, idx: torch.Tensor, kernel: str, block: int, kernels,
              keep_output: bool = False) -> torch.Tensor:
    scale = (DN ** -0.5)
    if kernel != "torch":
        return fused_absorbed_sparse_mla(x["q_nope"], x["latent"], x["weight"], idx, scale, DV,
                                         block, kernels, keep_output=keep_output)
    return absorbed_sparse_mla(x["q_nope"], x["latent"], x["weight"], idx, scale, DV, block)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1 << 20)
    p.add_argument("--split", choices=["heads", "sequence"], default="sequence")
    p.add_argument("--kernel", choices=["fused", "latent", "torch"], default="fused")
    defaults = DSAConfig()
    p.add_argument("--query-block", type=int, default=defaults.fused_query_block,
                   help="attention queries per call (torch: per block)")
    p.add_argument("--indexer-block", type=int, default=defaults.indexer_query_block)
    p.add_argument("--queries", type=int, default=0, help="only the first N rows (0: all)")
    p.add_argument("--keep-output", action="store_true",
                   help="model.dsa.keep_attention_output: the backward reads the forward's kept "
                        "kernel output instead of running the kernel forward again (fused, latent)")
    p.add_argument("--whole-row-topk", action="store_true",
                   help="the indexer's top-k as torch.topk over each whole row of scores (what "
                        "threshold_topk replaced), for a comparison in one call")
    p.add_argument("--indexer-scores", choices=["bf16", "fp8"], default="bf16",
                   help="model.dsa.indexer_scores (fused, latent)")
    p.add_argument("--deterministic", action="store_true",
                   help="model.dsa.deterministic_backward (latent)")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--json", default="")
    a = p.parse_args()
    if a.whole_row_topk:
        pool_topk.threshold_topk = lambda scores, maxima, group, k: scores.topk(k, dim=-1,
                                                                               sorted=False)
    if a.keep_output and a.kernel == "torch":
        p.error("--keep-output needs --kernel fused or latent (the torch kernel keeps no output)")
    if a.deterministic and a.kernel != "latent":
        p.error("--deterministic needs --kernel latent")
    if a.indexer_scores == "fp8" and a.kernel == "torch":
        p.error("--indexer-scores fp8 needs --kernel fused or latent")
    dev = torch.device("cuda")
    options = {"indexer_scores": a.indexer_scores}
    if a.deterministic:
        options["ordered"] = True
    kernels = ({"fused": fused_dsa_kernels, "latent": latent_dsa_kernels}[a.kernel](**options)
               if a.kernel != "torch" else None)
    x = make_inputs(a.keys, a.split, dev)
    if a.queries:
        for k in ("pos", "q_nope", "idx_q", "idx_w"):
            x[k] = x[k][:a.queries].detach().requires_grad_(k == "q_nope")
    rows = x["pos"].numel()
    log(f"{a.kernel} kernel, split {a.split}: {rows} queries x {x['heads']} heads over {a.keys} keys")
    results, repeat_equal = [], None
    for it in range(a.iters + 1):  # the first pass compiles the TileLang kernels
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            idx, t_index = timed(lambda: indexer(x, a.keys, a.kernel, a.indexer_block, kernels))
        out, t_fwd = timed(lambda: attention(x, idx, a.kernel, a.query_block, kernels,
                                             a.keep_output))
        grad = torch.ones_like(out)
        _, t_bwd = timed(lambda: out.backward(grad))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        # Under full recompute the forward runs twice; the indexer once (train.keep_dsa_selection
        # keeps its selection for the recompute) or twice (false).
        step = t_index + 2 * t_fwd + t_bwd
        r = dict(iter=it, indexer_ms=t_index, attn_fwd_ms=t_fwd, attn_bwd_ms=t_bwd,
                 step_ms_full_recompute=step, step_ms_reselecting=step + t_index,
                 peak_gib_above_inputs=peak,
                 inputs_gib=base / 2**30)
        log(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
        results.append(r)
        # Do two timed iterations (same inputs) give bitwise-equal gradients?
        grads = [x[t].grad for t in ("q_nope", "latent", "weight")]
        if it == 1:
            first_grads = [g.clone() for g in grads]
        elif it == 2:
            repeat_equal = all(torch.equal(a_, b_) for a_, b_ in zip(first_grads, grads))
            del first_grads
        for t in ("q_nope", "latent", "weight"):
            x[t].grad = None
        del out, grad
    split = indexer_split(x, a.keys, a.indexer_block, kernels) if kernels else {}
    violations = index_violations(idx.long(), x["pos"], torch.zeros_like(x["pos"]))
    kept = float((idx >= 0).sum(-1).float().mean())
    best = min(results[1:], key=lambda r: r["step_ms_full_recompute"]) if a.iters else results[0]
    summary = dict(kernel=a.kernel, split=a.split, keep_output=a.keep_output,
                   whole_row_topk=a.whole_row_topk, indexer_scores=a.indexer_scores,
                   deterministic=a.deterministic, queries=rows,
                   heads=x["heads"], keys=a.keys,
                   query_block=a.query_block, indexer_block=a.indexer_block,
                   index_violations=violations, mean_selected=kept, best=best,
                   last_indexer_block=split, gradients_repeat_bitwise=repeat_equal,
                   first_ms=results[0]["step_ms_full_recompute"])
    log("summary " + json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
