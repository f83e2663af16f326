"""``lora/`` and ``model/lora.py``: LoRA adapters on megatron's column- and row-parallel linears, against an fp64
torch reference of ``W + (alpha/r) B A`` at TP1 and TP2 (+SP), and on the tiny GLM model: the
base unchanged with B = 0, gradients only into the adapters, merging equal to the adapted model;
the adapted weights that KDA's projection and DSA read (``adapted_weight``) against TP1/CP1 at
TP2 +SP and CP2 for each KDA exchange, with negative controls."""

from __future__ import annotations

import zlib

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


def _linear_on_rank(rank, world, column, sp, mutation=None, dropout=0.0):
    """This rank's adapted linear on its shard of the common tensors -> its output and grads
    (with ``dropout``: the default generator seeded alike on every rank first)."""
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
    apply_lora(model, rank=R, alpha=ALPHA, target_modules=["proj"], dropout=dropout)
    adapter = linear.lora
    with torch.no_grad():  # the common A and B, split as apply_lora splits them
        adapter.A.copy_(t["a"] if column else t["a"].chunk(world, 1)[rank])
        adapter.B.copy_(t["b"].chunk(world, 0)[rank] if column else t["b"])
        if mutation == "scaling":
            adapter.scaling = ALPHA
        elif mutation == "transposed_a":
            adapter.A.copy_(adapter.A.t().reshape(adapter.A.shape))
    x = x.clone().requires_grad_(True)
    torch.manual_seed(5)
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


@pytest.mark.parametrize("column,sp", [(True, False), (True, True), (False, True)],
                         ids=["col", "col-sp", "row-sp"])
def test_dropout_masks_are_tp1s_cut_as_the_input(column, sp):
    """With dropout 0.5 and the same seed, every TP2 rank's output and grads equal the TP1 run's
    cut as the rank holds them: the mask is TP1's, so shards of a TP-split input (a row-parallel
    one's columns, a column-parallel one's SP rows) get distinct parts of it, and a replicated
    input the same mask on every rank. The masks drop something (the output differs from
    dropout 0)."""
    one = run_ranks(1, _linear_on_rank, column, False, None, 0.5)[0]
    two = run_ranks(2, _linear_on_rank, column, sp, None, 0.5)
    worst = _worst(two, 2, column, sp, one)
    assert worst < TOL, f"TP2 with dropout differs from TP1 by {worst:.3g}"
    undropped = run_ranks(1, _linear_on_rank, column, False)[0]
    assert (one["y"] - undropped["y"]).abs().max() > 1e-2


def _base_weight(model, name):
    """The base weight's name of the adapted linear ``name`` (a raw weight's under its slot)."""
    from skyrl_megatron_kda.lora.adapter import LoRAWeightSlot

    module = dict(model.named_modules())[name]
    if isinstance(module, LoRAWeightSlot):
        return f"{name.rpartition('.')[0]}.{module.param_name}"
    return f"{name}.weight"


def _glu(name):
    """Whether adapter parameter ``name`` is split as a SwiGLU fc1's rows: [gate shard; up shard]."""
    return name.endswith("linear_fc1.lora.B")


def _draw_b(name, param, tp_rank, tp):
    """B of adapter ``name``: drawn whole from a generator of its name and cut as the rank holds
    it (a SwiGLU fc1's as its weight: [gate shard; up shard]), so every mesh holds the same
    adapter."""
    from skyrl_megatron_kda.distributed.tensor_parallel import is_tp_sharded, shard_of

    shape = list(param.shape)
    if is_tp_sharded(param):
        shape[param.partition_dim] *= tp
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    full = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05
    return shard_of(full, param, tp_rank, tp, glu=_glu(name)).to(param.dtype)


# every linear the model reads or calls, but routed experts: all-linear (with KDA's in_proj and
# f_a/g_a), KDA's f_b/g_b and DSA's kv_b
MODEL_TARGETS = ["all-linear", "f_b_proj", "g_b_proj", "linear_kv_up_proj"]


