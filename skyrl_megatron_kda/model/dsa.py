"""GLM-5.3-Flash DSA ("indexed attention") layer on megatron-core 0.19.2, with TP, SP and CP.

What is megatron-core's own (configured, not copied):
  * ``MLASelfAttention`` builds q_lora/kv_lora MLA: down projections, RMS norms, up projections,
    the row-parallel output projection, and its ``forward`` (which hands ``x`` and ``qr`` to a
    core attention that ``requires_dsa_inputs``). Heads are split over TP by its parallel linears.
  * ``DSAttention`` / ``DSAIndexer`` (subclassed) give the core-attention slot, the ``indexer``
    submodule with wq_b / wk / k_norm / weights_proj, and the top-k sharing bookkeeping.
  * ``unfused_dsa_fn`` runs the sparse softmax attention over the selected key indices
    (``model.dsa.kernel=unfused``, kept as the reference).
  * ``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter backward) moves
    rows over the TP (SP) and CP groups.

What is ours, and why (megatron-core 0.19.2 has no equivalent):
  * k-pool compression: GLM pools ``index_kpool`` consecutive indexer keys of a document with a
    learned softmax gate and scores pools, not tokens; the tail (the query's incomplete pool) is
    always selected.
  * CP: megatron's ``DSAttention`` all-gathers the up-projected keys and values (all local heads,
    zigzag only). We all-gather the normalised KV latent (``kv_lora_rank`` per token: num_heads/TP
    times fewer bytes than the keys and values at GLM sizes) and the indexer's [key | pool gate] (no grad), put them in natural token
    order with the project's CP layouts (``distributed.cp_layout``: zigzag or contiguous, packed THD), and
    either attend over it in the absorbed layout (torch) or up-project the whole sequence
    locally (unfused). Queries stay local.
  * ``GlmDSASelfAttention.get_query_key_value_tensors``: megatron's version up-projects only
    local keys; ours inserts the latent gather between the KV norm and the up projection (NoPE
    only); with the torch kernel it hands the gathered latent on as ``key`` (``value`` None) and
    ``_run_core_attention`` adds the kv up-projection weight for the absorbed attention.
  * ``model.dsa.kernel=fused`` (GPU) and ``torch`` (CPU): megatron-core's sparse attention keeps,
    per query and head, the gathered fp32 keys and values of every selected key, and its indexer
    forms the [queries x pools] score matrix. Ours never forms whole-sequence keys and values:
    the indexer scores a block of queries at a time (fused: our Triton kernel over the pools the
    block can see, ``sparse_indexer.fused_pool_topk``; torch: blocks of pools,
    ``blocked_pool_topk``; then ``kpool_indices.pool_token_indices``, int32) and the attention
    runs in the absorbed MLA layout over the gathered KV latent (fused: megatron-core's TileLang
    sparse-MLA kernels, ``fused_sparse_mla``; torch: ``sparse_mla.absorbed_sparse_mla``),
    keeping O(queries) tensors for backward.
  * ``model.dsa.tp_split=sequence``: an all-to-all inside TP gives each rank every head for its
    own SP rows (megatron's ``all_to_all_hp2sp``/``sp2hp``), so the indexer runs once per row
    instead of once per TP rank.
  * ``DuplicatedLinear`` / ``IndexerKNorm`` / ``LatentRMSNorm``: the local backend has no TE
    duplicated linear or TE norm; torch's norm refuses SP, ours tags its weights for the TP sum.

The indexer is duplicated over TP, not split: every TP rank needs the same top-k for all of its
CP rank's query rows (its heads attend over them), and splitting indexer heads would need an
all-reduce of the [rows, pools] score matrix, far more bytes than recomputing the small indexer.
It runs without gradient, as in transformers' ``Glm5NextTextIndexer`` (no indexer KL loss), and
its parameters are frozen (``requires_grad=False``).
See docs/dsa.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttention,
    DSAttentionSubmodules,
    unfused_dsa_fn,
)
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import DSAConfig
from ..distributed.cp_layout import LAYOUTS, CPLayout, batch_sequences, sort_index
from .fused_sparse_mla import fused_absorbed_sparse_mla, fused_dsa_kernels
from .kpool_indices import pool_starts, pool_token_indices, pooled_keys
from .sparse_indexer import blocked_pool_topk, fused_pool_topk
from .sparse_mla import absorbed_sparse_mla


class DuplicatedLinear(torch.nn.Module):
    """Bias-free linear replicated on every TP rank (stand-in for TE's duplicated ``TELinear``)."""

    def __init__(self, input_size, output_size, *, config, init_method=None, bias=False, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype)
        )
        if init_method is not None:
            init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class IndexerKNorm(torch.nn.LayerNorm):
    """The indexer's affine LayerNorm in megatron's k_norm slot (local backend has no TE norm)."""

    def __init__(self, config, hidden_size, eps=1e-6):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


