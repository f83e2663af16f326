"""Optimizer state on the host (``train.optimizer_offload_fraction``) and bf16 gradient reduction
(``train.grad_reduce_in_fp32``): the settings' validation, the megatron configs built from them,
their memory model against the bytes the built optimizer and DDP hold, and bf16 reduction's
losses.

Offload is modelled (``plan``) but refused when a run or a trainer is built
(``train.optimizer.OFFLOAD_REFUSED``): megatron-core 0.19.2's HybridDeviceOptimizer cannot hold
fp32 model parameters, which this model always has (mHC maps, A_log, dt_bias).
``test_megatron_hybrid_optimizer_cannot_hold_fp32_parameters`` reproduces that on megatron's own
classes; when it fails, megatron changed and the refusal can be lifted. It is also refused on
``run.device=cpu``: there the hybrid optimizer offloads only parameters for which ``is_cuda``
holds (none), puts the rest in its CPU optimizer anyway and then looks each of them up among the
offloaded copies in ``step`` (KeyError), and it pins host memory and uses CUDA streams."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from pydantic import ValidationError

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.memory import GiB, estimate_memory
from skyrl_megatron_kda.memory.census import rank_parameters
from skyrl_megatron_kda.memory.states import optimizer_shards, optimizer_split
from skyrl_megatron_kda.recipes import load_recipe
from skyrl_megatron_kda.train.optimizer import (
    OFFLOAD_REFUSED,
    ddp_config,
    optimizer_config,
)
from tests.support.ranks import run_ranks

TINY = "glm53_flash_tiny"
FULL = "glm53_flash_1m"
ONE_RANK = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.etp=1",
            "parallel.sequence_parallel=false", "run.num_workers=1",
            "model.params_dtype=bfloat16", "data.seq_len=64"]
ON_GPU = ["run.device=gpu", "kda.kernel=torch", "model.dsa.kernel=torch"]


# --- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", ["-0.1", "1.5"])
def test_offload_fraction_outside_0_1_refused(fraction):
    with pytest.raises(ValidationError, match="optimizer_offload_fraction"):
        load_recipe(TINY, [*ON_GPU, f"train.optimizer_offload_fraction={fraction}"], environ={}).recipe


def test_offload_refused_on_cpu_ranks():
    with pytest.raises(ValidationError, match=r"train\.optimizer_offload_fraction=0\.5 needs "
                                              r"run\.device=gpu"):
        load_recipe(TINY, ["train.optimizer_offload_fraction=0.5"], environ={}).recipe


def test_grad_reduce_in_fp32_is_a_strict_bool():
    with pytest.raises(ValidationError, match="grad_reduce_in_fp32"):
        load_recipe(TINY, ["train.grad_reduce_in_fp32=maybe"], environ={}).recipe


def test_built_configs_follow_the_recipe():
    default = load_recipe(TINY, environ={}).recipe
    cfg = optimizer_config(default)
    assert not cfg.optimizer_cpu_offload and not cfg.use_precision_aware_optimizer
    assert cfg.optimizer_offload_fraction == 0.0 and cfg.use_distributed_optimizer
    assert ddp_config(default).grad_reduce_in_fp32

    recipe = load_recipe(TINY, ["train.grad_reduce_in_fp32=false"], environ={}).recipe
    assert not ddp_config(recipe).grad_reduce_in_fp32
    assert not optimizer_config(recipe).optimizer_cpu_offload


def test_offload_refused_when_built():
    """The recipe takes the fraction (``plan`` models it); the trainer's optimizer config and
    ``skyrl-kda run`` (before Ray starts) refuse it with one line naming megatron's limitation."""
    recipe = load_recipe(TINY, [*ON_GPU, "train.optimizer_offload_fraction=0.25"], environ={}).recipe
    with pytest.raises(ValueError, match=r"not supported with megatron-core 0\.19\.2: its "
                                         r"HybridDeviceOptimizer cannot hold fp32 model parameters"):
        optimizer_config(recipe)
    assert "\n" not in OFFLOAD_REFUSED


def test_run_refuses_offload_before_starting(capsys, tmp_path):
    overrides = [*ON_GPU, "train.optimizer_offload_fraction=1.0", f"run.output_dir={tmp_path}/run"]
    assert cli.main(["run", TINY, *[a for o in overrides for a in ("--set", o)]]) == 2
    assert f"error: {OFFLOAD_REFUSED}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _megatron_cuda_code():
    """Where megatron's CUDA-only optimizer code runs: as is on a GPU box, in
    ``cuda_names_cpu`` on a CPU one."""
    from skyrl_megatron_kda.distributed.cpu import cuda_names_cpu

    return contextlib.nullcontext() if torch.cuda.is_available() else cuda_names_cpu()


