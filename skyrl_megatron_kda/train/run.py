"""The training driver: one Ray actor per rank runs a ``RankTrainer``; this process steps them,
writes ``metrics.jsonl`` and ``recipe.yaml`` into ``run.output_dir``, shows progress, saves
checkpoints (every ``train.save_interval`` steps, at the end, and on SIGTERM / Ctrl-C: ``stop``)
and resumes from the latest one with ``run.resume``. What it may do with the output folder (a
used one, a resume with other schedule settings, a finished run) is ``train.run_folder``'s to say.

A rank that fails or dies ends the run with ``WorkerError`` naming the rank and the cause
(``workers.errors``). Whatever ends the run (done, a signal, a rank's failure, an exception
here), the rank actors are killed, and a Ray started here is shut down with all its processes
(``workers.lifetime``), before ``run`` returns or raises.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import yaml

from ..config import Recipe
from ..console import RunFailure
from ..workers.errors import WorkerError
from ..workers.group import ActorGroup
from ..workers.lifetime import StartedRay
from ..workers.rank_map import build_rank_map, rank_map_lines, write_rank_map
from . import checkpoint
from .outputs import AUTO_CHOICES, METRICS, RANK_MAP, RECIPE, MetricsLog
from .run_folder import RunStart, prepare
from .run_lock import holds_output_dir
from .step_guard import NonFiniteStep, describe
from .stop import Interrupted, StopSignals
from .trainer import RankTrainer

logger = logging.getLogger(__name__)

# Same on every rank (global after the all-reduce, or the recipe's); taken from rank 0.
_GLOBAL_KEYS = ("step", "loss", "grad_norm", "lr", "update_skipped", "tokens", "loss_tokens",
                "exchange", "skipped_records")


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
    if "lora_params" in first:
        line["lora_params"] = first["lora_params"]
    return line


class Progress:
    """One self-rewriting stderr line: step, loss, tokens/s and ETA (no dependency)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr):
        self.total, self.stream = total, stream
        self.times: list[float] = []
        self.open = False  # a step's line was written without its newline

    def update(self, line: dict) -> None:
        self.times.append(line["step_time_s"])
        recent = self.times[-10:]
        eta = (self.total - line["step"]) * sum(recent) / len(recent)
        done = int(20 * line["step"] / self.total)
        self.stream.write(
            f"\r[{'#' * done}{'.' * (20 - done)}] step {line['step']}/{self.total}  "
            f"loss {line['loss']:.4f}  {line['tokens_per_s']:,.0f} tok/s  "
            f"{line['step_time_s']:.2f} s/step  ETA {eta:.0f} s ")
        self.open = line["step"] != self.total
        if not self.open:
            self.stream.write("\n")
        self.stream.flush()

    def end(self) -> None:
        """End a line left open by a run that stopped early, so the next message starts its own."""
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


