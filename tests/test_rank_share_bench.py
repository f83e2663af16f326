"""``bench/rank_share.py`` on CPU, as the GPU run uses it (the tiny recipe on one gloo rank), so the
benchmark of the step-time model's parts cannot rot: it trains, times one layer of each (attention,
MLP) kind part by part, adds the plan's numbers beside them, and sums the parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rank_share.py"


def test_rank_share_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "parts.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1]), "TORCHDYNAMO_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(BENCH), "--recipe", "glm53_flash_tiny", "--cpu",
                          "--steps", "1", "--iters", "1", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step"]["step_s"] > 0 and result["step"]["optimizer_s"] > 0
    kinds = {(x["attention"], x["mlp"]) for x in result["layers"]}
    assert kinds == {("kda", "dense"), ("kda", "moe"), ("dsa", "moe")}
    for layer in result["layers"]:
        for part in ("mhc", "attention_part", "mlp_part"):
            assert layer[part]["s"] > 0 and layer[part]["plan_kept_gib"] > 0, (layer, part)
            assert "model_s" in layer[part]
        # the tiny recipe's DSA kernel on CPU (torch) has no measured rates: no model seconds
        if layer["attention"] == "dsa":
            assert layer["attention_part"]["model_s"] is None
            assert "has no measured step-time rates" in layer["attention_part"]["model_not_priced"]
        else:
            assert layer["attention_part"]["model_s"] > 0
    assert result["head"]["s"] > 0 and result["embedding"]["s"] > 0
    assert 0 < result["parts_sum_s"]


def test_rank_share_bench_steps_only(tmp_path):
    """``--no-parts`` (the slice comparisons of whole steps) trains and times the steps, nothing else."""
    out = tmp_path / "steps.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1]), "TORCHDYNAMO_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(BENCH), "--recipe", "glm53_flash_tiny", "--cpu",
                          "--steps", "1", "--no-parts", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step"]["step_s"] > 0
    assert "layers" not in result and "head" not in result
