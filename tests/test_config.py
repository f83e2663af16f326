"""Config validation: one test per accepted or rejected combination, env override, CLI overrides."""

import logging

import pytest
from pydantic import ValidationError

from skyrl_megatron_kda.config import (
    CP_EXCHANGE_ENV,
    LINK_PRESETS,
    ClusterConfig,
    DataConfig,
    KDAConfig,
    MeshRecipe,
    LinkConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    apply_env_overrides,
    merge,
    parse_overrides,
)
from skyrl_megatron_kda.config.cluster import EFA_NODE_GIB_S
from skyrl_megatron_kda.kda import exchanges
from skyrl_megatron_kda.recipe_rules import load_mesh_recipe


def recipe(**sections) -> MeshRecipe:
    """The sections validated by the config, then the registries' rules (``recipe_rules``:
    the exchange on the mesh, the CP layout's row multiple), with no environment override."""
    return load_mesh_recipe(sections, environ={})


# --- defaults --------------------------------------------------------------------------------


def test_defaults_are_glm53_flash():
    r = MeshRecipe()
    # GLM-5.3-Flash's published config (hidden 4096, 64 KDA heads of 128).
    assert r.model == ModelConfig(hidden_size=4096, params_dtype="bfloat16")
    assert r.kda.num_heads == 64
    assert r.kda.head_dim == 128
    assert r.kda.conv_size == 4
    assert r.kda.gate_lower_bound == -5.0
    assert r.kda.gate_low_rank == 128
    assert r.kda.output_gate_low_rank == 128
    assert r.kda.l2norm_eps == 1e-6
    assert r.kda.norm_eps == 1e-5
    assert r.kda.chunk_size == 64
    assert r.kda.cp_exchange == "a2a"
    assert r.kda.allow_inexact is True
    assert r.kda.kernel == "auto"
    assert r.parallel == ParallelConfig(tp=1, cp=1, ep=1, etp=1, pp=1, sequence_parallel=False)
    assert r.data == DataConfig(seq_len=8192, micro_batch_size=1)
    # Cost-model defaults: 8-GPU nodes, NVLink inside (measured on H200), InfiniBand between.
    assert r.cluster.gpus_per_node == 8
    assert r.cluster.inter_node_kind == "infiniband"
    assert r.cluster.intra_node == LinkConfig(bandwidth_gib_s=250.0, all_to_all_bandwidth_gib_s=268.0,
                                              latency_us=10.0)
    assert r.cluster.inter_node == LinkConfig(bandwidth_gib_s=45.0, latency_us=20.0)


def test_every_field_has_a_docstring():
    for model in (ParallelConfig, KDAConfig, ModelConfig, DataConfig, LinkConfig, ClusterConfig,
                  MeshRecipe):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_frozen():
    r = MeshRecipe()
    with pytest.raises(ValidationError, match="frozen"):
        r.kda.num_heads = 8


# --- accepted combinations -------------------------------------------------------------------


