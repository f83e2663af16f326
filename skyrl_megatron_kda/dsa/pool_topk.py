"""GLM's pooled lightning-indexer top-k: which pools of keys each query attends to.

``select_pools`` (the unfused kernel's, the oracle) scores every query against every pool at once
([s, heads, pools] before the head sum): quadratic in the sequence. ``blocked_pool_topk`` (the
torch kernel's) gives the same selection without that matrix: a block of queries scores one
block of pools at a time and merges it into a running top-k, so the live scores are
[query_block, heads, pool_block]. Ties included: pool blocks are visited in ascending pool id and
the running top-k (already ordered by score, then pool id) goes before the new block in a stable
sort, so equal scores keep the earlier pool, as ``select_pools``' stable sort of the whole row
does. Pools a block's queries cannot see (before the earliest document start, or ending past the
last query) are never scored. ``fused_pool_topk`` (the fused and latent kernels') takes the
scores of a block's visible pools and their group maxima from a score kernel and the exact
``threshold_topk.threshold_topk``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .threshold_topk import floor_topk


def select_pools(q, weights, keys, gate, ape, q_pos, doc_start, cu_seqlens, kpool: int, topk: int):
    """GLM's pooled top-k for queries at natural positions ``q_pos`` [s] (their documents start
    at ``doc_start`` [s]) over the whole sequence.

    q [s, b, H, d], weights [s, b, H] (scaled); keys, gate [T, b, d] in natural order; ape
    [kpool, d]. Pools are ``kpool`` consecutive tokens from each document's start; only complete
    pools are candidates, visible once their last token is <= the query. Ties keep the earlier
    pool (a stable sort), so the choice does not depend on how many other pools a row holds.
    Returns natural key positions [b, s, topk + kpool - 1]: ``topk / kpool`` pools' tokens
    (``kpool`` consecutive each, all -1 for a pool not chosen), then the tail; -1 = none.
    """
    P, dev = kpool, keys.device
    starts, lens = cu_seqlens[:-1], cu_seqlens.diff()
    per_doc = lens // P
    doc = torch.repeat_interleave(torch.arange(len(lens), device=dev), per_doc)
    first = (per_doc.cumsum(0) - per_doc)[doc]
    pool_start = starts[doc] + P * (torch.arange(doc.numel(), device=dev) - first)
    tok = pool_start[:, None] + torch.arange(P, device=dev)  # [n_pool, P]

    logits = gate.float()[tok] + ape.float()[None, :, None, :]  # [n_pool, P, b, d]
    pool_k = (logits.softmax(dim=1).to(keys.dtype) * keys[tok]).sum(dim=1)  # [n_pool, b, d]
    scores = torch.einsum("sbhd,pbd->sbhp", q.float(), pool_k.float()).relu()
    scores = (scores * weights.float().unsqueeze(-1)).sum(2).transpose(0, 1)  # [b, s, n_pool]

    visible = (pool_start[None] >= doc_start[:, None]) & (tok[None, :, -1] <= q_pos[:, None])
    scores = scores.masked_fill(~visible, float("-inf"))
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., : topk // P]
    chosen = visible.expand(order.shape[0], -1, -1).gather(-1, order)  # [b, s, k]
    idx = tok[order].masked_fill(~chosen[..., None], -1).flatten(-2)
    idx = F.pad(idx, (0, topk - idx.shape[-1]), value=-1)  # fewer pools than topk / kpool

    count = q_pos - doc_start + 1  # visible tokens of the query's document
    tail_n = count % P
    offs = torch.arange(P - 1, device=dev)
    tail = (q_pos + 1 - tail_n)[:, None] + offs
    tail = tail.masked_fill(offs[None] >= tail_n[:, None], -1)
    return torch.cat([idx, tail[None].expand(idx.shape[0], -1, -1)], dim=-1)


def _block_pool_scores(q, weights, pool_k):
    """GLM's index score: sum over indexer heads of weight * relu(q . k), fp32 -> [n, pools]."""
    scores = torch.einsum("nhd,pd->nhp", q.float(), pool_k.float()).relu()
    return (scores * weights.float()[..., None]).sum(dim=1)


