"""The DSA kernel registry is the one list every part reads: a kernel registered at run time is a
valid ``model.dsa.kernel``, its own rules (device, TP split) refuse recipes where they are loaded
(``recipe_rules``), ``plan``
reads its memory terms, ``auto`` picks among the registered kernels, and the layer runs it
without knowing its name. The toy kernel is the torch kernel under another name, counting the
calls the layer makes and keeping one more byte per query than the torch kernel (so the plan
must read the toy's term to be right)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from skyrl_megatron_kda.memory import estimate_memory
from skyrl_megatron_kda.memory.dsa import dsa_activation_bytes, dsa_shape, dsa_transient_bytes
from skyrl_megatron_kda.config import DSAConfig
from skyrl_megatron_kda.dsa import kernels
from skyrl_megatron_kda.dsa.kernels import TorchKernel
from skyrl_megatron_kda.recipe_rules import check_dsa, kernel_split
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.ranks import run_ranks

TOY = "toy"
ONE_RANK = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
            "run.num_workers=1", "data.seq_len=64"]


class ToyKernel(TorchKernel):
    """The torch kernel renamed; it refuses GPUs and splits heads only, and counts its calls."""

    name = TOY
    splits_rows = False
    working_set_label = "toy working set"
    calls: list[str] = []

    @classmethod
    def refusal(cls, device):
        return "the toy kernel runs on CPUs only" if device == "gpu" else None

    def kv_inputs(self, latent, kv_up_weight, dims):
        ToyKernel.calls.append("kv_inputs")
        return super().kv_inputs(latent, kv_up_weight, dims)

    def indices(self, indexer, qr, weights, keys, gate, layout):
        ToyKernel.calls.append("indices")
        return super().indices(indexer, qr, weights, keys, gate, layout)

    def attention(self, core, query, key, value, kv_up_weight, indices, layout):
        ToyKernel.calls.append("attention")
        return super().attention(core, query, key, value, kv_up_weight, indices, layout)

    @classmethod
    def kept_bytes(cls, shape):
        return TorchKernel.kept_bytes(shape) + shape.rows

    @classmethod
    def working_sets(cls, shape):
        return {"toy stage": max(TorchKernel.working_sets(shape).values()) + 1}


@pytest.fixture
def toy():
    kernels.register(ToyKernel)
    yield ToyKernel
    kernels.unregister(TOY)


def test_registry_lists_the_toy_after_the_built_in_kernels(toy):
    # The bookkeeping (same class again, a clash, a non-kernel) is the shared ``registry.Registry``
    # that tests/test_exchange_registry.py checks.
    assert kernels.names() == ("latent", "fused", "torch", "unfused", TOY)
    assert kernels.get(TOY) is ToyKernel
    with pytest.raises(ValueError, match="model.dsa.kernel=auto is not resolved"):
        kernels.get("auto")
    with pytest.raises(TypeError, match="is not a DSAKernel subclass"):
        kernels.register(object)


def test_config_takes_the_toy_and_its_rules(toy):
    assert kernel_split(DSAConfig(kernel=TOY)).tp_split == "heads"  # it cannot split rows
    with pytest.raises(ValueError, match="tp_split=sequence needs model.dsa.kernel latent, fused or torch"):
        check_dsa(DSAConfig(kernel=TOY, tp_split="sequence"))
    recipe = load_recipe("glm53_flash_tiny", [*ONE_RANK, f"model.dsa.kernel={TOY}"]).recipe
    assert recipe.model.dsa.kernel == TOY
    with pytest.raises(ValueError, match="the toy kernel runs on CPUs only"):
        load_recipe("glm53_flash_tiny", [*ONE_RANK, f"model.dsa.kernel={TOY}", "run.device=gpu"]).recipe


def test_without_the_toy_its_name_is_refused():
    with pytest.raises(ValueError, match="Input should be 'latent', 'fused', 'torch', 'unfused' or 'auto'"):
        check_dsa(DSAConfig(kernel=TOY))


def test_auto_is_resolved_once_from_the_registry_order(toy, monkeypatch):
    assert kernels.resolve("auto", "cpu") == "torch" and kernels.resolve("auto", "gpu") == "latent"
    assert kernels.resolve(TOY, "cpu") == TOY
    assert load_recipe("glm53_flash_tiny", ONE_RANK).recipe.model.dsa.kernel == "torch"
    # With only the oracle and the toy registered: the oracle is never auto's pick.
    monkeypatch.setattr(kernels.REGISTRY, "_classes",
                        {"unfused": kernels.UnfusedKernel, TOY: ToyKernel})
    assert kernels.resolve("auto", "cpu") == TOY
    with pytest.raises(ValueError, match="no kernel to pick on run.device=gpu"):
        kernels.resolve("auto", "gpu")


def test_plan_reads_the_kernels_memory_terms(toy):
    torch_recipe = load_recipe("glm53_flash_tiny", [*ONE_RANK, "model.dsa.kernel=torch",
                                                    "model.dsa.tp_split=heads"]).recipe
    toy_recipe = load_recipe("glm53_flash_tiny", [*ONE_RANK, f"model.dsa.kernel={TOY}"]).recipe
    shape = dsa_shape(toy_recipe)
    assert (dsa_activation_bytes(toy_recipe)
            == dsa_activation_bytes(torch_recipe) + shape.rows)
    assert dsa_transient_bytes(toy_recipe) == dsa_transient_bytes(torch_recipe) + 1
    phases = estimate_memory(toy_recipe).phases
    assert any(label.startswith("DSA layer + toy working set") for label in phases), phases
    auto = torch_recipe.model.dsa.model_copy(update={"kernel": "auto"})
    unresolved = torch_recipe.model_copy(
        update={"model": torch_recipe.model.model_copy(update={"dsa": auto})})
    with pytest.raises(ValueError, match="model.dsa.kernel=auto is not resolved"):
        dsa_activation_bytes(unresolved)


def test_step_time_refuses_a_kernel_without_measured_rates(toy):
    """The step-time model prices the DSA core through the kernel's ``rate_key``: the toy (and
    torch, the CPU path) has none, so the estimate is refused by name and ``plan`` says so in one
    line instead of pricing it at another kernel's rates; the same recipe on a GPU (auto: latent)
    is priced."""
    from skyrl_megatron_kda.steptime import estimate_step_time, step_time_lines

    for kernel in (TOY, "torch"):
        recipe = load_recipe("glm53_flash_tiny", [*ONE_RANK, f"model.dsa.kernel={kernel}"]).recipe
        why = f"model.dsa.kernel={kernel} has no measured step-time rates"
        with pytest.raises(ValueError, match=rf"^{why} \(DSAKernel.rate_key\): price the step "
                                             r"with model.dsa.kernel=latent or fused$"):
            estimate_step_time(recipe)
        assert step_time_lines(recipe) == [f"step time: not estimated: {why} (DSAKernel.rate_key): "
                                           "price the step with model.dsa.kernel=latent or fused"]
    on_gpu = load_recipe("glm53_flash_tiny", [*ONE_RANK, "run.device=gpu"]).recipe
    assert on_gpu.model.dsa.kernel == "latent" and estimate_step_time(on_gpu).step_s > 0
    kda_only = load_recipe("glm53_flash_tiny", [*ONE_RANK, f"model.dsa.kernel={TOY}",
                                                "model.num_layers=3"]).recipe
    assert estimate_step_time(kda_only).part("DSA attention").layers == 0


def _toy_layer_run(rank, world):
    from megatron.core import parallel_state

    from skyrl_megatron_kda.kda.parity import make_batch, relative_error
    from tests.test_dsa import H, _config, _ours, _randomize

    kernels.register(ToyKernel)
    parallel_state.initialize_model_parallel()
    batch = make_batch(H, lengths=(22, 3, 15, 8))
    outs = {}
    for name in ("torch", TOY):
        layer = _ours(_config(4), 4, kernel=name)
        _randomize(layer, seed=7)
        x = batch.x.clone().requires_grad_()
        out, _ = layer(x, attention_mask=None, packed_seq_params=batch.packed)
        (out * batch.grad_out).sum().backward()
        outs[name] = (out.detach(), x.grad)
    return {"calls": list(ToyKernel.calls), "out": relative_error(outs[TOY][0], outs["torch"][0]),
            "dx": relative_error(outs[TOY][1], outs["torch"][1])}


def test_the_layer_runs_a_registered_kernel():
    (result,) = run_ranks(1, _toy_layer_run)
    assert result["calls"] == ["kv_inputs", "indices", "attention"], result["calls"]
    assert result["out"] == 0 and result["dx"] == 0, result


def test_the_layer_never_names_a_kernel():
    """No kernel's name appears as a string in the layer's code: it asks the kernel object."""
    source = (Path(kernels.__file__).parents[1] / "layer.py").read_text()
    code = re.sub(r'"""[\s\S]*?"""', "", source)  # docstrings may describe the kernels
    for name in kernels.names():
        assert not re.search(rf"""["']{name}["']""", code), name
    assert not re.search(r"kernel\s*(==|!=)", code)  # nor compares one


class FusedAttentionTorchSelection(kernels.FusedKernel):
    """The fused kernel's attention with the torch kernel's (fp32) selection, at the torch
    kernel's own options (``model.dsa.torch``): the layer's output then differs from the torch
    kernel's by bf16 rounding alone, not by the few pools that bf16 scores rank the other way."""

    name = "fused_attention"

    def top_pools(self, *args):
        return TorchKernel(self.dsa).top_pools(*args)


class LatentAttentionTorchSelection(kernels.LatentKernel):
    """The same for our TileLang kernels (``latent``)."""

    name = "latent_attention"

    def top_pools(self, *args):
        return TorchKernel(self.dsa).top_pools(*args)


def _gpu_layers(rank, world, gpu_kernel, torch_selection):
    """The DSA layer on CUDA with the torch kernel, the real ``gpu_kernel`` and its attention on
    the torch selection (``torch_selection``), same weights and packed batch: relative errors of
    the output and the input gradient, and the share of query rows whose tokens the GPU
    kernel's indexer selects as the torch one does."""
    from megatron.core import parallel_state

    from skyrl_megatron_kda.kda.parity import make_batch, relative_error
    from tests.test_dsa import H, _config, _ours, _randomize, _record_topk

    kernels.register(torch_selection)
    parallel_state.initialize_model_parallel()
    dev = torch.device("cuda", torch.cuda.current_device())
    batch = make_batch(H, lengths=(220, 3, 150, 81), device=dev)
    outs, picks = {}, {}
    for name in ("torch", gpu_kernel, torch_selection.name):
        layer = _ours(_config(4, topk=32), 4, kernel=name)
        _randomize(layer, seed=7)
        layer.cuda()
        seen = _record_topk(layer)
        x = batch.x.clone().requires_grad_()
        out, _ = layer(x, attention_mask=None, packed_seq_params=batch.packed)
        (out * batch.grad_out).sum().backward()
        outs[name], picks[name] = (out.detach(), x.grad), seen[0].long().sort(-1).values
    attention = outs[torch_selection.name]
    return {"out": relative_error(attention[0], outs["torch"][0]),
            "dx": relative_error(attention[1], outs["torch"][1]),
            "same_tokens": float((picks[gpu_kernel] == picks["torch"]).all(-1).float().mean())}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU kernels need CUDA (TileLang)")
@pytest.mark.parametrize("gpu_kernel, torch_selection", [
    ("fused", FusedAttentionTorchSelection), ("latent", LatentAttentionTorchSelection)])
def test_gpu_layer_matches_the_torch_layer(gpu_kernel, torch_selection):
    """The registry's GPU kernels through the layer: its bf16 TileLang attention within the
    kernels' tolerance (1e-2, tests/test_fused_sparse_mla.py, tests/test_latent_sparse_mla.py)
    of the torch kernel's on the same selection (output and input gradient), and its bf16
    Triton indexer selecting the torch indexer's tokens for nearly every query row (a row
    whose pools score within bf16 rounding of each other may take another pool)."""
    (result,) = run_ranks(1, _gpu_layers, gpu_kernel, torch_selection, backend="nccl")
    print(result)
    assert result["out"] < 1e-2 and result["dx"] < 1e-2, result
    assert result["same_tokens"] > 0.97, result


CHANGED_OPTION = {
    # each kernel's options section: one option off its default
    "fused": ("keep_attention_output", True),
    "latent": ("deterministic_backward", True),
    "torch": ("attention_block", 16),
}


@pytest.mark.parametrize("section", list(CHANGED_OPTION))
@pytest.mark.parametrize("kernel", ["torch", "unfused", "fused", "latent"])
def test_a_kernels_options_are_refused_with_another_kernel(section, kernel):
    """model.dsa.fused, latent and torch hold one kernel's options each: a section set off its
    defaults runs with its own kernel and is refused by name with any other (never accepted
    and ignored); at its defaults it is no setting and passes with every kernel."""
    from skyrl_megatron_kda.recipe_rules import check_dsa

    option, value = CHANGED_OPTION[section]
    split = "heads" if kernel == "unfused" else "sequence"
    dsa = DSAConfig(kernel=kernel, tp_split=split, **{section: {option: value}})
    if kernel != section:
        written = str(value).lower()
        with pytest.raises(ValueError, match=rf"^model.dsa.{section}.{option}={written} applies "
                                             rf"to the {section} kernel only, and "
                                             rf"model.dsa.kernel={kernel}: set model.dsa.kernel"):
            check_dsa(dsa)
    else:
        assert check_dsa(dsa) is dsa
    untouched = DSAConfig(kernel=kernel, tp_split=split, **{section: {}})
    assert check_dsa(untouched) is untouched


def test_each_kernel_reads_its_own_options_section():
    """The fused kernel builds from model.dsa.fused, the latent kernel (its subclass) from
    model.dsa.latent: FP8 scores set for one leave the other's in bf16."""
    from skyrl_megatron_kda.dsa.kernels.fused import FusedKernel
    from skyrl_megatron_kda.dsa.kernels.latent import LatentKernel

    fused_fp8 = DSAConfig(fused={"indexer_scores": "fp8"})
    assert FusedKernel.kernel_options(fused_fp8)["indexer_scores"] == "fp8"
    assert LatentKernel.kernel_options(fused_fp8)["indexer_scores"] == "bf16"
    latent_fp8 = DSAConfig(latent={"indexer_scores": "fp8"})
    assert LatentKernel.kernel_options(latent_fp8)["indexer_scores"] == "fp8"
    assert FusedKernel.kernel_options(latent_fp8)["indexer_scores"] == "bf16"


@pytest.mark.parametrize("former, now", [
    ("keep_attention_output=true", "model.dsa.latent.keep_attention_output"),
    ("fused_query_block=512", "model.dsa.fused.query_block"),
    ("deterministic_backward=true", "model.dsa.latent.deterministic_backward"),
    ("attention_forward=flashmla", "model.dsa.latent.attention_forward"),
    ("indexer_scores=fp8", "model.dsa.latent.indexer_scores"),
    ("attention_block=16", "model.dsa.torch.attention_block"),
    ("indexer_pool_block=64", "model.dsa.torch.indexer_pool_block"),
])
def test_a_former_flat_kernel_option_is_refused_in_one_line_naming_its_key(former, now):
    """The kernel options model.dsa held before each kernel had its section: a recipe that
    still sets one is refused in one line that names where it went."""
    from skyrl_megatron_kda.console import error_lines
    from skyrl_megatron_kda.recipes import load_recipe

    key = former.split("=")[0]
    with pytest.raises(ValidationError) as err:
        load_recipe("glm53_flash_tiny", [f"model.dsa.{former}"], environ={})
    (line,), _ = error_lines(err.value)
    assert f"model.dsa.{key} is now {now}" in line, line
    load_recipe("glm53_flash_tiny", ["model.dsa.torch.attention_block=16"], environ={})


def test_auto_is_refused_where_it_picks_a_kernel_that_ignores_the_options_set():
    """model.dsa.kernel=auto with model.dsa.latent.keep_attention_output=true: on a CPU recipe
    auto picks torch, which reads no latent options, so loading the recipe refuses it in one
    line naming both settings instead of running torch with the setting ignored."""
    from skyrl_megatron_kda.recipes import load_recipe

    with pytest.raises(ValueError, match=r"^model.dsa.kernel=auto picks torch; "
                                         r"model.dsa.latent.keep_attention_output=true applies"):
        load_recipe("glm53_flash_tiny", ["model.dsa.latent.keep_attention_output=true"])
    assert load_recipe("glm53_flash_tiny", []).recipe.model.dsa.kernel == "torch"
    on_gpu = load_recipe("glm53_flash_tiny", ["run.device=gpu",
                                              "model.dsa.latent.keep_attention_output=true"])
    assert on_gpu.recipe.model.dsa.kernel == "latent"


def with_options(recipe, kernel, **options):
    """``recipe`` with ``model.dsa.kernel=kernel`` and ``options`` in that kernel's section."""
    dsa = recipe.model.dsa
    section = getattr(dsa, kernel).model_copy(update=options)
    dsa = dsa.model_copy(update={"kernel": kernel, kernel: section})
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"dsa": dsa})})


