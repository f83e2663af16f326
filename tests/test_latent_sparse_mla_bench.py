"""bench/latent_sparse_mla.py refuses tunings our programs do not take in one line, before any
GPU work (the programs' own checks run without TileLang), where it used to fail mid-run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, error", [
    (["--backward-configs", '[{"stacked": true, "channel_split": 2, "store_split": 1}]'],
     "the stacked backward's buffers take 240 KiB of shared memory"),
    (["--backward-configs", '[{"channel_split": 2}]'], "name stacked too"),
    (["--forward-configs", '[{"ping_pong": true}]'], "name warp_specialized too"),
    (["--backward-configs", "[1]"], "is not a JSON list of keyword dicts")])
def test_a_tuning_it_cannot_build_is_one_line(args, error):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "latent_sparse_mla.py"), *args],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert error in done.stderr.strip().splitlines()[-1]
