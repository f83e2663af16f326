"""Recipes: the GLM-5.3-Flash model config, the whole-job Recipe and its cross-section checks,
the registry, override precedence, and the `recipes` / `plan RECIPE` commands."""

import os
import re
import sys
import tomllib
import types
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from skyrl_megatron_kda import cli, recipes
from skyrl_megatron_kda.config import (
    CP_EXCHANGE_ENV,
    DSAConfig,
    LatentOptions,
    ModelConfig,
    MoEConfig,
    Recipe,
    TrainConfig,
)
from skyrl_megatron_kda.recipes import (
    BUILTIN_RECIPES,
    RECIPES_DIR,
    get_recipe,
    list_recipes,
    load_recipe,
    raw_recipe,
    register,
    register_recipe,
)

TINY = "glm53_flash_tiny"
FULL = "glm53_flash_1m"


@pytest.fixture
def registry():
    """A scratch registry: tests may register names without leaking them into other tests."""
    saved = dict(recipes._REGISTRY)
    yield
    recipes._REGISTRY.clear()
    recipes._REGISTRY.update(saved)


# --- the model config ---------------------------------------------------------------------------


def test_model_defaults_are_glm53_flash():
    """The published GLM-5.3-Flash config."""
    m = ModelConfig()
    assert (m.num_layers, m.vocab_size, m.hidden_size, m.rms_norm_eps) == (45, 154880, 4096, 1e-5)
    types_ = m.layer_types()
    assert [i for i, t in enumerate(types_) if t == "dsa"] == list(range(3, 45, 4))
    assert types_.count("kda") == 34 and types_[44] == "kda"
    assert m.mlp_types() == ["dense"] * 3 + ["moe"] * 42
    assert m.dense_ffn_hidden_size == 12288
    assert m.moe == MoEConfig(num_experts=288, top_k=8, ffn_hidden_size=2048, num_shared_experts=1,
                              routed_scaling_factor=2.5, score_function="sigmoid",
                              score_correction_bias=True, norm_topk_prob=True, swiglu_limit=10.0)
    assert m.dsa == DSAConfig(num_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                              qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256,
                              index_num_heads=32, index_head_dim=128, index_topk=2048,
                              index_kpool=4)
    hc = m.hyper_connections
    assert (hc.num_streams, hc.sinkhorn_iterations, hc.eps) == (4, 20, 1e-6)


def test_model_refuses_more_dense_layers_than_layers():
    with pytest.raises(ValidationError, match=r"model.num_dense_layers=5 must be <= model.num_layers=4"):
        ModelConfig(num_layers=4, num_dense_layers=5)


def test_model_refuses_dsa_offset_outside_period():
    with pytest.raises(ValidationError, match=r"model.dsa_offset=4 must be < model.dsa_every=4"):
        ModelConfig(dsa_offset=4)


def test_moe_refuses_top_k_above_experts():
    with pytest.raises(ValidationError, match=r"model.moe.top_k=9 must be <= model.moe.num_experts=8"):
        MoEConfig(num_experts=8, top_k=9)


def test_dsa_refuses_topk_not_divisible_by_kpool():
    with pytest.raises(ValidationError, match=r"index_topk=2050 must be divisible by .*index_kpool=4"):
        DSAConfig(index_topk=2050)


def test_train_refuses_min_lr_above_lr():
    with pytest.raises(ValidationError, match=r"train.min_lr=0.1 must be <= train.lr=0.01"):
        TrainConfig(lr=0.01, min_lr=0.1)


def test_train_recompute_layers_name_each_layer_type_once():
    for bad in ([], ["kda", "kda"]):
        with pytest.raises(ValidationError, match=r"train.recompute_layers=.* must name 'kda' and/or 'dsa', each once"):
            TrainConfig(recompute="full", recompute_layers=bad)
    with pytest.raises(ValidationError, match="recompute_layers"):
        TrainConfig(recompute_layers=["mlp"])
    train = TrainConfig(recompute="selective", recompute_layers=["dsa"])
    assert (train.recompute_of("dsa"), train.recompute_of("kda")) == ("selective", "none")


