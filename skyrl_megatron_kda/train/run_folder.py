"""What a run may do with its output folder, decided on the driver before Ray starts.

- A folder that already holds a run (a ``metrics.jsonl`` with a line in it, or anything under
  ``checkpoints/``) is refused: continue it with ``resume``, or pass ``overwrite``, which moves
  the old run aside to a sibling folder ``<name>.replaced-<YYYYmmdd-HHMMSS>`` (nothing is deleted).
- ``resume`` continues from the checkpoint ``latest`` names, or from ``step_N`` with
  ``from_step``. A ``latest`` that is missing (beside step folders), empty or names a missing
  folder is refused naming the step folder that verifies and ``--resume --from-step N``
  (``checkpoint.latest_advice``): no step is picked silently.
- ``resume`` refuses a recipe whose model differs from the run's ``recipe.yaml``
  (``config.recipe.model_meaning``: the model's shapes and meaning; the mesh, memory, kernel and
  exchange settings stay free), naming each changed setting: a checkpoint loads only into the
  model that saved it.
- The checkpoint's manifest records the schedule
  settings it was trained under (``TrainConfig.schedule``); a recipe that changes any of them is
  refused naming each, unless ``override_schedule`` (then applied from the saved step, and said).
- A checkpoint already at ``train.steps`` is a finished run: nothing to train.
- ``metrics.jsonl`` is read as the resume will read it: a bad line before the last is refused
  naming ``file:line``, a last line cut short by a kill is dropped (said in ``notes``).

Only the manifest's record is read here; the ranks verify the files' hashes when they load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import DuplicateKey, Recipe, load_yaml
from ..config.recipe import model_meaning
from . import manifest
from .checkpoint import checkpoints_dir, resume_checkpoint, step_dir
from .outputs import METRICS, RECIPE, read_resumed_metrics
from .run_lock import LOCK_FILE


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
    """Whether ``out`` holds (part of) a run: a metrics line, or anything under checkpoints/
    (not the run lock's file, ``run_lock.LOCK_FILE``)."""
    metrics, ckpts = out / METRICS, checkpoints_dir(out)
    has_metrics = metrics.is_file() and bool(metrics.read_text().strip())
    return has_metrics or (ckpts.is_dir() and any(ckpts.iterdir()))


def move_aside(out: Path) -> Path:
    """Move the run in ``out`` into a new sibling folder ``<out>.replaced-<time>``; returns it.
    What ``out`` holds moves, the run lock's file (``run_lock.LOCK_FILE``, held by this run)
    stays, so ``out`` is never without its lock."""
    target = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        target.mkdir()
    except FileExistsError:
        raise FileExistsError(f"--overwrite: {target} already exists (try again in a second)") \
            from None
    for item in out.iterdir():
        if item.name != LOCK_FILE:
            item.rename(target / item.name)
    return target


def prepare(recipe: Recipe, *, overwrite: bool = False, override_schedule: bool = False,
            from_step: int | None = None) -> RunStart:
    """Check ``run.output_dir`` against how the run is asked to start, move an old run aside
    for ``overwrite``, and say where training starts (``from_step``: resume from ``step_N``
    instead of ``latest``); refuses with one line."""
    out = Path(recipe.run.output_dir)
    resume = recipe.run.resume
    if overwrite and resume:
        raise ValueError("--overwrite and --resume exclude each other: continue the run in "
                         f"{out}, or move it aside and start over")
    if override_schedule and not resume:
        raise ValueError("--override-schedule applies to a resumed run only (add --resume)")
    if from_step is not None and not resume:
        raise ValueError("--from-step applies to a resumed run only (add --resume)")
    if resume:
        return _resume(recipe, out, override_schedule, from_step)
    if not holds_run(out):
        return RunStart()
    if not overwrite:
        raise FileExistsError(f"{out} already holds a run ({METRICS} or checkpoints/): continue it "
                              "with --resume, or pass --overwrite to move it aside and start over")
    moved = move_aside(out)
    return RunStart(notes=[f"--overwrite: moved the previous run in {out} to {moved}"])


def _resume(recipe: Recipe, out: Path, override_schedule: bool,
            from_step: int | None = None) -> RunStart:
    if from_step is None:
        path = resume_checkpoint(out)
        if path is None:
            raise FileNotFoundError(f"--resume: {checkpoints_dir(out)} has no checkpoint "
                                    "(run without --resume to start over)")
    else:
        path = step_dir(out, from_step)
        if not path.is_dir():
            raise FileNotFoundError(f"--from-step {from_step}: {path} does not exist")
    record = manifest.read(path)  # a step folder without a manifest is an unfinished save
    notes = _check_model(recipe, out) + _check_metrics(out)
    changes = manifest.schedule_changes(record["schedule"], recipe.train.schedule())
    if changes and not override_schedule:
        raise ValueError(f"--resume: the schedule differs from {path.name}'s: {', '.join(changes)}"
                         " (pass --override-schedule to apply it, or drop the changes)")
    if changes:
        notes.append(f"--override-schedule: from step {record['step']} on, {', '.join(changes)}")
    return RunStart(resume_from=path, step=int(record["step"]), override_schedule=bool(changes),
                    notes=notes)


def _check_metrics(out: Path) -> list[str]:
    """Read ``metrics.jsonl`` as the resumed run will (``outputs.MetricsLog``), before Ray starts:
    a bad line before the last is refused naming ``file:line``; a last line cut short (the run
    was killed while writing it) is dropped, and said."""
    path = out / METRICS
    if not path.is_file():
        return []
    cut = read_resumed_metrics(path)[1]
    if cut is None:
        return []
    return [f"--resume: {path}:{cut} was cut short when the run was killed (not a JSON line): "
            "dropped"]


def _check_model(recipe: Recipe, out: Path) -> list[str]:
    """Refuse a recipe whose model differs from the one the run's ``recipe.yaml`` records,
    naming each changed setting ``old -> new``; returns notes (a ``recipe.yaml`` that is missing
    or unreadable leaves the model uncompared, and says so)."""
    file = out / RECIPE
    try:
        saved = load_yaml(file.read_text())
    except DuplicateKey as err:
        raise ValueError(f"--resume: {file}: {err}") from None
    except (OSError, yaml.YAMLError) as err:
        why = "is missing" if isinstance(err, FileNotFoundError) else "cannot be read"
        return [f"--resume: {file} {why}: the model is not compared before the ranks load"]
    if not isinstance(saved, dict):
        return [f"--resume: {file} holds no recipe: the model is not compared before the ranks "
                "load"]
    before = model_meaning(saved)
    changes = [f"{name} {before[name]} -> {value}"
               for name, value in model_meaning(recipe.model_dump(mode="json")).items()
               if name in before and before[name] != value]
    if changes:
        raise ValueError(f"--resume: the model differs from the run's {RECIPE}: "
                         f"{', '.join(changes)} (a checkpoint loads only into the model it saved; "
                         "start a new run.output_dir)")
    return []
