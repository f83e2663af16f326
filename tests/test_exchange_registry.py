"""The CP exchange registry is the one list every part reads: an exchange registered at run time is
a valid ``kda.cp_exchange`` (and env value), its own rule refuses meshes where a recipe is loaded
(``recipe_rules``), in the cost model and in the layer, the cost model estimates it, ``auto`` can pick it, and the layer runs it."""

import pytest
import torch

from skyrl_megatron_kda.config import CP_EXCHANGE_ENV, MeshRecipe, merge
from skyrl_megatron_kda.kda import exchanges
from skyrl_megatron_kda import auto
from skyrl_megatron_kda.kda.cost import choose, estimate, exclusions
from skyrl_megatron_kda.kda.exchanges import A2AExchange, ExchangeShape
from skyrl_megatron_kda.recipe_rules import load_mesh_recipe
from tests.support.ranks import run_ranks

TOY = "toy_a2a"
TOY_RULE = "toy_a2a needs kda.num_heads divisible by 4"


class ToyExchange(A2AExchange):
    """a2a's data movement under another name, with a mesh rule of its own and a byte model that
    claims half of a2a's CP input bytes (as a payload compressed 2x would move), so that the cost
    model has a reason to prefer it."""

    name = TOY

    @classmethod
    def refusal(cls, mesh):
        if mesh.num_heads % 4:
            return f"{TOY_RULE}, got {mesh.num_heads}"
        return super().refusal(mesh)

    @classmethod
    def bytes_moved(cls, s):
        moved = super().bytes_moved(s)
        cp_in = moved["cp"] - cls.output_bytes(s)
        return {"cp": moved["cp"] - cp_in // 2, "tp": moved["tp"]}


@pytest.fixture
def toy():
    exchanges.register(ToyExchange)
    yield ToyExchange
    exchanges.unregister(TOY)


# TP8 x CP2 + SP, 1M tokens, exact only, CP over an NVLink domain: a2a is the pick among the
# built-in exchanges (tests/test_cost.py), and the toy moves fewer bytes the same way.
EXACT_NVLINK = {
    "parallel": {"tp": 8, "cp": 2, "sequence_parallel": True},
    "kda": {"cp_exchange": "auto", "allow_inexact": False},
    "data": {"seq_len": 2**20},
    "cluster": {"inter_node_kind": "nvlink"},
}


def test_an_unregistered_name_is_refused():
    with pytest.raises(ValueError, match=r"Input should be 'a2a', 'allgather', 'state' or 'auto'"):
        load_mesh_recipe({"kda": {"cp_exchange": TOY}}, environ={})
    with pytest.raises(ValueError, match=rf"{CP_EXCHANGE_ENV}='{TOY}' is not a KDA CP exchange"):
        load_mesh_recipe({}, environ={CP_EXCHANGE_ENV: TOY})


def test_registry_order_and_exact_set(toy):
    assert exchanges.names() == ("a2a", "allgather", "state", TOY)
    assert exchanges.exact_names() == ("a2a", "allgather", TOY)
    assert exchanges.get(TOY) is ToyExchange
    exchanges.register(ToyExchange)  # the same class again: a no-op
    with pytest.raises(ValueError, match=rf"'{TOY}' is already registered to ToyExchange"):
        exchanges.register(type("Other", (ToyExchange,), {}))
    with pytest.raises(ValueError, match="not resolved"):
        exchanges.get("auto")


def test_config_accepts_the_toy_and_refuses_with_its_rule(toy):
    recipe = load_mesh_recipe({"parallel": {"cp": 2}, "kda": {"cp_exchange": TOY}}, environ={})
    assert recipe.kda.cp_exchange == TOY
    assert load_mesh_recipe({"parallel": {"cp": 2}}, environ={CP_EXCHANGE_ENV: TOY}).kda.cp_exchange == TOY
    with pytest.raises(ValueError, match=rf"kda.cp_exchange={TOY} is refused on this mesh: "
                                         rf"{TOY_RULE}, got 6"):
        load_mesh_recipe({"parallel": {"cp": 2}, "kda": {"cp_exchange": TOY, "num_heads": 6}},
                         environ={})
    # a2a's rule is the toy's too (it splits heads over CP).
    with pytest.raises(ValueError, match=r"must be divisible by cp=3: toy_a2a splits"):
        load_mesh_recipe({"parallel": {"cp": 3}, "kda": {"cp_exchange": TOY, "num_heads": 8},
                          "data": {"seq_len": 48}}, environ={})


def test_cost_model_estimates_the_toy_and_auto_picks_it(toy):
    recipe = load_mesh_recipe(EXACT_NVLINK, environ={})
    choice, reason, table = choose(recipe)
    assert [e.name for e in table] == ["a2a", "allgather", "state", TOY]
    by_name = {e.name: e for e in table}
    assert by_name[TOY].exact and by_name[TOY].total_s < by_name["a2a"].total_s
    assert by_name[TOY].cp_in_bytes == by_name["a2a"].cp_in_bytes // 2
    shape = ExchangeShape.of(recipe)
    assert estimate(TOY, shape, False, recipe.cluster).cp_in_bytes == by_name[TOY].cp_in_bytes
    assert choice == TOY and reason.startswith(f"{TOY}: ")
    resolved, choices = auto.resolve(recipe)
    assert resolved.kda.cp_exchange == TOY and choices == {"kda.cp_exchange": reason}


def test_auto_without_the_toy_picks_a2a():
    assert choose(load_mesh_recipe(EXACT_NVLINK, environ={}))[0] == "a2a"


def test_cost_model_excludes_a_mesh_the_toy_refuses(toy):
    raw = merge(EXACT_NVLINK, {"kda": {"num_heads": 18},
                               "parallel": {"tp": 1, "sequence_parallel": False}})
    recipe = load_mesh_recipe(raw, environ={})
    assert exclusions(recipe) == {"state": "not exact, kda.allow_inexact=false",
                                  TOY: f"{TOY_RULE}, got 18"}
    choice, reason, _ = choose(recipe)
    assert choice != TOY and f"{TOY} excluded ({TOY_RULE}, got 18)" in reason


def _tiny(exchange: str, num_heads: int = 4) -> MeshRecipe:
    return MeshRecipe.model_validate({
        "model": {"hidden_size": 32, "params_dtype": "float32"},
        "kda": {"cp_exchange": exchange, "num_heads": num_heads, "head_dim": 8, "gate_low_rank": 8,
                "output_gate_low_rank": 8, "kernel": "torch"},
        "data": {"seq_len": 64},
    })


def _layer_runs_the_toy(rank, world):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from skyrl_megatron_kda.kda.parity import build_layer, make_batch

    exchanges.register(ToyExchange)  # a spawned process does not inherit the parent's registry
    parallel_state.initialize_model_parallel()
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    batch = make_batch(32, lengths=(40, 24))
    runs = {}
    for name in (TOY, "a2a"):
        torch.manual_seed(0)
        layer = build_layer(_tiny(name), pgs.tp, pgs.cp, on_cpu=True)
        x = batch.x.clone().requires_grad_()
        out, _ = layer(x, packed_seq_params=batch.packed)
        (out * batch.grad_out).sum().backward()
        runs[name] = (type(layer.exchange).__name__, out.detach(), x.grad)
    refused = _tiny(TOY)
    refused = refused.model_copy(update={"kda": refused.kda.model_copy(update={"num_heads": 6})})
    try:
        build_layer(refused, pgs.tp, pgs.cp, on_cpu=True)
        message = None
    except ValueError as err:
        message = str(err)
    parallel_state.destroy_model_parallel()
    return runs, message


def test_layer_builds_and_runs_the_toy(toy):
    ((runs, message),) = run_ranks(1, _layer_runs_the_toy)
    (toy_class, toy_out, toy_dx), (_, a2a_out, a2a_dx) = runs[TOY], runs["a2a"]
    assert toy_class == "ToyExchange"
    assert torch.isfinite(toy_out).all() and toy_out.abs().max() > 0
    # The same data movement and kernel as a2a: the same result on the same weights.
    assert torch.equal(toy_out, a2a_out) and torch.equal(toy_dx, a2a_dx)
    assert message == f"kda.cp_exchange={TOY} cannot run on this mesh: {TOY_RULE}, got 6"