@pytest.mark.parametrize(
    "parallel, kda, seq_len",
    [
        # The 1M-token layout of the first release: TP8 x CP2, SP on, allgather.
        ({"tp": 8, "cp": 2, "sequence_parallel": True}, {"cp_exchange": "allgather"}, 2**20),
        # Pure CP with the all-to-all exchange.
        ({"tp": 1, "cp": 4}, {"cp_exchange": "a2a"}, 8192),
        # TP2 x CP2 with SP, default exchange.
        ({"tp": 2, "cp": 2, "sequence_parallel": True}, {}, 8192),
        # allgather at tp=1 needs no SP (there is no TP group to shard over).
        ({"tp": 1, "cp": 2}, {"cp_exchange": "allgather"}, 8192),
        # cp=1: no zigzag split, so an odd length is fine.
        ({}, {"num_heads": 3}, 7),
        # state keeps all local heads on every rank: 8 local heads need not divide by cp=3.
        ({"tp": 8, "cp": 3, "sequence_parallel": True}, {"cp_exchange": "state"}, 48),
        # auto may pick state, so the same mesh is fine for it while inexact is allowed.
        ({"tp": 8, "cp": 3, "sequence_parallel": True}, {"cp_exchange": "auto"}, 48),
        # auto at TP2 without SP: allgather is just not a candidate.
        ({"tp": 2, "cp": 2}, {"cp_exchange": "auto", "allow_inexact": False}, 8192),
    ],
    ids=[
        "tp8-cp2-sp-allgather-1M",
        "tp1-cp4-a2a",
        "tp2-cp2-sp",
        "tp1-cp2-allgather",
        "cp1-odd-len",
        "tp8-cp3-state",
        "tp8-cp3-auto",
        "tp2-cp2-no-sp-auto-exact",
    ],
)
def test_accepted(parallel, kda, seq_len):
    r = recipe(parallel=parallel, kda=kda, data={"seq_len": seq_len})
    assert r.parallel.tp == parallel.get("tp", 1)
    assert r.data.seq_len == seq_len


# --- rejected combinations -------------------------------------------------------------------


def test_sequence_parallel_needs_tp():
    with pytest.raises(ValidationError, match=r"sequence_parallel needs tp > 1"):
        ParallelConfig(sequence_parallel=True)


def test_pipeline_parallel_refused():
    with pytest.raises(ValidationError, match=r"pp=2: pipeline parallelism is not supported yet"):
        ParallelConfig(pp=2)


@pytest.mark.parametrize("size", [0, -1])
def test_parallel_sizes_positive(size):
    with pytest.raises(ValidationError, match=r"cp\n.*greater than 0"):
        ParallelConfig(cp=size)


@pytest.mark.parametrize("size", [0, -1])
def test_loss_chunk_tokens_positive(size):
    with pytest.raises(ValidationError, match=r"loss_chunk_tokens\n.*greater than 0"):
        TrainConfig(loss_chunk_tokens=size)


def test_loss_chunk_tokens_default_is_the_unfused_loss():
    assert TrainConfig().loss_chunk_tokens is None
    assert TrainConfig(loss_chunk_tokens=4096).loss_chunk_tokens == 4096


def test_parallel_size_not_a_bool():
    with pytest.raises(ValidationError, match=r"tp\n.*valid integer"):
        ParallelConfig(tp=True)


def test_heads_divisible_by_tp():
    with pytest.raises(ValidationError, match=r"num_heads=64 must be divisible by tp=3"):
        recipe(parallel={"tp": 3})


def test_local_heads_divisible_by_cp():
    # 64 heads / tp8 = 8 local heads, not divisible by cp=3.
    with pytest.raises(ValueError, match=r"64/8 = 8 must be divisible by cp=3"):
        recipe(parallel={"tp": 8, "cp": 3, "sequence_parallel": True}, data={"seq_len": 48})


def test_allgather_with_tp_needs_sequence_parallel():
    with pytest.raises(
        ValueError,
        match=r"allgather with tp=2 needs sequence parallelism.*"
        r"set parallel.sequence_parallel=true, or use kda.cp_exchange=a2a",
    ):
        recipe(parallel={"tp": 2, "cp": 2}, kda={"cp_exchange": "allgather"})


def test_seq_len_divisible_by_two_cp():
    with pytest.raises(ValueError, match=r"seq_len=8196 must be divisible by 2\*cp=8"):
        recipe(parallel={"cp": 4}, data={"seq_len": 8196})


def test_cp_shard_divisible_by_tp_under_sequence_parallel():
    # 8200 / cp2 = 4100 tokens per CP rank, not divisible by tp8.
    with pytest.raises(ValidationError, match=r"4100 tokens per CP rank must be divisible by tp=8"):
        recipe(parallel={"tp": 8, "cp": 2, "sequence_parallel": True}, data={"seq_len": 8200})