def test_the_latent_kernel_loads_its_ordered_backward_and_plans_its_rows(monkeypatch):
    """LatentKernel hands model.dsa.latent.deterministic_backward to its kernel set (``ordered``), and
    plan's backward working set grows by one ordered call's fp32 rows and their sort: at the 1M
    recipe's share 1,024 queries x 2,080 slots x (512 x 4 + 44) bytes."""
    from skyrl_megatron_kda.dsa.kernels.latent import LatentKernel
    from skyrl_megatron_kda.memory.dsa import dsa_shape
    from skyrl_megatron_kda.recipes import load_recipe

    seen = []
    monkeypatch.setattr(LatentKernel, "load_kernels", staticmethod(lambda **kw: seen.append(kw)))
    for on in (False, True):
        LatentKernel(DSAConfig(kernel="latent", latent={"deterministic_backward": on}))
    assert seen == [{"indexer_scores": "bf16", "ordered": on, "attention_forward": "tilelang"}
                    for on in (False, True)]

    recipe = load_recipe("glm53_flash_1m", []).recipe
    sets = {}
    for on in (False, True):
        shape = dsa_shape(with_options(recipe, "latent", deterministic_backward=on))
        sets[on] = LatentKernel.working_sets(shape)
    assert sets[True]["attention backward"] - sets[False]["attention backward"] == (
        1024 * 2080 * (512 * 4 + 44))
    assert sets[True]["attention forward"] == sets[False]["attention forward"]


