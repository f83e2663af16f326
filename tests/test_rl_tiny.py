"""The RL example (``examples/rl_tiny/run_cpu.py``) end to end on CPU, as a user runs it: SkyRL's
real ``RayPPOTrainer.train()`` for 2 GRPO steps with SkyRL's default KL loss, the KDA policy and
reference workers as Ray actors, at TP1 and at TP2 x CP2 +SP x EP2 with each KDA exchange,
the CPU sampler from the disk-synced weights and the toy environment.

Both meshes start from the same checkpoint, the sampler draws with the same seed and SkyRL
shuffles with the same seed, so step 1 trains on the same rollouts: its reward is equal and its
grad norm agrees to 1e-5 (1e-4 for ``state``'s fp32 state chain; the meshes' gradients differ by
fp32 summation order; a dropped CP shard or a wrong TP gather changes it at order 1).

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


# job -> (mesh, extra SkyRL settings): TP1, and TP2 x CP2 with each KDA exchange (a2a: the recipe's)
JOBS = {
    "tp1": ("tp1", []),
    "tp2cp2_a2a": ("tp2cp2", []),
    "tp2cp2_allgather": ("tp2cp2", ["trainer.kda.cp_exchange=allgather"]),
    "tp2cp2_state": ("tp2cp2", ["trainer.kda.cp_exchange=state"]),
}
GRAD_NORM_TOL = {"tp2cp2_state": 1e-4}  # state's fp32 state chain; the others 1e-5
_jobs: dict = {}


def _run(name: str, tmp_path_factory) -> dict:
    if name in _jobs:
        return _jobs[name]
    mesh, extra = JOBS[name]
    work = tmp_path_factory.mktemp(f"rl_tiny_{name}")
    env = dict(os.environ, PYTHONPATH=str(EXAMPLE.parents[2]), TORCHDYNAMO_DISABLE="1")
    env.pop("SKYRL_KDA_CP_EXCHANGE", None)
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(work), "--steps", str(STEPS),
                           "--mesh", mesh, *extra], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    _jobs[name] = {"work": work, "stdout": proc.stdout, "metrics": metrics}
    return _jobs[name]


@pytest.fixture(scope="module", params=JOBS)
def job(request, tmp_path_factory) -> dict:
    return _run(request.param, tmp_path_factory)


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
    # SkyRL's default KL loss: the reference starts as the policy, so KL is 0 until a step.
    assert steps[1]["policy/policy_kl"] == 0.0
    assert steps[2]["policy/policy_kl"] > 0.0
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


@pytest.mark.parametrize("name", [name for name in JOBS if name != "tp1"])
def test_step_one_is_the_same_on_every_mesh(name, tmp_path_factory):
    one, four = (_steps(_run(job, tmp_path_factory))[1] for job in ("tp1", name))
    assert one["reward/avg_raw_reward"] == four["reward/avg_raw_reward"]  # the same rollouts
    err = abs(four["policy/grad_norm"] - one["policy/grad_norm"]) / one["policy/grad_norm"]
    tol = GRAD_NORM_TOL.get(name, 1e-5)
    assert err < tol, f"{name}: grad norm {four['policy/grad_norm']} vs {one['policy/grad_norm']}"