def test_model_strict_ints():
    with pytest.raises(ValidationError, match=r"num_layers"):
        ModelConfig.model_validate({"num_layers": "45"})


# --- the built-in recipes -----------------------------------------------------------------------


def test_full_recipe_loads(monkeypatch):
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)
    r = get_recipe(FULL)
    assert isinstance(r, Recipe)
    # The file spells out the model card's sizes, the defaults, and one speed setting besides.
    assert r.model.dsa.latent.keep_attention_output
    as_card = r.model.dsa.model_copy(update={"latent": LatentOptions()})
    assert r.model.model_copy(update={"dsa": as_card}) == ModelConfig()
    p = r.parallel
    assert (p.tp, p.cp, p.ep, p.etp, p.pp, p.sequence_parallel) == (8, 2, 32, 2, 1, True)
    assert r.data.seq_len == 2**20
    assert (r.run.num_workers, r.run.device, r.data_parallel_size) == (64, "gpu", 4)
    assert r.kda.cp_exchange == "auto" and r.train.recompute == "full"
    assert r.cluster.inter_node_kind == "efa"


def test_tiny_recipe_loads(monkeypatch):
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)
    r = get_recipe(TINY)
    m, p = r.model, r.parallel
    assert m.layer_types() == ["kda", "kda", "kda", "dsa"]
    assert m.mlp_types() == ["dense", "moe", "moe", "moe"]
    assert (m.hidden_size, m.vocab_size, m.params_dtype) == (64, 256, "float32")
    assert (m.moe.num_experts, m.moe.top_k) == (8, 2)
    assert (r.kda.num_heads, r.kda.head_dim, r.kda.kernel) == (4, 16, "torch")
    assert (p.tp, p.cp, p.ep, p.etp, p.sequence_parallel) == (2, 2, 2, 1, True)
    assert (r.run.num_workers, r.run.device, r.data_parallel_size) == (4, "cpu", 1)
    assert (r.data.seq_len, r.data.path, r.train.steps) == (256, None, 10)


def test_builtin_recipes_live_at_the_top_and_ship_as_package_data():
    root = Path(__file__).parents[1]
    for source in BUILTIN_RECIPES.values():
        assert (root / "recipes" / source).is_file()
        assert (RECIPES_DIR / source).resolve() == (root / "recipes" / source).resolve()
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert "*.yaml" in pyproject["tool"]["setuptools"]["package-data"]["skyrl_megatron_kda.builtin_recipes"]


def test_list_recipes_has_one_line_descriptions():
    listed = list_recipes()
    assert set(BUILTIN_RECIPES) <= set(listed)
    for name in BUILTIN_RECIPES:
        assert listed[name] and "\n" not in listed[name]


def test_auto_resolves_on_a_whole_recipe(monkeypatch):
    from skyrl_megatron_kda import auto

    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)
    resolved, choices = auto.resolve(get_recipe(FULL))
    reason = choices["kda.cp_exchange"]
    assert isinstance(resolved, Recipe) and resolved.run.num_workers == 64
    assert resolved.kda.cp_exchange in ("a2a", "allgather", "state")
    assert reason.startswith(resolved.kda.cp_exchange)


# --- overrides and the environment --------------------------------------------------------------


def test_overrides_win_over_the_file(monkeypatch):
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)
    r = get_recipe(TINY, ["kda.cp_exchange=allgather", "train.steps=7", "model.moe.top_k=3"])
    assert (r.kda.cp_exchange, r.train.steps, r.model.moe.top_k) == ("allgather", 7, 3)
    assert r.model.moe.num_experts == 8  # siblings of an overridden key keep the file's value


