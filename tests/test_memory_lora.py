"""``memory/lora.py``: the plan's LoRA terms against megatron's DDP and distributed optimizer built
around the tiny model after ``model.lora.apply_lora``, on every gloo rank: parameters by component
(base frozen, adapters the ``lora`` component), DDP's gradient bytes and the optimizer's fp32 main
copies and Adam moments after one step, to the byte, with the routed experts' adapters (per
expert: expert parameters, in DDP's expert-parallel buffers; shared: dense) at EP2; the plan's
selection equals ``lora_targets``' on the built model, and its name tables mirror
``model/lora.py``'s."""

from __future__ import annotations

import re

import pytest
import torch

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.memory import GiB, estimate_memory
from skyrl_megatron_kda.memory import lora as plan_lora
from skyrl_megatron_kda.memory.census import param_counts, rank_parameters
from skyrl_megatron_kda.memory.states import optimizer_split
from skyrl_megatron_kda.model import lora as model_lora
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import FULL, SINGLE, TINY
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss
from tests.test_memory_census import _COMPONENT_PATTERNS

LORA = ["train.lora.rank=4", "train.lora.alpha=8", 'train.lora.exclude_modules=["*.experts.*"]']
BF16 = ["model.params_dtype=bfloat16", "data.seq_len=64"]

EXPERTS = ["train.lora.rank=4", "train.lora.alpha=8", "parallel.tp=1", "parallel.cp=1",
           "parallel.ep=2", "parallel.etp=1", "parallel.sequence_parallel=false",
           "run.num_workers=2", "train.grad_reduce_in_fp32=true"]

CASES = {
    # one rank, fp32 gradient buffer: bf16 adapters, 4-byte gradients, 12-byte Adam state
    "tp1": (1, SINGLE + BF16 + LORA + ["train.grad_reduce_in_fp32=true"]),
    # TP2 +SP x EP2 on 2 ranks, bf16 gradient buffer: the adapters split as their base; DSA's
    # heads split (its linears called, not read)
    "tp2_sp": (2, ["parallel.tp=2", "parallel.cp=1", "parallel.ep=2", "parallel.etp=1",
                   "parallel.sequence_parallel=true", "run.num_workers=2",
                   "model.dsa.tp_split=heads", "train.grad_reduce_in_fp32=false"] + BF16 + LORA),
    # EP2 on 2 ranks (DP2, the expert-DP group 1) with the routed experts adapted: per-expert
    # adapters are expert parameters, their Adam state unsharded where the dense state is
    # halved; normalize_moe_lora gives them rank 4 // top_k 2
    "ep2_per_expert": (2, BF16 + EXPERTS + ["train.lora.share_expert_adapters=false",
                                            "train.lora.normalize_moe_lora=true"]),
    # the same with one shared adapter per MoE layer and kind: dense, whole on every rank
    "ep2_shared": (2, BF16 + EXPERTS),
}


def _component(name: str) -> str:
    if ".lora." in f".{name}":
        return "lora"
    for pattern, component in _COMPONENT_PATTERNS:
        if re.match(pattern, name):
            return component
    raise AssertionError(f"parameter {name} belongs to no component")


def _built_on_rank(rank, world, overrides):
    """The adapted tiny model's parameters by (component, dtype bytes, trainable), the adapted
    linears' names, DDP's gradient bytes (the parameters' views of its buffers, and the buffers
    whole), and the optimizer's fp32 main copies + Adam moments after one step."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config

    from skyrl_megatron_kda.distributed.cpu import cuda_names_cpu
    from skyrl_megatron_kda.train.optimizer import ddp_config, optimizer_config

    recipe = load_recipe(TINY, overrides).recipe
    model = build_on_mesh(recipe)
    lora = recipe.train.lora
    names = model_lora.apply_lora(model, rank=lora.rank, alpha=lora.alpha,
                                  target_modules=lora.target_modules,
                                  exclude_modules=lora.exclude_modules,
                                  share_expert_adapters=lora.share_expert_adapters,
                                  normalize_moe_lora=lora.normalize_moe_lora)
    counts: dict[tuple[str, int, bool], int] = {}
    for name, p in model.named_parameters():
        key = (_component(name), p.element_size(), p.requires_grad)
        counts[key] = counts.get(key, 0) + p.numel()
    config = get_model_config(model)
    config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(config, ddp_config(recipe), model)
    with cuda_names_cpu():
        optimizer = get_megatron_optimizer(optimizer_config(recipe), [ddp])
    grads = sum(p.main_grad.numel() * p.main_grad.element_size()
                for p in model.parameters() if p.requires_grad)
    buffers = [*ddp.buffers, *ddp.expert_parallel_buffers]
    padded = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    ids = token_ids(recipe)
    token_loss(model, ids, ids.roll(-1, 1)).sum().backward()  # DDP hooks the parameters
    with cuda_names_cpu():
        finalize_model_grads([ddp])
        optimizer.step()
    state = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        state += sum(4 * p.numel() for group in opt.shard_fp32_from_float16_groups for p in group)
        state += sum(v.numel() * v.element_size() for s in opt.optimizer.state.values()
                     for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    expert = sum(p.numel() for p in model.parameters()
                 if p.requires_grad and not getattr(p, "allreduce", True))
    return dict(counts=counts, names=sorted(names), grads=grads, padded=padded, state=state,
                trained=sum(1 for p in model.parameters() if p.requires_grad), expert=expert,
                expert_buffers=sum(b.grad_data.numel() for b in ddp.expert_parallel_buffers))


@pytest.fixture(scope="module")
def built():
    return {case: (load_recipe(TINY, overrides).recipe, run_ranks(world, _built_on_rank, overrides))
            for case, (world, overrides) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_lora_terms_equal_the_built_ddp_and_optimizer(built, case):
    recipe, ranks = built[case]
    est = estimate_memory(recipe)
    plan_names = sorted(lin.name for lin in plan_lora.lora_linears(recipe))
    for rank, got in enumerate(ranks):
        assert got["names"] == plan_names, (rank, set(got["names"]) ^ set(plan_names))
        assert got["counts"] == param_counts(rank_parameters(recipe)), rank
        assert got["grads"] == est.grads, (rank, got["grads"], est.grads)
        # Adam state: megatron cuts the DP shards at bucket boundaries, not parameter halves, so
        # under DP > 1 a rank's dense share is the plan's to a few parameters; the ranks' sum
        # is the plan's to the byte
        assert est.optimizer == optimizer_split(recipe).gpu
        assert abs(got["state"] - est.optimizer) <= 0.01 * est.optimizer, (rank, got["state"])
        # megatron pads its buffers (the distributed optimizer's shard alignment): not planned
        assert 0 <= got["padded"] - got["grads"] < 2**16, (rank, got["padded"], got["grads"])
        # the plan's expert-parameter adapters are what DDP puts in its expert-parallel buffers
        planned = sum(g.numel for g in rank_parameters(recipe)
                      if g.component == "lora" and g.expert)
        assert got["expert"] == planned, (rank, got["expert"], planned)
        assert (got["expert_buffers"] > 0) == (planned > 0), rank
    assert sum(got["state"] for got in ranks) == est.optimizer * len(ranks)


@pytest.mark.parametrize("case", list(CASES))
def test_negative_control_base_gradients_miss(built, case):
    """The comparison is not vacuous: the same recipe priced without LoRA (every parameter
    trains), or with the base's gradients counted, misses what DDP and the optimizer hold."""
    recipe, ranks = built[case]
    got = ranks[0]
    plain = recipe.model_copy(update={"train": recipe.train.model_copy(
        update={"lora": recipe.train.lora.model_copy(update={"rank": 0})})})
    full = estimate_memory(plain)
    assert got["grads"] != full.grads and got["state"] != full.optimizer
    base = sum(g.numel for g in rank_parameters(recipe) if g.component != "lora")
    assert got["grads"] != estimate_memory(recipe).grads + base * 4