@holds_output_dir
def run(recipe: Recipe, *, start: RunStart | None = None, progress: TextIO | None = sys.stderr,
        choices: Mapping[str, str] | None = None) -> list[dict]:
    """Train ``recipe`` on ``run.num_workers`` Ray actors; returns this invocation's metrics
    (none for a finished run); a LoRA run says what trains as it starts. ``start`` is
    ``run_folder.prepare``'s answer (made here when not given: a used folder is refused, no
    overwrite, no schedule override). ``choices``: why
    ``auto`` picked the recipe's values (``recipes.LoadedRecipe.choices``; None: nothing was
    left to auto), recorded beside ``recipe.yaml``. The folder's run lock
    (``run_lock``) is held throughout, Ray's shutdown included: taken here unless the caller
    (``skyrl-kda run``, before its ``prepare``) holds it; a live run there is refused."""
    out = Path(recipe.run.output_dir)
    if start is None:
        start = prepare(recipe)
    resume_from = start.resume_from
    finished = start.finished_line(recipe)
    if finished is not None:
        logger.info(finished)
        return []
    out.mkdir(parents=True, exist_ok=True)
    # Installed before Ray starts: a signal at any moment of start-up ends it cleanly.
    with StopSignals() as stop:
        try:
            with rank_group(recipe, stop) as group:
                _record_rank_map(recipe, group, out, progress)
                group.hold(_make_trainer, recipe)
                if recipe.train.lora.enabled:
                    logger.info(group.call_held(RankTrainer.lora_line)[0])
                # The recipe as the ranks run it (recipes.load_recipe resolved every auto), and
                # why auto picked what it did: rewritten by every invocation, so never stale.
                (out / RECIPE).write_text(yaml.safe_dump(recipe.model_dump(mode="json"),
                                                         sort_keys=False))
                (out / AUTO_CHOICES).write_text(yaml.safe_dump(dict(choices or {}),
                                                               sort_keys=False))
                step = 0
                if resume_from:
                    step = group.call_held(RankTrainer.load_checkpoint, str(resume_from),
                                           start.override_schedule)[0]
                metrics = MetricsLog(out / METRICS, step)
                if resume_from:
                    logger.info("resumed from %s at step %d", resume_from, step)
                stop.step = step
                stop.begin("training")
                return _train_loop(recipe, group, out, step, progress, stop, metrics)
        except KeyboardInterrupt:
            if stop.signum is None:  # Ctrl-C that reached Python's own handler (not main thread)
                raise
            last = checkpoint.latest_checkpoint(out)
            raise Interrupted(stop.signum, stop.stopped_line(stop.step, last), stop.step) from None


@contextlib.contextmanager
def rank_group(recipe: Recipe, stop: StopSignals):
    """Ray started or joined (``start_ray``) and one actor per rank for the block; however it
    ends, the actors are killed and a Ray started here is shut down with all its processes.
    ``run`` and ``export`` run their ranks in it."""
    ray_here = group = None
    try:
        ray_here = start_ray(recipe, stop)
        group = ActorGroup.for_recipe(recipe)
        yield group
    finally:
        stop.begin("stopping")
        if group is not None:
            group.shutdown()
        if ray_here is not None:
            ray_here.shutdown()


def _record_rank_map(recipe: Recipe, group: ActorGroup, out: Path,
                     console: TextIO | None) -> None:
    """Where the ranks landed: written to the run folder, shown on the console once, and a
    warning when ``cluster.gpus_per_node`` is not what Ray placed."""
    rank_map = build_rank_map(group.ranks, recipe)
    write_rank_map(out / RANK_MAP, rank_map)
    for note in rank_map["notes"]:
        logger.warning(note)
    if console is not None:
        console.write("\n".join(rank_map_lines(rank_map)) + "\n")
        console.flush()


def start_ray(recipe: Recipe, stop: StopSignals) -> StartedRay:
    """Start or join Ray (``StartedRay``: its ``shutdown`` ends every process it started), then
    take SIGTERM back from Ray's handler; a SIGTERM while ``ray.init`` runs ends as
    ``Interrupted``. ``run`` and ``export`` start Ray through it."""
    try:
        ray_here = StartedRay(recipe.run)
    except SystemExit:
        # While ray.init runs, its own SIGTERM handlers are in place (the only sys.exit calls on
        # its start-up path): they end the processes it has started, then exit.
        raise Interrupted(signal.SIGTERM, "stopped by SIGTERM while Ray was starting (Ray ended "
                          "its processes); nothing saved", exit_at_once=True) from None
    stop.install()
    return ray_here


