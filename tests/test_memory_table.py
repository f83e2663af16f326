"""``memory/table.py``: the ``plan`` table."""

from __future__ import annotations

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.memory import GiB, estimate_memory
from tests.support.memory_recipes import FULL, TINY, full_recipe


def test_plan_prints_memory_table(capsys):
    assert cli.main(["plan", FULL]) == 0
    out = capsys.readouterr().out
    assert "per-GPU memory estimate" in out and "choice:" in out
    est = estimate_memory(full_recipe())
    assert f"{est.total / GiB:.2f}" in out
    assert "vs. H200" in out


def test_plan_gpu_memory_unknown_on_cpu(capsys):
    assert cli.main(["plan", TINY]) == 0
    assert "GPU memory: unknown" in capsys.readouterr().out