def test_negative_control_expert_adapters_priced_dense_miss(built):
    """Per-expert adapters priced as dense parameters (Adam state halved over DP2 instead of
    whole over the expert-DP group of 1) miss the ranks' optimizer state."""
    recipe, ranks = built["ep2_per_expert"]
    expert = sum(g.numel for g in rank_parameters(recipe) if g.component == "lora" and g.expert)
    assert expert > 0
    dense_priced = estimate_memory(recipe).optimizer - expert * 12 + expert * 12 // 2
    assert sum(got["state"] for got in ranks) != dense_priced * len(ranks)


def test_rank_zero_changes_no_term():
    plain = estimate_memory(load_recipe(FULL).recipe)
    other = estimate_memory(load_recipe(FULL, ["train.lora.rank=0", "train.lora.alpha=3",
                                               'train.lora.target_modules=["linear_fc1"]']).recipe)
    assert plain == other


def test_expert_adapters_shared_and_per_expert():
    """The 1M recipe with the routed experts adapted: a shared adapter is one per MoE layer and
    kind (dense), per-expert adapters E/ep per layer and kind, split under ETP (expert
    parameters); normalize_moe_lora divides the experts' rank by top_k."""
    base = ["train.lora.rank=8", "train.lora.target_modules=['*.experts.local_experts.*']"]
    recipe = load_recipe(FULL, base).recipe
    m, p = recipe.model, recipe.parallel
    n_moe, D, F = m.mlp_types().count("moe"), m.hidden_size, m.moe.ffn_hidden_size
    assert plan_lora.lora_numels(recipe) == (n_moe * 8 * (2 * D + 3 * F), 0)
    per = load_recipe(FULL, base + ["train.lora.share_expert_adapters=false"]).recipe
    local = m.moe.num_experts // p.ep
    assert plan_lora.lora_numels(per) == (
        0, n_moe * local * 8 * (2 * D + 2 * F // p.etp + F // p.etp))
    norm = load_recipe(FULL, base + ["train.lora.normalize_moe_lora=true"]).recipe
    assert plan_lora.lora_numels(norm)[0] * m.moe.top_k == plan_lora.lora_numels(recipe)[0]


def test_empty_selection_is_refused():
    recipe = load_recipe(FULL, ["train.lora.rank=8", 'train.lora.target_modules=["nothing"]']).recipe
    with pytest.raises(ValueError, match="select no linear"):
        estimate_memory(recipe)


def test_plan_prints_the_lora_terms(capsys):
    overrides = ["train.lora.rank=64", 'train.lora.exclude_modules=["*.experts.*"]']
    assert cli.main(["plan", FULL, *[a for o in overrides for a in ("--set", o)]]) == 0
    out = capsys.readouterr().out
    est = estimate_memory(load_recipe(FULL, overrides).recipe)
    adapters = est.params["LoRA adapters"]
    assert adapters > 0
    assert re.search(rf"LoRA adapters +{adapters / GiB:.2f}", out)
    assert re.search(rf"gradients \(bfloat16 DDP buffer; LoRA adapters only\) +{est.grads / GiB:.2f}", out)
    assert "every base parameter frozen" in out
    assert f"{est.total / GiB:.2f}" in out