def test_unknown_override_key_is_refused_with_its_dotted_name():
    with pytest.raises(ValidationError, match=r"(?s)recipe glm53_flash_tiny.*model\.moe\.topk\n"
                                              r"  Extra inputs are not permitted"):
        get_recipe(TINY, ["model.moe.topk=3"])


def test_env_overrides_file_and_overrides():
    r = get_recipe(TINY, ["kda.cp_exchange=a2a"], environ={CP_EXCHANGE_ENV: "state"})
    assert r.kda.cp_exchange == "state"
    assert get_recipe(TINY, environ={}).kda.cp_exchange == "a2a"


def test_env_override_from_os_environ(monkeypatch):
    monkeypatch.setenv(CP_EXCHANGE_ENV, "allgather")
    assert get_recipe(TINY).kda.cp_exchange == "allgather"


def test_env_override_is_validated_like_any_value():
    with pytest.raises(ValueError, match=r"kda.cp_exchange=state .* kda.allow_inexact=false"):
        get_recipe(TINY, ["kda.allow_inexact=false"], environ={CP_EXCHANGE_ENV: "state"})


# --- YAML files ---------------------------------------------------------------------------------


def test_load_recipe_from_a_yaml_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((RECIPES_DIR / BUILTIN_RECIPES[TINY]).read_text() + "\n")
    r = load_recipe(str(path), ["train.steps=2"], environ={}).recipe
    assert r.train.steps == 2 and r.model.num_layers == 4


def test_yaml_with_a_typo_in_a_nested_key_is_refused(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model:\n  dsa:\n    index_top_k: 64\n")
    with pytest.raises(ValidationError, match=r"(?s)typo\.yaml.*model\.dsa\.index_top_k\n"
                                              r"  Extra inputs are not permitted"):
        load_recipe(path, environ={}).recipe


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"must hold a mapping at top level, got list"):
        load_recipe(path).recipe


@pytest.mark.parametrize("text", ["", "\n# only a comment\n"], ids=["empty", "comment-only"])
def test_empty_yaml_is_refused_naming_the_file(tmp_path, text):
    # Read as {} it would silently mean the full 320B model (every default).
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"recipe file {re.escape(str(path))} is empty"):
        load_recipe(path, environ={}).recipe