def _model_on_rank(rank, world, overrides):
    """The tiny model: log-probs before and after adapting (B = 0), which parameters get
    gradients, then with random B: log-probs adapted, the adapters' whole gradients, log-probs
    merged, and the merge's weights."""
    from megatron.core import parallel_state

    from skyrl_megatron_kda.distributed.tensor_parallel import unshard
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
    names = apply_lora(model, rank=4, alpha=8.0, target_modules=MODEL_TARGETS,
                       exclude_modules=["*.experts.*"])
    loss = token_loss(model, ids, ids.roll(-1, 1))
    zero_b = torch.equal(loss.detach(), base)
    loss.sum().backward()
    adapters = lora_parameters(model)
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        for n, p in adapters.items():
            p.grad = None
            if n.endswith(".B"):
                p.copy_(_draw_b(n, p, tp_group.rank(), tp_group.size()))
        expected = {_base_weight(model, n): (before[_base_weight(model, n)].double()
                                             + dict(model.named_modules())[n].lora.delta_weight()
                                             .double()) for n in names}
    adapted = token_loss(model, ids, ids.roll(-1, 1))
    adapted.sum().backward()
    adapted = adapted.detach()
    whole_grads = {n: unshard(p.grad, p, tp_group, glu=_glu(n)) for n, p in adapters.items()}
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
                left=[n for n in params if ".lora." in n], whole_grads=whole_grads,
                slots=[n for n, _ in model.named_modules() if n.endswith(("f_a_proj", "g_a_proj"))])


# Relative budget of the adapters' gradients at TP2 against TP1 (fp32 summation order through
# four layers; a missing or doubled TP reduction is O(1)).
MODEL_GRAD_TOL = 1e-5
MESHES = {"tp1": SINGLE,
          # reentrant recompute: adapters inside get gradients only if the frozen embedding's
          # output is made to need one
          "tp1-recompute": SINGLE + ["train.recompute=full"],
          "tp2-sp": ["parallel.cp=1", "parallel.ep=1", "run.num_workers=2", "model.dsa.tp_split=heads"],
          # DSA's rows path: every MLA linear's weight gathered over TP (forward_by_rows)
          "tp2-sp-rows": ["parallel.cp=1", "parallel.ep=1", "run.num_workers=2",
                          "model.dsa.tp_split=sequence"]}


@pytest.fixture(scope="module")
def model_runs():
    """Each mesh's ranks' results (computed once: the TP2 meshes are compared with TP1's)."""
    cache = {}

    def get(mesh):
        if mesh not in cache:
            world = 2 if mesh.startswith("tp2") else 1
            cache[mesh] = run_ranks(world, _model_on_rank, MESHES[mesh])
        return cache[mesh]
    return get


