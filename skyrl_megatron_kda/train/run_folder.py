"""What a run may do with its output folder, decided on the driver before Ray starts.

- A folder that already holds a run (a ``metrics.jsonl`` with a line in it, or anything under
  ``checkpoints/``) is refused: continue it with ``resume``, or pass ``overwrite``, which moves
  the old run aside to a sibling folder ``<name>.replaced-<YYYYmmdd-HHMMSS>`` (nothing is deleted).
- ``resume`` continues from the checkpoint ``latest`` names. Its manifest records the schedule
  settings it was trained under (``TrainConfig.schedule``); a recipe that changes any of them is
  refused naming each, unless ``override_schedule`` (then applied from the saved step, and said).
- A checkpoint already at ``train.steps`` is a finished run: nothing to train.

Only the manifest's record is read here; the ranks verify the files' hashes when they load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Recipe
from . import manifest
from .checkpoint import checkpoints_dir, latest_checkpoint
from .outputs import METRICS


@dataclass(frozen=True)
class RunStart:
    """How ``train.run.run`` starts: fresh, or from ``resume_from`` at ``step``."""

    resume_from: Path | None = None
    step: int = 0
    override_schedule: bool = False
    """The recipe's schedule settings differ from the checkpoint's and are to be applied."""
    notes: list[str] = field(default_factory=list)
    """Lines for the console: what was moved aside, which settings were overridden."""

    def finished_line(self, recipe: Recipe) -> str | None:
        """One line saying the resumed run has nothing left to train, or None."""
        if self.resume_from is None or self.step < recipe.train.steps:
            return None
        return (f"{recipe.run.output_dir} is finished: {self.resume_from.name} is at step "
                f"{self.step} of train.steps={recipe.train.steps} (nothing to train)")


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds (part of) a run: a metrics line, or anything under checkpoints/."""
    metrics, ckpts = out / METRICS, checkpoints_dir(out)
    has_metrics = metrics.is_file() and bool(metrics.read_text().strip())
    return has_metrics or (ckpts.is_dir() and any(ckpts.iterdir()))


def move_aside(out: Path) -> Path:
    """Rename ``out`` to ``<out>.replaced-<time>`` beside it; returns the new path."""
    target = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    if target.exists():
        raise FileExistsError(f"--overwrite: {target} already exists (try again in a second)")
    out.rename(target)
    return target


def prepare(recipe: Recipe, *, overwrite: bool = False, override_schedule: bool = False) -> RunStart:
    """Check ``run.output_dir`` against how the run is asked to start, move an old run aside
    for ``overwrite``, and say where training starts; refuses with one line."""
    out = Path(recipe.run.output_dir)
    resume = recipe.run.resume
    if overwrite and resume:
        raise ValueError("--overwrite and --resume exclude each other: continue the run in "
                         f"{out}, or move it aside and start over")
    if override_schedule and not resume:
        raise ValueError("--override-schedule applies to a resumed run only (add --resume)")
    if resume:
        return _resume(recipe, out, override_schedule)
    if not holds_run(out):
        return RunStart()
    if not overwrite:
        raise FileExistsError(f"{out} already holds a run ({METRICS} or checkpoints/): continue it "
                              "with --resume, or pass --overwrite to move it aside and start over")
    moved = move_aside(out)
    return RunStart(notes=[f"--overwrite: moved the previous run in {out} to {moved}"])


def _resume(recipe: Recipe, out: Path, override_schedule: bool) -> RunStart:
    path = latest_checkpoint(out)
    if path is None:
        raise FileNotFoundError(f"--resume: {checkpoints_dir(out)} has no checkpoint "
                                "(run without --resume to start over)")
    record = manifest.read(path)
    changes = manifest.schedule_changes(record["schedule"], recipe.train.schedule())
    if changes and not override_schedule:
        raise ValueError(f"--resume: the schedule differs from {path.name}'s: {', '.join(changes)}"
                         " (pass --override-schedule to apply it, or drop the changes)")
    notes = []
    if changes:
        notes.append(f"--override-schedule: from step {record['step']} on, {', '.join(changes)}")
    return RunStart(resume_from=path, step=int(record["step"]), override_schedule=bool(changes),
                    notes=notes)
