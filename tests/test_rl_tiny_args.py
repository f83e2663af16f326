"""The RL example's command line (``examples/rl_tiny/run_cpu.py``) on bad input: one
``error: ...`` line on stderr naming the argument, exit status 2, no traceback, and nothing
started or written: no Ray, no file in WORKDIR (the checks come before the checkpoint, the
tokenizer, the dataset and Ray)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import ray

from skyrl_megatron_kda.config import CP_EXCHANGE_ENV

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_tiny" / "run_cpu.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("rl_tiny_run_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Fails the test if the example starts Ray; the recipe's exchange, not the environment's."""
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv(CP_EXCHANGE_ENV, raising=False)


@pytest.mark.parametrize("arg, named", [
    ("trainer.epochs", "'trainer.epochs' has no =VALUE"),  # SkyRL's parser: epochs=None
    ("=3", "'=3' has no KEY before ="),  # SkyRL's parser: a key ''
    ("trainer.no_such_key=3", "'no_such_key'"),  # SkyRL's strict keys
    ("trainer.kda.cp_exchange=bogus", "kda.cp_exchange"),  # the recipe's validation
    ("trainer.algorithm.policy_loss_type=bogus", "policy_loss_type: bogus"),  # validate_cfg
    ("trainer.fused_lm_head_logprob=true", "fused_lm_head_logprob"),  # apply_recipe's problems
])
def test_bad_argument_is_one_error_line_before_anything_starts(example, tmp_path, capsys,
                                                               arg, named):
    work = tmp_path / "work"
    assert example.main([str(work), arg]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], err
    assert not work.exists()


def test_valid_arguments_pass_the_checks(example, tmp_path, monkeypatch):
    """The negative control: valid settings (with the options between them) reach the job, with
    the files made, and the extra settings win."""
    calls = []

    def run_job(work, cfg, recipe):
        calls.append((cfg, recipe))
        (work / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")

    monkeypatch.setattr(example, "run_job", run_job)
    work = tmp_path / "work"
    assert example.main([str(work), "trainer.kda.cp_exchange=allgather", "--steps", "3",
                         "trainer.algorithm.use_kl_loss=false"]) == 0
    [(cfg, recipe)] = calls
    assert recipe.kda.cp_exchange == "allgather" and cfg.trainer.max_training_steps == 3
    assert not cfg.trainer.algorithm.use_kl_loss
    assert {"GLM-tiny-hf", "train.jsonl"} <= {p.name for p in work.iterdir()}


def test_a_finished_workdir_is_one_error_line(example, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "metrics.jsonl").write_text('{"step": 1}\n')
    assert example.main([str(work)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {work} holds a finished job: use a fresh WORKDIR"]
    assert [p.name for p in work.iterdir()] == ["metrics.jsonl"]
