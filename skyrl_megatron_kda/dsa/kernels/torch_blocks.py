"""``model.dsa.kernel=torch``: the absorbed sparse MLA and the blocked indexer in plain torch,
in query blocks (``sparse_mla.absorbed_sparse_mla``, ``pool_topk.blocked_pool_topk``). The CPU
path, and the reference the fused kernel is tested against; its selection equals the unfused
oracle's whole-matrix one, ties included."""

from __future__ import annotations

from ..pool_topk import blocked_pool_topk
from ..sparse_mla import absorbed_sparse_mla
from .absorbed import AbsorbedKernel, indexer_inputs_bytes
from .base import DSAShape


class TorchKernel(AbsorbedKernel):
    name = "torch"
    keeps_lse = True
    working_set_label = "one block's working set"
    options = "torch"

    def top_pools(self, q, weights, pool_k, candidates, rows, n_select, out, later):
        c = candidates
        out.copy_(blocked_pool_topk(q, weights, pool_k, c.starts, c.q_pos[rows], c.doc_start[rows],
                                    c.kpool, n_select, query_block=q.shape[0],
                                    pool_block=self.options_of(self.dsa).indexer_pool_block))

    def attend(self, query, latent, kv_up_weight, indices, scale, v_head_dim):
        return absorbed_sparse_mla(query, latent, kv_up_weight, indices, scale, v_head_dim,
                                   self.options_of(self.dsa).attention_block)

    @classmethod
    def working_sets(cls, shape: DSAShape) -> dict[str, int]:
        """As the code allocates them (b = attention_block; K = index_topk + kpool - 1,
        R = kv_lora_rank, n the share's heads, w the activation bytes):

        * ``indexer``: the indexer inputs (``absorbed.indexer_inputs_bytes``) and one block of
          indexer_query_block queries against indexer_pool_block pools: its indexer queries,
          fp32 einsum and relu scores (index heads), and the running top-k merge (fp32 score,
          int64 id, and the stable sort's values and indices).
        * ``attention forward``: one block's gathered latent rows [b, K, R] (w, and fp32 when w
          is not 4), its fp32 absorbed queries and latent-space output [b, n, R], and three fp32
          [b, n, K] score/probability tensors.
        * ``attention backward``: the fp32 latent gradient [T, R] that the blocks accumulate
          into, the fp32 W_UK/W_UV copies and their gradients (2 x the local kv up-projection
          weight), plus the larger of the latent gradient's cast to w at the end (when w is not
          4) and one block: its gathered rows as in forward, three fp32 [b, n, R] (absorbed
          queries, output gradient, query gradient), four fp32 [b, n, K] and three fp32
          [b, K, R] (the two latent-row gradient terms and their sum)."""
        w, a = shape.act_bytes, shape.dsa
        T, R, n = shape.whole, a.kv_lora_rank, shape.heads
        K = a.index_topk + a.index_kpool - 1
        hi, di = a.index_num_heads, a.index_head_dim
        up = 4 if w != 4 else 0  # the fp32 copy of a half tensor; none when already fp32
        qb = min(a.indexer_query_block, shape.index_rows)
        o = cls.options_of(a)
        pb, b = o.indexer_pool_block, o.attention_block
        selected = a.index_topk // a.index_kpool
        block = qb * hi * di * (w + up) + 2 * qb * hi * pb * 4 + qb * (selected + pb) * (4 + 8) * 2
        rows = b * K * R * (w + up)
        weights = 2 * n * (a.qk_nope_head_dim + a.v_head_dim) * R * 4
        return {
            "indexer": indexer_inputs_bytes(shape) + block,
            "attention forward": rows + 2 * b * n * R * 4 + 3 * b * n * K * 4,
            "attention backward": T * R * 4 + weights + max(
                T * R * w if up else 0,
                rows + 3 * b * n * R * 4 + 4 * b * n * K * 4 + 3 * b * K * R * 4),
        }
