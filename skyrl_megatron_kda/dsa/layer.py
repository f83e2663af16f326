"""GLM-5.3-Flash DSA ("indexed attention") layer on megatron-core 0.19.2, with TP, SP and CP.

What is megatron-core's own (configured, not copied):
  * ``MLASelfAttention`` builds q_lora/kv_lora MLA: down projections, RMS norms, up projections,
    the row-parallel output projection, and its ``forward`` (which hands ``x`` and ``qr`` to a
    core attention that ``requires_dsa_inputs``). Heads are split over TP by its parallel linears.
  * ``DSAttention`` / ``DSAIndexer`` (subclassed) give the core-attention slot, the ``indexer``
    submodule with wq_b / wk / k_norm / weights_proj, and the top-k sharing bookkeeping.
  * ``unfused_dsa_fn`` runs the sparse softmax attention over the selected key indices
    (``model.dsa.kernel=unfused``, kept as the reference: ``kernels/unfused.py``).
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
    only) and hands the gathered latent to the kernel (``kv_inputs``: the latent itself as
    ``key`` for an absorbed kernel, the up-projected keys and values for unfused);
    ``_run_core_attention`` adds the kv up-projection weight.
  * The kernels (``kernels/``: one ``DSAKernel`` contract, chosen by ``model.dsa.kernel``):
    megatron-core's sparse attention keeps, per query and head, the gathered fp32 keys and
    values of every selected key, and its indexer forms the [queries x pools] score matrix. The
    ``fused`` (GPU) and ``torch`` (CPU) kernels never form whole-sequence keys and values: the
    indexer scores a block of queries at a time (``pool_topk``; then
    ``pools.pool_token_indices``, int32) and the attention runs in the absorbed MLA layout over
    the gathered KV latent (``fused_sparse_mla`` on megatron-core's TileLang kernels,
    ``sparse_mla`` in torch), keeping O(queries) tensors for backward.
  * ``model.dsa.tp_split=sequence``: an all-to-all inside TP gives each rank every head for a
    balanced 1/tp of its CP rank's rows (megatron's ``all_to_all_hp2sp``/``sp2hp`` on the rows
    in ``DSABatchRows.attention_order``), so the indexer runs once per row instead of once per
    TP rank, and no TP rank holds all the latest rows.
  * ``DuplicatedLinear`` / ``IndexerKNorm`` / ``LatentRMSNorm``: the local backend has no TE
    duplicated linear or TE norm; torch's norm refuses SP, ours tags its weights for the TP sum.

The indexer is duplicated over TP, not split: every TP rank needs the same top-k for all of its
CP rank's query rows (its heads attend over them), and splitting indexer heads would need an
all-reduce of the [rows, pools] score matrix, far more bytes than recomputing the small indexer.
It runs without gradient, as in transformers' ``Glm5NextTextIndexer`` (no indexer KL loss), and
its parameters are frozen (``requires_grad=False``).
See README.md beside this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttention,
    DSAttentionSubmodules,
)
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import DSAConfig
from ..distributed.cp_layout import layout_kind
from . import kept_selection, kernels
from .batch_rows import DSABatchRows, dsa_batch_rows
from .kernels import DSAKernel, KVDims


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


class GlmKPoolIndexer(DSAIndexer):
    """megatron's lightning indexer (its projections) with GLM's k-pool scoring, over CP; the
    selection itself is the kernel's (``DSAKernel.indices``)."""

    def __init__(self, config, submodules, pg_collection=None, *, index_kpool: int,
                 kernel: DSAKernel):
        super().__init__(config, submodules, pg_collection)
        if self.index_topk % index_kpool:
            raise ValueError(f"index_topk={self.index_topk} must divide by index_kpool={index_kpool}")
        if config.qk_pos_emb_head_dim or config.dsa_indexer_rotate_activation:
            raise NotImplementedError("GLM's indexer has no RoPE and no Hadamard rotation")
        self.index_kpool = index_kpool
        self.kernel = kernel
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
    def forward(self, x, qr, layout: DSABatchRows):
        """x [r, b, hidden], qr [r, b, q_lora] (this rank's rows) -> natural key positions
        [b, s, index_topk + kpool - 1] for the query rows of this rank's share."""
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
        return self.kernel.indices(self, qr, weights, keys, gate, layout)

    def query_heads(self, qr: torch.Tensor) -> torch.Tensor:
        """Indexer queries [n, b, index_heads, index_head_dim] of q latent rows [n, b, q_lora]."""
        q, _ = self.linear_wq_b(qr)
        return q.view(*q.shape[:2], self.index_n_heads, self.index_head_dim)

    def indexed_queries(self, qr, weights, move_rows):
        """This rank's [q latent | head weights] -> those of the rows it indexes, in one
        collective ``move_rows``: all its CP rank's rows (``DSABatchRows.cp_rank_rows``) or its
        share of them under the sequence split (``DSABatchRows.attention_share``)."""
        return move_rows(torch.cat([qr, weights], -1)).split(
            [qr.shape[-1], self.index_n_heads], dim=-1)


