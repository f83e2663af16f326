"""Sharded checkpoints: a checkpoint saved on one mesh loads into another (CP2 -> CP1, TP2 -> TP1,
and CP1 with the memory settings on) with the loss the saving mesh would have had at that step.
That a run stopped by SIGTERM and resumed repeats the uninterrupted run's metrics exactly is
tests/test_example.py's (the fine-tune example, 4 ranks); what the stop says and leaves is
tests/test_shutdown.py's."""

import pytest

from tests.support import cli_runs
from tests.support.mesh_runs import SAVE_AFTER, mesh_runs

EXACT_KEYS = ("step", "loss", "grad_norm", "lr", "loss_tokens", "cp_bytes")


def test_resume_without_checkpoint_is_refused(tmp_path):
    rc, err = cli_runs.finish(cli_runs.start(tmp_path / "empty", "--resume"), timeout=120)
    assert rc != 0 and "has no checkpoint" in err


@pytest.mark.parametrize("target", ["cp2_to_cp1", "tp2_to_tp1", "memory_levers"])
def test_checkpoint_loads_into_another_mesh(target):
    runs = mesh_runs()
    loaded = runs[target]
    assert loaded["resumed_at"] == SAVE_AFTER
    # The saving mesh's own next step (it kept training after the save).
    expected = runs["cp2"]["a2a"][SAVE_AFTER]
    got = loaded["next"]
    assert got["step"] == expected["step"] == SAVE_AFTER + 1
    assert got["loss_tokens"] == expected["loss_tokens"], "the data position was not restored"
    rel = abs(got["loss"] - expected["loss"]) / expected["loss"]
    # fp32 summation order only (a wrong shard or a lost optimizer state is far above this: the
    # loss moves by ~1e-2 per step here).
    assert rel < 1e-5, f"{target}: loss {got['loss']} vs {expected['loss']} on the saving mesh ({rel:.1e})"
    grad_rel = abs(got["grad_norm"] - expected["grad_norm"]) / expected["grad_norm"]
    assert grad_rel < 1e-4, f"{target}: grad norm {got['grad_norm']} vs {expected['grad_norm']}"
