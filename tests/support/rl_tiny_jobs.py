"""The RL example (``examples/rl_tiny/run_rl_tiny.sh``) as a user runs it: SkyRL's ``main_base``
with the KDA entrypoint in a subprocess, each job in a fresh WORKDIR; ``launch`` caches each
named job for the test session, so the tests of one job share its run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "rl_tiny" / "run_rl_tiny.sh"
_jobs: dict = {}


def steps_of(metrics_file: Path) -> dict:
    """step -> every metric logged at that step (SkyRL logs a step in several calls)."""
    out: dict = {}
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["step"], {}).update(record)
    return out


# The example's rollouts (68-80 tokens, past the recipe's index_topk of 64) from longer prompts
# and fewer sampled tokens than its defaults (28-40 words, up to 40 tokens): sampling, one token
# at a time, is most of a CPU job's step.
PROMPT_WORDS = "44:56"
SHORT_ROLLOUTS = ["generator.sampling_params.max_generate_length=24"]


def launch(name: str, tmp_path_factory, *, mesh: str, steps: int, settings: list,
           fully_async: int | None = None, lora_rank: int | None = None) -> dict:
    """Run (once per session) the example as job ``name``: {work, stdout, output, steps}."""
    if name in _jobs:
        return _jobs[name]
    work = tmp_path_factory.mktemp(f"rl_tiny_{name}")
    # RAY_DEDUP_LOGS=0: every repeated line reaches the output; the recipe's exchange, not one
    # from the environment the tests run in
    env = dict(os.environ, WORKDIR=str(work), MESH=mesh, STEPS=str(steps), PYTHON=sys.executable,
               TORCHDYNAMO_DISABLE="1", RAY_DEDUP_LOGS="0", PROMPT_WORDS=PROMPT_WORDS)
    env.pop("SKYRL_KDA_CP_EXCHANGE", None)
    env.pop("FULLY_ASYNC", None)
    env.pop("LORA_RANK", None)
    if fully_async is not None:
        env["FULLY_ASYNC"] = str(fully_async)
    if lora_rank is not None:
        env["LORA_RANK"] = str(lora_rank)
    proc = subprocess.run(["bash", str(SCRIPT), *SHORT_ROLLOUTS, *settings], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    _jobs[name] = {"work": work, "stdout": proc.stdout, "output": proc.stdout + proc.stderr,
                   "steps": steps_of(work / "logs" / "metrics.jsonl")}
    return _jobs[name]


def worker_log(job: dict) -> str:
    """What the job's Ray workers wrote (SkyRL sends their output to its infra log)."""
    return "".join(p.read_text() for p in sorted((job["work"] / "logs").glob("infra-*.log")))
