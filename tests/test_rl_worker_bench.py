"""``bench/rl_worker.py`` on CPU, as the GPU run uses it: the tiny recipe on one gloo rank, the
KDA policy worker a real Ray actor in SkyRL's actor group, 2 steps of forward, forward_backward
(GRPO, SkyRL's KL loss on, the chunked log-prob path) and optim_step, so the benchmark cannot rot.

What the rows must show: every call timed in order with its value; the log-probs of the random
tiny model near -ln(256) (uniform over its 256-token vocabulary; a misaligned label or a padding
column would not average there, and a broken forward gives NaN or 0); the KL loss 0 at step 1 (the
stand-in reference is the step's own forward) and above 0 at step 2 (the optimizer step moved the
weights), a non-zero grad norm at each step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rl_worker.py"
TP1 = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
       "run.num_workers=1"]
CALLS = ("forward", "forward_backward", "optim_step")


def _env() -> dict:
    kept = {k: v for k, v in os.environ.items() if k != "SKYRL_KDA_CP_EXCHANGE"}
    return {**kept, "PYTHONPATH": str(BENCH.parents[1]), "TORCHDYNAMO_DISABLE": "1"}


def test_bench_times_the_worker_calls_on_the_tiny_recipe(tmp_path):
    out = tmp_path / "rl_worker.json"
    sets = [arg for key in [*TP1, "train.loss_chunk_tokens=16"] for arg in ("--set", key)]
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--recipe", "glm53_flash_tiny", "--tokens", "96", "--rows", "4",
         "--steps", "2", "--kl", "--json", str(out), *sets],
        env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["device"], result["workers"], result["tokens"]) == ("cpu", 1, 96)
    assert result["loss_chunk_tokens"] == 16 and result["kl"] is True
    rows = result["calls"]
    assert [(r["step"], r["call"]) for r in rows] == [(s, c) for s in (1, 2) for c in CALLS]
    for r in rows:
        assert r["seconds"] > 0 and r["tokens_per_s"] == pytest.approx(96 / r["seconds"])
        assert r["peak_gib"] is None  # no CUDA allocator on a CPU rank
        # one progress line per call, with the elapsed seconds first
        assert f"step {r['step']} {r['call']}: {r['seconds']:.3f} s" in proc.stdout
    forwards = [r for r in rows if r["call"] == "forward"]
    for r in forwards:
        assert abs(r["mean_logprob"] + math.log(256)) < 0.5, r
    steps = [r for r in rows if r["call"] == "forward_backward"]
    assert steps[0]["metrics"]["policy_kl"] == 0.0
    assert steps[1]["metrics"]["policy_kl"] > 0.0
    for r in steps:
        assert math.isfinite(r["final_loss"])
    assert all(r["grad_norm"] > 0 for r in rows if r["call"] == "optim_step")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_recipe_without_cuda_is_one_clear_line():
    proc = subprocess.run([sys.executable, str(BENCH), "--steps", "1"], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("bench/rl_worker.py: recipe glm53_flash_slice has run.device=gpu but CUDA is "
                    "not available here; on a CPU use --recipe glm53_flash_tiny"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
