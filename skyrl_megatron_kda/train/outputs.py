"""Names of the files a training run writes into ``run.output_dir`` (``train.run`` writes them;
``train.report`` and ``train.export`` read them back), and the one reader of ``metrics.jsonl``.
A module of its own so that reading a run does not import the trainer, megatron-core or Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS = "metrics.jsonl"
"""One JSON line of merged rank metrics per step."""

RECIPE = "recipe.yaml"
"""The recipe as the ranks ran it (every ``auto`` resolved)."""

AUTO_CHOICES = "auto_choices.yaml"
"""Beside ``recipe.yaml``: setting -> the reason ``auto`` gave for its value
(``recipes.LoadedRecipe.choices``); empty when the recipe left nothing to ``auto``."""

RANK_MAP = "rank_map.json"
"""Each rank's node, GPU and mesh coordinates, as this invocation placed them
(``workers.rank_map``)."""


def read_metrics_lines(path: Path) -> list[dict]:
    """The JSON lines of a metrics file in file order (blank lines skipped); a line that is not
    a JSON object (e.g. cut short when the run was killed) is an error naming ``file:line``."""
    return _read_lines(path, cut_last_ok=False)[0]


def read_resumed_metrics(path: Path) -> tuple[list[dict], int | None]:
    """What a resume reads of ``metrics.jsonl``: its lines, and the number of a last line that
    is cut short (not JSON: the run was killed while writing it; dropped, the caller says so),
    or None. A bad line before the last is an error naming ``file:line``."""
    return _read_lines(path, cut_last_ok=True)


def _read_lines(path: Path, cut_last_ok: bool) -> tuple[list[dict], int | None]:
    texts = [(n, t) for n, t in enumerate(path.read_text().splitlines(), start=1) if t.strip()]
    lines = []
    for number, text in texts:
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            if cut_last_ok and number == texts[-1][0]:
                return lines, number
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg}; cut short when the "
                             "run was killed?)") from err
        if not isinstance(line, dict) or "step" not in line:
            raise ValueError(f"{path}:{number}: not a metrics line (a JSON object with a step)")
        lines.append(line)
    return lines, None


class MetricsLog:
    """``metrics.jsonl`` as a run writes it, one line per step. A fresh run starts it empty. A
    resume from step N keeps the lines up to N; lines past N (steps no checkpoint of this resume
    holds: a killed run's last steps, or with ``--from-step`` a later checkpoint's) stay in the
    file until this run's first save lands (``saved``) or its last step is done (``finished``):
    a resume stopped before then leaves the file as it found it, beside the ``latest`` it did not
    move. Meanwhile the new lines are kept here. A last line cut short is dropped."""

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        lines = read_resumed_metrics(path)[0] if resume_step and path.is_file() else []
        self.kept = [m for m in lines if m["step"] <= resume_step]
        self.pending: list[dict] | None = None
        if len(self.kept) < len(lines):
            self.pending = []
        else:
            self._rewrite(self.kept)

    def write(self, line: dict) -> None:
        if self.pending is not None:
            self.pending.append(line)
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def saved(self) -> None:
        """A checkpoint of this run landed: the lines past the resumed step are replaced."""
        if self.pending is not None:
            self._rewrite(self.kept + self.pending)
            self.pending = None

    finished = saved

    def _rewrite(self, lines: list[dict]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(m) + "\n" for m in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