def blocked_pool_topk(q: torch.Tensor, weights: torch.Tensor, pool_k: torch.Tensor,
                      starts: torch.Tensor, q_pos: torch.Tensor, doc_start: torch.Tensor,
                      kpool: int, n_select: int, query_block: int = 256,
                      pool_block: int = 4096) -> torch.Tensor:
    """Pool ids [s, n_select] (best first; -1 = none) that queries q [s, heads, d] with head
    weights [s, heads] select among pools with keys ``pool_k`` [n_pool, d] starting at ``starts``
    [n_pool] (``pools.pool_starts``); a pool is a candidate when it lies in the query's
    document (from ``doc_start`` [s]) and ends at or before the query's position ``q_pos`` [s]."""
    if query_block < 1 or pool_block < 1 or n_select < 0:
        raise ValueError(f"query_block, pool_block must be >= 1 and n_select >= 0, got "
                         f"{query_block}, {pool_block}, {n_select}")
    if pool_k.shape[0] != starts.shape[0]:
        raise ValueError(f"pool_k has {pool_k.shape[0]} pools but starts has {starts.shape[0]}")
    ends = starts + kpool - 1
    result = torch.full((q.shape[0], n_select), -1, dtype=torch.long, device=q.device)
    for q0 in range(0, q.shape[0], query_block):
        q1 = min(q0 + query_block, q.shape[0])
        pos, first = q_pos[q0:q1], doc_start[q0:q1]
        lo = int(torch.searchsorted(starts, first.min()))
        hi = int(torch.searchsorted(ends, pos.max(), right=True))
        best_score = torch.empty(q1 - q0, 0, device=q.device)
        best_id = torch.empty(q1 - q0, 0, dtype=torch.long, device=q.device)
        for p0 in range(lo, hi, pool_block):
            p1 = min(p0 + pool_block, hi)
            scores = _block_pool_scores(q[q0:q1], weights[q0:q1], pool_k[p0:p1])
            visible = (starts[p0:p1] >= first[:, None]) & (ends[p0:p1] <= pos[:, None])
            scores = scores.masked_fill(~visible, float("-inf"))
            ids = torch.arange(p0, p1, device=q.device).expand(q1 - q0, -1)
            scores, ids = torch.cat([best_score, scores], 1), torch.cat([best_id, ids], 1)
            order = scores.sort(dim=-1, descending=True, stable=True).indices[:, :n_select]
            best_score, best_id = scores.gather(1, order), ids.gather(1, order)
        chosen = best_id.masked_fill(best_score == float("-inf"), -1)
        result[q0:q1, : chosen.shape[1]] = chosen
    return result


def fused_pool_topk(q: torch.Tensor, weights: torch.Tensor, pool_k: torch.Tensor,
                    starts: torch.Tensor, q_pos: torch.Tensor, doc_start: torch.Tensor,
                    kpool: int, n_select: int, query_block: int, scorer,
                    group: int) -> torch.Tensor:
    """``blocked_pool_topk``'s selection with the scores from ``scorer``, a kernel with the
    contract of megatron-core's TileLang indexer (``indexer_fwd_interface``; the fused kernel
    passes ours in Triton, ``index_scores.pool_scores``): q [n, heads, d] bf16, keys [P, d],
    weights [n, heads] fp32, each query's visible key range [ks, ke) as int32 -> fp32 logits
    [n, P], -inf outside the range (the relu and the head sum happen on chip), and their maxima
    over consecutive groups of ``group`` pools [n, ceil(P / group)]. Per block of
    ``query_block`` queries the logits cover only the pools the block can see; the top-k is
    ``threshold_topk``'s (exactly ``torch.topk``'s: ties in any order, unlike the stable torch
    path), its rare crowded rows scored again after the last block for a whole-row top-k, so
    the blocks run without waiting for the host."""
    if query_block < 1 or n_select < 0:
        raise ValueError(f"query_block must be >= 1 and n_select >= 0, got {query_block}, {n_select}")
    ends = starts + kpool - 1
    # Each query's candidates are one contiguous run of pool ids: its document's complete pools
    # that end at or before it.
    first_pool = torch.searchsorted(starts, doc_start)
    end_pool = torch.searchsorted(ends, q_pos, right=True)
    result = torch.full((q.shape[0], n_select), -1, dtype=torch.long, device=q.device)
    # Every block's pool range in one transfer and the rare rows with too many candidates
    # redone after the loop: no host sync inside it, so the GPU never waits for the host.
    ranges = _block_ranges(first_pool, end_pool, query_block)
    crowded = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)

    def select(rows: slice | torch.Tensor, lo: int, hi: int, whole_rows: bool):
        k = min(n_select, hi - lo)
        if k <= 0:
            return None
        ks = (first_pool[rows] - lo).to(torch.int32)
        ke = (end_pool[rows] - lo).clamp(min=0).to(torch.int32)
        logits, group_max = scorer(q[rows].contiguous(), pool_k[lo:hi].contiguous(),
                                   weights[rows].float().contiguous(), ks.contiguous(),
                                   ke.contiguous())
        if whole_rows:
            score, ids = logits.topk(k, dim=-1, sorted=False)
            many = None
        else:  # the attention needs no order
            score, ids, many = floor_topk(logits, group_max, group, k)
        result[rows] = -1
        result[rows, :k] = (ids + lo).masked_fill(score == float("-inf"), -1)
        return many

    for (lo, hi), q0 in zip(ranges, range(0, q.shape[0], query_block)):
        rows = slice(q0, min(q0 + query_block, q.shape[0]))
        many = select(rows, lo, hi, whole_rows=False)
        if many is not None:
            crowded[rows] = many
    redo = crowded.nonzero(as_tuple=True)[0]  # the call's one host sync after the ranges'
    for r0 in range(0, redo.numel(), query_block):
        rows = redo[r0:r0 + query_block]
        select(rows, int(first_pool[rows].min()), int(end_pool[rows].max()), whole_rows=True)
    return result


def _block_ranges(first_pool: torch.Tensor, end_pool: torch.Tensor, block: int) -> list:
    """Per block of ``block`` queries, [lowest first pool, highest end pool) as host ints."""
    pad = -first_pool.numel() % block
    lo = torch.cat([first_pool, first_pool.new_full((pad,), torch.iinfo(first_pool.dtype).max)])
    hi = torch.cat([end_pool, end_pool.new_zeros(pad)])
    return torch.stack([lo.view(-1, block).amin(1), hi.view(-1, block).amax(1)], 1).tolist()
