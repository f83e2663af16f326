"""Sharded checkpoints: a run interrupted and resumed repeats the uninterrupted losses exactly,
and a checkpoint saved on one mesh loads into another (CP2 -> CP1, TP2 -> TP1, and CP1 with the
memory settings on) with the loss the saving mesh would have had at that step."""

import signal

import pytest

from tests.support import cli_runs
from tests.support.mesh_runs import SAVE_AFTER, mesh_runs

EXACT_KEYS = ("step", "loss", "grad_norm", "lr", "loss_tokens", "cp_bytes")


def test_sigterm_then_resume_repeats_the_uninterrupted_losses():
    out = cli_runs.ROOT / "interrupted"
    proc = cli_runs.start(out)
    cli_runs.wait_for_steps(proc, out, 2)
    proc.send_signal(signal.SIGTERM)
    rc, err = cli_runs.finish(proc)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    stopped = len(cli_runs.metrics(out))
    assert 2 <= stopped < cli_runs.STEPS, "stopped too late to test a resume"
    assert f"stopped by SIGTERM after step {stopped}" in err
    assert (out / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"

    rc, err = cli_runs.finish(cli_runs.start(out, "--resume"))
    assert rc == 0, err[-3000:]
    resumed = cli_runs.metrics(out)
    ref_dir, ref_rc, _ = cli_runs.reference_run()
    assert ref_rc == 0
    reference = cli_runs.metrics(ref_dir)
    # Identical on CPU: same weights, Adam state, LR schedule and data position.
    assert [{k: m[k] for k in EXACT_KEYS} for m in resumed] == \
        [{k: m[k] for k in EXACT_KEYS} for m in reference]


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
