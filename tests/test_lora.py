"""``model/lora.py``: LoRA adapters on megatron's column- and row-parallel linears, against an fp64
torch reference of ``W + (alpha/r) B A`` at TP1 and TP2 (+SP), and on the tiny GLM model: the
base unchanged with B = 0, gradients only into the adapters, merging equal to the adapted model."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import SINGLE, TINY
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss

S, B_, IN, OUT, R, ALPHA = 6, 2, 12, 10, 3, 5.0  # distinct sizes, so a swapped dim cannot pass
TOL = 1e-6


def _full_tensors():
    gen = torch.Generator().manual_seed(7)
    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    return dict(w=draw(OUT, IN), a=draw(R, IN), b=draw(OUT, R), x=draw(S, B_, IN), g=draw(S, B_, OUT))


def _reference(t, scaling=ALPHA / R):
    """fp64 autograd of (x @ (W + scaling B A)^T * g).sum() -> output and grads of x, A, B."""
    a, b, x = (t[k].clone().requires_grad_(True) for k in ("a", "b", "x"))
    y = x @ (t["w"] + scaling * b @ a).t()
    (y * t["g"]).sum().backward()
    return dict(y=y.detach(), x=x.grad, a=a.grad, b=b.grad)


def _linear_on_rank(rank, world, column, sp, mutation=None):
    """This rank's adapted linear on its shard of the common tensors -> its output and grads."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core import ModelParallelConfig

    from skyrl_megatron_kda.model.lora import apply_lora

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    config = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp,
                                 use_cpu_initialization=True, params_dtype=torch.float64)
    t = _full_tensors()
    if column:
        linear = ColumnParallelLinear(IN, OUT, config=config, init_method=torch.nn.init.zeros_,
                                      bias=False, gather_output=False, tp_group=tp_group)
        w = t["w"].chunk(world, 0)[rank]
        x = t["x"].chunk(world, 0)[rank] if sp else t["x"]
        g = t["g"].chunk(world, 2)[rank]
    else:
        linear = RowParallelLinear(IN, OUT, config=config, init_method=torch.nn.init.zeros_,
                                   bias=False, input_is_parallel=True, skip_bias_add=True,
                                   tp_group=tp_group)
        w = t["w"].chunk(world, 1)[rank]
        x = t["x"].chunk(world, 2)[rank]
        g = t["g"].chunk(world, 0)[rank] if sp else t["g"]
    model = torch.nn.Module()
    model.proj = linear
    with torch.no_grad():
        linear.weight.copy_(w)
    apply_lora(model, rank=R, alpha=ALPHA, target_modules=["proj"])
    adapter = linear.lora
    with torch.no_grad():  # the common A and B, split as apply_lora splits them
        adapter.A.copy_(t["a"] if column else t["a"].chunk(world, 1)[rank])
        adapter.B.copy_(t["b"].chunk(world, 0)[rank] if column else t["b"])
        if mutation == "scaling":
            adapter.scaling = ALPHA
        elif mutation == "transposed_a":
            adapter.A.copy_(adapter.A.t().reshape(adapter.A.shape))
    x = x.clone().requires_grad_(True)
    y, _ = linear(x)
    (y * g).sum().backward()
    return dict(y=y.detach(), x=x.grad, a=adapter.A.grad, b=adapter.B.grad,
                weight_grad=linear.weight.grad, weight_trains=linear.weight.requires_grad)


def _reference_shard(ref, rank, world, column, sp):
    """The reference cut as the rank holds each tensor."""
    if column:
        return dict(y=ref["y"].chunk(world, 2)[rank], a=ref["a"], b=ref["b"].chunk(world, 0)[rank],
                    x=ref["x"].chunk(world, 0)[rank] if sp else ref["x"])
    return dict(y=ref["y"].chunk(world, 0)[rank] if sp else ref["y"],
                a=ref["a"].chunk(world, 1)[rank], b=ref["b"], x=ref["x"].chunk(world, 2)[rank])


def _worst(results, world, column, sp, ref):
    return max((got[k] - _reference_shard(ref, rank, world, column, sp)[k]).abs().max().item()
               for rank, got in enumerate(results) for k in ("y", "x", "a", "b"))


# (world, column-parallel, SP): each split of A and B, with and without the sequence split.
CASES = [(1, True, False), (1, False, False), (2, True, False), (2, False, False),
         (2, True, True), (2, False, True)]


@pytest.mark.parametrize("world,column,sp", CASES,
                         ids=[f"tp{w}-{'col' if c else 'row'}{'-sp' if s else ''}" for w, c, s in CASES])
def test_adapted_linear_equals_fp64_reference(world, column, sp):
    """Output, input grad and A/B grads of every rank's shard equal autograd of
    x @ (W + (alpha/r) B A)^T in fp64; the base weight gets no gradient."""
    results = run_ranks(world, _linear_on_rank, column, sp)
    worst = _worst(results, world, column, sp, _reference(_full_tensors()))
    assert worst < TOL, f"max diff {worst:.3g} over budget {TOL} (a split or reduction bug is O(1))"
    assert all(r["weight_grad"] is None and not r["weight_trains"] for r in results)