def test_broken_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  hidden_size: [64\nparallel: {tp: 1}\n")
    with pytest.raises(ValueError) as info:
        load_recipe(path, environ={}).recipe
    text = str(info.value)
    assert text.startswith(f"recipe file {path}: not valid YAML") and "line 3" in text, text
    assert "<unicode string>" not in text and "\n" not in text, text


def test_missing_yaml_and_unknown_name():
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml does not exist"):
        load_recipe("/nonexistent/nope.yaml").recipe
    with pytest.raises(KeyError, match=r"'glm99' is neither a registered recipe"):
        load_recipe("glm99").recipe
    with pytest.raises(KeyError, match=r"no recipe named 'glm99'; registered: .*glm53_flash_1m"):
        get_recipe("glm99")


# --- the registry -------------------------------------------------------------------------------


def test_register_is_reentrant(registry):
    before = dict(recipes._REGISTRY)
    register()
    register()
    assert recipes._REGISTRY == before


def test_register_clash_raises(registry):
    with pytest.raises(ValueError, match=r"recipe 'glm53_flash_tiny' is already registered to "
                                         r"'glm53_flash_tiny.yaml'; refusing 'other.yaml'"):
        register_recipe(TINY, "other.yaml")
    assert recipes._REGISTRY[TINY] == "glm53_flash_tiny.yaml"


def test_register_refuses_bad_sources(registry):
    with pytest.raises(ValueError, match=r"neither a .yaml/.yml path nor 'module:attr'"):
        register_recipe("x", "recipe.json")
    with pytest.raises(ValueError, match=r"non-empty string"):
        register_recipe("", "x.yaml")


def test_lazy_module_attr_recipes(registry, monkeypatch):
    module = types.ModuleType("fake_recipes_for_test")
    module.AS_DICT = {"description": "as a dict", "train": {"steps": 3}}
    calls = []

    def build():
        calls.append(1)
        return {"description": "from a function", "parallel": {"tp": 2, "sequence_parallel": True},
                "run": {"num_workers": 2}}

    module.build = build
    module.NOT_A_DICT = [1]
    register_recipe("lazy_dict", "fake_recipes_for_test:AS_DICT")
    register_recipe("lazy_fn", "fake_recipes_for_test:build")
    register_recipe("lazy_fn", "fake_recipes_for_test:build")  # same target again: no-op
    register_recipe("lazy_bad", "fake_recipes_for_test:NOT_A_DICT")
    assert not calls  # nothing is imported or called at registration
    monkeypatch.setitem(sys.modules, "fake_recipes_for_test", module)
    assert get_recipe("lazy_dict", ["train.steps=4"], environ={}).train.steps == 4
    assert module.AS_DICT["train"]["steps"] == 3  # the target is not mutated
    r = get_recipe("lazy_fn", environ={})
    assert (r.parallel.tp, r.data_parallel_size, r.description) == (2, 1, "from a function")
    with pytest.raises(ValueError, match=r"fake_recipes_for_test:NOT_A_DICT gave list, expected a dict"):
        get_recipe("lazy_bad")
    assert load_recipe("lazy_dict", environ={}).recipe.description == "as a dict"


# --- Megatron's world-size rule and other cross-section checks ----------------------------------


def test_world_size_must_divide_by_tp_cp_pp():
    with pytest.raises(ValidationError, match=r"run.num_workers=6 must be divisible by tp\*cp\*pp "
                                              r"= 2\*2\*1 = 4"):
        get_recipe(TINY, ["run.num_workers=6"], environ={})


def test_world_size_must_divide_by_ep_etp_pp():
    # The expert mesh folds over the same ranks: EP8 fits 8 ranks (TP2 x CP2 x DP2), not 4.
    ok = get_recipe(TINY, ["run.num_workers=8", "parallel.ep=8"], environ={})
    assert ok.data_parallel_size == 2
    with pytest.raises(ValidationError, match=r"run.num_workers=4 must be divisible by ep\*etp\*pp "
                                              r"= 8\*1\*1 = 8"):
        get_recipe(TINY, ["parallel.ep=8"], environ={})
    with pytest.raises(ValidationError, match=r"run.num_workers=64 must be divisible by ep\*etp\*pp "
                                              r"= 32\*4\*1 = 128"):
        get_recipe(FULL, ["parallel.etp=4"], environ={})


def test_experts_must_divide_by_ep():
    with pytest.raises(ValidationError, match=r"model.moe.num_experts=8 must be divisible by ep=3"):
        get_recipe(TINY, ["parallel.ep=3", "run.num_workers=12"], environ={})


def test_expert_ffn_must_divide_by_etp():
    with pytest.raises(ValidationError, match=r"model.moe.ffn_hidden_size=31 must be divisible by etp=2"):
        get_recipe(TINY, ["model.moe.ffn_hidden_size=31", "parallel.etp=2"], environ={})


def test_ep_with_tp_needs_sequence_parallel():
    with pytest.raises(ValidationError, match=r"ep=2 with tp=2 needs parallel.sequence_parallel=true"):
        get_recipe(TINY, ["parallel.sequence_parallel=false"], environ={})


def test_dsa_heads_and_dense_ffn_must_divide_by_tp():
    with pytest.raises(ValidationError, match=r"model.dsa.num_heads=3 must be divisible by tp=2"):
        get_recipe(TINY, ["model.dsa.num_heads=3"], environ={})
    with pytest.raises(ValidationError, match=r"model.dense_ffn_hidden_size=129 must be divisible by tp=2"):
        get_recipe(TINY, ["model.dense_ffn_hidden_size=129"], environ={})


def test_fla_kernel_needs_gpu():
    with pytest.raises(ValidationError, match=r"kda.kernel=fla needs run.device=gpu"):
        get_recipe(TINY, ["kda.kernel=fla"], environ={})


def test_fla_tilelang_backward_needs_gpu():
    with pytest.raises(ValidationError, match=r"kda.fla_backward=tilelang needs run.device=gpu"):
        get_recipe(TINY, ["kda.fla_backward=tilelang"], environ={})
    with pytest.raises(ValidationError, match=r"fla_backward"):
        get_recipe(TINY, ["kda.fla_backward=cuda"], environ={})


def test_the_recipe_sets_flas_backward_switch(monkeypatch):
    """fla reads FLA_TILELANG at every call; the recipe's choice is what it reads, whatever was
    set before, and TileLang where fla cannot use it (here: no nvcc / no tilelang) is refused."""
    pytest.importorskip("fla", reason="fla-core is a test dependency of this check")
    from fla.backends import TileLangBackend

    from skyrl_megatron_kda.kda.kernel import use_fla_backward

    monkeypatch.setenv("FLA_TILELANG", "1")
    use_fla_backward("triton")
    assert os.environ["FLA_TILELANG"] == "0" and not TileLangBackend().is_enabled()
    monkeypatch.setattr(TileLangBackend, "is_available", classmethod(lambda cls: False))
    with pytest.raises(RuntimeError, match="kda.fla_backward=tilelang: fla's TileLang backend is unavailable"):
        use_fla_backward("tilelang")
    assert os.environ["FLA_TILELANG"] == "0"
    monkeypatch.setattr(TileLangBackend, "is_available", classmethod(lambda cls: True))
    use_fla_backward("tilelang")
    assert os.environ["FLA_TILELANG"] == "1" and TileLangBackend().is_enabled()


def test_layer_checks_still_apply_to_recipes():
    with pytest.raises(ValidationError, match=r"kda.num_heads=4 must be divisible by tp=8"):
        get_recipe(TINY, ["parallel.tp=8", "run.num_workers=16"], environ={})


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_recipes(capsys):
    assert cli.main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == sorted(names) and {FULL, TINY} <= set(names)
    [tiny] = [line for line in lines if line.startswith(TINY + " ")]
    assert tiny.split(None, 1)[1] == list_recipes()[TINY]


def test_cli_plan_tiny(capsys, monkeypatch):
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)
    assert cli.main(["plan", TINY]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("model: 4 layers (3 KDA, 1 DSA; 1 dense FFN, 8 experts top-2), hidden 64, "
                      "vocab 256; 4 CPU ranks = TP2 x CP2 x DP1, EP2 x ETP1")
    assert out[1].startswith("KDA layer: 4 heads x 16, hidden 64, TP2 x CP2 +SP, T=256 x 1")
    assert [line.split()[0] for line in out[5:8]] == ["a2a", "allgather", "state"]
    [choice] = [line for line in out if line.startswith("choice: ")]
    assert choice.startswith("choice: a2a (configured); auto would pick ")


def test_cli_plan_recipe_with_overrides(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)
    assert cli.main(["plan", FULL]) == 0
    out = capsys.readouterr().out
    assert "64 GPU ranks = TP8 x CP2 x DP4, EP32 x ETP2" in out
    assert "(CP spans nodes over efa, T=1048576)" in out
    assert cli.main(["plan", FULL, "--set", "cluster.inter_node_kind=tcp",
                     "--set", "kda.allow_inexact=false"]) == 0
    assert "over tcp" in capsys.readouterr().out
    path = tmp_path / "t.yaml"
    path.write_text((RECIPES_DIR / BUILTIN_RECIPES[TINY]).read_text())
    assert cli.main(["plan", str(path), "--set", "data.seq_len=512"]) == 0
    assert "T=512 x 1" in capsys.readouterr().out


def test_cli_plan_refuses_unknown_recipe_key():
    with pytest.raises(ValidationError, match=r"train\.stepz"):
        cli.main(["--debug", "plan", TINY, "--set", "train.stepz=3"])


def test_dsa_with_tp_needs_sequence_parallel():
    # EP1 so that only the DSA rule can object; a KDA-only trunk (no DSA layer) is fine without SP.
    base = ["parallel.ep=1", "parallel.sequence_parallel=false", "kda.cp_exchange=a2a"]
    with pytest.raises(ValidationError, match=r"DSA layers at tp=2 need parallel.sequence_parallel=true"):
        get_recipe(TINY, base, environ={})
    assert get_recipe(TINY, base + ["model.num_layers=3"], environ={}).model.layer_types() == ["kda"] * 3


def test_slice_recipe_is_one_gpu_with_the_real_layer_widths():
    """The device benchmark's slice: full-width GLM layers (KDA x3 + DSA at 3), MoE scaled down,
    one GPU, fla kernels; its memory plan is what bench/model_slice.py checks against the peak."""
    from skyrl_megatron_kda.memory import estimate_memory

    slice_ = load_recipe("glm53_flash_slice").recipe  # the plan takes resolved kernels
    full = get_recipe(FULL)
    assert (slice_.parallel.tp, slice_.parallel.cp, slice_.run.num_workers) == (1, 1, 1)
    assert slice_.model.hidden_size == full.model.hidden_size
    assert slice_.model.vocab_size == full.model.vocab_size
    assert slice_.kda.num_heads == full.kda.num_heads and slice_.kda.kernel == "fla"
    assert slice_.model.num_layers == 4 and slice_.model.dsa_offset == 3
    assert slice_.model.moe.num_experts < full.model.moe.num_experts
    assert estimate_memory(slice_).total / 2**30 < 139  # one H200


def test_a_recipe_file_with_the_old_exchange_reason_is_refused_in_one_line(tmp_path):
    from skyrl_megatron_kda.console import error_lines

    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({**raw_recipe(TINY), "kda": {"exchange_reason": "a2a: 1 ms"}}))
    with pytest.raises(ValidationError) as err:
        load_recipe(str(path), environ={})
    (line,), _ = error_lines(err.value)
    assert "kda.exchange_reason is not a setting" in line and "auto_choices.yaml" in line, line


