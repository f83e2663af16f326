"""What a KDA SkyRL job records: every numeric metric of every step in ``metrics.jsonl``, one
console line per step a person can read, and SkyRL's whole config in a file (SkyRL logs it at
setup, about 500 lines).

SkyRL's console logger prints the whole metrics dict at 4 decimals each step (about 50 lines, and
the rollout-vs-train log-prob drift, about 1e-6 in fp32, reads ``0.0000``). With
``trainer.logger=console`` the KDA tracker prints ``step_line`` instead; the other backends
(wandb, mlflow, tensorboard, swanlab) get the full dict as SkyRL sends it, and the line as well.
``metrics.jsonl`` (under ``trainer.log_path``) gets every numeric metric, whatever the backend,
and ``steps.log`` beside it the step lines: the trainer runs in a Ray task, whose output reaches
the console through Ray's log forwarding, which can drop the lines printed just before the job
ends.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

from skyrl.train.utils.tracking import Tracking

LOGGER_MODULES = {"wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab",
                  "tensorboard": "tensorboard", "console": None}
"""``trainer.logger`` -> the module SkyRL's ``Tracking`` imports for it (tensorboard through
``torch.utils.tensorboard``, which needs the ``tensorboard`` package)."""

METRICS_FILE = "metrics.jsonl"
STEPS_FILE = "steps.log"

STALENESS = "async/staleness_max"
"""The fully async trainer's metric: how many steps old the step's oldest rollout is."""

STEP_LINE: Tuple[Tuple[str, str, str], ...] = (
    # (label, SkyRL metric, format): the numbers that say whether an RL step is healthy
    ("reward", "reward/avg_raw_reward", ".4g"),
    ("KL", "policy/policy_kl", ".2e"),
    ("logprob drift", "policy/rollout_train_logprobs_abs_diff_max", ".2e"),
    ("is_ratio mean", "policy/loss_metrics/is_ratio_mean", ".4g"),
    ("grad norm", "policy/grad_norm", ".4g"),
    ("tokens/s/GPU", "trainer/tokens_per_second_per_gpu", ".4g"),
    ("step s", "timing/step", ".3g"),
    ("staleness max", STALENESS, "d"),
)
"""The console line's fields, in order; a metric the step did not report is left out (the
fully async trainer reports staleness, the synchronous one does not; SkyRL's off-policy
correction reports ``is_ratio_mean``)."""


def metrics_path(t) -> Path:
    """Where a job's per-step metrics go: ``trainer.log_path``/metrics.jsonl."""
    return Path(t.log_path) / METRICS_FILE


def steps_path(t) -> Path:
    """Where a job's step lines go, as the console shows them: ``trainer.log_path``/steps.log."""
    return Path(t.log_path) / STEPS_FILE


def config_dump_path(t) -> Path:
    """Where the job's whole SkyRL config goes: ``trainer.log_path``/skyrl_config.yaml."""
    return Path(t.log_path) / "skyrl_config.yaml"


def numeric(data: Dict[str, Any]) -> Dict[str, float]:
    """The numeric metrics of one step (SkyRL also logs tables and strings)."""
    return {k: v for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def step_line(step: int, data: Dict[str, Any], suffix: str = "") -> str:
    """One console line for a step's metrics, small numbers in scientific notation."""
    parts: List[str] = [f"step {step}"]
    stale = data.get(STALENESS)
    for label, key, fmt in STEP_LINE:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            parts.append(f"{label} {format(int(value) if fmt == 'd' else value, fmt)}")
        elif value is not None:
            parts.append(f"{label} {value}")  # nan / inf, as they are
        if value is not None and label == "logprob drift" and isinstance(stale, (int, float)) \
                and stale > 0:
            # A stale rollout was sampled by an older policy: its drift is that policy's change.
            parts[-1] += f" (rollouts up to {int(stale)} step{'s' * (stale > 1)} stale: expected)"
    return " | ".join(parts) + (f" | {suffix}" if suffix else "")


class KDATracking(Tracking):
    """SkyRL's ``Tracking`` with ``metrics.jsonl``, ``step_line`` and ``steps.log`` (see the
    module)."""

    def __init__(self, *, metrics_file: Path, steps_file: Path, suffix: str, **kwargs):
        backend = kwargs.get("backend", "console")
        module = LOGGER_MODULES.get(backend)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"trainer.logger={backend}: the {module!r} package is not installed; pip install "
                f"'skyrl_megatron_kda[loggers]' or {module}, or set trainer.logger=console")
        super().__init__(**kwargs)
        self.metrics_file, self.steps_file = Path(metrics_file), Path(steps_file)
        for path in (self.metrics_file, self.steps_file):
            path.parent.mkdir(parents=True, exist_ok=True)
        self.suffix = suffix

    def log(self, data, step, commit=False):
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps({"step": step, **numeric(data)}) + "\n")
        if self.backend != "console":
            super().log(data, step, commit=commit)
        # The fully async trainer logs a step's timings in a second call: those stay in
        # metrics.jsonl, so that each step is one console line.
        if any(key in data for _, key, _ in STEP_LINE if not key.startswith("timing/")):
            line = step_line(step, data, self.suffix)
            with open(self.steps_file, "a") as f:
                f.write(line + "\n")
            print(line, flush=True)

    def finish(self):
        # SkyRL's __del__ finishes every tracker, one whose backend failed to start too: then
        # there is nothing to finish (SkyRL's own would warn of a missing attribute 'logger').
        if hasattr(self, "logger"):
            super().finish()


def kda_tracker(cfg, recipe) -> KDATracking:
    """The tracker of a KDA job, as SkyRL's ``BasePPOExp.get_tracker`` builds its own."""
    t = cfg.trainer
    p = recipe.parallel
    return KDATracking(metrics_file=metrics_path(t), steps_file=steps_path(t),
                       suffix=f"KDA exchange {recipe.kda.cp_exchange} (CP{p.cp})",
                       project_name=t.project_name, experiment_name=t.run_name,
                       backend=t.logger, config=cfg, tags=t.tags)

