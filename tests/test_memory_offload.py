"""``memory/offload.py``: what ``train.offload_activations`` moves to the host, against the
model's host offload hooks on CPU, and the pinned blocks it takes."""

from __future__ import annotations

from skyrl_megatron_kda.memory.head import embedding_tensor_bytes, head_activation_bytes
from skyrl_megatron_kda.memory.offload import (
    host_activation_bytes, offloaded_tensor_bytes, pinned_block_bytes)
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import SINGLE, TINY
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss


def test_offload_leaves_only_the_head_saved_on_the_device(census):
    """Under train.offload_activations every tensor the layers save for backward goes through the
    model's host offload hooks (the census's hooks, outside them, see none of them); the head's
    stay on the device, as the plan says (saved last and read first)."""
    measured, recipes = census
    assert sum(measured["bf16"].values()) > 0
    on_device = {part: v for part, v in measured["offload"].items() if v}
    recipe = recipes["offload"]
    assert on_device == {"head": head_activation_bytes(recipe)
                         - sum(embedding_tensor_bytes(recipe))}, on_device


def _host_census_on_rank(rank, world, overrides_list):
    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        model = build_on_mesh(recipe)
        ids = token_ids(recipe)
        loss = token_loss(model, ids, ids.roll(-1, 1))
        saved = sorted(model.host_offload.saved)
        loss.sum().backward()
        out.append((saved, model.host_offload.held, model.host_offload.peak))
    return out


def test_host_offload_holds_what_the_plan_says():
    """Under full recompute, train.offload_activations copies each layer's input streams and
    the head's tensors to the host, once each and no parameter: the copies equal the plan's
    list tensor by tensor, their pinned blocks its host figure for a GPU run, and backward gives
    every byte back."""
    base = SINGLE + ["model.params_dtype=bfloat16", "data.seq_len=96", "train.recompute=full",
                     "train.offload_activations=true"]
    variants = [base, base + ["train.loss_chunk_tokens=100"]]
    for overrides, (saved, held, peak) in zip(variants, run_ranks(1, _host_census_on_rank, variants)[0]):
        recipe = load_recipe(TINY, overrides).recipe
        assert saved == sorted(offloaded_tensor_bytes(recipe)), overrides
        assert held == 0 and peak == sum(saved) == host_activation_bytes(recipe)[0]
        gpu = load_recipe(TINY, overrides + ["run.device=gpu"]).recipe
        pinned = sum(pinned_block_bytes(n) for n in saved)
        assert host_activation_bytes(gpu) == (pinned, True) and pinned > sum(saved)
    # Not modelled tensor by tensor without full recompute: a lower bound, said so.
    assert offloaded_tensor_bytes(load_recipe(TINY, SINGLE + ["train.offload_activations=true"]).recipe) is None


def test_pinned_blocks_round_up_to_a_power_of_two():
    assert [pinned_block_bytes(n) for n in (0, 1, 3, 4, 5, 2**31, 2**31 + 1)] == [
        0, 1, 4, 4, 8, 2**31, 2**32]