def _relative(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mesh", list(MESHES))
def test_adapted_model_starts_as_base_trains_adapters_and_merges(mesh, model_runs):
    """With B = 0 the adapted model's log-probs equal the base's bitwise; backward reaches the
    adapters only; with B drawn, merging gives W + (alpha/r) B A and the adapted log-probs. The
    targets cover every weight the model reads itself: KDA's q/k/v/b/f_b/g_b and f_a/g_a, DSA's
    kv_b, and on the rows mesh every MLA linear."""
    results = model_runs(mesh)
    for r in results:
        last = {n.rsplit(".", 1)[-1] for n in r["names"]}
        assert {"o_proj", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_down_proj",
                "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "q_proj", "k_proj",
                "v_proj", "b_proj", "f_b_proj", "g_b_proj", "f_a_proj", "g_a_proj"} <= last, last
        assert r["zero_b"] and r["frozen_moved"] < 1e-5
        assert not r["no_b_grad"] and r["grads"] == r["adapters"], (r["no_b_grad"], r["grads"])
        assert r["moved"] > 1e-3  # the drawn adapters change the model, so the next check bites
        assert r["weight_err"] < 1e-7 and r["merged_err"] < 1e-5, (r["weight_err"], r["merged_err"])
        assert not r["left"] and not r["slots"]


@pytest.mark.parametrize("mesh", ["tp2-sp", "tp2-sp-rows"])
def test_adapter_grads_at_tp2_equal_tp1(mesh, model_runs):
    """Every adapter's A and B gradient (gathered to its whole shape) at TP2 +SP, with DSA on
    heads or on rows, equals the TP1 model's: the adapted weights' TP reductions are right."""
    ref = model_runs("tp1")[0]["whole_grads"]
    for r in model_runs(mesh):
        assert r["whole_grads"].keys() == ref.keys()
        errors = {n: _relative(g, ref[n]) for n, g in r["whole_grads"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] < MODEL_GRAD_TOL, f"{worst}: relative error {errors[worst]:.3g}"


def _refusals_on_rank(rank, world):
    from skyrl_megatron_kda.model.lora import apply_lora

    recipe = load_recipe(TINY, SINGLE).recipe
    out = []
    for targets, dropout in ((["nothing_here"], 0.0), (["output_layer"], 0.0), ("all-linear", 0.0),
                             (["q_proj"], 0.1), (["linear_kv_up_proj"], 0.1),
                             (["g_a_proj"], 0.1), (["o_proj"], 0.1)):
        try:
            apply_lora(build_on_mesh(recipe), rank=2, target_modules=targets, dropout=dropout)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_refusals_name_the_target_and_reason():
    """A target that selects nothing and the LM head refuse, naming the linear; so does dropout
    on a linear whose weight the model reads (its input cannot be dropped for the adapter alone),
    and not on a called one. ``all-linear`` with the routed experts is accepted
    (tests/test_lora_experts.py)."""
    nothing, head, experts, kda_in, kv_up, g_a, called = run_ranks(1, _refusals_on_rank)[0]
    assert "select no linear" in nothing
    assert "output_layer" in head and "LM head" in head
    assert experts is None
    assert "dropout=0.1" in kda_in and "q_proj" in kda_in and "head slices" in kda_in
    assert "linear_kv_up_proj" in kv_up and "KV latent" in kv_up
    assert "g_a_proj" in g_a and "g_a weight" in g_a
    assert called is None


def _slice_on_rank(rank, world):
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from skyrl_megatron_kda.lora.adapter import adapted_weight
    from skyrl_megatron_kda.model.lora import apply_lora

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
    model = torch.nn.Module()
    model.proj = ColumnParallelLinear(IN, 4 * OUT, config=config, init_method=torch.nn.init.normal_,
                                      bias=False, gather_output=False,
                                      tp_group=parallel_state.get_tensor_model_parallel_group())
    plain = torch.equal(adapted_weight(model.proj, slice(3, 9)), model.proj.weight[3:9])
    same_tensor = adapted_weight(model.proj) is model.proj.weight
    apply_lora(model, rank=R, alpha=ALPHA, target_modules=["proj"])
    with torch.no_grad():
        model.proj.lora.B.normal_()
    rows = slice(3, 9)
    whole = adapted_weight(model.proj)[rows]
    part = adapted_weight(model.proj, rows)
    expected = model.proj.weight[rows] + model.proj.lora.B[rows] @ model.proj.lora.A * (ALPHA / R)
    return dict(plain=plain, same_tensor=same_tensor, diff=(whole - part).abs().max().item(),
                err=(part - expected).abs().max().item(), moved=(part - model.proj.weight[rows])
                .abs().max().item())


def test_head_slice_of_adapted_weight_is_adapted_slice():
    """``adapted_weight(linear, rows)`` (what KDA reads for a head slice) equals the slice of the
    whole adapted weight and W[rows] + (alpha/r) B[rows] A, on each TP2 rank; a linear without
    adapter reads its weight itself."""
    for r in run_ranks(2, _slice_on_rank):
        assert r["plain"] and r["same_tensor"]
        assert r["diff"] < 1e-7 and r["err"] < 1e-6 and r["moved"] > 1e-2, r


# The KDA layer alone (the parity harness of tests/test_kda_parity.py): (exchange, tp, cp, SP).
KDA_MESHES = [("a2a", 2, 1, True),
              *((exchange, tp, cp, sp) for exchange in ("a2a", "allgather", "state")
                for tp, cp, sp in ((1, 2, False), (2, 2, True)))]
KDA_CONTROLS = ["scale", "transposed"]  # adapted weights built wrong, on the a2a TP2 x CP2 mesh
KDA_TARGETS = ["in_proj", "f_b_proj", "g_b_proj", "out_proj"]  # every KDA linear and f_a/g_a


def _adapted_kda(recipe, tp_group, cp_group, full_state):
    """A KDA layer on the groups with every adapter, loaded from ``full_state`` (adapters
    included), each parameter cut as the rank holds it."""
    from skyrl_megatron_kda.distributed.tensor_parallel import load_full_state
    from skyrl_megatron_kda.kda import parity
    from skyrl_megatron_kda.model.lora import apply_lora

    layer = parity.build_layer(recipe, tp_group, cp_group, on_cpu=True)
    apply_lora(layer, rank=R, alpha=ALPHA, target_modules=KDA_TARGETS)
    load_full_state(layer, full_state, tp_group.rank(), tp_group.size())
    return layer


def _kda_on_rank(rank, world):
    """{case: relative errors of out, dx and every adapter's whole A/B gradient (CP-summed, as
    the DP x CP reduction sums them) against the TP1/CP1 layer with the same adapters}."""
    import torch.distributed as dist

    from skyrl_megatron_kda.distributed.cp_layout import rank_rows
    from skyrl_megatron_kda.distributed.tensor_parallel import gather_full_grads
    from skyrl_megatron_kda.kda import parity
    from skyrl_megatron_kda.model import lora
    from tests.support.kda_cases import CPU, Case, batch_for, mesh_groups, recipe_for

    groups = mesh_groups(rank, sorted({(tp, cp) for _, tp, cp, _ in KDA_MESHES}))
    single = [dist.new_group([r]) for r in range(world)][rank]
    batch = batch_for("thd", CPU)
    out = {}
    cases = [(m, None) for m in KDA_MESHES] + [(("a2a", 2, 2, True), c) for c in KDA_CONTROLS]
    for (exchange, tp, cp, sp), corrupt in cases:
        recipe = recipe_for(Case(exchange, tp, cp, sp, "thd"), CPU, batch.x.shape[0])
        weights = parity.reference_weights(recipe, single)
        ref = parity.build_layer(parity._single_rank(recipe), single, single, on_cpu=True)
        lora.apply_lora(ref, rank=R, alpha=ALPHA, target_modules=KDA_TARGETS)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n in weights:
                    p.copy_(weights[n])
                elif n.endswith(".B"):
                    p.copy_(_draw_b(n, p, 0, 1))
        full_state = {n: p.detach().clone() for n, p in ref.named_parameters()}
        x_ref = batch.x.clone().requires_grad_()
        y_ref, _ = ref(x_ref, packed_seq_params=batch.packed)
        (y_ref * batch.grad_out).sum().backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if ".lora." in n}
        if rank >= tp * cp:
            continue
        tp_group, cp_group = groups[(tp, cp)]
        layer = _adapted_kda(recipe, tp_group, cp_group, full_state)
        rows = rank_rows(batch.cu_seqlens, cp, tp, cp_group.rank(), tp_group.rank(), sp)
        x = batch.x[rows].clone().requires_grad_()
        saved = lora.LoRAAdapter.adapted
        if corrupt == "scale":  # alpha instead of alpha/r
            lora.LoRAAdapter.adapted = lambda self, w, rows=None: saved(self, w, rows) + (
                saved(self, w, rows) - (w if rows is None else w[rows])) * (R - 1)
        elif corrupt == "transposed":  # B A read with A's numbers in transposed layout
            lora.LoRAAdapter.adapted = lambda self, w, rows=None: (
                w if rows is None else w[rows]) + (self.B if rows is None else self.B[rows]) @ \
                self.A.t().reshape(self.A.shape) * self.scaling
        try:
            y, _ = layer(x, packed_seq_params=batch.packed)
        finally:
            lora.LoRAAdapter.adapted = saved
        (y * batch.grad_out[rows]).sum().backward()
        errors = {"out": parity.relative_error(y.detach(), y_ref.detach()[rows]),
                  "dx": parity.relative_error(x.grad, x_ref.grad[rows])}
        for n, g in gather_full_grads(layer, tp_group).items():
            if ".lora." in n:
                dist.all_reduce(g, group=cp_group)
                errors[n] = parity.relative_error(g, ref_grads[n])
        out[f"{exchange}-tp{tp}-cp{cp}{'-' + corrupt if corrupt else ''}"] = errors
    return out


@pytest.fixture(scope="module")
def kda_runs():
    merged = {}
    for per_rank in run_ranks(4, _kda_on_rank):
        for case, errors in per_rank.items():
            merged.setdefault(case, []).append(errors)
    return merged


@pytest.mark.parametrize("exchange,tp,cp,sp", KDA_MESHES,
                         ids=[f"{e}-tp{t}{'+sp' if s else ''}-cp{c}" for e, t, c, s in KDA_MESHES])
def test_kda_adapter_grads_equal_cp1(kda_runs, exchange, tp, cp, sp):
    """The adapted KDA layer at TP2 +SP and at CP2 for each exchange: output, input gradient and
    the whole A and B gradients of every adapter (q/k/v/b/f_b/g_b from their head slices, f_a/g_a,
    o_proj) equal the TP1/CP1 layer's within 2e-6 relative: fp32 summation order (measured
    6e-7..1.1e-6 for a2a and allgather, 1.4e-6 through ``state``'s fp32 state chain; the base
    layer's own parity budget is 1e-5), where a missing or doubled reduction is O(1)."""
    ranks = kda_runs[f"{exchange}-tp{tp}-cp{cp}"]
    assert len(ranks) == tp * cp
    names = {n.rsplit(".lora.", 1)[0].rsplit(".", 1)[-1] for n in ranks[0] if ".lora." in n}
    assert names == {"q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj", "f_a_proj",
                     "g_a_proj", "o_proj"}, names
    budget = 2e-6
    worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
    bad = {k: v for k, v in worst.items() if not v <= budget}
    assert not bad, f"relative errors over {budget} (a TP or CP reduction bug is O(1)): {bad}"


@pytest.mark.parametrize("corrupt", KDA_CONTROLS)
def test_kda_wrong_adapted_weight_is_caught(kda_runs, corrupt):
    """An adapted weight with alpha instead of alpha/r, or with A's numbers transposed, misses the
    TP1/CP1 layer by far more than the budget."""
    ranks = kda_runs[f"a2a-tp2-cp2-{corrupt}"]
    assert max(max(r["out"], r["dx"]) for r in ranks) > 1e-2
