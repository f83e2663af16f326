"""``memory/layers.py``: what a layer keeps under each recompute mode, against autograd's saved
tensors on CPU, and how the kept activations scale."""

from __future__ import annotations

import pytest

from skyrl_megatron_kda.memory import estimate_memory
from skyrl_megatron_kda.memory.kda import kda_activation_bytes
from skyrl_megatron_kda.memory.dsa import SELECTION_LABEL
from skyrl_megatron_kda.memory.layers import checkpoint_input_bytes
from tests.support.memory_recipes import full_recipe


@pytest.mark.parametrize("variant", ["full", "selective", "selective_kda", "full_dsa"])
def test_recompute_keeps_what_the_plan_says(census, variant):
    """Bytes autograd keeps under each recompute setting equal the plan's kept activations
    (full: the layer inputs; selective: the attention inputs instead of the norm + attention
    tensors; layer types left out of recompute_layers keep everything)."""
    measured, recipes = census
    parts, recipe = measured[variant], recipes[variant]
    est = estimate_memory(recipe)
    assert sum(parts.values()) < sum(measured["bf16"].values())
    # KDA's attention term models fla's kernels; the CPU torch kernel keeps other tensors.
    kda = [f"{i}.attention" for i, kind in enumerate(recipe.model.layer_types()) if kind == "kda"]
    kept = sum(v for part, v in parts.items() if part not in kda)
    # The kept DSA selections are the checkpoints' objects, not saved tensors: their census is
    # tests/test_kept_selection.py's.
    unseen = ("KDA attention", SELECTION_LABEL)
    assert kept == sum(v for label, v in est.activations.items() if label not in unseen), (
        parts, est.activations)


def test_activations_linear_in_sequence_length():
    """Every kept term doubles with seq_len, except KDA's concatenated projection weights and
    the DSA projections' whole weights gathered over TP (tp_split=sequence), both constants:
    affine there, exactly linear elsewhere."""
    a, b, c = (estimate_memory(full_recipe("train.recompute=none", "kda.cp_exchange=a2a", f"data.seq_len={t}"))
               for t in (131072, 262144, 524288))
    for label, value in a.activations.items():
        if label in ("KDA attention", "DSA attention"):
            assert c.activations[label] - b.activations[label] == 2 * (b.activations[label] - value)
            assert b.activations[label] < 2 * value
        else:
            assert b.activations[label] == 2 * value, label
    assert b.exchange_buffers == 2 * a.exchange_buffers


def test_full_recompute_reduces_kept_activations():
    none = estimate_memory(full_recipe("train.recompute=none", "train.moe_chunk_tokens=0"))
    full = estimate_memory(full_recipe("train.recompute=full", "train.moe_chunk_tokens=0"))
    # Full recompute keeps each layer's input streams and the head only: about 15x less at 1M
    # tokens (the MoE, KDA and mHC tensors dominate what recompute=none keeps without MoE
    # chunks).
    assert sum(full.activations.values()) < sum(none.activations.values()) / 15
    recipe = full_recipe("train.recompute=full")
    assert full.activations["layer inputs (checkpoints)"] == (
        recipe.model.num_layers * checkpoint_input_bytes(recipe, "full"))
    assert full.states == none.states


def test_recompute_modes_order_the_kept_activations():
    kept = {mode: sum(estimate_memory(full_recipe(f"train.recompute={mode}")).activations.values())
            for mode in ("none", "selective", "full")}
    assert kept["full"] < kept["selective"] < kept["none"]
    # Recomputing only the DSA layers leaves every KDA layer's attention tensors kept.
    dsa_only = estimate_memory(full_recipe("train.recompute=selective", "train.recompute_layers=[dsa]"))
    recipe = full_recipe()
    n_kda = recipe.model.layer_types().count("kda")
    assert dsa_only.activations["KDA attention"] == n_kda * kda_activation_bytes(recipe)
    assert "DSA attention" not in dsa_only.activations
