"""Triton kernels on CPU: a script run in a fresh Python under Triton's interpreter
(``TRITON_INTERPRET`` is read when Triton is imported, so not in the test's own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(script: str) -> dict:
    """``script``'s last printed line, read as JSON; it runs from the repository's root with
    the package importable."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.strip().splitlines()[-1]
    return json.loads(out)