@pytest.mark.parametrize("mutation", ["scaling", "transposed_a"])
def test_negative_controls_are_caught(mutation):
    """An adapter scaled by alpha instead of alpha/r, or reading A's numbers in transposed layout,
    misses the reference by far more than the budget: the comparison above can fail."""
    world, column, sp = 2, False, True
    results = run_ranks(world, _linear_on_rank, column, sp, mutation)
    assert _worst(results, world, column, sp, _reference(_full_tensors())) > 1e3 * TOL


def _model_on_rank(rank, world, overrides):
    """The tiny model: log-probs before and after adapting (B = 0), which parameters get
    gradients, then with random B: log-probs adapted, merged, and the merge's weights."""
    from skyrl_megatron_kda.model.lora import apply_lora, lora_parameters, merge_lora

    recipe = load_recipe(TINY, overrides).recipe
    model = build_on_mesh(recipe)
    ids = token_ids(recipe)
    trainable = token_loss(model, ids, ids.roll(-1, 1)).detach()
    # Freezing alone moves fp32 results in their last bit (torch.matmul folds an [s, b, h] input
    # differently when nothing needs its weight's gradient), so B = 0 is compared with the base
    # frozen as apply_lora freezes it.
    for p in model.parameters():
        p.requires_grad_(False)
    base = token_loss(model, ids, ids.roll(-1, 1)).detach()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = apply_lora(model, rank=4, alpha=8.0, target_modules="all-linear",
                       exclude_modules=["*.experts.*"])
    loss = token_loss(model, ids, ids.roll(-1, 1))
    zero_b = torch.equal(loss.detach(), base)
    loss.sum().backward()
    adapters = lora_parameters(model)
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    gen = torch.Generator().manual_seed(3)  # the same on every rank: a whole B must agree over TP
    with torch.no_grad():
        for n, p in adapters.items():
            if n.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        expected = {f"{n}.weight": (before[f"{n}.weight"].double() + dict(model.named_modules())[n]
                                    .lora.delta_weight().double()) for n in names}
        adapted = token_loss(model, ids, ids.roll(-1, 1))
    merge_lora(model)
    with torch.no_grad():
        merged = token_loss(model, ids, ids.roll(-1, 1))
    params = dict(model.named_parameters())
    weight_err = max((params[n].double() - w).abs().max().item() for n, w in expected.items())
    return dict(names=names, zero_b=zero_b, frozen_moved=(base - trainable).abs().max().item(),
                grads=grads, adapters=set(adapters),
                no_b_grad=[n for n, p in adapters.items()
                           if n.endswith(".B") and (p.grad is None or not p.grad.abs().sum() > 0)],
                moved=(adapted - base).abs().max().item(),
                merged_err=(merged - adapted).abs().max().item(), weight_err=weight_err,
                left=[n for n in params if ".lora." in n])


MESHES = {"tp1": SINGLE,
          # reentrant recompute: adapters inside get gradients only if the frozen embedding's
          # output is made to need one
          "tp1-recompute": SINGLE + ["train.recompute=full"],
          "tp2-sp": ["parallel.cp=1", "parallel.ep=1", "run.num_workers=2", "model.dsa.tp_split=heads"]}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_adapted_model_starts_as_base_trains_adapters_and_merges(mesh):
    """With B = 0 the adapted model's log-probs equal the base's bitwise; backward reaches the
    adapters only; with B drawn, merging gives W + (alpha/r) B A and the adapted log-probs."""
    results = run_ranks(2 if mesh == "tp2-sp" else 1, _model_on_rank, MESHES[mesh])
    for r in results:
        last = {n.rsplit(".", 1)[-1] for n in r["names"]}
        assert {"o_proj", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_down_proj",
                "linear_q_up_proj", "linear_kv_down_proj"} <= last, last
        assert r["zero_b"] and r["frozen_moved"] < 1e-5
        assert not r["no_b_grad"] and r["grads"] == r["adapters"], (r["no_b_grad"], r["grads"])
        assert r["moved"] > 1e-3  # the drawn adapters change the model, so the next check bites
        assert r["weight_err"] < 1e-7 and r["merged_err"] < 1e-5, (r["weight_err"], r["merged_err"])
        assert not r["left"]


def _refusals_on_rank(rank, world):
    from skyrl_megatron_kda.model.lora import apply_lora

    recipe = load_recipe(TINY, SINGLE).recipe
    out = []
    for targets in (["nothing_here"], ["linear_kv_up_proj"], ["output_layer"], "all-linear",
                    ["in_proj"]):
        try:
            apply_lora(build_on_mesh(recipe), rank=2, target_modules=targets)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_refusals_name_the_target_and_reason():
    """A target that selects nothing, linears whose weight the model reads directly and routed
    experts' linears refuse, naming the linear."""
    nothing, kv_up, head, experts, kda_in = run_ranks(1, _refusals_on_rank)[0]
    assert "select no linear" in nothing
    assert "linear_kv_up_proj" in kv_up and "KV latent" in kv_up
    assert "output_layer" in head and "LM head" in head
    assert "experts.local_experts.0.linear_fc1" in experts and "exclude_modules" in experts
    assert "q_proj" in kda_in and "head slices" in kda_in
