"""``memory/census.py``: parameter counts equal the built megatron model exactly (single rank,
and every rank of TP2 x CP2 x EP2 and TP2 x EP2 x ETP2 meshes on gloo); the full model's size
against its model card."""

from __future__ import annotations

import re

from skyrl_megatron_kda.memory.census import (
    active_parameters, param_counts, rank_buffers_bytes, rank_parameters, total_parameters)
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import SINGLE, TINY, full_recipe
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh


MODEL_CARD_TOTAL = 321.3e9
"""GLM-5.3-Flash's parameter count with its MTP layer (its model card)."""


_COMPONENT_PATTERNS = [
    (r"^embedding\.", "embedding"),
    (r"^output_layer\.", "output_layer"),
    (r"^final_norm\.", "final_norm"),
    (r"^layers\.\d+\.(attn_hc|ffn_hc)\.", "mhc"),
    (r"^layers\.\d+\.(input_layernorm|pre_mlp_layernorm)\.", "layer_norms"),
    (r"^layers\.\d+\.self_attention\.core_attention\.indexer\.", "dsa_indexer"),
    (r"^layers\.\d+\.self_attention\.(q_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj|o_proj|"
     r"f_a_weight|g_a_weight|o_norm_weight|conv_weight|A_log|dt_bias)", "kda"),
    (r"^layers\.\d+\.self_attention\.", "dsa"),
    (r"^layers\.\d+\.mlp\.router\.", "moe_router"),
    (r"^layers\.\d+\.mlp\.shared_experts\.", "moe_shared"),
    (r"^layers\.\d+\.mlp\.experts\.", "moe_experts"),
    (r"^layers\.\d+\.mlp\.linear_fc", "dense_mlp"),
]


def _component(name: str) -> str:
    for pattern, component in _COMPONENT_PATTERNS:
        if re.match(pattern, name):
            return component
    raise AssertionError(f"parameter {name} belongs to no component")


def _model_counts(model) -> tuple[dict, int]:
    counts: dict[tuple[str, int, bool], int] = {}
    for name, p in model.named_parameters():
        key = (_component(name), p.element_size(), p.requires_grad)
        counts[key] = counts.get(key, 0) + p.numel()
    buffers = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    return counts, buffers


def _count_on_rank(rank, world, overrides_list):
    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        counts, buffers = _model_counts(build_on_mesh(recipe))
        out.append((counts, buffers, param_counts(rank_parameters(recipe)),
                    rank_buffers_bytes(recipe)))
    return out


def _assert_counts(results):
    for rank, per_recipe in enumerate(results):
        for i, (model, model_buffers, formula, formula_buffers) in enumerate(per_recipe):
            assert formula == model, f"rank {rank} recipe {i}: formula {formula} != model {model}"
            assert formula_buffers == model_buffers, (rank, i)


def test_parameter_count_equals_model_single_rank():
    """fp32 (the tiny recipe) and bf16 (where the fp32-kept tensors differ from the rest)."""
    variants = [SINGLE, SINGLE + ["model.params_dtype=bfloat16"],
                SINGLE + ["model.tie_word_embeddings=true"]]
    (result,) = run_ranks(1, _count_on_rank, variants)
    _assert_counts([result])
    bf16 = result[1][0]
    assert any(dtype == 4 for (_, dtype, _) in bf16), "bf16 model keeps fp32 tensors (mHC, A_log)"


def test_parameter_count_equals_model_on_mesh():
    """Every rank of the tiny recipe's mesh (TP2 x CP2 +SP, EP2) and of TP2 x EP2 x ETP2."""
    results = run_ranks(4, _count_on_rank, [[]])
    _assert_counts(results)
    results = run_ranks(2, _count_on_rank, [["parallel.cp=1", "run.num_workers=2"]])
    _assert_counts(results)
    results = run_ranks(4, _count_on_rank, [["parallel.cp=1", "parallel.etp=2", "run.num_workers=4"]])
    _assert_counts(results)


def test_negative_control_wrong_sharding_is_caught():
    """The comparison is not vacuous: counting experts unsharded by ETP changes the total."""
    recipe = load_recipe(TINY, ["parallel.cp=1", "parallel.etp=2", "run.num_workers=4"]).recipe
    good = param_counts(rank_parameters(recipe))
    no_etp = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"etp": 1})})
    assert param_counts(rank_parameters(no_etp)) != good


def test_full_model_size_matches_model_card():
    """Our trunk has no MTP layer; with one (a KDA + MoE decoder layer, as layer 45 of the
    pattern, plus its [D, 2D] projection and two norms) the total is the card's 321.3B."""
    trunk = full_recipe()
    total = total_parameters(trunk)
    with_mtp_layer = total_parameters(
        trunk.model_copy(update={"model": trunk.model.model_copy(update={"num_layers": 46})}))
    D = trunk.model.hidden_size
    mtp = with_mtp_layer - total + 2 * D * D + 2 * D
    assert total < MODEL_CARD_TOTAL
    assert abs(total + mtp - MODEL_CARD_TOTAL) / MODEL_CARD_TOTAL < 0.005, (total, mtp)
    active = active_parameters(trunk)
    assert 16.5e9 < active < 18.0e9, active  # card: 18B active, MTP included
