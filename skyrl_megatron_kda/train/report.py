"""``skyrl-kda report RUN_DIR``: PNG plots of a run's ``metrics.jsonl`` (loss, tokens/s, step
time, CP bytes per step by exchange), written next to it in ``RUN_DIR/report/``."""

from __future__ import annotations

from pathlib import Path

# Figure objects without pyplot: no backend or display is chosen by importing this module.
from matplotlib.figure import Figure

from .outputs import METRICS, read_metrics_lines

PLOTS = {
    "loss.png": ("loss", "loss (token-masked mean)"),
    "tokens_per_s.png": ("tokens_per_s", "tokens / s"),
    "step_time.png": ("step_time_s", "step time (s, slowest rank)"),
    "cp_bytes.png": ("cp_bytes", "KDA CP bytes sent per rank per step (MiB)"),
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The metrics lines of a run, in step order; a clear error when there are none."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {run_dir} a run's output folder?)")
    lines = read_metrics_lines(path)
    if not lines:
        raise ValueError(f"{path} has no steps yet")
    return sorted(lines, key=lambda m: m["step"])


def write_report(run_dir: str | Path) -> list[Path]:
    """Draw one PNG per metric (one line per exchange seen in the run); returns their paths."""
    lines = read_metrics(run_dir)
    out = Path(run_dir) / "report"
    out.mkdir(exist_ok=True)
    paths = []
    for name, (key, label) in PLOTS.items():
        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for exchange in sorted({m["exchange"] for m in lines}):
            rows = [m for m in lines if m["exchange"] == exchange]
            scale = 2**-20 if key == "cp_bytes" else 1.0
            ax.plot([m["step"] for m in rows], [m[key] * scale for m in rows], marker=".",
                    label=exchange)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend(title="exchange")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        paths.append(out / name)
    return paths