@pytest.mark.parametrize("bound", [-5.5, 0.0, 1.0])
def test_gate_lower_bound_range(bound):
    with pytest.raises(ValidationError, match=r"must be in \[-5, 0\): fla's safe gate requires it"):
        KDAConfig(gate_lower_bound=bound)


def test_chunk_size_choices():
    assert KDAConfig(chunk_size=32).chunk_size == 32
    with pytest.raises(ValidationError, match="chunk_size"):
        KDAConfig(chunk_size=128)


@pytest.mark.parametrize(
    "field", ["num_heads", "head_dim", "conv_size", "gate_low_rank", "output_gate_low_rank", "kernel_segments"]
)
def test_kda_sizes_positive(field):
    with pytest.raises(ValidationError, match=rf"{field}\n.*greater than 0"):
        KDAConfig(**{field: 0})


def test_unknown_cp_exchange():
    with pytest.raises(ValueError, match=r"kda.cp_exchange: Input should be 'a2a', 'allgather'"):
        recipe(kda={"cp_exchange": "ring"})


def test_unknown_key_refused():
    extra = r"\n.*Extra inputs are not permitted"
    with pytest.raises(ValidationError, match=r"kda\.cp_exchnage" + extra):
        recipe(kda={"cp_exchnage": "allgather"})
    with pytest.raises(ValidationError, match=r"trainer" + extra):
        recipe(trainer={})


# --- cluster (cost model of auto) ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nvlink", "infiniband", "efa", "tcp"])
def test_inter_node_presets(kind):
    c = ClusterConfig(inter_node_kind=kind)
    assert c.inter_node == LinkConfig(**LINK_PRESETS[kind])
    assert c.intra_node == LinkConfig(**LINK_PRESETS["nvlink"])


def test_link_partial_override_keeps_the_preset():
    c = recipe(cluster={"inter_node_kind": "efa", "inter_node": {"latency_us": 30},
                        "intra_node": {"bandwidth_gib_s": 300}}).cluster
    assert c.inter_node == LinkConfig(bandwidth_gib_s=40.0, latency_us=30.0,
                                      node_bandwidth_gib_s=EFA_NODE_GIB_S)
    assert c.intra_node == LinkConfig(bandwidth_gib_s=300.0, all_to_all_bandwidth_gib_s=268.0,
                                      latency_us=10.0)
    # Without an all-to-all figure a link uses its all-gather bandwidth for both.
    assert c.inter_node.a2a_bandwidth_gib_s == 40.0 and c.intra_node.a2a_bandwidth_gib_s == 268.0


def test_cluster_from_overrides_round_trips():
    r = load_mesh_recipe(parse_overrides(["cluster.inter_node_kind=tcp", "cluster.gpus_per_node=4",
                                           "cluster.inter_node.bandwidth_gib_s=2.5"]), environ={})
    assert (r.cluster.gpus_per_node, r.cluster.inter_node.bandwidth_gib_s) == (4, 2.5)
    assert MeshRecipe.model_validate(r.model_dump()) == r


@pytest.mark.parametrize(
    "cluster, match",
    [
        ({"intra_node": {"bandwidth_gib_s": 0}},
         r"intra_node.bandwidth_gib_s\n.*bandwidth_gib_s=0.0 must be > 0"),
        ({"inter_node": {"bandwidth_gib_s": -45}}, r"bandwidth_gib_s=-45.0 must be > 0 \(GiB/s per GPU\)"),
        ({"intra_node": {"all_to_all_bandwidth_gib_s": 0}}, r"all_to_all_bandwidth_gib_s=0.0 must be > 0"),
        ({"inter_node": {"latency_us": -1}}, r"latency_us=-1.0 must be >= 0 \(microseconds per collective\)"),
        ({"inter_node_kind": "roce"}, r"inter_node_kind='roce' is not a link preset; expected one of "
                                      r"nvlink, infiniband, efa, tcp"),
        ({"gpus_per_node": 0}, r"gpus_per_node\n.*greater than 0"),
        ({"inter_node": {"bandwith_gib_s": 1}}, r"bandwith_gib_s\n.*Extra inputs are not permitted"),
    ],
    ids=["zero-bandwidth", "negative-bandwidth", "zero-a2a-bandwidth", "negative-latency",
         "unknown-kind", "zero-gpus", "typo"],
)
def test_cluster_bad_values(cluster, match):
    with pytest.raises(ValidationError, match=match):
        recipe(cluster=cluster)


