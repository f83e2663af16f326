"""``bench/latent_backward_ablation.py`` on CPU: it loads without CUDA or tilelang and refuses an
unknown row in one line before it touches a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "latent_backward_ablation.py"


def test_an_unknown_row_is_one_line_naming_the_rows():
    run = subprocess.run([sys.executable, str(BENCH), "--rows", "as it is,no such row"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2
    error = [line for line in run.stderr.splitlines() if line.startswith("latent_backward")]
    assert len(error) == 1 and "unknown rows ['no such row']" in error[0]
    assert "'memory only: adds'" in error[0] and "'as it is'" in error[0]
