"""Optimizer state on the host (``train.optimizer_offload_fraction``) and bf16 gradient reduction
(``train.grad_reduce_in_fp32``): the settings' validation, the megatron configs built from them,
their memory model against the bytes the built optimizer and DDP hold, and (GPU only) that an
offloaded optimizer takes the same steps and that its checkpoints resume without offload and
vice versa.

megatron-core 0.19.2's HybridDeviceOptimizer cannot run on this project's CPU ranks: it offloads
only parameters for which ``is_cuda`` holds (none on a CPU rank), puts the rest in its CPU
optimizer anyway and then looks each of them up among the offloaded copies in ``step``
(KeyError), and it pins host memory and uses CUDA streams. So the recipe refuses it on
``run.device=cpu`` and the step tests run on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from skyrl_megatron_kda import cli, memory
from skyrl_megatron_kda.recipes import load_recipe
from skyrl_megatron_kda.train.optimizer import ddp_config, optimizer_config
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
        load_recipe(TINY, [*ON_GPU, f"train.optimizer_offload_fraction={fraction}"], environ={})


def test_offload_refused_on_cpu_ranks():
    with pytest.raises(ValidationError, match=r"train\.optimizer_offload_fraction=0\.5 needs "
                                              r"run\.device=gpu"):
        load_recipe(TINY, ["train.optimizer_offload_fraction=0.5"], environ={})


def test_grad_reduce_in_fp32_is_a_strict_bool():
    with pytest.raises(ValidationError, match="grad_reduce_in_fp32"):
        load_recipe(TINY, ["train.grad_reduce_in_fp32=maybe"], environ={})


def test_built_configs_follow_the_recipe():
    default = load_recipe(TINY, environ={})
    cfg = optimizer_config(default)
    assert not cfg.optimizer_cpu_offload and not cfg.use_precision_aware_optimizer
    assert cfg.optimizer_offload_fraction == 0.0 and cfg.use_distributed_optimizer
    assert ddp_config(default).grad_reduce_in_fp32

    recipe = load_recipe(TINY, [*ON_GPU, "train.optimizer_offload_fraction=0.25",
                                "train.grad_reduce_in_fp32=false"], environ={})
    cfg = optimizer_config(recipe)
    # The hybrid optimizer runs on megatron's precision-aware path (it keeps the fp32 main
    # parameters itself); without TE this is the only path that may take it.
    assert cfg.optimizer_cpu_offload and cfg.use_precision_aware_optimizer
    assert cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    assert cfg.optimizer_offload_fraction == 0.25 and cfg.decoupled_weight_decay
    assert not ddp_config(recipe).grad_reduce_in_fp32


# --- memory model -------------------------------------------------------------------------


def _full(*overrides: str):
    return load_recipe(FULL, list(overrides))


def _shard_bytes(recipe, per_element: int, predicate) -> int:
    """``per_element`` bytes for each element of this rank's optimizer shard (the parameters
    ``predicate`` picks); a group's bytes divided over its shard group, as memory.py does."""
    dense, expert = memory.optimizer_shards(recipe)
    return sum(g.numel * per_element // (expert if g.expert else dense)
               for g in memory.rank_parameters(recipe) if g.trainable and predicate(g))


def test_bf16_grad_buffer_halves_the_bf16_gradients():
    fp32, bf16 = memory.estimate_memory(_full()), memory.estimate_memory(
        _full("train.grad_reduce_in_fp32=false"))
    groups = [g for g in memory.rank_parameters(_full()) if g.trainable]
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
    on_gpu = memory.estimate_memory(_full())
    offloaded = memory.estimate_memory(_full("train.optimizer_offload_fraction=1.0"))
    assert offloaded.optimizer == 0
    assert offloaded.total == on_gpu.total - on_gpu.optimizer
    # Host: fp32 main copy, two moments, pinned fp32 gradient copy per shard element.
    assert offloaded.host_optimizer == _shard_bytes(_full(), 16, lambda g: True)
    assert on_gpu.host_optimizer == 0


def test_partial_offload_takes_that_share_of_each_term():
    recipe = _full("train.optimizer_offload_fraction=0.25", "train.grad_reduce_in_fp32=false")
    split, whole = memory.optimizer_split(recipe), memory.optimizer_split(
        _full("train.grad_reduce_in_fp32=false"))
    assert whole.host == 0
    assert split.gpu == whole.gpu - round(0.25 * whole.gpu)
    assert split.step_casts == whole.step_casts - round(0.25 * whole.step_casts)
    assert split.host == round(0.25 * _shard_bytes(recipe, 16, lambda g: True))


