"""``model.dsa.kernel=unfused``: the oracle the other kernels are tested against. megatron-core's
``unfused_dsa_fn`` attends with whole-sequence keys and values (the latent up-projected for
every token), and the indexer scores every query row against every pool at once
(``pool_topk.select_pools``, int64 indices). Memory grows with the sequence per query; never
``auto``'s pick, and it splits heads only (``tp_split=heads``)."""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

from ..pool_topk import select_pools
from .base import DSAKernel, DSAShape, KVDims

TOPK_CHUNK = 1024
"""Keys per step of megatron-core 0.19.2's ``unfused_dsa_fn`` loop (``topk_chunk_size``)."""


class UnfusedKernel(DSAKernel):
    name = "unfused"
    splits_rows = False
    auto_candidate = False
    working_set_label = "indexer scores"

    def kv_inputs(self, latent, kv_up_weight, dims: KVDims):
        # The projection's own weight on the gathered latent: its forward would gather SP rows
        # again.
        kv = F.linear(latent, kv_up_weight)
        kv = kv.view(*kv.shape[:2], dims.heads, -1)
        key, value = kv.split([dims.qk_head_dim, dims.v_head_dim], dim=-1)
        return key.contiguous(), value.contiguous()

    def indices(self, indexer, qr, weights, keys, gate, layout):
        qr, weights = indexer.cp_rank_queries(qr, weights, layout)
        return select_pools(indexer.query_heads(qr), weights, keys, gate,
                            indexer.kpool_compress_ape, layout.query_positions,
                            layout.query_document_starts, layout.maps.cu_seqlens,
                            indexer.index_kpool, indexer.index_topk)

    def attention(self, core, query, key, value, kv_up_weight, indices, layout):
        # The same causal, per-document bounds as a second guard (and so that megatron does not
        # build its default [s, s] causal mask, which assumes queries at positions 0..s-1).
        return unfused_dsa_fn(query, key, value, indices, core.softmax_scale,
                              varlen_starts=layout.query_document_starts,
                              varlen_ends=layout.query_positions + 1)

    @classmethod
    def kept_bytes(cls, shape: DSAShape) -> int:
        """Per (query, local head): the fp32 query and the running max/sum/accumulator of each
        top-k chunk; per (query, head, selected key): the gathered fp32 key and value, the int64
        index, the validity mask and the fp32 probability."""
        a = shape.dsa
        n = a.num_heads // shape.tp
        dq, dv = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
        keys = a.index_topk + a.index_kpool - 1
        chunks = -(-keys // TOPK_CHUNK)
        query_heads = shape.cp_rows * n
        return (query_heads * (4 * dq + chunks * (8 * dv + 33))
                + query_heads * keys * (8 + 1 + 4 + 4 * (dq + dv)))

    @classmethod
    def working_sets(cls, shape: DSAShape) -> dict[str, int]:
        """The [queries x pools] fp32 scores of the CP rank's rows over index heads (and their
        masked copy), and the whole sequence's keys and values of the local heads (up projection,
        split, contiguous copies: about three copies)."""
        a, w = shape.dsa, shape.act_bytes
        pools = shape.whole // a.index_kpool
        scores = 2 * shape.cp_rows * pools * a.index_num_heads * 4
        kv = 3 * shape.whole * (a.num_heads // shape.tp) * (
            a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * w
        return {"indexer scores": scores + kv}
