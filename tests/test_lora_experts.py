"""LoRA on routed experts (``model/lora.py``, docs/lora.md): per-expert adapters (expert
parameters, split under ETP, A drawn from the global expert) and shared ones (one per MoE layer
and kind, dense) on the tiny GLM model. B = 0 gives the frozen base bitwise; with B drawn whole
and cut as each rank holds it, the log-probs and every adapter's gradient at EP2 (TP2 +SP) and
EP2 x ETP2 (TP2 +SP, DP2) equal the EP1/ETP1 model's (TP2 +SP) within the MoE dispatcher's
budget, as megatron's DDP and finalize_model_grads reduce them; merging equals the adapted
model; an expert adapter drawn from its local instead of its global expert, or scaled wrong, is
caught."""

from __future__ import annotations

import re
import zlib

import pytest
import torch

from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import SINGLE, TINY
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss

RANK, ALPHA = 4, 8.0
TARGETS = ["linear_fc1", "linear_fc2"]  # the dense MLP's, the shared experts' and the routed ones

TOLERANCE = 1e-6
"""Relative fp32 gap (``_gap``: norm of the difference over the reference's norm) of the
log-probs and of each adapter's whole gradient between an EP mesh and EP1/ETP1 on the same TP2
+SP dense mesh: tests/test_moe_dispatcher.py's budget for EP2 x ETP2 (each expert sees its rows
in the same order; the combine sums ETP partial outputs in another order: ~1e-7). A missing or
doubled reduction, or an adapter on the wrong expert, is O(1) (the negative controls ask 1e3 x)."""

MESHES = {
    # the reference: EP1/ETP1 on TP2 +SP (world 2, DP1)
    "ep1": ["parallel.cp=1", "parallel.ep=1", "parallel.etp=1", "run.num_workers=2"],
    # EP2 over the two TP ranks (ETP1)
    "ep2": ["parallel.cp=1", "parallel.ep=2", "parallel.etp=1", "run.num_workers=2"],
    # EP2 x ETP2 over 4 ranks: TP2 +SP, DP2 (both replicas get the same row)
    "ep2_etp2": ["parallel.cp=1", "parallel.ep=2", "parallel.etp=2", "run.num_workers=4"],
}
WORLD = {"ep1": 2, "ep2": 2, "ep2_etp2": 4}


def _global_name(name: str, moe_layers: dict) -> str:
    """``name`` with a routed expert's local index replaced by its global one."""
    m = re.match(r"^(.*)\.experts\.local_experts\.(\d+)\.(.*)$", name)
    if m is None:
        return name
    e = moe_layers[m[1]].local_expert_indices[int(m[2])]
    return f"{m[1]}.experts.local_experts.{e}.{m[3]}"


def _group_of(param):
    """The group an adapter parameter is split over: ETP for an expert parameter, else TP."""
    from megatron.core import parallel_state

    if not getattr(param, "allreduce", True):
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _glu(name):
    return name.endswith("linear_fc1.lora.B")


def _draw_b(name, param):
    """B drawn whole from a generator of its global name, cut as this rank holds it."""
    from skyrl_megatron_kda.distributed.tensor_parallel import is_tp_sharded, shard_of

    group = _group_of(param)
    shape = list(param.shape)
    if is_tp_sharded(param):
        shape[param.partition_dim] *= group.size()
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    full = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05
    return shard_of(full, param, group.rank(), group.size(), glu=_glu(name)).to(param.dtype)


