"""``bench/kernel_resources.py``: without TileLang it refuses in one line; with TileLang and
nvcc (no GPU needed) the opt-in ping-pong forward and stacked backward compile for sm_90a with
every product on Hopper's wgmma, no register spills and shared memory within the 227 KiB a
Hopper block may take."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_megatron_kda.dsa.ops.latent.common import SHARED_BYTES

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kernel_resources.py"
HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          timeout=900)


@pytest.mark.skipif(HAS_TILELANG, reason="checks the refusal where tilelang is not installed")
def test_without_tilelang_it_refuses_in_one_line():
    run = _run()
    errors = [line for line in run.stderr.splitlines() if line.startswith("kernel_resources")]
    assert run.returncode == 2 and len(errors) == 1 and "needs the tilelang package" in errors[0]


@pytest.mark.skipif(not HAS_TILELANG or shutil.which("nvcc") is None,
                    reason="lowering and compiling the kernels needs tilelang and nvcc")
def test_the_new_kernels_compile_to_wgmma_without_spills():
    run = _run("--forward-configs", '[{"warp_specialized": true, "ping_pong": true}]',
               "--backward-configs", '[{"stacked": true, "channel_split": 4, "store_split": 1}]')
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2, rows
    for row in rows:
        assert row["spill_stores"] == row["spill_loads"] == row["mma_sync"] == 0, row
        assert row["wgmma"] and row["shared_kib"] * 1024 <= SHARED_BYTES, row
    bad = _run("--backward-configs", '[{"stacked": true, "channel_split": 3}]',
               "--forward-configs", "[]")
    assert bad.returncode == 2 and "backward config" in bad.stderr.splitlines()[-1]
