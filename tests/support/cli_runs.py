"""`skyrl-kda run` of the tiny recipe as a user runs it (a subprocess driving 4 Ray CPU actors),
on a small learnable corpus (16-token alphabet: the loss can fall well below ln(256)).
``reference_run`` is computed once per test session and shared by test_train / test_checkpoint."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 6
# One rank (TP1 x CP1, EP1): for tests of folders, checkpoints' files and signals, which do not
# depend on the mesh; a rank is a process importing torch and megatron-core, seconds each.
ONE_RANK = ["--set", "parallel.tp=1", "--set", "parallel.cp=1", "--set", "parallel.ep=1",
            "--set", "parallel.sequence_parallel=false", "--set", "run.num_workers=1"]
_TMP = tempfile.TemporaryDirectory(prefix="skyrl_kda_train_")
ROOT = Path(_TMP.name)


def corpus() -> Path:
    path = ROOT / "corpus.jsonl"
    if not path.exists():
        rng = random.Random(0)
        docs = [[rng.randrange(16) for _ in range(rng.randint(8, 120))] for _ in range(200)]
        path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in docs))
    return path


def command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "skyrl_megatron_kda.cli", "run", "glm53_flash_tiny",
            "--set", f"data.path={corpus()}", "--set", f"run.output_dir={out}",
            "--set", f"train.steps={STEPS}", *extra]


def env() -> dict:
    kept = {k: v for k, v in os.environ.items() if k != "SKYRL_KDA_CP_EXCHANGE"}
    return {**kept, "TORCHDYNAMO_DISABLE": "1"}


def start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command(out, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env())


def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while len(metrics(out)) < steps:
        if proc.poll() is not None:
            raise AssertionError(f"run ended (rc {proc.returncode}) before step {steps}: "
                                 f"{proc.stderr.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no step {steps} within {timeout} s")
        time.sleep(0.5)


@functools.cache
def reference_run() -> tuple[Path, int, str]:
    """The uninterrupted run: (output dir, exit code, stderr)."""
    out = ROOT / "reference"
    rc, err = finish(start(out))
    return out, rc, err


def flip_4kib(path: Path) -> None:
    """Invert 4 KiB in the middle of ``path``: the size stays, the bytes differ (a damaged shard)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 - 2048
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
    path.write_bytes(bytes(data))
