"""A step whose loss or gradient norm is not finite never reaches the weights, a checkpoint or
``latest`` (``train.on_nonfinite``, ``train.step_guard``), and no float setting may be inf or NaN.

Spawned gloo ranks run the tiny model's real megatron optimizer; the end-to-end case is
``skyrl-kda run`` with a learning rate that diverges, on 4 Ray CPU ranks."""

from __future__ import annotations

import math
import subprocess
import sys
import typing

import pytest
import torch
from pydantic import BaseModel, ValidationError

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.config import Recipe
from skyrl_megatron_kda.recipes import get_recipe, load_recipe
from tests.support import cli_runs
from tests.support.ranks import run_ranks

TINY = "glm53_flash_tiny"
TWO_RANKS = ["parallel.tp=2", "parallel.cp=1", "parallel.ep=1", "parallel.etp=1",
             "parallel.sequence_parallel=true", "run.num_workers=2", "data.seq_len=64"]


# --- settings -------------------------------------------------------------------------------

def _float_settings(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every float setting of the recipe schema, sections walked recursively."""
    names = []
    for name, field in model.model_fields.items():
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                names += _float_settings(kind, f"{prefix}{name}.")
        if float in kinds:
            names.append(f"{prefix}{name}")
    return names


def test_every_float_setting_refuses_inf_and_nan():
    names = _float_settings(Recipe)
    assert {"train.lr", "train.min_lr", "train.grad_clip", "train.weight_decay"} <= set(names)
    for name in names:
        for value in ("inf", "-inf", "nan", ".inf", ".nan"):
            with pytest.raises(ValidationError) as err:
                get_recipe(TINY, [f"{name}={value}"], environ={})
            loc = tuple(str(part) for part in err.value.errors()[0]["loc"])
            assert loc[:len(name.split("."))] == tuple(name.split(".")), (name, value, loc)


def test_finite_float_settings_still_load():
    recipe = get_recipe(TINY, ["train.lr=1e6", "train.grad_clip=0.5"], environ={})
    assert recipe.train.lr == 1e6 and recipe.train.grad_clip == 0.5


def test_lr_inf_is_one_error_line_before_anything_starts(capsys):
    assert cli.main(["plan", TINY, "--set", "train.lr=inf"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "train.lr" in err[0], err


def test_vocab_not_divisible_by_tp_is_refused_by_plan_and_run(capsys):
    for command in ("plan", "run"):
        assert cli.main([command, TINY, "--set", "model.vocab_size=255"]) == 2  # tiny: TP2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: recipe glm53_flash_tiny"), err
        assert err[0].endswith(": model.vocab_size=255 must be divisible by tp=2: the embedding "
                               "and output layer split the vocabulary"), err


# --- the step guard on the real optimizer ---------------------------------------------------

def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.module.parameters()]


def _adam_state(trainer) -> list[torch.Tensor]:
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return [v.detach().clone() for opt in optimizers for s in opt.optimizer.state.values()
            for v in s.values() if isinstance(v, torch.Tensor)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _poison_on(trainer, rank: int, steps: set[int]) -> None:
    """A NaN in one gradient element of ``rank`` only, at the given (1-based) steps."""
    import torch.distributed as dist

    finalize = trainer.finalize_grads

    def poisoned(num_tokens=None):
        finalize(num_tokens)
        if dist.get_rank() == rank and trainer.step + 1 in steps:
            next(trainer.model.module.parameters()).main_grad.view(-1)[0] = float("nan")

    trainer.finalize_grads = poisoned


def _guarded_run(rank, world, overrides, poisoned_steps, steps) -> dict:
    from skyrl_megatron_kda.train.step_guard import NonFiniteStep
    from skyrl_megatron_kda.train.trainer import RankTrainer

    trainer = RankTrainer(load_recipe(TINY, [*TWO_RANKS, *overrides], environ={}).recipe)
    _poison_on(trainer, 1, poisoned_steps)
    lines, unchanged, error = [], [], None
    for _ in range(steps):
        before = (_weights(trainer), _adam_state(trainer), trainer.scheduler.num_steps)
        try:
            lines.append(trainer.train_step())
        except NonFiniteStep as err:
            error = str(err)
        after = (_weights(trainer), _adam_state(trainer), trainer.scheduler.num_steps)
        unchanged.append(_same(before[0], after[0]) and _same(before[1], after[1])
                         and before[2] == after[2])
        if error:
            break
    trainer.close()
    return {"lines": lines, "unchanged": unchanged, "error": error}


def test_stop_applies_nothing_when_one_rank_sees_a_nan_gradient():
    """Rank 1's NaN at step 2 stops both ranks before megatron's step (which would apply it:
    an fp32 model has no loss scaler), weights, Adam state and LR as they were."""
    results = run_ranks(2, _guarded_run, ["train.on_nonfinite=stop"], {2}, 3)
    for r in results:
        assert [line["update_skipped"] for line in r["lines"]] == [False]
        assert r["unchanged"] == [False, True]  # step 1 applied, step 2 not
        assert r["error"].startswith("step 2: loss ") and "gradient norm nan: not finite; the "\
            "update was not applied (train.on_nonfinite=stop)" in r["error"], r["error"]


def test_skip_drops_the_update_then_stops_after_max_skipped_steps_in_a_row():
    overrides = ["train.on_nonfinite=skip", "train.max_skipped_steps=2"]
    results = run_ranks(2, _guarded_run, overrides, {2, 4, 5}, 6)
    for r in results:
        skipped = [line["update_skipped"] for line in r["lines"]]
        assert skipped == [False, True, False, True], skipped
        assert math.isnan(r["lines"][1]["grad_norm"]) and math.isfinite(r["lines"][1]["loss"])
        # A skipped step changes nothing; the finite step after it applies again.
        assert r["unchanged"] == [False, True, False, True, True]
        assert r["error"].startswith("step 5: ") and "2 updates skipped in a row "\
            "(train.max_skipped_steps=2)" in r["error"], r["error"]


def _megatron_step_as_before(trainer):
    """The optimizer step without the guard: megatron's ``step()`` and the schedule."""
    def optimizer_step(loss=None):
        lr = trainer.optimizer.param_groups[0]["lr"]
        with trainer.cpu_mode():
            ok, grad_norm, _ = trainer.optimizer.step()
        assert ok
        trainer.scheduler.step(increment=1)
        trainer.step += 1
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        return float(grad_norm), lr, True

    trainer.optimizer_step = optimizer_step


def _three_steps(rank, world, guarded: bool) -> dict:
    from skyrl_megatron_kda.train.trainer import RankTrainer

    trainer = RankTrainer(load_recipe(TINY, TWO_RANKS, environ={}).recipe)
    if not guarded:
        _megatron_step_as_before(trainer)
    lines = [trainer.train_step() for _ in range(3)]
    out = {"losses": [m["loss"] for m in lines], "norms": [m["grad_norm"] for m in lines],
           "weights": _weights(trainer), "adam": _adam_state(trainer)}
    trainer.close()
    return out


def test_finite_steps_under_the_guard_are_bitwise_megatrons_step():
    guarded = run_ranks(2, _three_steps, True)
    plain = run_ranks(2, _three_steps, False)
    for g, p in zip(guarded, plain):
        assert g["losses"] == p["losses"] and g["norms"] == p["norms"]
        assert _same(g["weights"], p["weights"]) and _same(g["adam"], p["adam"])
    assert guarded[0]["losses"][2] < guarded[0]["losses"][0]


# --- saves ----------------------------------------------------------------------------------

def _save_then_poison(rank, world, out: str) -> dict:
    from skyrl_megatron_kda.train import checkpoint, manifest
    from skyrl_megatron_kda.train.trainer import RankTrainer

    trainer = RankTrainer(load_recipe(TINY, TWO_RANKS, environ={}).recipe)
    trainer.train_step()
    first = trainer.save_checkpoint(out)
    trainer.train_step()
    if rank == 1:  # one weight of one rank
        with torch.no_grad():
            next(trainer.model.module.parameters()).view(-1)[0] = float("inf")
    try:
        trainer.save_checkpoint(out)
        error = None
    except checkpoint.NonFiniteState as err:
        error = str(err)
    latest = checkpoint.latest_checkpoint(out)
    trainer.close()
    return {"first": first, "error": error, "latest": str(latest),
            "finite": manifest.read(latest)["finite"]}


def test_save_refuses_a_nonfinite_state_and_latest_stays(tmp_path):
    results = run_ranks(2, _save_then_poison, str(tmp_path))
    for r in results:
        assert r["error"] == ("step 2: the weights or optimizer state hold inf or NaN; not saved "
                              "(latest stays at step_00000001)")
        assert r["latest"] == r["first"] and r["finite"] is True
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()


# --- through the command line ---------------------------------------------------------------

def test_a_diverging_run_stops_with_one_line_and_latest_stays_finite(tmp_path):
    """``--set train.lr=1e6``: step 1 applies a huge update, step 2's gradient norm is NaN. The
    run exits 1 with one error line naming the step and the values, after the checkpoint of
    step 1; ``latest`` stays there and verifies. On one rank: the ranks' agreement on a
    non-finite step is test_stop_applies_nothing_when_one_rank_sees_a_nan_gradient's."""
    out = tmp_path / "run"
    proc = cli_runs.start(out, *cli_runs.ONE_RANK, "--set", "train.lr=1e6",
                          "--set", "train.save_interval=1")
    status, err = cli_runs.finish(proc)
    assert status == 1, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    line = errors[0]
    assert line.startswith("error: step 2: loss ") and "gradient norm nan: not finite" in line
    assert f"the last good checkpoint is {out / 'checkpoints' / 'step_00000001'}" in line
    assert [m["step"] for m in cli_runs.metrics(out)] == [1]
    verify = subprocess.run([sys.executable, "-m", "skyrl_megatron_kda.cli", "checkpoint",
                             "verify", str(out)], capture_output=True, text=True,
                            env=cli_runs.env())
    assert verify.returncode == 0, verify.stderr
    assert "step_00000001: ok, step 1" in verify.stdout
    assert "weights and optimizer state finite" in verify.stdout
