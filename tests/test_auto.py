"""The one resolver of every ``auto`` setting (``auto.resolve``): it picks the DSA kernel and the
KDA exchange with their reasons, checks each pick as if the recipe had named it, takes a newcomer
as one ``register`` call (a toy ``kda.kernel`` setting here), and what reads the recipe after
it (memory) refuses an ``auto`` left unresolved."""

from __future__ import annotations

import logging

import pytest

from skyrl_megatron_kda import auto
from skyrl_megatron_kda.config import Recipe
from skyrl_megatron_kda.memory import estimate_memory
from skyrl_megatron_kda.memory.dsa import dsa_activation_bytes
from skyrl_megatron_kda.memory.kda import exchange_extra_bytes
from skyrl_megatron_kda.recipes import get_recipe, load_recipe

FULL, TINY = "glm53_flash_1m", "glm53_flash_tiny"
KDA_KERNEL = "kda.kernel"


def _kda_kernel(recipe):
    # The toy: kda.kernel=auto is fla on a GPU, torch on a CPU.
    name = "fla" if recipe.run.device == "gpu" else "torch"
    return name, f"{name}: run.device={recipe.run.device}"


TOY = auto.AutoSetting(KDA_KERNEL, _kda_kernel, needs=Recipe)


@pytest.fixture
def toy():
    auto.register(TOY)
    yield TOY
    auto.unregister(KDA_KERNEL)


def test_one_resolver_picks_both_settings_and_records_why(caplog):
    """The 1M recipe leaves model.dsa.kernel and kda.cp_exchange to auto: one call picks both,
    in registration order, logs each pick and returns its reason; a recipe that names both
    comes back as it was, with no reason."""
    written = get_recipe(FULL, environ={})
    assert (written.model.dsa.kernel, written.kda.cp_exchange) == ("auto", "auto")
    with caplog.at_level(logging.INFO, logger="skyrl_megatron_kda.auto"):
        resolved, choices = auto.resolve(written)
    assert list(choices) == ["model.dsa.kernel", "kda.cp_exchange"]
    assert [s.key for s in auto.settings()] == list(choices)
    assert choices["model.dsa.kernel"].startswith("latent: ")
    assert choices["kda.cp_exchange"].startswith(f"{resolved.kda.cp_exchange}: ")
    assert (resolved.model.dsa.kernel, resolved.kda.cp_exchange) == ("latent", "state")
    assert [r.getMessage() for r in caplog.records] == [f"{k}=auto -> {v}" for k, v in choices.items()]
    assert resolved.model.dsa.latent.keep_attention_output, "the recipe's other settings stay"
    named = get_recipe(FULL, ["model.dsa.kernel=latent", "kda.cp_exchange=a2a"], environ={})
    assert auto.resolve(named) == (named, {})


def test_a_newcomer_is_one_register_call(toy):
    """A toy ``AutoSetting`` for kda.kernel: registered, ``load_recipe`` resolves it after the
    built-in ones and records its reason; a whole recipe's device picks its value."""
    loaded = load_recipe(TINY, ["kda.kernel=auto"], environ={})
    assert loaded.recipe.kda.kernel == "torch"
    assert list(loaded.choices) == ["model.dsa.kernel", KDA_KERNEL]
    assert loaded.choices[KDA_KERNEL] == "torch: run.device=cpu"
    on_gpu = load_recipe(TINY, ["kda.kernel=auto", "run.device=gpu"], environ={})
    assert on_gpu.recipe.kda.kernel == "fla"
    auto.register(TOY)  # the same setting again is a no-op
    with pytest.raises(ValueError, match="an auto setting for kda.kernel is already registered"):
        auto.register(auto.AutoSetting(KDA_KERNEL, _kda_kernel))


def test_without_the_toy_its_setting_stays_auto():
    """The negative control: unregistered, kda.kernel=auto is left as written (the layer
    resolves it itself) and no reason is recorded for it."""
    loaded = load_recipe(TINY, ["kda.kernel=auto"], environ={})
    assert loaded.recipe.kda.kernel == "auto" and KDA_KERNEL not in loaded.choices


def test_a_pick_the_config_refuses_is_refused_naming_the_setting():
    """A chooser's value is validated as if the recipe had named it: one line naming the
    setting, the value and the config's reason."""
    bad = auto.AutoSetting(KDA_KERNEL, lambda recipe: ("cuda", "cuda: always"))
    auto.register(bad)
    try:
        with pytest.raises(ValueError, match=r"^kda.kernel=auto picks cuda; Input should be "):
            load_recipe(TINY, ["kda.kernel=auto"], environ={})
    finally:
        auto.unregister(KDA_KERNEL)


def test_memory_refuses_an_unresolved_auto_for_kda_and_dsa():
    """memory reads the exchange and the DSA kernel through their registries, which refuse
    ``auto``: a recipe as written (get_recipe) is refused for either setting, by name; the same
    recipe resolved (load_recipe) is planned."""
    written = get_recipe(FULL, environ={})
    with pytest.raises(ValueError, match=r"^kda.cp_exchange=auto is not resolved"):
        exchange_extra_bytes(written)
    with pytest.raises(ValueError, match=r"^model.dsa.kernel=auto is not resolved"):
        dsa_activation_bytes(written)
    kda_only = get_recipe(FULL, ["model.dsa.kernel=latent"], environ={})
    with pytest.raises(ValueError, match=r"^kda.cp_exchange=auto is not resolved"):
        estimate_memory(kda_only)
    resolved = load_recipe(FULL, environ={}).recipe
    assert exchange_extra_bytes(resolved)[0] == resolved.kda.cp_exchange
    assert dsa_activation_bytes(resolved) > 0
    assert estimate_memory(resolved).total > 0


def test_a_mesh_recipe_resolves_only_what_it_holds():
    """A ``MeshRecipe`` has no run.device: its exchange is chosen, its DSA kernel (a setting that
    needs a whole ``Recipe``) stays auto, for its registry to refuse where it is used."""
    from skyrl_megatron_kda.recipe_rules import load_mesh_recipe

    mesh = load_mesh_recipe({"parallel": {"tp": 8, "cp": 2, "sequence_parallel": True},
                             "kda": {"cp_exchange": "auto"}, "data": {"seq_len": 2**20}},
                            environ={})
    resolved, choices = auto.resolve(mesh)
    assert list(choices) == ["kda.cp_exchange"] and resolved.kda.cp_exchange != "auto"
    assert resolved.model.dsa.kernel == "auto"
