"""GLM-5.3-Flash DSA ("indexed attention") layer on megatron-core 0.19.2, with TP, SP and CP.

What is megatron-core's own (configured, not copied):
  * ``MLASelfAttention`` builds q_lora/kv_lora MLA: down projections, RMS norms, up projections,
    the row-parallel output projection, and its ``forward`` under ``tp_split=heads`` (which
    hands ``x`` and ``qr`` to a core attention that ``requires_dsa_inputs``). Heads are split
    over TP by its parallel linears, whose parameters (shards) every split keeps.
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
  * ``model.dsa.tp_split=sequence``: each rank attends with every head for a balanced 1/tp of
    its CP rank's rows (``DSABatchRows.attention_order``), so the indexer runs once per row
    instead of once per TP rank, and no TP rank holds all the latest rows; the whole layer then
    runs on rows (``GlmDSASelfAttention.forward_by_rows``: every projection with its whole
    weight gathered over TP, the q latent to the share and the output back by all-to-all),
    instead of megatron's row gathers around head-split linears.
  * ``DuplicatedLinear`` / ``IndexerKNorm`` / ``LatentRMSNorm``: the local backend has no TE
    duplicated linear or TE norm; torch's norm refuses SP, ours tags its weights for the TP sum.
  * LoRA (lora/adapter.py): where this layer reads a linear's weight instead of calling it (the kv
    up projection's, handed to the kernels; every projection's on the rows path) it reads
    ``adapted_weight`` (``W + (alpha/r) B A`` of the shard; the weight itself without adapter).

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
)
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import DSAConfig
from ..distributed.cp_layout import layout_kind
from ..lora.adapter import adapted_weight
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
        """x [r, b, hidden] (this rank's rows), qr [r', b, q_lora] (the q latent of the rows its
        attention takes: its own, or under the sequence split its share) -> natural key
        positions [b, s, index_topk + kpool - 1] for the query rows of this rank's share."""
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

    def cp_rank_queries(self, qr, weights, layout: DSABatchRows):
        """This rank's [q latent | head weights] -> those of all its CP rank's rows (one gather)."""
        return layout.cp_rank_rows(torch.cat([qr, weights], -1)).split(
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

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, position_ids=None, sequence_len_offset=None, *,
                inference_params=None):
        """megatron's MLA forward, or under ``model.dsa.tp_split=sequence`` (TP > 1 with SP)
        ``forward_by_rows``."""
        tp = self.pg_collection.tp.size()
        if not self.kernel.dsa.attends_by_rows(tp, self.config.sequence_parallel):
            return super().forward(hidden_states, attention_mask, key_value_states,
                                   inference_context, rotary_pos_emb, rotary_pos_cos,
                                   rotary_pos_sin, rotary_pos_cos_sin, attention_bias,
                                   packed_seq_params, position_ids, sequence_len_offset,
                                   inference_params=inference_params)
        unsupported = (key_value_states, inference_context, inference_params, rotary_pos_emb,
                       rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin, attention_bias)
        if any(v is not None for v in unsupported):
            raise NotImplementedError("GlmDSASelfAttention: self-attention training only")
        return self.forward_by_rows(hidden_states, attention_mask, packed_seq_params)

    def forward_by_rows(self, hidden_states, attention_mask, packed_seq_params=None):
        """The layer on rows instead of heads: hidden_states [r, b, hidden] (this rank's SP
        rows) -> ([r, b, hidden], bias), as megatron's forward returns it.

        megatron's parallel linears split heads over TP and gather rows around each one: the
        input rows before the down projections, their outputs' widths, the q latent rows before
        the q up projection, and a reduce-scatter after the output projection. Under the
        sequence split the attention already runs on rows (each rank every head of a share of
        its CP rank's rows), so every projection runs there too, on whole weights gathered
        over TP (their gradients reduce-scattered back to the shards): the down projections and
        norms on this rank's own rows, then one all-to-all of the q latent to the share
        (``DSABatchRows.to_share``), the q up projection, the attention and the output
        projection on the share, and one all-to-all of the output back to the rank's rows. The
        rows move as latents (1,536 values) and outputs (hidden), not as every head's queries
        and outputs; the FLOPs are the same. The KV latent is gathered as in ``forward``."""
        x, tp = hidden_states, self.tp_group
        layout = dsa_batch_rows(x, packed_seq_params, self.pg_collection.tp,
                                self.pg_collection.cp, self.config.sequence_parallel, self.cp_layout)
        qr = self.q_layernorm(_whole_linear(self.linear_q_down_proj, x, tp))
        kv_latent = self.kv_layernorm(_whole_linear(self.linear_kv_down_proj, x, tp))
        qr = layout.to_share(qr)
        q = _whole_linear(self.linear_q_up_proj, qr, tp)
        heads = self.config.num_attention_heads
        query = q.view(*q.shape[:2], heads, self.q_head_dim)
        kv_up_weight = gather_from_sequence_parallel_region(adapted_weight(self.linear_kv_up_proj),
                                                            group=tp)
        dims = KVDims(heads, self.config.qk_head_dim, self.config.v_head_dim)
        key, value = self.kernel.kv_inputs(layout.whole_sequence(kv_latent), kv_up_weight, dims)
        out = self.core_attention(query, key, value, attention_mask, x=x, qr=qr,
                                  packed_seq_params=packed_seq_params, kv_up_weight=kv_up_weight)
        # The row-parallel output projection's weight [hidden, heads/tp * v] gathered along its
        # input width: the transpose's rows.
        proj = self.linear_proj
        out = out.reshape(*out.shape[:2], -1) @ gather_from_sequence_parallel_region(
            adapted_weight(proj).t(), group=tp)
        out = layout.from_share(out)
        if proj.bias is not None and not proj.skip_bias_add:
            return out + proj.bias, None
        return out, proj.bias

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, **extra_kwargs):
        """megatron's, plus the kv up-projection weight (an absorbed kernel applies it to the
        latent that stands in ``key``)."""
        extra_kwargs["kv_up_weight"] = adapted_weight(self.linear_kv_up_proj)
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
                                           adapted_weight(self.linear_kv_up_proj), dims)
        return query, key, value, qr, kv_latent


def _whole_linear(linear: ColumnParallelLinear, x: torch.Tensor, group) -> torch.Tensor:
    """A column-parallel linear layer on rows with its whole (LoRA-adapted) weight (and bias),
    gathered over TP; the gather's backward reduce-scatters the weight's gradient to the shards. megatron's
    MLA drops a bias it was asked to skip, so this does too."""
    weight = gather_from_sequence_parallel_region(adapted_weight(linear), group=group)
    bias = linear.bias
    if bias is not None:
        bias = None if linear.skip_bias_add else gather_from_sequence_parallel_region(bias, group=group)
    return F.linear(x, weight, bias)


def glm_dsa_layer_spec(cp_layout: str, dsa: DSAConfig) -> ModuleSpec:
    """Self-attention spec: megatron MLA (local modules) with the GLM pooled-DSA core.

    Needs an MLA config with ``qk_pos_emb_head_dim=0``, ``qk_layernorm=True`` and the
    ``dsa_indexer_*`` fields; ``cp_layout`` is the CP token layout of the batch (as
    ``parallel.cp_layout``); ``dsa`` the recipe's ``model.dsa`` section (its ``index_kpool``
    pools the indexer's keys), whose resolved ``kernel`` is built here, once, and shared by the
    spec's three modules (``auto`` is refused: ``kernels.get``).
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
        params={"index_kpool": dsa.index_kpool, "kernel": kernel},
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
