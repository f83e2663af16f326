"""GLM-5.3-Flash DSA ("indexed attention") layer on megatron-core 0.19.2.

What is megatron-core's own (configured, not copied):
  * ``MLASelfAttention`` builds q_lora/kv_lora MLA (q_a/kv_a down projections, RMS norms,
    up projections, output projection). NoPE works with ``qk_pos_emb_head_dim=0``.
  * ``DSAttention`` (subclassed) gives the core-attention slot that receives ``x`` and ``qr``
    (``requires_dsa_inputs``), the ``indexer`` submodule and the top-k sharing bookkeeping.
  * ``DSAIndexer`` (subclassed) owns wq_b / wk / LayerNorm k_norm / weights_proj and computes
    q, k and the per-head weights (RoPE of width 0, Hadamard rotation off).
  * ``unfused_dsa_fn`` runs the sparse softmax attention over the selected key indices.

What is ours, and why (megatron-core 0.19.2 has no equivalent):
  * k-pool compression: GLM pools ``index_kpool`` consecutive indexer keys with a learned
    softmax gate (``kpool_compress_gate`` over hidden, plus ``kpool_compress_ape``) and scores
    pools, not tokens; megatron scores every token.
  * pool -> token expansion and the always-selected tail (the current incomplete pool).
  * ``DuplicatedLinear``: megatron's DSA spec uses TE's ``TELinear`` (``parallel_mode=
    "duplicated"``); the local backend has none, so a replicated plain linear stands in.
  * The forward of ``GlmDSAttention``: megatron's ``DSAttention.forward`` couples its
    token-level indexer with CP / indexer-loss paths; ours calls the pooled indexer and then
    megatron's ``unfused_dsa_fn`` directly (no CP, no indexer KL loss yet).

Selection follows transformers' ``Glm5NextTextIndexer`` (no grad through the indexer, as there)
for unpadded causal sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttention,
    DSAttentionSubmodules,
    unfused_dsa_fn,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm


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


class GlmKPoolIndexer(DSAIndexer):
    """megatron's lightning indexer plus GLM's k-pool compression and tail selection."""

    def __init__(self, config, submodules, pg_collection=None, index_kpool: int = 4):
        super().__init__(config, submodules, pg_collection)
        self.index_kpool = index_kpool
        assert self.index_topk % index_kpool == 0, "index_topk must divide by index_kpool"
        self.kpool_compress_ape = torch.nn.Parameter(
            torch.zeros(index_kpool, self.index_head_dim, dtype=config.params_dtype)
        )
        self.kpool_compress_gate = torch.nn.Parameter(
            torch.ones(self.index_head_dim, self.hidden_size, dtype=config.params_dtype)
        )

    @torch.no_grad()
    def forward(self, x, qr, mask=None, packed_seq_params=None):
        """Top-k token indices [b, s, index_topk + kpool - 1]; -1 marks an empty slot."""
        assert packed_seq_params is None and mask is None, "only unpadded causal sbhd input"
        # q [s, b, h, d]; k [s, b, d]; weights [s, b, h] (already * h^-0.5 * d^-0.5)
        q, k, weights = self.forward_before_topk(x, qr)
        s, b, _ = k.shape
        P, n_pool = self.index_kpool, (s + self.index_kpool - 1) // self.index_kpool
        dev = k.device

        # Pool p holds tokens [pP, pP+P); only complete pools are candidates.
        tok = torch.arange(n_pool * P, device=dev).view(n_pool, P)
        in_range = tok < s
        safe = tok.clamp(max=s - 1)
        gate = F.linear(x, self.kpool_compress_gate)  # [s, b, d]
        logits = gate.float()[safe] + self.kpool_compress_ape.float()[None, :, None, :]
        logits = logits.masked_fill(~in_range[..., None, None], float("-inf"))
        prob = torch.nan_to_num(logits.softmax(dim=1)).to(k.dtype)  # [n_pool, P, b, d]
        pool_k = (prob * k[safe]).sum(dim=1)  # [n_pool, b, d]
        pool_complete = in_range.all(-1)  # [n_pool]

        # Scores [s, b, h, n_pool] -> relu -> head-weighted sum -> [b, s, n_pool]
        scores = torch.einsum("sbhd,pbd->sbhp", q.float(), pool_k.float()).relu()
        scores = (scores * weights.float().unsqueeze(-1)).sum(2).transpose(0, 1)
        pos = torch.arange(s, device=dev)
        visible = (tok[:, -1][None, :] <= pos[:, None]) & pool_complete[None, :]  # [s, n_pool]
        scores = scores.masked_fill(~visible[None], torch.finfo(scores.dtype).min)

        select_k = min(self.index_topk // P, n_pool)
        sel = scores.topk(select_k, dim=-1).indices  # [b, s, k]
        sel_ok = visible[pos[:, None], sel]  # [b, s, k]
        idx = tok[sel].masked_fill(~sel_ok[..., None], -1).flatten(-2)  # [b, s, k*P]

        # Tail: the visible tokens of the query's incomplete pool, always selected.
        count = pos + 1
        tail_n = count % P
        offs = torch.arange(P - 1, device=dev)
        tail = (count - tail_n)[:, None] + offs
        tail = tail.masked_fill(offs[None] >= tail_n[:, None], -1)
        idx = torch.cat([idx, tail[None].expand(b, -1, -1)], dim=-1)
        width = self.index_topk + P - 1
        return F.pad(idx, (0, width - idx.shape[-1]), value=-1)[..., :width]


class GlmDSAttention(DSAttention):
    """Core attention for GLM DSA layers: pooled indexer -> megatron's sparse attention."""

    def forward(self, query, key, value, attention_mask, x, qr, packed_seq_params=None, **_):
        assert packed_seq_params is None, "packed sequences not supported yet"
        if self.skip_topk:  # "shared" layer: reuse the source layer's selection
            topk = self._get_index_share_topk_holder(None, attention_mask)[self.source_layer]
        else:
            topk = self.indexer(x, qr)
            if self.index_share:
                self._get_index_share_topk_holder(None, attention_mask)[self.layer_number] = topk
        return unfused_dsa_fn(query, key, value, topk, self.softmax_scale)


def glm_dsa_layer_spec(index_kpool: int) -> ModuleSpec:
    """Self-attention spec: megatron MLA (local modules) with the GLM pooled-DSA core."""
    rms = WrappedTorchNorm  # needs config.normalization="RMSNorm", qk_layernorm=True
    indexer = ModuleSpec(
        module=GlmKPoolIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=DuplicatedLinear,
            linear_wk=DuplicatedLinear,
            k_norm=IndexerKNorm,
            linear_weights_proj=DuplicatedLinear,
        ),
        params={"index_kpool": index_kpool},
    )
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=ModuleSpec(
                module=GlmDSAttention, submodules=DSAttentionSubmodules(indexer=indexer)
            ),
            linear_proj=RowParallelLinear,
            q_layernorm=rms,
            kv_layernorm=rms,
        ),
    )
