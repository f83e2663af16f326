"""What the kernels that attend in the absorbed MLA layout share (``torch`` and ``fused``).

They never form whole-sequence keys and values: the core attention gets the whole sequence's
normalised KV latent as ``key`` and the kv up-projection weight, and applies the absorption per
query block (``sparse_mla.py``). Their indexer scores one block of queries at a time against the
pools the block can see and returns int32 token indices (``pools.pool_token_indices``), so no
[queries x pools] matrix is formed; the blocks queue on the GPU without waiting for the host
(``pool_topk.PoolCandidates``, ``pool_topk.DeferredRows``). Under ``tp_split=sequence`` (TP > 1
with SP) the layer hands it the queries of this rank's share of the rows with every head
(``GlmDSASelfAttention``). A subclass gives the two
steps that differ: ``top_pools`` (one query block's pool ids) and ``attend`` (one batch row).
"""

from __future__ import annotations

from abc import abstractmethod
from functools import partial

import torch

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
        rows, not its own SP rows, whose q latent the layer brought by one all-to-all inside TP,
        ``DSABatchRows.to_share``)."""
        q_pos, doc_start = layout.query_positions, layout.query_document_starts
        if layout.attends_by_rows(self.dsa):  # qr is the share's already (the layer moved it)
            q_pos, doc_start = layout.attention_rows(q_pos), layout.attention_rows(doc_start)
            weights = layout.to_share(weights)
        else:
            qr, weights = indexer.cp_rank_queries(qr, weights, layout)
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
        candidates = PoolCandidates(starts, q_pos, doc_start, P, block)
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
        """query [s, b, n, dn] (this CP rank's rows with this TP rank's heads; under the
        sequence split this rank's share of them with every head), ``key`` the whole sequence's
        KV latent [T, b, R] in natural order, the kv up-projection weight of those heads
        [n * (dn + dv), R], indices [b, s, k] -> [s, b, n * dv]. Each batch row attends over
        its own latent column."""
        s, b = query.shape[:2]
        outs = [self.attend(query[:, i], key[:, i], kv_up_weight, indices[i], core.softmax_scale,
                            core.config.v_head_dim) for i in range(b)]
        out = outs[0].unsqueeze(1) if b == 1 else torch.stack(outs, dim=1)
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
        keeps them) one fp32 log-sum-exp per head. The absorbed queries and the latent-space
        output are rebuilt per block in backward; the kv up-projection weight it reads is the
        layer's (``memory.dsa``)."""
        a, w = shape.dsa, shape.act_bytes
        dq = a.qk_nope_head_dim + a.qk_rope_head_dim
        keys = a.index_topk + a.index_kpool - 1
        lse = 4 * shape.heads if cls.keeps_lse else 0
        return shape.rows * (shape.heads * dq * w + lse + 4 * keys)


def indexer_inputs_bytes(shape: DSAShape) -> int:
    """What the blocked indexer holds before its blocks: the gathered [key | pool gate] of the
    whole sequence (2 index_head_dim per token; a second copy when CP > 1 puts the gathered rows
    in natural order), the queries' inputs, and the pool compression (fp32 gate logits and
    softmax, the cast weights, the gathered keys and their product: T index_head_dim (8 + 2w)).
    ``tp_split=heads``: the CP rank's [q latent | head weights], gathered over TP;
    ``sequence``: the share's q latent is the layer's (kept for its q up projection), and the
    head weights' all-to-all holds four sets of the share's [rows, index heads] (this rank's,
    their send order, the rows received, their arrangement)."""
    a, w, T = shape.dsa, shape.act_bytes, shape.whole
    di = a.index_head_dim
    keys = T * 2 * di * w * (2 if shape.cp > 1 else 1)
    compression = T * di * (8 + 2 * w)
    if shape.by_rows:
        return keys + 4 * shape.index_rows * a.index_num_heads * w + compression
    return keys + shape.cp_rows * (a.q_lora_rank + a.index_num_heads) * w + compression
