"""The parameter census: every parameter of one rank, counted exactly as ``model/glm.py`` builds
it (tests compare the counts with the megatron model element by element), with each tensor's
dtype (the mHC maps and KDA's ``A_log``/``dt_bias`` stay fp32 in a bf16 model). Under
``train.lora`` every base parameter is frozen and the adapters (``lora.py``) are the trainable
``lora`` component."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..config import Recipe
from .lora import lora_numels
from .rows import DTYPE_BYTES


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one kind on one rank: all layers together, one dtype."""

    component: str  # see PARAM_COMPONENTS
    numel: int
    dtype_bytes: int
    trainable: bool = True  # has a gradient and Adam state (the DSA indexer is frozen; under
    # train.lora every base parameter)
    expert: bool = False  # routed-expert weight: optimizer sharded over the expert-DP group

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype_bytes


PARAM_COMPONENTS = ("embedding", "output_layer", "final_norm", "mhc", "layer_norms", "kda", "dsa",
                    "dsa_indexer", "dense_mlp", "moe_router", "moe_shared", "moe_experts", "lora")
"""Parameter kinds, in the order of the model."""


PARAM_GROUPS: dict[str, tuple[str, ...]] = {
    "KDA attention": ("kda",),
    "DSA attention": ("dsa", "dsa_indexer"),
    "dense MLP": ("dense_mlp",),
    "MoE routed experts": ("moe_experts",),
    "MoE shared + router": ("moe_shared", "moe_router"),
    "embedding + output": ("embedding", "output_layer"),
    "mHC + norms": ("mhc", "layer_norms", "final_norm"),
    "LoRA adapters": ("lora",),
}
"""How the table groups the parameter kinds."""


def rank_parameters(recipe: Recipe) -> list[ParamGroup]:
    """The parameters of one rank, grouped by kind and dtype (every rank holds the same count:
    TP shards evenly, each EP rank owns num_experts/ep experts); under ``train.lora`` the base
    frozen and the adapters added (``lora.py``)."""
    m, p, k = recipe.model, recipe.parallel, recipe.kda
    w = DTYPE_BYTES[m.params_dtype]
    D, tp, N = m.hidden_size, p.tp, m.hyper_connections.num_streams
    kinds = m.layer_types()
    mlps = m.mlp_types()
    n_kda, n_dsa = kinds.count("kda"), kinds.count("dsa")
    n_dense, n_moe = mlps.count("dense"), mlps.count("moe")
    out: list[ParamGroup] = []

    def add(component: str, numel: int, dtype_bytes: int = w, **flags) -> None:
        if numel:
            out.append(ParamGroup(component, numel, dtype_bytes, **flags))

    vocab_shard = m.vocab_size // tp * D
    add("embedding", vocab_shard)
    add("output_layer", 0 if m.tie_word_embeddings else vocab_shard)
    add("final_norm", D)
    # Two HyperConnection modules per layer: fn [(2+N)N, N*D], base [(2+N)N], scale [3], fp32.
    add("mhc", m.num_layers * 2 * ((2 + N) * N * N * D + (2 + N) * N + 3), 4)
    add("layer_norms", m.num_layers * 2 * D)

    # KDA (kda/layer.py): column-parallel q/k/v/f_b/g_b/b, row-parallel o_proj, TP-duplicated
    # f_a/g_a/o_norm, head-sharded conv taps; A_log and dt_bias fp32.
    h, K = k.num_heads // tp, k.head_dim
    lw = h * K
    kda_w = 3 * lw * D + lw * (k.gate_low_rank + k.output_gate_low_rank) + h * D + lw * D
    kda_w += (k.gate_low_rank + k.output_gate_low_rank) * D + K + 3 * lw * k.conv_size
    add("kda", n_kda * kda_w)
    add("kda", n_kda * (h + lw), 4)

    # DSA (dsa/layer.py): megatron MLA, every projection TP-sharded (down projections too),
    # latent norms duplicated; the indexer duplicated and frozen.
    a = m.dsa
    n, dq = a.num_heads // tp, a.qk_nope_head_dim + a.qk_rope_head_dim
    dsa_w = a.q_lora_rank // tp * D + n * dq * a.q_lora_rank
    dsa_w += (a.kv_lora_rank + a.qk_rope_head_dim) // tp * D
    dsa_w += n * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank + D * n * a.v_head_dim
    dsa_w += a.q_lora_rank + a.kv_lora_rank
    add("dsa", n_dsa * dsa_w)
    hi, di = a.index_num_heads, a.index_head_dim
    indexer = hi * di * a.q_lora_rank + di * D + 2 * di + hi * D + a.index_kpool * di + di * D
    add("dsa_indexer", n_dsa * indexer, trainable=False)

    # SwiGLU MLPs: fc1 [2F, D] column-parallel (gate and up), fc2 [D, F] row-parallel.
    add("dense_mlp", n_dense * 3 * m.dense_ffn_hidden_size // tp * D)
    e = m.moe
    add("moe_router", n_moe * e.num_experts * D)
    add("moe_shared", n_moe * 3 * e.ffn_hidden_size * e.num_shared_experts // tp * D)
    local_experts = e.num_experts // p.ep
    add("moe_experts", n_moe * local_experts * 3 * (e.ffn_hidden_size // p.etp) * D, expert=True)
    if recipe.train.lora.enabled:
        out = [ParamGroup(g.component, g.numel, g.dtype_bytes, False, g.expert) for g in out]
        dense_lora, expert_lora = lora_numels(recipe)
        add("lora", dense_lora)
        add("lora", expert_lora, expert=True)  # per-expert adapters: sharded as the experts
    return out


def rank_buffers_bytes(recipe: Recipe) -> int:
    """Non-parameter state of the model: each router's fp32 ``expert_bias`` and token counter."""
    n_moe = recipe.model.mlp_types().count("moe")
    return n_moe * 2 * recipe.model.moe.num_experts * 4 if recipe.model.moe.score_correction_bias else 0


def total_parameters(recipe: Recipe) -> int:
    """Parameters of the whole model (all ranks together, no replicas): the rank count at
    tp = ep = etp = 1; LoRA's adapters left out."""
    single = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(
        update={"tp": 1, "cp": 1, "ep": 1, "etp": 1, "sequence_parallel": False})})
    return sum(g.numel for g in rank_parameters(single) if g.component != "lora")


def active_parameters(recipe: Recipe) -> int:
    """Parameters one token passes through: everything but the routed experts, plus top_k of
    them (the frozen indexer included; the embedding counted as a lookup of its table)."""
    total = total_parameters(recipe)
    e = recipe.model.moe
    n_moe = recipe.model.mlp_types().count("moe")
    routed = n_moe * e.num_experts * 3 * e.ffn_hidden_size * recipe.model.hidden_size
    return total - routed + routed * e.top_k // e.num_experts


def param_counts(groups: Iterable[ParamGroup]) -> dict[tuple[str, int, bool], int]:
    """Elements by (component, dtype bytes, trainable): the key tests compare with a model."""
    out: dict[tuple[str, int, bool], int] = {}
    for g in groups:
        key = (g.component, g.dtype_bytes, g.trainable)
        out[key] = out.get(key, 0) + g.numel
    return out