class GlmDSAttention(DSAttention):
    """Core attention for GLM DSA layers: the pooled indexer's selection, then the kernel's
    sparse attention.

    Receives local queries [s, b, n, d] and, in natural order from ``GlmDSASelfAttention``, what
    the kernel's ``kv_inputs`` made of the whole sequence's KV latent, with the kv up-projection
    weight; the top-k indices are natural positions, so causality and document boundaries are
    in the selection and no mask is needed (``attention_mask`` is unused).
    """

    def __init__(self, *args, cp_layout: str, kernel: DSAKernel, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp_layout = cp_layout
        self.kernel = kernel

    def forward(self, query, key, value, attention_mask, x, qr, packed_seq_params=None,
                kv_up_weight=None, **_):
        layout = dsa_batch_rows(x, packed_seq_params, self.pg_collection.tp,
                                self.pg_collection.cp, self.config.sequence_parallel,
                                self.cp_layout)
        if self.skip_topk:  # "shared" layer: reuse the source layer's selection
            topk = self._get_index_share_topk_holder(packed_seq_params, attention_mask)[self.source_layer]
        else:
            topk = kept_selection.select(lambda: self.indexer(x.detach(), qr.detach(), layout),
                                         self.indexer.index_kpool, self.indexer.index_topk)
            if self.index_share:
                self._get_index_share_topk_holder(packed_seq_params, attention_mask)[self.layer_number] = topk
        return self.kernel.attention(self, query, key, value, kv_up_weight, topk, layout)


class GlmDSASelfAttention(MLASelfAttention):
    """megatron's MLA whose keys/values cover the whole sequence: the KV latent is gathered over
    SP and CP before the up projection (NoPE only). ``cp_layout`` names the CP token layout."""

    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.causal,
                 cp_comm_type=None, pg_collection=None, pp_layer_offset=None, name=None,
                 *, cp_layout: str, kernel: DSAKernel):
        # cp_comm_type configures megatron's softmax-attention CP; DSA always gathers the latent.
        if config.qk_pos_emb_head_dim:
            raise NotImplementedError("GlmDSASelfAttention is NoPE MLA (qk_pos_emb_head_dim=0)")
        layout_kind(cp_layout)  # an unknown name is refused before megatron builds anything
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
        self.cp_layout = cp_layout
        self.kernel = kernel

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, **extra_kwargs):
        """megatron's, plus the kv up-projection weight (an absorbed kernel applies it to the
        latent that stands in ``key``)."""
        extra_kwargs["kv_up_weight"] = self.linear_kv_up_proj.weight
        return super()._run_core_attention(query, key, value, attention_mask, packed_seq_params,
                                           attn_mask_type, **extra_kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *,
                                    inference_params=None):
        """-> query [s, b, n_loc, d] (this CP rank's rows), the kernel's key and value of the
        whole sequence (``DSAKernel.kv_inputs`` of the normalised KV latent [T, b, kv_lora] in
        natural order), qr [r, b, q_lora] and the KV latent [r, b, kv_lora] of this rank's
        rows."""
        if key_value_states is not None or inference_context is not None or inference_params is not None:
            raise NotImplementedError("GlmDSASelfAttention: self-attention training only")
        layout = dsa_batch_rows(hidden_states, packed_seq_params, self.pg_collection.tp,
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
        dims = KVDims(self.num_attention_heads_per_partition, self.config.qk_head_dim,
                      self.config.v_head_dim)
        key, value = self.kernel.kv_inputs(layout.whole_sequence(kv_latent),
                                           self.linear_kv_up_proj.weight, dims)
        return query, key, value, qr, kv_latent


def glm_dsa_layer_spec(index_kpool: int, cp_layout: str, dsa: DSAConfig) -> ModuleSpec:
    """Self-attention spec: megatron MLA (local modules) with the GLM pooled-DSA core.

    Needs an MLA config with ``qk_pos_emb_head_dim=0``, ``qk_layernorm=True`` and the
    ``dsa_indexer_*`` fields; ``cp_layout`` is the CP token layout of the batch (as
    ``parallel.cp_layout``); ``dsa`` the recipe's ``model.dsa`` section, whose resolved ``kernel``
    is built here, once, and shared by the spec's three modules (``auto`` is refused:
    ``kernels.get``).
    """
    kernel = kernels.get(dsa.kernel)(dsa)
    indexer = ModuleSpec(
        module=GlmKPoolIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=DuplicatedLinear,
            linear_wk=DuplicatedLinear,
            k_norm=IndexerKNorm,
            linear_weights_proj=DuplicatedLinear,
        ),
        params={"index_kpool": index_kpool, "kernel": kernel},
    )
    return ModuleSpec(
        module=GlmDSASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "cp_layout": cp_layout, "kernel": kernel},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=ModuleSpec(
                module=GlmDSAttention,
                params={"cp_layout": cp_layout, "kernel": kernel},
                submodules=DSAttentionSubmodules(indexer=indexer),
            ),
            linear_proj=RowParallelLinear,
            q_layernorm=LatentRMSNorm,
            kv_layernorm=LatentRMSNorm,
        ),
    )