def test_cluster_spans_nodes():
    c = ClusterConfig(gpus_per_node=8)
    assert c.cp_spans_nodes(tp=8, cp=2) and not c.cp_spans_nodes(tp=4, cp=2)
    assert not c.cp_spans_nodes(tp=16, cp=1), "no CP group to span"


# --- environment override --------------------------------------------------------------------


def test_env_override_applies_and_logs(caplog):
    raw = {"parallel": {"tp": 2, "cp": 2, "sequence_parallel": True}, "kda": {"cp_exchange": "a2a"}}
    with caplog.at_level(logging.INFO, logger="skyrl_megatron_kda.config"):
        r = load_mesh_recipe(raw, environ={CP_EXCHANGE_ENV: "allgather"})
    assert r.kda.cp_exchange == "allgather"
    assert raw["kda"]["cp_exchange"] == "a2a", "the input dict must not be mutated"
    [record] = caplog.records
    assert "SKYRL_KDA_CP_EXCHANGE=allgather" in record.getMessage()
    assert "config value: a2a" in record.getMessage()


def test_env_override_without_kda_section_logs_default(caplog):
    with caplog.at_level(logging.INFO, logger="skyrl_megatron_kda.config"):
        r = load_mesh_recipe({"parallel": {"cp": 2}}, environ={CP_EXCHANGE_ENV: "allgather"})
    assert r.kda.cp_exchange == "allgather"
    assert "config value: a2a (default)" in caplog.text


def test_env_unset_or_empty_changes_nothing(caplog):
    raw = {"kda": {"cp_exchange": "allgather"}}
    with caplog.at_level(logging.INFO, logger="skyrl_megatron_kda.config"):
        choices = exchanges.REGISTRY.choices()
        assert apply_env_overrides(raw, choices, environ={}) == raw
        assert apply_env_overrides(raw, choices, environ={CP_EXCHANGE_ENV: ""}) == raw
    assert not caplog.records


def test_env_override_auto(monkeypatch):
    monkeypatch.setenv(CP_EXCHANGE_ENV, "auto")
    assert load_mesh_recipe({"kda": {"cp_exchange": "a2a"}}).kda.cp_exchange == "auto"


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv(CP_EXCHANGE_ENV, "allgather")
    assert load_mesh_recipe({}).kda.cp_exchange == "allgather"
    monkeypatch.delenv(CP_EXCHANGE_ENV)
    assert load_mesh_recipe({}).kda.cp_exchange == "a2a"


def test_env_invalid_value_refused():
    match = (r"SKYRL_KDA_CP_EXCHANGE='foo' is not a KDA CP exchange; "
             r"allowed values: a2a, allgather, state, auto")
    with pytest.raises(ValueError, match=match):
        load_mesh_recipe({}, environ={CP_EXCHANGE_ENV: "foo"})


def test_env_override_that_breaks_config_refused():
    raw = {"parallel": {"tp": 2, "cp": 2}}  # valid with the default a2a
    assert load_mesh_recipe(raw, environ={}).kda.cp_exchange == "a2a"
    with pytest.raises(ValueError, match=r"allgather with tp=2 needs sequence parallelism"):
        load_mesh_recipe(raw, environ={CP_EXCHANGE_ENV: "allgather"})


# --- CLI overrides and merge -----------------------------------------------------------------