def _megatron_hybrid_optimizer(no_grad: bool):
    """megatron's own path with the offload configuration megatron intends (precision-aware,
    fraction 1): ``DistributedOptimizer._build_model_and_main_param_groups`` shards an fp32
    parameter (as A_log, dt_bias, an mHC map) and a bf16 one, then the hybrid optimizer is built
    over the shard group as ``DistributedOptimizer.__init__`` builds it. Returns the shard group
    and the optimizer (or the construction error)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    params = [torch.nn.Parameter(torch.randn(8, device=device)),
              torch.nn.Parameter(torch.randn(8, device=device, dtype=torch.bfloat16))]
    group = {"params": list(params), "wd_mult": 1.0}
    gbuf_ranges = [{torch.float32: [{"param_map": {p: {"param": Range(0, 8)} for p in params}}]}]
    config = OptimizerConfig(
        optimizer="adam", bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True,
        optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
        use_precision_aware_optimizer=True)
    with _megatron_cuda_code(), (torch.no_grad() if no_grad else contextlib.nullcontext()):
        DistributedOptimizer._build_model_and_main_param_groups(
            gbuf_ranges, {p: (0, torch.float32, 0) for p in params},
            [{"params": params, "orig_group": group}], config)
        try:
            optimizer = HybridDeviceOptimizer(
                [group], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
                gpu_optimizer_cls=torch.optim.AdamW, overlap_cpu_optimizer_d2h_h2d=False,
                pin_cpu_grads=cuda, pin_cpu_params=cuda, param_update_in_fp32=True, lr=1e-3,
                weight_decay=0.0)
        except ValueError as err:
            return group["params"], err
    return group["params"], optimizer


def test_megatron_hybrid_optimizer_cannot_hold_fp32_parameters():
    """Why ``train.optimizer_offload_fraction`` is refused (megatron-core 0.19.2). When this test
    fails, megatron's hybrid optimizer changed: lift ``OFFLOAD_REFUSED`` and run the offloaded
    steps and checkpoints on a GPU."""
    # The fp32 branch slices the parameter without detaching it: a non-leaf view, which
    # torch.optim.Optimizer refuses (the error the GPU run hit); the bf16 branch detaches.
    (fp32_shard, bf16_shard), built = _megatron_hybrid_optimizer(no_grad=False)
    assert not fp32_shard.is_leaf and bf16_shard.is_leaf
    assert isinstance(built, ValueError) and "can't optimize a non-leaf Tensor" in str(built)
    # Built under no_grad the shard is a leaf and the optimizer constructs, but it makes fp32
    # copies of 16-bit parameters only, and its load_state_dict looks every parameter with state
    # up among those copies: no checkpoint holding an fp32 parameter's state loads.
    (fp32_shard, bf16_shard), optimizer = _megatron_hybrid_optimizer(no_grad=True)
    assert fp32_shard.is_leaf and not isinstance(optimizer, ValueError)
    assert bf16_shard in optimizer.param_to_fp32_param
    assert fp32_shard not in optimizer.param_to_fp32_param
    for p in (fp32_shard, bf16_shard):  # a step's state, as _sync_sub_optimizers_state_to_hdo
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(8),
                              "exp_avg_sq": torch.zeros(8), "master_param": p.detach().float()}
    with _megatron_cuda_code(), pytest.raises(KeyError) as missing:
        optimizer.load_state_dict(optimizer.state_dict())
    assert missing.traceback[-1].name == "_update_fp32_params_by_new_state"


# --- memory model -------------------------------------------------------------------------


def _full(*overrides: str):
    return load_recipe(FULL, list(overrides)).recipe


def _shard_bytes(recipe, per_element: int, predicate) -> int:
    """``per_element`` bytes for each element of this rank's optimizer shard (the parameters
    ``predicate`` picks); a group's bytes divided over its shard group, as memory/states.py does."""
    dense, expert = optimizer_shards(recipe)
    return sum(g.numel * per_element // (expert if g.expert else dense)
               for g in rank_parameters(recipe) if g.trainable and predicate(g))


def test_bf16_grad_buffer_halves_the_bf16_gradients():
    fp32, bf16 = estimate_memory(_full("train.grad_reduce_in_fp32=true")), estimate_memory(
        _full("train.grad_reduce_in_fp32=false"))
    groups = [g for g in rank_parameters(_full()) if g.trainable]
    half = sum(g.numel for g in groups if g.dtype_bytes == 2)
    single = sum(g.numel for g in groups if g.dtype_bytes == 4)  # mHC maps, A_log, dt_bias
    assert fp32.grads == 4 * (half + single)
    assert bf16.grads == 2 * half + 4 * single
    # The step casts the rank's shard of the bf16 gradients to fp32 (its own phase).
    recipe = _full("train.grad_reduce_in_fp32=false")
    casts = _shard_bytes(recipe, 4, lambda g: g.dtype_bytes == 2)
    assert bf16.phases["optimizer step: fp32 casts of bf16 grads"] == casts
    assert "optimizer step: fp32 casts of bf16 grads" not in fp32.phases
    assert bf16.optimizer == fp32.optimizer