def _experts_on_rank(rank, world, overrides, share):
    """The tiny model with adapters on every fc1/fc2: whether B = 0 is the base bitwise, the
    adapted log-probs and whole adapter gradients by global name (as megatron's DDP and
    finalize_model_grads leave them in ``main_grad``, divided by the DP replicas, which all see
    the same row), the merged model's gap, and the negative controls' log-probs."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.utils import get_model_config

    from skyrl_megatron_kda.distributed.cpu import cuda_names_cpu
    from skyrl_megatron_kda.distributed.tensor_parallel import unshard
    from skyrl_megatron_kda.lora.adapter import LoRAAdapter, initial_a
    from skyrl_megatron_kda.model.lora import apply_lora, lora_parameters, merge_lora
    from skyrl_megatron_kda.model.moe_layer import GLMMoELayer

    recipe = load_recipe(TINY, overrides).recipe
    model = build_on_mesh(recipe)
    ids = token_ids(recipe)
    for p in model.parameters():
        p.requires_grad_(False)
    base = token_loss(model, ids, ids.roll(-1, 1)).detach()
    names = apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=TARGETS,
                       share_expert_adapters=share)
    zero_b = torch.equal(token_loss(model, ids, ids.roll(-1, 1)).detach(), base)
    moe_layers = {n: m for n, m in model.named_modules() if isinstance(m, GLMMoELayer)}
    adapters = lora_parameters(model)
    with torch.no_grad():
        for n, p in adapters.items():
            if n.endswith(".B"):
                p.copy_(_draw_b(_global_name(n, moe_layers), p))
    # megatron's DDP (all-reduce, summing: per-token loss) and finalize_model_grads reduce the
    # gradients: per-expert adapters over the expert-DP group, the others over DP x CP, and the
    # shared expert adapters (sequence_parallel mark) over TP too
    config = get_model_config(model)
    config.calculate_per_token_loss = True
    for module in model.modules():  # as the trainer: finalize must not move the routing
        if hasattr(module, "expert_bias"):
            module.frozen_expert_bias = True
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  model)
    adapted = token_loss(model, ids, ids.roll(-1, 1))
    adapted.sum().backward()
    adapted = adapted.detach()
    with cuda_names_cpu():
        finalize_model_grads([ddp])
    dp = parallel_state.get_data_parallel_world_size()
    grads = {}
    for n, p in adapters.items():
        g = p.main_grad.detach() / dp  # every DP replica saw the same row
        grads[_global_name(n, moe_layers)] = unshard(g, p, _group_of(p), glu=_glu(n))
    counts = dict(local=sum(p.numel() for p in adapters.values()),
                  expert=sum(p.numel() for n, p in adapters.items()
                             if ".experts." in n and ".shared_experts." not in n),
                  marked=sorted({(n.split(".lora.")[0].rsplit(".", 1)[-1],
                                  getattr(p, "allreduce", True),
                                  getattr(p, "sequence_parallel", False))
                                 for n, p in adapters.items() if ".experts." in n
                                 and ".shared_experts." not in n}))
    # Negative controls, on the adapted model: per-expert adapters' A drawn from the local
    # expert's name (as if the index were local), or every routed expert adapter scaled 2x.
    modules = dict(model.named_modules())
    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in adapters.items()}
        for name in names:
            adapter = modules[name]._modules.get("lora")
            if isinstance(adapter, LoRAAdapter) and ".local_experts." in name:
                full_a = initial_a(name, adapter.rank, modules[name].input_size, 0)
                if adapter.split == "row":
                    full_a = full_a.chunk(adapter.tp_group.size(), 1)[adapter.tp_group.rank()]
                adapter.A.copy_(full_a)
        local_index = token_loss(model, ids, ids.roll(-1, 1))
        for n, p in adapters.items():
            p.copy_(saved[n])
        routed = [m for n, m in modules.items() if n.endswith(".lora") and ".experts." in n
                  and ".shared_experts." not in n]  # per-expert adapters and shared ones
        for adapter in routed:
            adapter.scaling *= 2
        scaled = token_loss(model, ids, ids.roll(-1, 1))
        for adapter in routed:
            adapter.scaling /= 2
        merged_names = merge_lora(model)
        merged = token_loss(model, ids, ids.roll(-1, 1))
    return dict(zero_b=zero_b, adapted=adapted, grads=grads, counts=counts,
                moved=(adapted - base).abs().max().item(),
                merged_err=(merged - adapted).abs().max().item(),
                merged_all=sorted(merged_names) == sorted(names),
                left=[n for n, _ in model.named_parameters() if ".lora." in n],
                local_index=local_index, scaled=scaled, names=names)


def _gap(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(mesh, share):
        if (mesh, share) not in cache:
            cache[mesh, share] = run_ranks(WORLD[mesh], _experts_on_rank, MESHES[mesh], share)
        return cache[mesh, share]
    return get


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per_expert"])
@pytest.mark.parametrize("mesh", ["ep2", "ep2_etp2"])
def test_expert_adapters_equal_ep1(runs, mesh, share):
    """B = 0 is the frozen base bitwise; with B drawn, every rank's log-probs and every
    adapter's whole gradient (per-expert ones by global expert, gathered over ETP; shared ones
    summed over the ranks) equal the EP1/ETP1 model's; merging gives the adapted log-probs."""
    ref = runs("ep1", share)[0]
    merged = {}
    for r in runs(mesh, share):
        assert r["zero_b"] and r["moved"] > 1e-3
        assert r["merged_all"] and not r["left"] and r["merged_err"] < 1e-5, r["merged_err"]
        assert _gap(r["adapted"], ref["adapted"]) < TOLERANCE
        merged.update(r["grads"])
        gaps = {n: _gap(g, ref["grads"][n]) for n, g in r["grads"].items()}
        worst = max(gaps, key=gaps.get)
        assert gaps[worst] < TOLERANCE, f"{worst}: relative gap {gaps[worst]:.3g}"
    assert merged.keys() == ref["grads"].keys()  # every global expert's adapter is somewhere


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per_expert"])
def test_negative_controls_are_caught(runs, share):
    """Per-expert adapters whose A is drawn from the local expert index (EP2 holds experts 4-7 as
    0-3), or routed expert adapters scaled 2 x alpha/r, miss the EP1 log-probs by far more than
    the budget (the local index is the global one at EP1, so there it changes nothing)."""
    ref = runs("ep1", share)[0]
    for r in runs("ep2", share):
        assert _gap(r["scaled"], ref["adapted"]) > 1e3 * TOLERANCE
        if not share:
            assert _gap(r["local_index"], ref["adapted"]) > 1e3 * TOLERANCE
    assert _gap(ref["local_index"], ref["adapted"]) < TOLERANCE


