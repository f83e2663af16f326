"""``memory/states.py``: the distributed optimizer's shards."""

from __future__ import annotations

from skyrl_megatron_kda.memory import estimate_memory
from skyrl_megatron_kda.memory.census import rank_parameters
from skyrl_megatron_kda.memory.states import optimizer_shards
from tests.support.memory_recipes import full_recipe


def test_optimizer_shards_dense_over_dp_cp_and_experts_over_expert_dp():
    recipe = full_recipe()
    assert optimizer_shards(recipe) == (64 // 8, 64 // (32 * 2))
    groups = rank_parameters(recipe)
    dense = sum(g.numel * (12 if g.dtype_bytes == 2 else 8) for g in groups
                if g.trainable and not g.expert)
    expert = sum(g.numel * 12 for g in groups if g.expert)
    assert estimate_memory(recipe).optimizer == dense // 8 + expert
