"""What the kernels that attend in the absorbed MLA layout share (``torch`` and ``fused``).

They never form whole-sequence keys and values: the core attention gets the whole sequence's
normalised KV latent as ``key`` and the kv up-projection weight, and applies the absorption per
query block (``sparse_mla.py``). Their indexer scores one block of queries at a time against the
pools the block can see and returns int32 token indices (``pools.pool_token_indices``), so no
[queries x pools] matrix is formed; the blocks queue on the GPU without waiting for the host
(``pool_topk.PoolCandidates``, ``pool_topk.DeferredRows``). Under ``tp_split=sequence`` (TP > 1
with SP) the queries go through an all-to-all inside TP, each rank attends with every head on its own rows, and the
output comes back (megatron's ``all_to_all_hp2sp`` / ``sp2hp``). A subclass gives the two
steps that differ: ``top_pools`` (one query block's pool ids) and ``attend`` (one batch row).
"""

from __future__ import annotations

from abc import abstractmethod
from functools import partial

import torch
from megatron.core.tensor_parallel.mappings import (
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    gather_from_sequence_parallel_region,
)

from ..pool_topk import DeferredRows, PoolCandidates
from ..pools import pool_starts, pooled_keys
from .base import DSAKernel, DSAShape, KVDims


class AbsorbedKernel(DSAKernel):
    """A kernel in the absorbed layout: blocked indexer, latent attention, either TP split."""

    splits_rows = True
    keeps_lse = False
    """Whether its attention keeps one fp32 log-sum-exp per (query, head) for backward."""

    def kv_inputs(self, latent, kv_up_weight, dims: KVDims):
        return latent, None

    def indices(self, indexer, qr, weights, keys, gate, layout):
        """The selection as int32, without the [queries x pools] scores: the indexer queries,
        pool scores, top-k and token indices of one query block at a time. ``tp_split=heads``:
        for every row of this CP rank (the TP ranks' rows gathered); ``sequence``: for the rows
        this rank attends (``DSABatchRows.attention_rows``: a balanced share of its CP rank's
        rows, not its own SP rows; their queries come by one all-to-all inside TP)."""
        q_pos, doc_start = layout.query_positions, layout.query_document_starts
        if layout.attends_by_rows(self.dsa):
            q_pos, doc_start = layout.attention_rows(q_pos), layout.attention_rows(doc_start)
            qr, weights = indexer.indexed_queries(qr, weights, layout.attention_share)
        else:
            qr, weights = indexer.indexed_queries(qr, weights, layout.cp_rank_rows)
        P, (s, b) = indexer.index_kpool, qr.shape[:2]
        cu = layout.maps.cu_seqlens
        if int(cu[-1]) >= 2**31:
            raise ValueError(f"DSA kernel {self.name!r} keeps int32 token indices: "
                             f"{int(cu[-1])} tokens is too many (at most 2**31 - 1)")
        starts = pool_starts(cu, P)
        pool_k = [self.index_keys(pooled_keys(keys[:, i], gate[:, i], indexer.kpool_compress_ape,
                                              starts, P)) for i in range(b)]
        out = torch.empty(b, s, indexer.index_topk + P - 1, dtype=torch.int32, device=qr.device)
        n_select, block = indexer.index_topk // P, self.dsa.indexer_query_block
        candidates = PoolCandidates(starts, q_pos, doc_start, P)
        later = DeferredRows()
        for q0 in range(0, s, block):
            rows = slice(q0, min(q0 + block, s))
            q = indexer.query_heads(qr[rows])
            for i in range(b):
                pools = torch.empty(q.shape[0], n_select, dtype=torch.long, device=qr.device)
                self.top_pools(q[:, i], weights[rows, i], pool_k[i], candidates, rows, n_select,
                               pools, later)
                later.then(partial(candidates.write_tokens, out[i, rows], pools, rows))
        later.finish()
        return out

    def attention(self, core, query, key, value, kv_up_weight, indices, layout):
        """query [s, b, n, dn] (this CP rank's rows, this TP rank's heads), ``key`` the whole
        sequence's KV latent [T, b, R] in natural order, this TP rank's kv up-projection weight
        [n * (dn + dv), R], indices [b, s', k] -> [s, b, n * dv]. Each batch row attends over
        its own latent column."""
        s, b = query.shape[:2]
        by_rows = layout.attends_by_rows(self.dsa)
        if by_rows:  # the rows the indexer selected for (``DSABatchRows.attention_order``)
            order = layout.attention_order()
            query = _heads_to_rows(order.apply(query), layout.tp_group)
            # Every head's weight; backward sums the ranks' head gradients and keeps this rank's.
            kv_up_weight = gather_from_sequence_parallel_region(kv_up_weight, group=layout.tp_group)
        outs = [self.attend(query[:, i], key[:, i], kv_up_weight, indices[i], core.softmax_scale,
                            core.config.v_head_dim) for i in range(b)]
        out = outs[0].unsqueeze(1) if b == 1 else torch.stack(outs, dim=1)
        if by_rows:
            out = order.undo(_rows_to_heads(out, layout.tp_group))
        return out.reshape(s, b, -1)

    def index_keys(self, pool_k: torch.Tensor):
        """The pass's pool keys [n_pool, d] as ``top_pools`` takes them, prepared once."""
        return pool_k

    @abstractmethod
    def top_pools(self, q, weights, pool_k, candidates: PoolCandidates, rows: slice,
                  n_select: int, out: torch.Tensor, later: DeferredRows) -> None:
        """One query block's selected pool ids into ``out`` [n, n_select] (-1 = none): queries
        q [n, heads, d] with head weights [n, heads], the block's ``rows`` of ``candidates``
        (the pools each query may see), pools with keys ``pool_k`` (``index_keys``'). Work
        that needs the host to read a GPU result may go to ``later``, which runs it before the
        block's ids are read."""

    @abstractmethod
    def attend(self, query, latent, kv_up_weight, indices, scale: float,
               v_head_dim: int) -> torch.Tensor:
        """One batch row: queries [Tq, H, dn], latent [Tk, R], weight [H * (dn + dv), R],
        indices [Tq, k] -> [Tq, H, dv]."""

    # -- memory -----------------------------------------------------------------------------

    @classmethod
    def kept_bytes(cls, shape: DSAShape) -> int:
        """Per query of the share: the query [heads, d_qk], the int32 token indices and (if it
        keeps them) one fp32 log-sum-exp per head; attending by rows also keeps the gathered kv
        up-projection weight of every head. The absorbed queries and the latent-space output are
        rebuilt per block in backward."""
        a, w = shape.dsa, shape.act_bytes
        dq = a.qk_nope_head_dim + a.qk_rope_head_dim
        keys = a.index_topk + a.index_kpool - 1
        lse = 4 * shape.heads if cls.keeps_lse else 0
        weight = a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank * w
        return (shape.rows * (shape.heads * dq * w + lse + 4 * keys)
                + (weight if shape.gathers_weight else 0))