def test_the_latent_kernel_loads_flashmla_and_plans_its_forward(monkeypatch):
    """model.dsa.latent.attention_forward=flashmla reaches the latent kernel set, and plan's forward
    working set grows by what FlashMLA's contract adds per call at the 1M recipe's share: one
    int32 length per query, the rows' maxima and the log-sum-exp's copy (8,192 queries x 64
    heads fp32 each); both pad the indices to 2,176 (FlashMLA's 128-key blocks; our
    warp-specialised forward's pairs of 64-key blocks), 64 more than one 64-key block would;
    nothing else moves."""
    from skyrl_megatron_kda.dsa.kernels.latent import LatentKernel
    from skyrl_megatron_kda.memory.dsa import dsa_shape
    from skyrl_megatron_kda.recipes import load_recipe

    seen = []
    monkeypatch.setattr(LatentKernel, "load_kernels", staticmethod(lambda **kw: seen.append(kw)))
    LatentKernel(DSAConfig(kernel="latent", latent={"attention_forward": "flashmla"}))
    assert seen[0]["attention_forward"] == "flashmla"

    recipe = load_recipe("glm53_flash_1m", []).recipe
    sets = {}
    for forward in ("tilelang", "flashmla"):
        shape = dsa_shape(with_options(recipe, "latent", attention_forward=forward))
        sets[forward] = LatentKernel.working_sets(shape)
        if forward == "tilelang":
            with monkeypatch.context() as m:
                m.setattr(LatentKernel, "forward_index_multiple", classmethod(lambda cls, s: 64))
                one_block = LatentKernel.working_sets(shape)
    assert sets["flashmla"]["attention forward"] - sets["tilelang"]["attention forward"] == (
        8192 * 4 + 2 * 8192 * 64 * 4)
    assert sets["tilelang"]["attention forward"] - one_block["attention forward"] == (
        8192 * (2176 - 2112) * 4)
    for name in ("indexer", "attention backward"):
        assert sets["flashmla"][name] == sets["tilelang"][name]


@pytest.mark.parametrize("kernel", ["fused", "latent"])
def test_a_kept_output_leaves_the_forwards_working_set(kernel):
    """Under keep_attention_output (model.dsa.fused or latent) the forward keeps each block's own kernel output
    (in ``kept_bytes``), so plan's forward working set holds one [f, n, 512] output fewer at the
    1M recipe's share (8,192 queries x 64 heads, bf16); nothing else moves."""
    from skyrl_megatron_kda.dsa.kernels.fused import FusedKernel
    from skyrl_megatron_kda.dsa.kernels.latent import LatentKernel
    from skyrl_megatron_kda.memory.dsa import dsa_shape
    from skyrl_megatron_kda.recipes import load_recipe

    model = {"fused": FusedKernel, "latent": LatentKernel}[kernel]
    recipe = load_recipe("glm53_flash_1m", []).recipe
    sets = {}
    for keep in (False, True):
        sets[keep] = model.working_sets(dsa_shape(with_options(recipe, kernel,
                                                               keep_attention_output=keep)))
    assert sets[False]["attention forward"] - sets[True]["attention forward"] == 8192 * 64 * 512 * 2
    assert sets[False]["indexer"] == sets[True]["indexer"]