class LatentRMSNorm(torch.nn.RMSNorm):
    """MLA's q/kv latent RMSNorm. Under SP it sees only this TP rank's rows, so its weight is
    tagged ``sequence_parallel`` for megatron's ``finalize_model_grads`` to sum it over TP."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


@dataclass(frozen=True)
class DSABatchLayout:
    """Where this rank's rows sit in natural token order, and how to gather them.

    ``layout.positions[c, j]`` is the natural position of row ``j`` of CP rank ``c`` (its TP
    ranks' SP shards together); ``layout.cu_seqlens`` are the natural document boundaries.
    """

    layout: CPLayout
    tp_group: torch.distributed.ProcessGroup
    cp_group: torch.distributed.ProcessGroup
    sequence_parallel: bool

    @property
    def query_positions(self) -> torch.Tensor:
        """Natural positions of this CP rank's rows (the rows the attention queries cover)."""
        return self.layout.positions[self.cp_group.rank()]

    @property
    def query_document_starts(self) -> torch.Tensor:
        """Natural position of the first token of each query row's document."""
        cu = self.layout.cu_seqlens
        return cu[torch.bucketize(self.query_positions, cu[1:], right=True)]

    @property
    def splits_sequence(self) -> bool:
        """Whether this rank's rows are a TP slice of its CP rank's rows (SP with TP > 1)."""
        return self.sequence_parallel and self.tp_group.size() > 1

    def attends_by_rows(self, dsa: DSAConfig) -> bool:
        """``DSAConfig.attends_by_rows`` on this mesh."""
        return dsa.attends_by_rows(self.tp_group.size(), self.sequence_parallel)

    def own_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The part of a [s, ...] tensor over this CP rank's rows that covers this rank's own
        rows (its SP slice; all of them without SP)."""
        if not self.splits_sequence:
            return t
        n = t.shape[0] // self.tp_group.size()
        return t[self.tp_group.rank() * n:(self.tp_group.rank() + 1) * n]

    def cp_rank_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[r, b, ...] rows of this rank -> all rows of its CP rank: under SP the TP all-gather,
        whose backward reduce-scatters (sums the TP ranks' head-partial grads). TP > 1 without
        SP is refused when the layer is built."""
        if self.splits_sequence:
            return gather_from_sequence_parallel_region(t, group=self.tp_group)
        return t

    def whole_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """[r, b, ...] rows of this rank -> [T, b, ...] in natural order; backward sums each
        row's gradient over every rank that used it and returns this rank's share."""
        t = self.cp_rank_rows(t)
        if self.cp_group.size() > 1:
            t = gather_from_sequence_parallel_region(t, group=self.cp_group)
            t = t.index_select(0, sort_index(self.layout.rank_major_positions()))
        return t


def dsa_batch_layout(hidden_states: torch.Tensor, packed_seq_params: PackedSeqParams | None,
                     tp_group, cp_group, sequence_parallel: bool, kind: str) -> DSABatchLayout:
    """The layout of a batch from this rank's input rows: [s, b, h] (every batch row one
    sequence) or packed THD (b = 1, global natural ``cu_seqlens``, padded ones if given)."""
    sp = tp_group.size() if sequence_parallel else 1
    if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
        raise ValueError(f"DSA supports packed qkv_format 'thd' only, got {packed_seq_params.qkv_format!r}")
    cu, _ = batch_sequences(hidden_states, packed_seq_params, hidden_states.shape[0] * sp * cp_group.size())
    cp = cp_group.size()
    kind = kind if cp > 1 else "contiguous"  # one CP rank: every layout is the identity
    layout = CPLayout.build(cu, cp, sp, packed_seq_params is not None, kind)
    return DSABatchLayout(layout, tp_group, cp_group, sequence_parallel)


def select_pools(q, weights, keys, gate, ape, q_pos, doc_start, cu_seqlens, kpool: int, topk: int):
    """GLM's pooled top-k for queries at natural positions ``q_pos`` [s] (their documents start
    at ``doc_start`` [s]) over the whole sequence.

    q [s, b, H, d], weights [s, b, H] (scaled); keys, gate [T, b, d] in natural order; ape
    [kpool, d]. Pools are ``kpool`` consecutive tokens from each document's start; only complete
    pools are candidates, visible once their last token is <= the query. Ties keep the earlier
    pool (a stable sort), so the choice does not depend on how many other pools a row holds.
    Returns natural key positions [b, s, topk + kpool - 1]: pools' tokens, then the tail; -1 = none.
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

    count = q_pos - doc_start + 1  # visible tokens of the query's document
    tail_n = count % P
    offs = torch.arange(P - 1, device=dev)
    tail = (q_pos + 1 - tail_n)[:, None] + offs
    tail = tail.masked_fill(offs[None] >= tail_n[:, None], -1)
    idx = torch.cat([idx, tail[None].expand(idx.shape[0], -1, -1)], dim=-1)
    width = topk + P - 1
    return F.pad(idx, (0, width - idx.shape[-1]), value=-1)


class GlmKPoolIndexer(DSAIndexer):
    """megatron's lightning indexer (its projections) with GLM's k-pool scoring, over CP."""

    def __init__(self, config, submodules, pg_collection=None, *, index_kpool: int,
                 dsa: DSAConfig):
        super().__init__(config, submodules, pg_collection)
        self.dsa = dsa
        if self.index_topk % index_kpool:
            raise ValueError(f"index_topk={self.index_topk} must divide by index_kpool={index_kpool}")
        if config.qk_pos_emb_head_dim or config.dsa_indexer_rotate_activation:
            raise NotImplementedError("GLM's indexer has no RoPE and no Hadamard rotation")
        self.index_kpool = index_kpool
        # Fails here, at build, where the fused kernels cannot run (no CUDA or no tilelang).
        self.kernels = fused_dsa_kernels() if dsa.kernel == "fused" else None
        self.kpool_compress_ape = torch.nn.Parameter(
            torch.zeros(index_kpool, self.index_head_dim, dtype=config.params_dtype)
        )
        self.kpool_compress_gate = torch.nn.Parameter(
            torch.ones(self.index_head_dim, self.hidden_size, dtype=config.params_dtype)
        )
        # Frozen: the selection has no gradient and there is no indexer KL loss, and an optimizer
        # that steps every parameter (megatron's) would otherwise weight-decay the indexer.
        self.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x, qr, layout: DSABatchLayout):
        """x [r, b, hidden], qr [r, b, q_lora] (this rank's rows) -> natural key positions
        [b, s, index_topk + kpool - 1] for the s rows of this CP rank (int32 with the torch
        kernel, int64 with unfused)."""
        k, _ = self.linear_wk(x)
        if self.config.dsa_indexer_k_norm_fp32:
            k = self.k_norm(k.float()).to(k.dtype)
        else:
            k = self.k_norm(k)
        gate = F.linear(x, self.kpool_compress_gate)
        weights, _ = self.linear_weights_proj(x)
        weights = weights * (self.index_n_heads**-0.5) * self.softmax_scale
        # Keys of the whole sequence (narrow: 2 * index_head_dim per token); queries stay local.
        keys, gate = layout.whole_sequence(torch.cat([k, gate], -1)).chunk(2, dim=-1)
        if self.dsa.kernel != "unfused":
            return self._blocked_indices(qr, weights, keys, gate, layout)
        qr, weights = self._cp_rank_queries(qr, weights, layout)
        q, _ = self.linear_wq_b(qr)
        q = q.view(*q.shape[:2], self.index_n_heads, self.index_head_dim)
        return select_pools(q, weights, keys, gate, self.kpool_compress_ape,
                            layout.query_positions, layout.query_document_starts,
                            layout.layout.cu_seqlens,
                            self.index_kpool, self.index_topk)

    def _blocked_indices(self, qr, weights, keys, gate, layout: DSABatchLayout) -> torch.Tensor:
        """``select_pools``' indices, as int32, without the [queries x pools] scores: the
        indexer queries, pool scores, top-k and token indices of one query block at a time.
        ``tp_split=heads``: for every row of this CP rank (the TP ranks' rows gathered);
        ``sequence``: for this rank's own rows only."""
        q_pos, doc_start = layout.query_positions, layout.query_document_starts
        if layout.attends_by_rows(self.dsa):
            q_pos, doc_start = layout.own_rows(q_pos), layout.own_rows(doc_start)
        else:
            qr, weights = self._cp_rank_queries(qr, weights, layout)
        P, (s, b) = self.index_kpool, qr.shape[:2]
        cu = layout.layout.cu_seqlens
        if int(cu[-1]) >= 2**31:
            raise ValueError(f"DSA kernel {self.dsa.kernel!r} keeps int32 token indices: "
                             f"{int(cu[-1])} tokens is too many (at most 2**31 - 1)")
        starts = pool_starts(cu, P)
        pool_k = [pooled_keys(keys[:, i], gate[:, i], self.kpool_compress_ape, starts, P)
                  for i in range(b)]
        out = torch.empty(b, s, self.index_topk + P - 1, dtype=torch.int32, device=qr.device)
        block = self.dsa.indexer_query_block
        for q0 in range(0, s, block):
            q1 = min(q0 + block, s)
            q, _ = self.linear_wq_b(qr[q0:q1])
            q = q.view(q1 - q0, b, self.index_n_heads, self.index_head_dim)
            pos, first = q_pos[q0:q1], doc_start[q0:q1]
            for i in range(b):
                pools = self._top_pools(q[:, i], weights[q0:q1, i], pool_k[i], starts, pos, first)
                out[i, q0:q1] = pool_token_indices(pools, starts, pos, first, P)
        return out

    def _cp_rank_queries(self, qr, weights, layout: DSABatchLayout):
        """This rank's [q latent | head weights] -> those of all its CP rank's rows (one gather)."""
        return layout.cp_rank_rows(torch.cat([qr, weights], -1)).split(
            [qr.shape[-1], self.index_n_heads], dim=-1)

    def _top_pools(self, q, weights, pool_k, starts, pos, first):
        """One query block's selected pool ids: the Triton scores of the whole visible range
        (fused) or the torch blocks over pools."""
        P, n_select, block = self.index_kpool, self.index_topk // self.index_kpool, q.shape[0]
        if self.dsa.kernel == "fused":
            return fused_pool_topk(q, weights, pool_k, starts, pos, first, P, n_select, block,
                                   self.kernels.index_scores)
        return blocked_pool_topk(q, weights, pool_k, starts, pos, first, P, n_select,
                                 query_block=block, pool_block=self.dsa.indexer_pool_block)


class GlmDSAttention(DSAttention):
    """Core attention for GLM DSA layers: pooled indexer -> sparse attention (the torch kernel's
    absorbed sparse MLA, or megatron's ``unfused_dsa_fn``).

    Receives local queries [s, b, n, d] and, in natural order from ``GlmDSASelfAttention``,
    whole-sequence keys/values [T, b, n, d] (unfused) or the whole-sequence KV latent [T, b, R]
    as ``key`` with the kv up-projection weight (torch); the top-k indices are natural positions, so causality and
    document boundaries are in the selection and no mask is needed. ``attention_mask`` is unused
    (causal per document by construction).
    """

    def __init__(self, *args, cp_layout: str, dsa: DSAConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp_layout = cp_layout
        self.dsa = dsa
        self.kernels = fused_dsa_kernels() if dsa.kernel == "fused" else None

    def forward(self, query, key, value, attention_mask, x, qr, packed_seq_params=None,
                kv_up_weight=None, **_):
        layout = dsa_batch_layout(x, packed_seq_params, self.pg_collection.tp,
                                  self.pg_collection.cp, self.config.sequence_parallel,
                                  self.cp_layout)
        if self.skip_topk:  # "shared" layer: reuse the source layer's selection
            topk = self._get_index_share_topk_holder(packed_seq_params, attention_mask)[self.source_layer]
        else:
            topk = self.indexer(x.detach(), qr.detach(), layout)
            if self.index_share:
                self._get_index_share_topk_holder(packed_seq_params, attention_mask)[self.layer_number] = topk
        if self.dsa.kernel != "unfused":
            return self._absorbed(query, key, kv_up_weight, topk, layout)
        # The same causal, per-document bounds as a second guard (and so that megatron does not
        # build its default [s, s] causal mask, which assumes queries at positions 0..s-1).
        return unfused_dsa_fn(query, key, value, topk, self.softmax_scale,
                              varlen_starts=layout.query_document_starts,
                              varlen_ends=layout.query_positions + 1)

    def _absorbed(self, query, latent, kv_up_weight, topk, layout: DSABatchLayout):
        """query [s, b, n, dn] (this CP rank's rows, this TP rank's heads), the whole sequence's
        KV latent [T, b, R] in natural order, this TP rank's kv up-projection weight
        [n * (dn + dv), R], indices [b, s', k] -> [s, b, n * dv]. With ``tp_split=sequence``
        (and TP > 1) the queries go through an all-to-all to [s/tp, b, heads, dn], attend with
        every head's weight, and come back. Each batch row attends over its own latent column."""
        if kv_up_weight is None:
            raise ValueError(f"DSA kernel {self.dsa.kernel!r} needs the kv up-projection weight")
        s, b = query.shape[:2]
        by_rows = layout.attends_by_rows(self.dsa)
        if by_rows:
            query = _heads_to_rows(query, layout.tp_group)
            # Every head's weight; backward sums the ranks' head gradients and keeps this rank's.
            kv_up_weight = gather_from_sequence_parallel_region(kv_up_weight, group=layout.tp_group)
        outs = [self._attend(query[:, i], latent[:, i], kv_up_weight, topk[i]) for i in range(b)]
        out = outs[0].unsqueeze(1) if b == 1 else torch.stack(outs, dim=1)
        if by_rows:
            out = _rows_to_heads(out, layout.tp_group)
        return out.reshape(s, b, -1)

    def _attend(self, query, latent, kv_up_weight, indices):
        if self.dsa.kernel == "fused":
            return fused_absorbed_sparse_mla(query, latent, kv_up_weight, indices,
                                             self.softmax_scale, self.config.v_head_dim,
                                             self.dsa.fused_query_block, self.kernels)
        return absorbed_sparse_mla(query, latent, kv_up_weight, indices, self.softmax_scale,
                                   self.config.v_head_dim, self.dsa.attention_block)


def _heads_to_rows(t: torch.Tensor, group) -> torch.Tensor:
    """[s, b, n, d] (all rows, this TP rank's heads) -> [s/tp, b, n * tp, d] (this rank's SP
    rows, every head in TP-rank order); megatron's all-to-all, differentiable."""
    s, b, n, d = t.shape
    out = all_to_all_hp2sp(t.reshape(s * b, n * d), group=group)
    return out.view(s // group.size(), b, n * group.size(), d)


def _rows_to_heads(t: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``_heads_to_rows``: [s/tp, b, H, d] -> [s, b, H/tp, d]."""
    r, b, h, d = t.shape
    out = all_to_all_sp2hp(t.reshape(r * b, h * d), group=group)
    return out.view(r * group.size(), b, h // group.size(), d)


class GlmDSASelfAttention(MLASelfAttention):
    """megatron's MLA whose keys/values cover the whole sequence: the KV latent is gathered over
    SP and CP before the up projection (NoPE only). ``cp_layout`` names the CP token layout."""

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal,
                 cp_comm_type=None, pg_collection=None, pp_layer_offset=None, name=None,
                 *, cp_layout: str, dsa: DSAConfig):
        # cp_comm_type configures megatron's softmax-attention CP; DSA always gathers the latent.
        if config.qk_pos_emb_head_dim:
            raise NotImplementedError("GlmDSASelfAttention is NoPE MLA (qk_pos_emb_head_dim=0)")
        if cp_layout not in LAYOUTS:
            raise ValueError(f"unknown CP layout {cp_layout!r}; expected one of {sorted(LAYOUTS)}")
        super().__init__(config, submodules, layer_number, attn_mask_type, cp_comm_type,
                         pg_collection, pp_layer_offset, name)
        if self.pg_collection.tp.size() > 1 and not config.sequence_parallel:
            # megatron's finalize_model_grads sums every "q_layernorm" grad over TP; the MLA q
            # latent norm's grad is only TP-partial when SP splits its rows.
            raise ValueError("DSA with tp > 1 needs sequence_parallel=True")
        if self.recompute_up_proj or self.config.cache_mla_latents:
            raise NotImplementedError("DSA: up-projection recompute and latent caching are not supported")
        if self.checkpoint_core_attention:
            raise NotImplementedError("DSA: megatron's core-attention recompute is not supported "
                                      "(train.recompute rebuilds whole layers or attention blocks)")
        if dsa.kernel == "auto":
            raise ValueError("model.dsa.kernel=auto is resolved by the recipe "
                             "(Recipe.with_dsa_kernel_resolved) before the model is built")
        self.cp_layout = cp_layout
        self.dsa = dsa

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, **extra_kwargs):
        """megatron's, plus (torch kernel) the kv up-projection weight the absorbed attention
        applies to the latent that stands in ``key``."""
        if self.dsa.kernel != "unfused":
            extra_kwargs["kv_up_weight"] = self.linear_kv_up_proj.weight
        return super()._run_core_attention(query, key, value, attention_mask, packed_seq_params,
                                           attn_mask_type, **extra_kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *,
                                    inference_params=None):
        """-> query [s, b, n_loc, d] (this CP rank's rows), key/value [T, b, n_loc, d] (natural
        order), qr [r, b, q_lora] and the KV latent [r, b, kv_lora] of this rank's rows. With
        the torch kernel, key is the whole sequence's normalised KV latent [T, b, kv_lora] in
        natural order and value is None: the keys and values are never formed."""
        if key_value_states is not None or inference_context is not None or inference_params is not None:
            raise NotImplementedError("GlmDSASelfAttention: self-attention training only")
        layout = dsa_batch_layout(hidden_states, packed_seq_params, self.pg_collection.tp,
                                  self.pg_collection.cp, self.config.sequence_parallel, self.cp_layout)
        q_compressed, kv_latent = self._qkv_down_projection(hidden_states)
        if kv_latent.size(-1) != self.config.kv_lora_rank:  # column-parallel: TP-sharded width
            kv_latent = gather_from_tensor_model_parallel_region(kv_latent, group=self.tp_group)
            if self.config.sequence_parallel:
                kv_latent = scatter_to_sequence_parallel_region(kv_latent, group=self.tp_group)
        qr = self.q_layernorm(q_compressed)
        kv_latent = self.kv_layernorm(kv_latent)

        q, _ = self.linear_q_up_proj(qr)
        query = q.view(*q.shape[:2], self.num_attention_heads_per_partition, self.q_head_dim)
        if self.dsa.kernel != "unfused":
            return query, layout.whole_sequence(kv_latent), None, qr, kv_latent
        # The projection's own weight on the gathered latent: its forward would gather SP rows again.
        kv = F.linear(layout.whole_sequence(kv_latent), self.linear_kv_up_proj.weight)
        kv = kv.view(*kv.shape[:2], self.num_attention_heads_per_partition, -1)
        key, value = kv.split([self.config.qk_head_dim, self.config.v_head_dim], dim=-1)
        return query, key.contiguous(), value.contiguous(), qr, kv_latent


def glm_dsa_layer_spec(index_kpool: int, cp_layout: str, dsa: DSAConfig) -> ModuleSpec:
    """Self-attention spec: megatron MLA (local modules) with the GLM pooled-DSA core.

    Needs an MLA config with ``qk_pos_emb_head_dim=0``, ``qk_layernorm=True`` and the
    ``dsa_indexer_*`` fields; ``cp_layout`` is the CP token layout of the batch (as
    ``kda.cp_layout``); ``dsa`` the recipe's ``model.dsa`` section (its kernel and block sizes).
    """
    indexer = ModuleSpec(
        module=GlmKPoolIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=DuplicatedLinear,
            linear_wk=DuplicatedLinear,
            k_norm=IndexerKNorm,
            linear_weights_proj=DuplicatedLinear,
        ),
        params={"index_kpool": index_kpool, "dsa": dsa},
    )
    return ModuleSpec(
        module=GlmDSASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "cp_layout": cp_layout, "dsa": dsa},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=ModuleSpec(
                module=GlmDSAttention,
                params={"cp_layout": cp_layout, "dsa": dsa},
                submodules=DSAttentionSubmodules(indexer=indexer),
            ),
            linear_proj=RowParallelLinear,
            q_layernorm=LatentRMSNorm,
            kv_layernorm=LatentRMSNorm,
        ),
    )