def test_full_offload_moves_the_optimizer_term_to_the_host():
    on_gpu = estimate_memory(_full())
    offloaded = estimate_memory(_full("train.optimizer_offload_fraction=1.0"))
    assert offloaded.optimizer == 0
    assert offloaded.total == on_gpu.total - on_gpu.optimizer
    # Host: fp32 main copy, two moments, pinned fp32 gradient copy per shard element.
    assert offloaded.host_optimizer == _shard_bytes(_full(), 16, lambda g: True)
    assert on_gpu.host_optimizer == 0


def test_partial_offload_takes_that_share_of_each_term():
    recipe = _full("train.optimizer_offload_fraction=0.25", "train.grad_reduce_in_fp32=false")
    split, whole = optimizer_split(recipe), optimizer_split(
        _full("train.grad_reduce_in_fp32=false"))
    assert whole.host == 0
    assert split.gpu == whole.gpu - round(0.25 * whole.gpu)
    assert split.step_casts == whole.step_casts - round(0.25 * whole.step_casts)
    assert split.host == round(0.25 * _shard_bytes(recipe, 16, lambda g: True))


def test_plan_shows_host_memory_and_the_lower_total(capsys):
    assert cli.main(["plan", FULL, "--set", "train.optimizer_offload_fraction=1.0",
                     "--set", "train.grad_reduce_in_fp32=false"]) == 0
    out = capsys.readouterr().out
    est = estimate_memory(_full("train.optimizer_offload_fraction=1.0",
                                       "train.grad_reduce_in_fp32=false"))
    assert f"+ optimizer state {est.host_optimizer / GiB:.2f} GiB" in out
    assert "gradients (bfloat16 DDP buffer)" in out and "100% on the host" in out
    assert f"{est.total / GiB:.2f}" in out


def _built_bytes(rank, world, overrides) -> dict:
    """DDP's gradient bytes, the optimizer's fp32 main copies + Adam moments after one step, and
    the fp32 casts of the gradients the step makes, of a 1-rank bf16 tiny model on CPU."""
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = load_recipe(TINY, overrides, environ={}).recipe
    trainer = RankTrainer(recipe)
    loss = trainer.train_step()["loss"]
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    grads = sum(p.main_grad.numel() * p.main_grad.element_size()
                for p in trainer.model.module.parameters() if p.requires_grad)
    state = 0
    for opt in optimizers:
        state += sum(4 * p.numel() for group in opt.shard_fp32_from_float16_groups for p in group)
        state += sum(v.numel() * v.element_size() for s in opt.optimizer.state.values()
                     for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    # The next step's gradients, cast as the step casts them; a cast sharing the DDP buffer's
    # storage (the fp32 buffer's case) allocates nothing.
    row = trainer._my_rows()[0]
    _, count = trainer._forward_backward(row)
    trainer.finalize_grads(count)
    casts = 0
    with trainer.cpu_mode():
        for opt in optimizers:
            opt._copy_model_grads_to_main_grads()
            for group in opt.shard_fp32_from_float16_groups:
                for p in group:
                    buffer = [b.grad_data.untyped_storage().data_ptr()
                              for b in (*trainer.model.buffers, *trainer.model.expert_parallel_buffers)]
                    if p.grad.untyped_storage().data_ptr() not in buffer:
                        casts += p.grad.numel() * p.grad.element_size()
    trainer.close()
    return {"loss": loss, "grads": grads, "state": state, "casts": casts}


@pytest.mark.parametrize("fp32", [True, False], ids=["fp32-grads", "bf16-grads"])
def test_memory_terms_equal_the_built_optimizer(fp32):
    overrides = [*ONE_RANK, f"train.grad_reduce_in_fp32={str(fp32).lower()}"]
    built = run_ranks(1, _built_bytes, overrides)[0]
    recipe = load_recipe(TINY, overrides, environ={}).recipe
    est, split = estimate_memory(recipe), optimizer_split(recipe)
    assert math.isfinite(built["loss"])
    assert built["grads"] == est.grads
    assert built["state"] == split.gpu == est.optimizer
    assert built["casts"] == split.step_casts
    assert (built["casts"] == 0) == fp32


def _three_losses(rank, world, overrides) -> list[float]:
    from skyrl_megatron_kda.train.trainer import RankTrainer

    trainer = RankTrainer(load_recipe(TINY, overrides, environ={}).recipe)
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    trainer.close()
    return losses


def test_bf16_grad_reduction_leaves_the_first_loss_and_trains():
    """The forward is unchanged (first loss bitwise); the bf16-rounded gradients move the later
    steps by about bf16's precision, not more."""
    fp32 = run_ranks(1, _three_losses, [*ONE_RANK, "train.grad_reduce_in_fp32=true"])[0]
    bf16 = run_ranks(1, _three_losses, [*ONE_RANK, "train.grad_reduce_in_fp32=false"])[0]
    assert bf16[0] == fp32[0]
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16))
    assert worst < 1e-2, f"bf16 gradient reduction moved the losses by {worst:.1e}: {fp32} vs {bf16}"
    assert fp32[2] < fp32[0]
