"""GLM's pooled lightning-indexer top-k: which pools of keys each query attends to.

``select_pools`` (the unfused kernel's, the oracle) scores every query against every pool at once
([s, heads, pools] before the head sum): quadratic in the sequence. ``blocked_pool_topk`` (the
torch kernel's) gives the same selection without that matrix: a block of queries scores one
block of pools at a time and merges it into a running top-k, so the live scores are
[query_block, heads, pool_block]. Ties included: pool blocks are visited in ascending pool id and
the running top-k (already ordered by score, then pool id) goes before the new block in a stable
sort, so equal scores keep the earlier pool, as ``select_pools``' stable sort of the whole row
does. Pools a block's queries cannot see (before the earliest document start, or ending past the
last query) are never scored. ``fused_block_topk`` (the fused and latent kernels') takes the
scores of a block's visible pools and their group maxima from a score kernel and the exact
``threshold_topk.floor_topk``; the rare rows that top-k cannot settle are redone a few blocks
later (``DeferredRows``), so the host never waits for the GPU inside the indexer's loop.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .pools import write_pool_tokens
from .ops.threshold_topk import floor_topk

LAG = 2
"""Query blocks the indexer queues on the GPU before the host reads a block's crowded rows
(``DeferredRows``): one keeps the GPU busy while the host reads; two leave room for the
host's own time per block."""


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


def relative_ranges(first: torch.Tensor, end: torch.Tensor,
                    lo) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of pool ids [first, end) as int32 [ks, ke) relative to a window that starts at pool
    ``lo`` (a number, or one per run) and holds every run's first pool; a run ending before
    the window is empty."""
    return (first - lo).to(torch.int32), (end - lo).clamp(min=0).to(torch.int32)


class PoolCandidates:
    """Which pools each of a rank's queries may select: one contiguous run of pool ids [first,
    end) per query, its document's complete pools that end at or before it. On the device for
    the score kernel, and on the host (one transfer for the whole pass) so that a query block's
    pool window costs no host sync. The indexer scores ``block`` queries at a time: each
    query's run relative to its block's window (``ranges``) is computed once for the pass,
    not by five small kernels per block."""

    def __init__(self, starts: torch.Tensor, q_pos: torch.Tensor, doc_start: torch.Tensor,
                 kpool: int, block: int):
        if block < 1:
            raise ValueError(f"the query block must be >= 1, got {block}")
        self.starts, self.q_pos, self.doc_start, self.kpool = starts, q_pos, doc_start, kpool
        self.first = torch.searchsorted(starts, doc_start)
        self.end = torch.searchsorted(starts + kpool - 1, q_pos, right=True)
        self._host = torch.stack([self.first, self.end]).cpu()
        self.block = block
        firsts = self._host[0]  # each block's lowest first pool starts its window
        pad = firsts.new_full((-firsts.numel() % block,), torch.iinfo(firsts.dtype).max)
        lows = torch.cat([firsts, pad]).view(-1, block).min(1).values
        lows = lows.repeat_interleave(block)[:firsts.numel()]
        self._ks, self._ke = relative_ranges(self.first, self.end, lows.to(self.first.device))

    def ranges(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The pools [ks, ke) int32 that the query block ``rows`` may each see, relative to the
        block's ``window``; ``rows`` must be one of the pass's blocks (it starts at a multiple
        of ``block``)."""
        if rows.start % self.block or rows.stop - rows.start > self.block:
            raise ValueError(f"rows {rows.start}:{rows.stop} are not one block of "
                             f"{self.block} queries")
        return self._ks[rows], self._ke[rows]

    def window(self, rows: slice | torch.Tensor) -> tuple[int, int]:
        """[lowest first, highest end) over ``rows`` (a slice or CPU row ids): the pools a
        block of these queries is scored against."""
        first, end = self._host[0, rows], self._host[1, rows]
        return (int(first.min()), int(end.max())) if first.numel() else (0, 0)

    def write_tokens(self, out: torch.Tensor, pools: torch.Tensor, rows: slice) -> None:
        """``rows``' selected pool ids [n, k] as token indices into ``out`` (their range is
        not checked: the ids come from a top-k over these candidates)."""
        write_pool_tokens(out, pools, self.starts, self.q_pos[rows], self.doc_start[rows],
                          self.kpool)


class DeferredRows:
    """Work on rows that the GPU flags, done once the host has the flags, ``lag`` flagged
    blocks later. Reading a block's flags at once would leave the GPU idle until the host had
    queued the next block; read later, it waits only for that block's copy while the blocks
    queued after it keep the GPU busy. ``then`` queues an action that runs after every fix
    queued before it; ``finish`` runs what is left."""

    def __init__(self, lag: int = LAG):
        self.lag, self._queue = lag, deque()

    def fix(self, flags: torch.Tensor, action) -> None:
        """``action(rows)`` with the flagged rows of bool ``flags`` [n] as CPU ids, if any."""
        done = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            flags = host
        self._queue.append((flags, done, action))
        self._run(self.lag)

    def then(self, action) -> None:
        self._queue.append((None, None, action))
        self._run(self.lag)

    def finish(self) -> None:
        self._run(0)

    def _run(self, keep: int) -> None:
        while self._queue:
            flags, done, action = self._queue[0]
            if flags is not None and sum(f is not None for f, _, _ in self._queue) <= keep:
                return
            self._queue.popleft()
            if flags is None:
                action()
                continue
            if done is not None:
                done.synchronize()
            rows = flags.nonzero(as_tuple=True)[0]
            if rows.numel():
                action(rows)