def test_plan_shows_host_memory_and_the_lower_total(capsys):
    assert cli.main(["plan", FULL, "--set", "train.optimizer_offload_fraction=1.0",
                     "--set", "train.grad_reduce_in_fp32=false"]) == 0
    out = capsys.readouterr().out
    est = memory.estimate_memory(_full("train.optimizer_offload_fraction=1.0",
                                       "train.grad_reduce_in_fp32=false"))
    assert f"host memory per GPU: optimizer state {est.host_optimizer / memory.GiB:.2f} GiB" in out
    assert "gradients (bfloat16 DDP buffer)" in out and "100% on the host" in out
    assert f"{est.total / memory.GiB:.2f}" in out


def _built_bytes(rank, world, overrides) -> dict:
    """DDP's gradient bytes, the optimizer's fp32 main copies + Adam moments after one step, and
    the fp32 casts of the gradients the step makes, of a 1-rank bf16 tiny model on CPU."""
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = load_recipe(TINY, overrides, environ={})
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
    recipe = load_recipe(TINY, overrides, environ={})
    est, split = memory.estimate_memory(recipe), memory.optimizer_split(recipe)
    assert math.isfinite(built["loss"])
    assert built["grads"] == est.grads
    assert built["state"] == split.gpu == est.optimizer
    assert built["casts"] == split.step_casts
    assert (built["casts"] == 0) == fp32


def _three_losses(rank, world, overrides) -> list[float]:
    from skyrl_megatron_kda.train.trainer import RankTrainer

    trainer = RankTrainer(load_recipe(TINY, overrides, environ={}))
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


# --- on a GPU: the hybrid optimizer's steps and checkpoints -------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="megatron's HybridDeviceOptimizer needs CUDA parameters (refused on run.device=cpu)")


def _gpu_run(rank, world, overrides, save_dir, load_dir) -> dict:
    """3 steps (after loading ``load_dir`` if given: its step + 1 to 3); saves after step 2 into
    ``save_dir`` if given. Returns the losses and the final weights on the CPU."""
    from skyrl_megatron_kda.train.checkpoint import latest_checkpoint
    from skyrl_megatron_kda.train.trainer import RankTrainer

    trainer = RankTrainer(load_recipe(TINY, [*ONE_RANK, *ON_GPU, *overrides], environ={}))
    if load_dir:
        trainer.load_checkpoint(str(latest_checkpoint(load_dir)))
    losses = []
    while trainer.step < 3:
        losses.append(trainer.train_step()["loss"])
        if save_dir and trainer.step == 2:
            trainer.save_checkpoint(save_dir)
    weights = {k: v.detach().float().cpu() for k, v in trainer.model.module.state_dict().items()
               if isinstance(v, torch.Tensor)}
    trainer.close()
    return {"losses": losses, "weights": weights}


def _assert_same_run(a: dict, b: dict, what: str) -> None:
    # The offloaded share runs torch's fused AdamW on the CPU instead of the foreach one on the
    # GPU: the same update, summed in another order, so fp32 main weights may differ in the last
    # bits and a bf16 weight by one rounding step; a wrong step (a missed gradient, another LR)
    # moves them by the LR, far more.
    assert len(a["losses"]) == len(b["losses"])
    for x, y in zip(a["losses"], b["losses"]):
        assert abs(x - y) <= 1e-6 * abs(x), f"{what}: losses {a['losses']} vs {b['losses']}"
    for name, w in a["weights"].items():
        torch.testing.assert_close(b["weights"][name], w, rtol=2**-8, atol=0,
                                   msg=lambda m, name=name: f"{what}: {name}: {m}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fraction", ["1.0", "0.5"])
def test_offloaded_optimizer_takes_the_same_steps(fraction):
    plain = run_ranks(1, _gpu_run, [], None, None, backend="nccl")[0]
    offload = run_ranks(1, _gpu_run, [f"train.optimizer_offload_fraction={fraction}"], None, None,
                        backend="nccl")[0]
    _assert_same_run(plain, offload, f"offload {fraction} vs none after 3 steps")


@pytest.mark.gpu
@needs_cuda
def test_checkpoints_cross_offload_settings(tmp_path):
    on, off = ["train.optimizer_offload_fraction=1.0"], []
    for saved, loaded in ((on, off), (off, on)):
        folder = tmp_path / ("from_offload" if saved else "to_offload")
        whole = run_ranks(1, _gpu_run, saved, str(folder), None, backend="nccl")[0]
        resumed = run_ranks(1, _gpu_run, loaded, None, str(folder), backend="nccl")[0]
        _assert_same_run({"losses": whole["losses"][2:], "weights": whole["weights"]}, resumed,
                         f"saved with {saved or 'no offload'}, resumed with {loaded or 'no offload'}")