def indexer_inputs_bytes(shape: DSAShape) -> int:
    """What the blocked indexer holds before its blocks: the gathered [key | pool gate] of the
    whole sequence (2 index_head_dim per token; a second copy when CP > 1 puts the gathered rows
    in natural order), the [q latent | head weights] of the rows it indexes, and the pool
    compression (fp32 gate logits and softmax, the cast weights, the gathered keys and their
    product: T index_head_dim (8 + 2w)). ``tp_split=heads``: the CP rank's queries, gathered;
    ``sequence``: the rank's share, whose all-to-all briefly holds four sets of rows (this
    rank's, their send order, the rows received and their arrangement) before the compression,
    which holds only the last."""
    a, w, T = shape.dsa, shape.act_bytes, shape.whole
    di = a.index_head_dim
    keys = T * 2 * di * w * (2 if shape.cp > 1 else 1)
    row = (a.q_lora_rank + a.index_num_heads) * w
    compression = T * di * (8 + 2 * w)
    if shape.gathers_weight:
        exchange = 2 * (shape.sp_rows + shape.index_rows) * row
        return keys + max(exchange, shape.index_rows * row + compression)
    return keys + shape.cp_rows * row + compression


def query_exchange_bytes(shape: DSAShape) -> int:
    """Attending by rows, the queries' all-to-all inside TP: this CP rank's queries put in
    ``DSABatchRows.attention_order`` and the rows received, each the size of the rank's share
    [rows, heads, d_qk] (the rows after it are kept, ``kept_bytes``); the backward's gradients
    take the same two. 0 under ``tp_split=heads``."""
    a = shape.dsa
    if not shape.gathers_weight:
        return 0
    return 2 * shape.rows * shape.heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) * shape.act_bytes


def _heads_to_rows(t: torch.Tensor, group) -> torch.Tensor:
    """[s, b, n, d] (all rows, this TP rank's heads) -> [s/tp, b, n * tp, d] (the t-th
    contiguous 1/tp of the rows on TP rank t, every head in TP-rank order); megatron's
    all-to-all, differentiable."""
    s, b, n, d = t.shape
    out = all_to_all_hp2sp(t.reshape(s * b, n * d), group=group)
    return out.view(s // group.size(), b, n * group.size(), d)


def _rows_to_heads(t: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``_heads_to_rows``: [s/tp, b, H, d] -> [s, b, H/tp, d]."""
    r, b, h, d = t.shape
    out = all_to_all_sp2hp(t.reshape(r * b, h * d), group=group)
    return out.view(r * group.size(), b, h // group.size(), d)
