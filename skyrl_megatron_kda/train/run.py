"""The training driver: one Ray actor per rank runs a ``RankTrainer``; this process steps them,
writes ``metrics.jsonl`` and ``recipe.yaml`` into ``run.output_dir``, shows progress, saves
checkpoints (every ``train.save_interval`` steps, at the end, and on SIGTERM / Ctrl-C) and
resumes from the latest one with ``run.resume``.

A rank that fails or dies ends the run with ``WorkerError`` naming the rank and the cause
(``workers.group``); the other actors are killed with it.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TextIO

import ray
import yaml

from ..config import Recipe
from ..workers.group import ActorGroup, ensure_ray
from . import checkpoint
from .outputs import METRICS, RECIPE
from .trainer import RankTrainer

logger = logging.getLogger(__name__)

# Same on every rank (global after the all-reduce, or the recipe's); taken from rank 0.
_GLOBAL_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "loss_tokens", "exchange",
                "skipped_records")


class Interrupted(RuntimeError):
    """The run stopped on SIGTERM or Ctrl-C after saving a checkpoint; ``--resume`` continues it."""

    def __init__(self, signum: int, step: int, path: Path):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; "
                         f"checkpoint {path} (continue with --resume)")
        self.signum, self.step, self.path = signum, step, path


def _make_trainer(rank: int, world: int, recipe: Recipe):
    """Rank side: the trainer (torch.distributed is already up in the actor)."""
    return RankTrainer(recipe)


def merge_rank_metrics(per_rank: list[dict]) -> dict:
    """One metrics line from every rank's: the global values of rank 0, the slowest rank's step
    time (the step ends when it does), the largest per-rank CP byte count and GPU memory peak
    (None on CPU), and tokens/s."""
    first = per_rank[0]
    line = {k: first[k] for k in _GLOBAL_KEYS}
    line["step_time_s"] = max(m["step_time_s"] for m in per_rank)
    line["cp_bytes"] = max(m["cp_bytes"] for m in per_rank)
    peaks = [m["peak_gib"] for m in per_rank if m.get("peak_gib") is not None]
    line["peak_gib"] = max(peaks) if peaks else None
    line["tokens_per_s"] = line["tokens"] / line["step_time_s"]
    return line


class Progress:
    """One self-rewriting stderr line: step, loss, tokens/s and ETA (no dependency)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr):
        self.total, self.stream = total, stream
        self.times: list[float] = []

    def update(self, line: dict) -> None:
        self.times.append(line["step_time_s"])
        recent = self.times[-10:]
        eta = (self.total - line["step"]) * sum(recent) / len(recent)
        done = int(20 * line["step"] / self.total)
        self.stream.write(
            f"\r[{'#' * done}{'.' * (20 - done)}] step {line['step']}/{self.total}  "
            f"loss {line['loss']:.4f}  {line['tokens_per_s']:,.0f} tok/s  "
            f"{line['step_time_s']:.2f} s/step  ETA {eta:.0f} s ")
        if line["step"] == self.total:
            self.stream.write("\n")
        self.stream.flush()


class _StopSignals:
    """SIGTERM / SIGINT set a flag that the loop checks between steps (a step in flight
    finishes, then a checkpoint is saved); a second signal restores the default behaviour."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step "
              "(again to abort now)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _start_metrics(path: Path, resume_step: int) -> None:
    """metrics.jsonl up to ``resume_step`` (the lines a resumed run continues after)."""
    kept = []
    if resume_step and path.is_file():
        kept = [ln for ln in path.read_text().splitlines()
                if ln.strip() and json.loads(ln)["step"] <= resume_step]
    path.write_text("".join(ln + "\n" for ln in kept))


def run(recipe: Recipe, *, progress: TextIO | None = sys.stderr) -> list[dict]:
    """Train ``recipe`` on ``run.num_workers`` Ray actors; returns this invocation's metrics."""
    out = Path(recipe.run.output_dir)
    resume_from = checkpoint.latest_checkpoint(out) if recipe.run.resume else None
    if recipe.run.resume and resume_from is None:
        raise FileNotFoundError(f"run.resume is set but {checkpoint.checkpoints_dir(out)} has no "
                                "checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    world = recipe.run.num_workers
    started_here = ensure_ray(recipe.run)
    group = None
    try:
        group = ActorGroup(world, recipe.run.device)
        group.hold(_make_trainer, recipe)
        # The recipe as the ranks run it: recipes.load_recipe resolved kda.cp_exchange=auto and
        # kept the reason in kda.exchange_reason.
        (out / RECIPE).write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
        start = group.call_held("load_checkpoint", str(resume_from))[0] if resume_from else 0
        _start_metrics(out / METRICS, start)
        if resume_from:
            logger.info("resumed from %s at step %d", resume_from, start)
        lines = _train_loop(recipe, group, out, start, progress)
        group.shutdown()
        group = None
        return lines
    finally:
        if group is not None:
            group.shutdown()
        if started_here:
            ray.shutdown()


def _train_loop(recipe: Recipe, group, out: Path, start: int, progress: TextIO | None) -> list[dict]:
    total, interval = recipe.train.steps, recipe.train.save_interval
    bar = Progress(total, progress) if progress is not None else None
    lines: list[dict] = []
    with _StopSignals() as stop, open(out / METRICS, "a") as metrics:
        for step in range(start + 1, total + 1):
            line = merge_rank_metrics(group.call_held("train_step"))
            if line["step"] != step:
                raise RuntimeError(f"ranks reported step {line['step']}, expected {step}")
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()
            lines.append(line)
            if bar is not None:
                bar.update(line)
            if stop.signum is not None:
                path = Path(group.call_held("save_checkpoint", str(out))[0])
                raise Interrupted(stop.signum, step, path)
            if (step == total and recipe.train.save_at_end) or (interval and step % interval == 0):
                group.call_held("save_checkpoint", str(out))
    return lines
