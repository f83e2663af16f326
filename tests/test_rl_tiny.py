"""The RL example (``examples/rl_tiny/run_cpu.py``) end to end on CPU, as a user runs it: SkyRL's
real ``RayPPOTrainer.train()`` for 2 GRPO steps with the KDA policy worker as a Ray actor (TP1),
the CPU sampler from the disk-synced weights and the toy environment.

The sampler and the trainer hold the same weights at each step (one optimizer step per training
step, the sync before the next rollouts), so SkyRL's ``policy/rollout_train_logprobs_abs_diff_max``
is fp32 rounding (about 1e-6) at step 1 (initial weights) and step 2 (after a step); a sync that
was skipped or mapped a tensor wrongly shows as 0.1 or more (the step moves the log-probs by more
than 1e-3, checked in tests/test_skyrl_weight_sync.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_tiny" / "run_cpu.py"
STEPS = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("rl_tiny")
    env = dict(os.environ, PYTHONPATH=str(EXAMPLE.parents[2]), TORCHDYNAMO_DISABLE="1")
    env.pop("SKYRL_KDA_CP_EXCHANGE", None)
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(work), "--steps", str(STEPS)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    return {"work": work, "stdout": proc.stdout, "metrics": metrics}


def _steps(job) -> dict:
    """step -> every metric logged at that step (SkyRL logs a step in several calls)."""
    out: dict = {}
    for line in job["metrics"]:
        out.setdefault(line["step"], {}).update(line)
    return out


def test_two_grpo_steps_ran_through_skyrls_trainer(job):
    steps = _steps(job)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, m in steps.items():
        assert "reward/avg_raw_reward" in m, f"step {step}: no reward logged"
        assert 0 <= m["reward/avg_raw_reward"] <= 1
        assert m["policy/grad_norm"] > 0, f"step {step}: no gradient"
        assert m["policy/policy_kl"] == 0.0  # no reference model in this job
    assert "SkyRL settings: trainer.strategy=megatron" in job["stdout"]  # what ran is shown


def test_sampler_logprobs_equal_the_trainers_before_and_after_a_step(job):
    for step, m in _steps(job).items():
        diff = m["policy/rollout_train_logprobs_abs_diff_max"]
        assert diff < 1e-5, f"step {step}: sampler vs trainer log-probs differ by {diff:.1e}"


def test_each_step_published_a_new_version(job):
    weights = job["work"] / "weights"
    # v1 = the initial weights, then one per step; the newest two are kept.
    assert sorted(os.listdir(weights)) == ["LATEST", f"v{STEPS:06d}", f"v{STEPS + 1:06d}"]
    assert (weights / "LATEST").read_text().strip() == f"v{STEPS + 1:06d}"