def test_per_expert_and_shared_counts_and_marks(runs):
    """Per-expert adapters: E/ep local experts' each, expert parameters (``allreduce`` False),
    split under ETP; shared: one per MoE layer and kind, dense, summed over TP by
    finalize_model_grads (``sequence_parallel``)."""
    recipe = load_recipe(TINY, MESHES["ep2_etp2"]).recipe
    moe = recipe.model.moe
    D, F, E = recipe.model.hidden_size, moe.ffn_hidden_size, moe.num_experts
    n_moe = recipe.model.mlp_types().count("moe")
    shared = runs("ep2_etp2", True)[0]["counts"]
    per_expert = runs("ep2_etp2", False)[0]["counts"]
    # shared: whole A, B: fc1 r (D + 2F), fc2 r (F + D)
    assert shared["expert"] == n_moe * RANK * (2 * D + 3 * F)
    # per expert (E/2 local, ETP2): fc1 A [r, D], B [2F/2, r]; fc2 A [r, F/2], B [D, r]
    assert per_expert["expert"] == n_moe * E // 2 * RANK * (2 * D + F + F // 2)
    assert shared["local"] - shared["expert"] == per_expert["local"] - per_expert["expert"]
    assert shared["marked"] == [("linear_fc1", True, True), ("linear_fc2", True, True)]
    assert per_expert["marked"] == [("linear_fc1", False, False), ("linear_fc2", False, False)]


def _normalized_on_rank(rank, world):
    from skyrl_megatron_kda.model.lora import apply_lora

    recipe = load_recipe(TINY, SINGLE).recipe
    out = []
    for share in (True, False):
        model = build_on_mesh(recipe)
        apply_lora(model, rank=8, alpha=ALPHA, target_modules=TARGETS, normalize_moe_lora=True,
                   share_expert_adapters=share)
        out.append(sorted({(n.rsplit(".", 1)[-1], m.rank, m.scaling)
                           for n, m in model.named_modules() if type(m).__name__.endswith("Adapter")
                           and ".mlp.experts." in n}))
    try:
        apply_lora(build_on_mesh(recipe), rank=8, target_modules=TARGETS, dropout=0.1)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    return out


def test_normalize_moe_lora_and_dropout_refusal():
    """``normalize_moe_lora``: routed experts' adapters take rank 8 // top_k 2 = 4, scale
    alpha / 4; dropout on a routed expert's linear refuses in one line."""
    shared, per_expert, dropout = run_ranks(1, _normalized_on_rank)[0]
    assert shared == per_expert == [("lora", 4, ALPHA / 4)]
    assert "routed experts" in dropout and "local_experts.0.linear_fc1" in dropout