def _train_loop(recipe: Recipe, group, out: Path, start: int, progress: TextIO | None,
                stop: StopSignals, metrics: MetricsLog) -> list[dict]:
    total, interval = recipe.train.steps, recipe.train.save_interval
    bar = Progress(total, progress) if progress is not None else None
    lines: list[dict] = []
    with _ending(bar):
        for step in range(start + 1, total + 1):
            line = merge_rank_metrics(_train_step(group, out))
            if line["step"] != step:
                raise RuntimeError(f"ranks reported step {line['step']}, expected {step}")
            metrics.write(line)
            lines.append(line)
            stop.step = step
            if bar is not None:
                bar.update(line)
            if line["update_skipped"]:
                if bar is not None:
                    bar.end()
                logger.warning(skipped_line(recipe, lines))
            path = None
            if (stop.signum is not None or (step == total and recipe.train.save_at_end)
                    or (interval and step % interval == 0)):
                if bar is not None:
                    bar.end()
                path = _save(group, out, stop, step)
                metrics.saved()
            # Also a first signal that arrived during this save; one that came after the check
            # above is answered after the next step.
            if stop.signum is not None and path is not None:
                raise Interrupted(stop.signum, stop.saved_line(step, path), step, path)
    metrics.finished()
    return lines


def skipped_line(recipe: Recipe, lines: list[dict]) -> str:
    """The console's line for the skipped update of ``lines[-1]`` (``train.on_nonfinite=skip``;
    the ranks' own warning reaches only Ray's worker logs)."""
    line = lines[-1]
    in_a_row = next((i for i, m in enumerate(reversed(lines)) if not m["update_skipped"]),
                    len(lines))
    return (f"step {line['step']}: {describe(line['loss'], line['grad_norm'])}: not finite; "
            f"update skipped (train.on_nonfinite=skip; {in_a_row} in a row, the run stops at "
            f"train.max_skipped_steps={recipe.train.max_skipped_steps})")


def summary_line(lines: list[dict], output_dir: str) -> str:
    """The run's last line: steps, first and last loss, the updates skipped, the adapter
    parameters that trained under LoRA, the folder."""
    skipped = [m["step"] for m in lines if m.get("update_skipped")]
    said = ""
    if skipped:
        steps = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        said = (f"; {len(skipped)} update{'s' if len(skipped) > 1 else ''} skipped (not "
                f"finite, step{'s' if len(skipped) > 1 else ''} {steps})")
    if lines[-1].get("lora_params") is not None:
        said += f"; LoRA: {lines[-1]['lora_params']:,} adapter parameters trained, base frozen"
    return (f"{len(lines)} steps, loss {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f}{said}; "
            f"{output_dir}")


class NonFiniteRun(RunFailure):
    """The run stopped at a step whose loss or gradient norm was not finite
    (``train.on_nonfinite``): the step, its values and the checkpoint to continue from."""


def _train_step(group, out: Path) -> list[dict]:
    """Every rank's metrics of one step; a non-finite step (``step_guard.NonFiniteStep``, raised
    on every rank before anything was applied) ends the run naming the last good checkpoint."""
    try:
        return group.call_held(RankTrainer.train_step)
    except WorkerError as err:
        if err.kind != NonFiniteStep.__name__:
            raise
        last = checkpoint.latest_checkpoint(out)
        where = (f"the last good checkpoint is {last} (--resume continues from it)"
                 if last is not None else "no checkpoint was saved before it")
        raise NonFiniteRun(f"{err.message}; nothing of it saved; {where}") from err


@contextlib.contextmanager
def _ending(bar: Progress | None):
    try:
        yield
    finally:
        if bar is not None:
            bar.end()


def _save(group, out: Path, stop: StopSignals, step: int) -> Path:
    """The checkpoint of ``step``; signals meanwhile let it finish (``stop``)."""
    stop.begin("saving")
    logger.info("saving checkpoint of step %d", step)
    path = Path(group.call_held(RankTrainer.save_checkpoint, str(out))[0])
    # With a stop pending the run ends here: a signal from now on must not be taken for a
    # second one during a step (which would abandon a checkpoint that was written).
    stop.begin("training" if stop.signum is None else "stopping")
    return path
