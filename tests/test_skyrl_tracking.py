"""The KDA SkyRL job's per-step record (``integrations/skyrl/tracking.py``): one console line per
step with small numbers in scientific notation, every numeric metric in metrics.jsonl, SkyRL's
console dump replaced by the line and other loggers left SkyRL's."""

from __future__ import annotations

import json

from skyrl_megatron_kda.integrations.skyrl.tracking import KDATracking, step_line

STEP = {"reward/avg_raw_reward": 0.1041, "policy/policy_kl": 0.04485, "trainer/epoch": 0,
        "policy/rollout_train_logprobs_abs_diff_max": 1.9073e-06, "policy/grad_norm": 2.4212,
        "trainer/tokens_per_second_per_gpu": 788.2, "timing/step": 10.16, "note": "text"}


def test_the_step_line_shows_the_drift_in_scientific_notation():
    line = step_line(2, STEP, "KDA exchange a2a (CP1)")
    assert line == ("step 2 | reward 0.1041 | KL 4.49e-02 | logprob drift 1.91e-06 | grad norm "
                    "2.421 | tokens/s/GPU 788.2 | step s 10.2 | KDA exchange a2a (CP1)")
    # SkyRL's console formats to 4 decimals: the drift would read 0.0000 (the negative control)
    assert f"{STEP['policy/rollout_train_logprobs_abs_diff_max']:.4f}" == "0.0000"


def test_missing_metrics_are_left_out_and_non_finite_ones_shown():
    line = step_line(3, {"reward/avg_raw_reward": 0.5, "policy/grad_norm": float("nan"),
                         "async/staleness_max": 1})
    assert line == "step 3 | reward 0.5 | grad norm nan | staleness max 1"


def _tracker(tmp_path, backend):
    return KDATracking(metrics_file=tmp_path / "logs" / "metrics.jsonl",
                       steps_file=tmp_path / "logs" / "steps.log", suffix="KDA exchange state (CP2)",
                       project_name="p", experiment_name="e", backend=backend, config=None)


def test_console_backend_prints_the_line_instead_of_skyrls_dump(tmp_path, capsys):
    tracker = _tracker(tmp_path, "console")
    tracker.log(STEP, step=1)
    tracker.log({"timing/step": 9.5}, step=1)  # the fully async trainer's second call
    out = capsys.readouterr().out.splitlines()
    assert out == [step_line(1, STEP, "KDA exchange state (CP2)")]
    # the same line in steps.log (the console of a Ray task can lose its last lines)
    assert (tmp_path / "logs" / "steps.log").read_text().splitlines() == out
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, **{k: v for k, v in STEP.items() if k != "note"}},
                       {"step": 1, "timing/step": 9.5}]


class _Recorder:
    """A stand-in for SkyRL's mlflow / tensorboard adapters (not installed here)."""

    def __init__(self):
        self.sent = []

    def log(self, data, step):
        self.sent.append((step, data))


def test_other_backends_get_skyrls_dict_as_well(tmp_path, capsys):
    tracker = _tracker(tmp_path, "console")
    tracker.backend, tracker.logger = "mlflow", _Recorder()
    tracker.log(STEP, step=4)
    sent = tracker.logger.sent
    assert sent == [(4, STEP)]
    assert capsys.readouterr().out.splitlines() == [step_line(4, STEP, "KDA exchange state (CP2)")]
