"""The RL example under SkyRL's fully async trainer (``FULLY_ASYNC=N
examples/rl_tiny/run_rl_tiny.sh``, through SkyRL's ``main_base`` and the KDA entrypoint) end to
end on CPU: ``FullyAsyncRayPPOTrainer.train()`` with the KDA policy worker as Ray actors, the
project's sampler and the toy environment, 2 steps, no KL loss (no reference ranks: the runtime
is CI's). Three jobs, each on one rank (the worker calls and the weight publish on a TP2 x CP2
mesh are the synchronous trainer's, ``test_rl_tiny.py``'s TP2 x CP2 job, and the fully async
trainer calls the same ones):

- TP1 at staleness 0, checkpointed every step: every rollout is trained in the step it was
  scheduled for, so the sampler's and the trainer's log-probs of the same tokens agree to fp32
  rounding (about 1e-6; a skipped or wrong sync shows as 0.1 or more, see test_rl_tiny.py) and
  SkyRL's off-policy ratio ``is_ratio`` is 1 to the same precision;
- TP1 at staleness 1: the second step trains rollouts scheduled one step earlier (SkyRL's
  ``async/staleness_max`` = 1, never more); their ratio departs from 1 by more than fp32
  rounding, and SkyRL's off-policy correction reports it (``is_ratio_*``, outlier masks) at
  every step;
- TP1 resumed from the first job's step-1 checkpoint (SkyRL's ``fully_async_state.pt``, the
  consumed prompts, beside the worker's checkpoint): its step 2 samples the same rollouts
  (rewards bit for bit); the batch's rows come in the order the generation workers finished,
  which depends on timing, so the sums over rows (grad norm, loss, is_ratio, log-prob diff
  statistics, the trainer's mean reward ``loss/avg_final_rewards``) agree to fp32 summation order (loss measured 1.4e-7 relative; the log-prob
  diff statistics, themselves rounding noise of about 3e-7, by up to 7e-9; a lost Adam moment or
  a wrong prompt changes the loss at order 1e-3 or more). At staleness 0 generation for a step
  starts only after the previous sync, so what is sampled does not depend on timing; at
  staleness 1 it does (how many rollouts finish while a step trains), so that job is not resumed.
"""

from __future__ import annotations

import pytest

from tests.support.rl_tiny_jobs import launch

STEPS, RESUME_FROM = 2, 1
NO_KL = ["trainer.algorithm.use_kl_loss=false"]
# job -> (mesh, staleness bound, extra SkyRL settings)
JOBS = {
    "tp1_stale0": ("tp1", 0, [*NO_KL, "trainer.ckpt_interval=1"]),
    "tp1_stale1": ("tp1", 1, NO_KL),
}
DRIFT_TOL = 1e-5  # fp32 rounding (measured 9.5e-7); a wrong sync: 0.1 or more


def _launch(name: str, mesh: str, staleness: int, extra: list, tmp_path_factory) -> dict:
    job = launch(f"async_{name}", tmp_path_factory, mesh=mesh, steps=STEPS, settings=extra,
                 fully_async=staleness)
    return dict(job, staleness=staleness)


def _run(name: str, tmp_path_factory) -> dict:
    return _launch(name, *JOBS[name], tmp_path_factory)


@pytest.fixture(scope="module", params=JOBS)
def job(request, tmp_path_factory) -> dict:
    return _run(request.param, tmp_path_factory)


def test_fully_async_trainer_ran_every_step_within_the_staleness_bound(job):
    steps = job["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert "trainer: KDAFullyAsyncTrainer (fully async" in job["stdout"]
    # one line per step, with its staleness (SkyRL logs a step's timings separately), in
    # steps.log; the console shows them as Ray forwards the trainer task's output, which may
    # drop the last ones when the job ends
    lines = (job["work"] / "logs" / "steps.log").read_text().splitlines()
    assert len(lines) == STEPS and all("| staleness max " in line for line in lines), lines
    console = [line for line in job["stdout"].splitlines() if " | KDA exchange " in line]
    assert console and all(shown.endswith(line) for shown, line in zip(console, lines)), console
    for step, m in steps.items():
        assert m["async/staleness_max"] <= job["staleness"], (step, m["async/staleness_max"])
        assert m["async/staleness_violation_count"] == 0, step
        assert m["policy/grad_norm"] > 0, step


def test_staleness_zero_samples_with_the_trainers_weights(tmp_path_factory):
    for step, m in _run("tp1_stale0", tmp_path_factory)["steps"].items():
        assert m["async/staleness_max"] == 0
        drift = m["policy/rollout_train_logprobs_abs_diff_max"]
        assert drift < DRIFT_TOL, f"step {step}: sampler vs trainer log-probs differ by {drift:.1e}"
        assert abs(m["policy/loss_metrics/is_ratio_max"] - 1) < DRIFT_TOL, step


def test_staleness_one_trains_stale_rollouts_with_the_off_policy_correction(tmp_path_factory):
    steps = _run("tp1_stale1", tmp_path_factory)["steps"]
    for step, m in steps.items():
        for metric in ("is_ratio_mean", "is_ratio_max", "outlier_seq_masked_ratio"):
            assert f"policy/loss_metrics/{metric}" in m, (step, metric)
    # Step 2 trains the rollouts scheduled while step 1 trained, with step 1's weights.
    assert steps[2]["async/staleness_max"] == 1
    drift = steps[2]["policy/rollout_train_logprobs_abs_diff_max"]
    assert drift > 100 * DRIFT_TOL, f"stale rollouts, yet log-probs agree to {drift:.1e}"
    assert abs(steps[2]["policy/loss_metrics/is_ratio_max"] - 1) > 100 * DRIFT_TOL


def test_a_resumed_fully_async_job_continues_exactly_like_the_uninterrupted_one(tmp_path_factory):
    whole = _run("tp1_stale0", tmp_path_factory)
    checkpoint = whole["work"] / "ckpt" / f"global_step_{RESUME_FROM}"
    assert (checkpoint / "fully_async_state.pt").is_file()  # beside the worker's checkpoint
    assert (checkpoint / "policy").is_dir()
    mesh, staleness, extra = JOBS["tp1_stale0"]
    resumed = _launch("tp1_stale0_resumed", mesh, staleness,
                      [*extra, "trainer.resume_mode=from_path", f"trainer.resume_path={checkpoint}"],
                      tmp_path_factory)
    assert sorted(resumed["steps"]) == [RESUME_FROM + 1], "SkyRL did not resume at the next step"

    again, before = resumed["steps"][RESUME_FROM + 1], whole["steps"][RESUME_FROM + 1]
    exact = [k for k in before if k.startswith(("reward/", "async/"))]
    assert {k: again[k] for k in exact} == {k: before[k] for k in exact}
    # The rows reach the trainer in the order the generation workers finish (timing on a busy
    # machine), so sums over rows, the gradient norm included, agree to rounding only; a resume
    # that lost the optimizer state or the weights moves them by far more.
    means = [k for k in before if k.startswith(("policy/", "loss/avg_final_rewards"))]
    assert {k: again[k] for k in means} == pytest.approx({k: before[k] for k in means},
                                                         rel=1e-5, abs=1e-7)