def test_parse_overrides_nested_and_typed():
    got = parse_overrides(
        ["kda.cp_exchange=allgather", "parallel.tp=2", "parallel.sequence_parallel=true"]
    )
    assert got == {
        "kda": {"cp_exchange": "allgather"},
        "parallel": {"tp": 2, "sequence_parallel": True},
    }


def test_parse_overrides_last_wins_and_value_may_contain_equals():
    assert parse_overrides(["parallel.tp=2", "parallel.tp=4"]) == {"parallel": {"tp": 4}}
    assert parse_overrides(["a.b=x=y"]) == {"a": {"b": "x=y"}}


@pytest.mark.parametrize("pair", ["parallel.tp", "=2", "parallel..tp=2", "parallel.=2"])
def test_parse_overrides_malformed(pair):
    with pytest.raises(ValueError, match=rf"override '{pair}' is not of the form"):
        parse_overrides([pair])


def test_parse_overrides_conflict():
    with pytest.raises(ValueError, match=r"'kda.cp_exchange=a2a': kda was already set"):
        parse_overrides(["kda=1", "kda.cp_exchange=a2a"])


def test_merge_deep_and_pure():
    base = {"parallel": {"tp": 2, "cp": 2}, "kda": {"cp_exchange": "a2a"}}
    over = {"parallel": {"cp": 4}, "data": {"seq_len": 64}}
    got = merge(base, over)
    assert got == {
        "parallel": {"tp": 2, "cp": 4},
        "kda": {"cp_exchange": "a2a"},
        "data": {"seq_len": 64},
    }
    assert base == {"parallel": {"tp": 2, "cp": 2}, "kda": {"cp_exchange": "a2a"}}
    assert over == {"parallel": {"cp": 4}, "data": {"seq_len": 64}}
    got["data"]["seq_len"] = 1
    assert over["data"]["seq_len"] == 64


def test_overrides_end_to_end():
    base = {"parallel": {"cp": 2}, "data": {"seq_len": 4096}}
    pairs = ["kda.cp_exchange=allgather", "parallel.tp=2", "parallel.sequence_parallel=true"]
    r = load_mesh_recipe(merge(base, parse_overrides(pairs)), environ={})
    assert (r.parallel.tp, r.parallel.cp, r.parallel.sequence_parallel) == (2, 2, True)
    assert r.kda.cp_exchange == "allgather"


def test_unknown_key_from_override_refused():
    with pytest.raises(ValidationError, match=r"parallel\.tpp\n.*Extra inputs are not permitted"):
        load_mesh_recipe(parse_overrides(["parallel.tpp=2"]), environ={})


def test_flatten_and_unflatten_are_inverse():
    from skyrl_megatron_kda.config import flatten, unflatten

    tree = {"model": {"dsa": {"kernel": "torch", "index_topk": 8}, "hidden_size": 32},
            "run": {"device": "cpu"}, "empty": {}}
    flat = flatten(tree)
    assert flat == {"model.dsa.kernel": "torch", "model.dsa.index_topk": 8,
                    "model.hidden_size": 32, "run.device": "cpu"}  # an empty mapping has no leaf
    assert unflatten(flat) == {k: v for k, v in tree.items() if v}


def test_the_old_exchange_reason_key_is_refused_naming_it():
    # The reason auto gave is the loader's answer (recipes.LoadedRecipe), not a setting.
    with pytest.raises(ValidationError, match="kda.exchange_reason is not a setting: .*auto_choices"):
        MeshRecipe.model_validate({"kda": {"exchange_reason": "state: 200 ms"}})


def test_the_old_cp_layout_key_names_its_new_home():
    with pytest.raises(ValidationError, match="kda.cp_layout is now parallel.cp_layout"):
        MeshRecipe.model_validate({"kda": {"cp_layout": "contiguous"}})
    assert MeshRecipe.model_validate(
        {"parallel": {"cp_layout": "contiguous"}}).parallel.cp_layout == "contiguous"
