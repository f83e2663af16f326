"""Names of the files a training run writes into ``run.output_dir`` (``train.run`` writes them;
``train.report`` and ``train.export`` read them back), and the one reader of ``metrics.jsonl``.
A module of its own so that reading a run does not import the trainer, megatron-core or Ray."""

from __future__ import annotations

import json
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
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg}; cut short when the "
                             "run was killed?)") from err
        if not isinstance(line, dict) or "step" not in line:
            raise ValueError(f"{path}:{number}: not a metrics line (a JSON object with a step)")
        lines.append(line)
    return lines