def fused_block_topk(q: torch.Tensor, weights: torch.Tensor, pool_k: torch.Tensor,
                     candidates: PoolCandidates, rows: slice, n_select: int, scorer, group: int,
                     out: torch.Tensor, later: DeferredRows) -> None:
    """One query block's pool ids into ``out`` [n, n_select] (-1 = none): ``blocked_pool_topk``'s
    selection with the scores from ``scorer``, a kernel with the contract of megatron-core's
    TileLang indexer (``indexer_fwd_interface``; the fused kernel passes ours in Triton,
    ``index_scores.pool_scores``): q [n, heads, d] bf16, keys [P, d] (or what the kernel set's
    ``index_keys`` made of them, sliced by pool range), weights [n, heads] fp32,
    each query's visible key range [ks, ke) as int32 -> fp32 logits [n, P], -inf outside the
    range (the relu and the head sum happen on chip), and their maxima over consecutive groups
    of ``group`` pools [n, ceil(P / group)]. ``rows``: the block's queries among
    ``candidates``'; the logits cover only the pools the block can see. The top-k is
    ``threshold_topk.floor_topk``'s (``torch.topk``'s values; ties at its floor are not always
    resolved as the stable torch path does); its rare crowded rows are scored again with a
    whole-row top-k by ``later``, so the blocks queue on the GPU without waiting for the
    host."""
    ks, ke = candidates.ranges(rows)
    crowded = _select(q, weights, pool_k, ks, ke, candidates.window(rows), n_select, scorer,
                      group, out, whole_rows=False)
    if crowded is None:
        return

    def redo(block_rows: torch.Tensor) -> None:
        on = block_rows.to(q.device, non_blocking=True)
        window = candidates.window(block_rows + rows.start)
        ks, ke = relative_ranges(candidates.first[rows][on], candidates.end[rows][on], window[0])
        redone = torch.empty(block_rows.numel(), n_select, dtype=out.dtype, device=out.device)
        _select(q[on], weights[on], pool_k, ks, ke, window, n_select, scorer, group, redone,
                whole_rows=True)
        out[on] = redone

    later.fix(crowded, redo)


def _select(q, weights, pool_k, ks, ke, window: tuple[int, int], n_select: int, scorer,
            group: int, out: torch.Tensor, whole_rows: bool) -> torch.Tensor | None:
    """The pools ``window`` = [lo, hi) scored for queries q, each seeing pools [ks, ke) of it
    (int32, relative to lo), and the top-k into ``out``; returns ``floor_topk``'s crowded rows
    (None for ``whole_rows``: ``torch.topk`` over each row)."""
    lo, hi = window
    k = min(n_select, hi - lo)
    if k < n_select:
        out.fill_(-1)
    if k <= 0:
        return None
    logits, group_max = scorer(q.contiguous(), pool_k[lo:hi], weights.float().contiguous(),
                               ks.contiguous(), ke.contiguous())
    crowded = None
    if whole_rows:
        score, ids = logits.topk(k, dim=-1, sorted=False)
    else:  # the attention needs no order
        score, ids, crowded = floor_topk(logits, group_max, group, k)
    write_pool_ids(out[:, :k], ids, score, lo)
    return crowded


@triton.jit
def _pool_ids(ids_ptr, scores_ptr, out_ptr, k, out_stride, offset, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for c0 in range(0, k, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        inside = cols < k
        ids = tl.load(ids_ptr + row * k + cols, mask=inside)
        scores = tl.load(scores_ptr + row * k + cols, mask=inside)
        tl.store(out_ptr + row * out_stride + cols,
                 tl.where(scores == float("-inf"), -1, ids + offset), mask=inside)


def write_pool_ids(out: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor,
                   offset: int) -> None:
    """A top-k's column ids [n, k] plus ``offset`` (the window's first pool) into ``out``
    [n, k] (int64, rows contiguous), -1 where the score is -inf (a pool the query cannot see):
    one Triton program per row on CUDA (three torch kernels otherwise)."""
    if not out.is_cuda:
        torch.add(ids, offset, out=out).masked_fill_(scores == float("-inf"), -1)
    else:
        pool_ids_kernel(out, ids, scores, offset)


def pool_ids_kernel(out: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor,
                    offset: int) -> None:
    """``write_pool_ids``'s Triton program, on any device Triton runs on."""
    n, k = ids.shape
    if out.dtype != torch.int64 or out.shape != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out must be int64 [{n}, {k}] with contiguous rows, got {out.dtype} "
                         f"{list(out.shape)} strides {out.stride()}")
    if n:
        _pool_ids[(n,)](ids.long().contiguous(), scores.float().contiguous(), out, k,
                        out.stride(0), offset, BLOCK=min(1024, triton.next_power_of_2(k)),
                        num_warps=4)


def fused_pool_topk(q: torch.Tensor, weights: torch.Tensor, pool_k: torch.Tensor,
                    starts: torch.Tensor, q_pos: torch.Tensor, doc_start: torch.Tensor,
                    kpool: int, n_select: int, query_block: int, scorer,
                    group: int) -> torch.Tensor:
    """``fused_block_topk`` over every ``query_block`` queries of q [s, heads, d] -> pool ids
    [s, n_select] (-1 = none), with ``blocked_pool_topk``'s arguments."""
    if query_block < 1 or n_select < 0:
        raise ValueError(f"query_block must be >= 1 and n_select >= 0, got {query_block}, "
                         f"{n_select}")
    candidates = PoolCandidates(starts, q_pos, doc_start, kpool, query_block)
    result = torch.empty(q.shape[0], n_select, dtype=torch.long, device=q.device)
    later = DeferredRows()
    for q0 in range(0, q.shape[0], query_block):
        rows = slice(q0, min(q0 + query_block, q.shape[0]))
        fused_block_topk(q[rows], weights[rows], pool_k, candidates, rows, n_select, scorer, group,
                         result[rows], later)
    later.finish()
    return result