def test_load_recipe_resolves_auto_once_and_returns_the_reasons(caplog):
    """get_recipe keeps the file's auto; load_recipe (what a run loads) resolves it after the
    overrides and the environment, logs each pick's reason once and returns it beside the
    recipe (not in it)."""
    import logging

    assert get_recipe(FULL, environ={}).kda.cp_exchange == "auto"
    with caplog.at_level(logging.INFO, logger="skyrl_megatron_kda.auto"):
        loaded = load_recipe(FULL, environ={})
    r, reason = loaded.recipe, loaded.choices["kda.cp_exchange"]
    assert r.kda.cp_exchange == "state" and reason.startswith("state: ")
    assert [rec.getMessage() for rec in caplog.records] == loaded.choice_lines()
    assert loaded.choices["model.dsa.kernel"].startswith(f"{r.model.dsa.kernel}: ")
    assert list(loaded.choices) == ["model.dsa.kernel", "kda.cp_exchange"]
    assert loaded.choice_lines() == [f"{k}=auto -> {v}" for k, v in loaded.choices.items()]
    assert Recipe.model_validate(r.model_dump(mode="json")) == r  # recipe.yaml round-trips
    pinned = load_recipe(FULL, ["model.dsa.kernel=latent"], environ={CP_EXCHANGE_ENV: "a2a"})
    assert pinned.recipe.kda.cp_exchange == "a2a" and pinned.choices == {}
    forced = load_recipe(FULL, ["kda.cp_exchange=a2a"], environ={CP_EXCHANGE_ENV: "auto"}).recipe
    assert forced.kda.cp_exchange == "state", "the environment is applied before resolution"
