"""The GLM-5.3-Flash text model (trunk without the MTP layer) assembled from megatron-core parts.

Structure (transformers' ``Glm5NextTextModel`` + ``lm_head``; sizes all from the recipe)::

    embedding      megatron VocabParallelEmbedding (no position embedding: NoPE)
    expand         copy the embedding into N mHC streams                [s, b, N, D]
    layers[i]      GLMDecoderLayer: attention block then FFN block, each inside its own mHC
                   attention = KDA (kda/layer.py) where i % dsa_every != dsa_offset, else DSA
                   (dsa/layer.py: megatron MLA + GLM's pooled indexer)
                   FFN = megatron MLP (clamped SwiGLU) for i < num_dense_layers, else MoELayer
    collapse       unweighted mean of the streams
    final_norm     RMSNorm
    output_layer   megatron ColumnParallelLinear (vocab-parallel logits; tied if configured)

Why a decoder layer of our own instead of megatron's ``TransformerLayer``: mHC replaces the
residual add (each block reads a learned mix of N streams and writes back into all of them), and
megatron-core 0.19.2 has no hook for that; every block inside is megatron's own module.

``train.recompute`` rebuilds whole layers (``full``) or attention blocks (``selective``) of the
types in ``train.recompute_layers`` in backward (reentrant checkpoints, as megatron's);
``train.offload_activations`` keeps the tensors saved for backward in host memory (parameters
excepted, model/host_offload.py);
``train.loss_chunk_tokens`` computes the head's log-probs (the loss) in token chunks without
forming the logits (``GLMModel.token_logprobs``, model/head.py); ``train.moe_chunk_tokens`` runs
the MoE experts in token chunks, each rebuilt in backward (model/moe_layer.py).

Tensors are megatron's ``[s, b, ...]`` inside; ``s`` is this rank's CP shard (zigzag by default)
and, under sequence parallelism, its ``1/tp`` slice. The MTP layer is not built.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import MLATransformerConfig
from torch.utils.checkpoint import checkpoint

from ..config import Recipe
from ..kda import exchanges
from ..kda.exchanges import CommLedger
from ..kda.kernel import use_fla_backward
from ..kda.layer import kda_layer_spec
from .. import recipe_rules
from ..megatron_config import mesh_config_kwargs
from ..dsa.kept_selection import KeptSelection, kept_for
from ..dsa.layer import glm_dsa_layer_spec
from . import head
from .host_offload import HostOffload
from .hyper_connections import HyperConnection, expand_to_streams, reduce_streams
from .moe import build_moe_layer, check_glm_moe_config, moe_transformer_config_kwargs


class RMSNorm(torch.nn.Module):
    """GLM's RMSNorm (fp32 statistics, cast back, then the weight), usable under SP.

    megatron's local torch norm refuses sequence parallelism; under SP each TP rank sees only its
    rows, so the weight is tagged ``sequence_parallel`` and ``finalize_model_grads`` sums its
    gradient over TP (as megatron does for its own norms)."""

    def __init__(self, config, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def glm_transformer_config(recipe: Recipe, *, use_cpu: bool) -> MLATransformerConfig:
    """One megatron config for the whole model: MLA/DSA sizes, the dense FFN, the MoE (through
    model/moe.py) and the mesh. KDA layers read their own sizes from ``recipe.kda``."""
    m, dsa = recipe.model, recipe.model.dsa
    config = MLATransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.dense_ffn_hidden_size,
        num_attention_heads=dsa.num_heads,
        **mesh_config_kwargs(recipe, use_cpu=use_cpu),
        normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MLA without RoPE (GLM-5.3-Flash's text tower is NoPE).
        multi_latent_attention=True,
        q_lora_rank=dsa.q_lora_rank,
        kv_lora_rank=dsa.kv_lora_rank,
        qk_head_dim=dsa.qk_nope_head_dim,
        qk_pos_emb_head_dim=dsa.qk_rope_head_dim,
        v_head_dim=dsa.v_head_dim,
        rope_type="rope",
        rotary_scaling_factor=1.0,
        qk_layernorm=True,
        # DSA: megatron's variant switch, all-gather CP; the k-pool lives in dsa/layer.py.
        experimental_attention_variant="dsa",
        cp_comm_type="allgather",
        dsa_indexer_n_heads=dsa.index_num_heads,
        dsa_indexer_head_dim=dsa.index_head_dim,
        dsa_indexer_topk=dsa.index_topk,
        dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=1e-6,
        **moe_transformer_config_kwargs(m.moe),
    )
    check_glm_moe_config(config)
    return config


def _dense_mlp_spec() -> ModuleSpec:
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


class GLMDecoderLayer(MegatronModule):
    """One trunk layer: ``streams -> attn_hc -> norm -> attention -> expand -> ffn_hc -> norm ->
    FFN -> expand``, as transformers' ``Glm5NextTextDecoderLayer``."""

    def __init__(self, config: MLATransformerConfig, recipe: Recipe, layer_index: int,
                 pg_collection: ProcessGroupCollection, ledger: CommLedger):
        super().__init__(config)
        m = recipe.model
        self.layer_type = m.layer_types()[layer_index]
        self.mlp_type = m.mlp_types()[layer_index]
        hc = m.hyper_connections
        self.recompute = recipe.train.recompute_of(self.layer_type)
        self.keeps_selection = (self.layer_type == "dsa" and self.recompute != "none"
                                and recipe.train.keep_dsa_selection)
        hc_args = dict(hidden_size=m.hidden_size, num_streams=hc.num_streams,
                       sinkhorn_iters=hc.sinkhorn_iterations, hc_eps=hc.eps, norm_eps=m.rms_norm_eps,
                       map_chunk_rows=hc.map_chunk_rows)
        self.attn_hc = HyperConnection(**hc_args)
        self.ffn_hc = HyperConnection(**hc_args)
        self.input_layernorm = RMSNorm(config, m.hidden_size, m.rms_norm_eps)
        self.pre_mlp_layernorm = RMSNorm(config, m.hidden_size, m.rms_norm_eps)
        number = layer_index + 1  # megatron counts layers from 1
        if self.layer_type == "kda":
            self.self_attention = build_module(
                kda_layer_spec(recipe.kda, recipe.parallel.cp_layout), config=config, layer_number=number,
                pg_collection=pg_collection, ledger=ledger)
        else:
            dsa = recipe.model.dsa
            spec = glm_dsa_layer_spec(recipe.parallel.cp_layout, dsa)
            self.self_attention = build_module(spec, config=config, layer_number=number,
                                               pg_collection=pg_collection)
        if self.mlp_type == "dense":
            self.mlp = build_module(_dense_mlp_spec(), config=config, tp_group=pg_collection.tp)
        else:
            self.mlp = build_moe_layer(m.moe, config=config, layer_number=number,
                                       pg_collection=pg_collection,
                                       chunk_tokens=recipe.train.moe_chunk_tokens)

    def kept_selection(self) -> KeptSelection | None:
        """What one checkpoint of this layer hands its recompute: a DSA layer's indexer
        selection (``train.keep_dsa_selection``), so that the indexer runs once per step."""
        return KeptSelection() if self.keeps_selection else None

    def _attention(self, x: torch.Tensor, packed_seq_params: PackedSeqParams | None,
                   kept: KeptSelection | None = None) -> torch.Tensor:
        with kept_for(kept):
            out, bias = self.self_attention(self.input_layernorm(x), None,
                                            packed_seq_params=packed_seq_params)
        return _with_bias(out, bias)

    def forward(self, streams: torch.Tensor, packed_seq_params: PackedSeqParams | None = None,
                kept: KeptSelection | None = None) -> torch.Tensor:
        """streams [s, b, N, D] -> streams [s, b, N, D]; ``kept``: the selection holder of a
        full-recompute checkpoint (``kept_selection``)."""
        x, post, comb = self.attn_hc(streams)
        if self.recompute == "selective" and torch.is_grad_enabled():
            out = checkpoint(self._attention, x, packed_seq_params, self.kept_selection(),
                             use_reentrant=True)
        else:
            out = self._attention(x, packed_seq_params, kept)
        streams = self.attn_hc.expand(out, streams, post, comb)
        x, post, comb = self.ffn_hc(streams)
        out, bias = self.mlp(self.pre_mlp_layernorm(x))
        return self.ffn_hc.expand(_with_bias(out, bias), streams, post, comb)


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias


class GLMModel(MegatronModule):
    """GLM-5.3-Flash text model on one rank of the TP x CP x EP mesh (see the module docstring)."""

    def __init__(self, config: MLATransformerConfig, recipe: Recipe,
                 pg_collection: ProcessGroupCollection):
        super().__init__(config)
        m = recipe.model
        self.recipe = recipe
        self.pg_collection = pg_collection
        self.num_streams = m.hyper_connections.num_streams
        # megatron's VocabParallelEmbedding, not LanguageModelEmbedding: NoPE needs no position
        # table, and GLM has no embedding dropout (whose RNG fork is all the latter would add).
        # Under SP the TP all-reduce of the vocabulary shards is a reduce-scatter over rows.
        self.embedding = VocabParallelEmbedding(
            m.vocab_size, m.hidden_size, init_method=config.embedding_init_method,
            reduce_scatter_embeddings=config.sequence_parallel, config=config,
            tp_group=pg_collection.tp)
        self._ledgers: list[CommLedger] = []
        layers = []
        for i in range(m.num_layers):
            ledger = CommLedger()
            self._ledgers.append(ledger)
            layers.append(GLMDecoderLayer(config, recipe, i, pg_collection, ledger))
        self.layers = torch.nn.ModuleList(layers)
        self.final_norm = RMSNorm(config, m.hidden_size, m.rms_norm_eps)
        self.output_layer = ColumnParallelLinear(
            m.hidden_size, m.vocab_size, config=config, init_method=config.init_method,
            bias=False, skip_bias_add=False, gather_output=False,
            skip_weight_param_allocation=m.tie_word_embeddings, tp_group=pg_collection.tp)
        self._cp_bytes_base = 0
        # train.loss_chunk_tokens: the head in token chunks without the logits (token_logprobs).
        self.loss_chunk_tokens = recipe.train.loss_chunk_tokens
        self.host_offload = HostOffload() if recipe.train.offload_activations else None

    # --- communication accounting -------------------------------------------------------------

    def _cp_bytes_total(self) -> int:
        total = 0
        for ledger in self._ledgers:
            for key, entry in ledger.as_dict().items():
                if key.startswith("cp/"):
                    total += entry["sent"]
        return total

    def cp_bytes(self) -> int:
        """Bytes this rank sent over the CP group in all KDA layers (forward and backward) since
        the last ``reset_cp_bytes`` (or construction)."""
        return self._cp_bytes_total() - self._cp_bytes_base

    def reset_cp_bytes(self) -> None:
        """Start a new ``cp_bytes`` count (e.g. at each training step)."""
        self._cp_bytes_base = self._cp_bytes_total()

    # --- forward ------------------------------------------------------------------------------

    def _output_weight(self) -> torch.Tensor | None:
        return self.embedding.weight if self.recipe.model.tie_word_embeddings else None

    def _vocab_weight(self) -> torch.Tensor:
        """This rank's vocabulary shard of the output layer [V/tp, D] (the embedding when tied)."""
        tied = self._output_weight()
        return self.output_layer.weight if tied is None else tied

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """Logits [b, s_local, vocab/tp] of ``input_ids`` [b, s_local] (see ``_final_hidden``);
        losses and log-probs come from ``token_logprobs``. ``position_ids`` are accepted for
        megatron's calling convention and unused: the model has no positional encoding (KDA is
        causal by construction, DSA is NoPE)."""
        hidden = self._final_hidden(input_ids, packed_seq_params)
        logits, _ = self.output_layer(hidden, weight=self._output_weight())  # [s, b, V/tp]
        return logits.transpose(0, 1).contiguous()

    def token_logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                       packed_seq_params: PackedSeqParams | None = None, temperature: float = 1.0,
                       entropy: bool = False, entropy_grad: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head: (fp32 log-probs [b, s_local] of ``labels`` [b, s_local] under
        softmax(logits / ``temperature``), each token's entropy [b, s_local] when ``entropy``,
        else None), unmasked. The fine-tune loss is the negated log-prob at temperature 1
        (megatron's vocab-parallel cross entropy); the RL path adds the sampling temperature and
        the entropy, differentiable with ``entropy_grad`` (model/head.py).

        The model picks how: in token chunks without the logits under ``train.loss_chunk_tokens``
        (the fast path), else from the whole logits (the reference); both give the same numbers.
        """
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}")
        hidden = self._final_hidden(input_ids, packed_seq_params)
        labels = labels.transpose(0, 1).contiguous()  # [s, b], as the hidden states
        options = dict(tp_group=self.pg_collection.tp, temperature=temperature, entropy=entropy,
                       entropy_grad=entropy_grad)
        if self.loss_chunk_tokens is not None:
            logp, ent = head.chunked_logprobs(
                hidden, self._vocab_weight(), labels, chunk=self.loss_chunk_tokens,
                sequence_parallel=self.config.sequence_parallel, **options)
        else:
            logits, _ = self.output_layer(hidden, weight=self._output_weight())  # [s, b, V/tp]
            logp, ent = head.logprobs_from_logits(logits, labels, **options)
        logp = logp.transpose(0, 1).contiguous()
        return logp, None if ent is None else ent.transpose(0, 1).contiguous()

    def _final_hidden(self, input_ids: torch.Tensor, packed_seq_params: PackedSeqParams | None
                      ) -> torch.Tensor:
        """The trunk: final-norm hidden states [s, b, D] (SP: this TP rank's [s/tp, b, D]) of
        ``input_ids`` [b, s_local], this CP rank's tokens in the recipe's CP layout (packed THD:
        b = 1 and ``packed_seq_params`` with the global cu_seqlens)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [b, s_local], got shape {tuple(input_ids.shape)}")
        # The head's saved tensors stay on the device: saved last and read first in backward,
        # in host memory they would lower no peak and cost two copies.
        with self._saved_tensors_home():
            hidden = self.embedding(input_ids)  # SP: [s/tp, b, D]; else [b, s, D]
            if not self.config.sequence_parallel:
                hidden = hidden.transpose(0, 1).contiguous()
            streams = expand_to_streams(hidden, self.num_streams)
            for layer in self.layers:
                if layer.recompute == "full" and torch.is_grad_enabled():
                    # Reentrant, like megatron's recompute: the first forward runs without grad, so
                    # stateful counters (the MoE router's tokens per expert) count each token once.
                    streams = checkpoint(layer, streams, packed_seq_params, layer.kept_selection(),
                                         use_reentrant=True)
                else:
                    streams = layer(streams, packed_seq_params)
        return self.final_norm(reduce_streams(streams))

    def _saved_tensors_home(self):
        """Where autograd keeps the tensors saved for backward: host memory under
        ``train.offload_activations`` (model/host_offload.py), else where they are."""
        if self.host_offload is None:
            return contextlib.nullcontext()
        return self.host_offload.hooks(self)


def build_model(recipe: Recipe, *, use_cpu: bool, pg_collection: ProcessGroupCollection | None = None
                ) -> GLMModel:
    """The model for ``recipe`` on this rank (megatron parallel state must be initialised).

    ``kda.cp_exchange=auto`` must be resolved already (``recipes.load_recipe`` does it, once);
    the choice is on ``model.recipe`` (its reason is the loader's, ``recipes.LoadedRecipe``). Random
    init on CPU draws full tensors and slices them (the MoE layers' from a seed per tensor,
    ``model.moe.build_moe_layer``), so the same seed gives the same full weights at every mesh:
    TP, CP, EP, ETP."""
    pgs = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    recipe_rules.check(recipe)  # a recipe not made by recipes.load_recipe meets them here
    _check_mesh(recipe, pgs)
    exchanges.get(recipe.kda.cp_exchange)  # refuses an unresolved auto before any layer is built
    use_fla_backward(recipe.kda.fla_backward)
    config = glm_transformer_config(recipe, use_cpu=use_cpu)
    return GLMModel(config, recipe, pgs)


def _check_mesh(recipe: Recipe, pgs: ProcessGroupCollection) -> None:
    """The live process groups must be the mesh the recipe describes."""
    p = recipe.parallel
    live = {"tp": pgs.tp.size(), "cp": pgs.cp.size(), "ep": pgs.ep.size(), "etp": pgs.expt_tp.size()}
    want = {"tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp}
    if live != want:
        raise ValueError(f"megatron parallel state {live} does not match the recipe's {want}; "
                         "initialise it from recipe.parallel")
