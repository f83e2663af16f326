"""Stopping `skyrl-kda run`: a signal at any moment (start-up, mid-step, a second one during the
checkpoint save) ends every process the run started before the driver exits, the exit status is
128 + the signal with one last line that says what happened, and what was saved resumes.
How the driver answers each signal in each phase is checked without Ray first (``StopSignals``).
The runs are one rank (``cli_runs.ONE_RANK``): what a stop does is the driver's and Ray's, the same
for any mesh; test_train.py kills one rank of the 4-rank mesh and test_example.py resumes a
SIGTERM-stopped 4-rank run."""

from __future__ import annotations

import signal

import pytest

from skyrl_megatron_kda.train.stop import StopSignals
from tests.support import cli_runs
from tests.support.watched_run import WatchedRun

STEPS = 4
RUN = [*cli_runs.ONE_RANK, "--set", f"train.steps={STEPS}"]


def test_signals_in_each_phase(capsys):
    # Whatever an earlier test left (ray.init installs its own SIGTERM handler) must come back.
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    # raise_signal runs the handler in this (the main) thread before it returns.
    with StopSignals() as stop:
        with pytest.raises(KeyboardInterrupt):  # start-up: stop at once
            signal.raise_signal(signal.SIGINT)
        assert stop.signum == signal.SIGINT and stop.phase == "stopping"
        signal.raise_signal(signal.SIGTERM)  # while stopping: acknowledged, the clean-up goes on
        assert "already stopping" in capsys.readouterr().err
        assert stop.stopped_line(0, None) == ("stopped by SIGINT during start-up; nothing saved; "
                                              "no checkpoint yet, start it again")

    with StopSignals() as stop:
        stop.begin("training")
        signal.raise_signal(signal.SIGTERM)  # first: finish the step, then save
        assert "saving a checkpoint after this step" in capsys.readouterr().err
        stop.begin("saving")
        signal.raise_signal(signal.SIGTERM)  # during the save: it finishes
        assert "save in progress finishes first" in capsys.readouterr().err
        assert stop.saved_line(3, "ck/step_3") == (
            "stopped by SIGTERM after step 3; a second SIGTERM during the save let it finish; "
            "checkpoint ck/step_3 (continue with --resume)")

    with StopSignals() as stop:
        stop.begin("training")
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):  # second during a step: stop without saving
            signal.raise_signal(signal.SIGTERM)
        assert stop.stopped_line(2, "ck/step_2") == (
            "stopped by SIGTERM during step 3; a second SIGTERM stopped it without saving; "
            "nothing saved; --resume continues from ck/step_2")
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _assert_stopped(run: WatchedRun, rc: int, err: str, last_line: str) -> None:
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert err.strip().splitlines()[-1] == last_line, err[-3000:]
    # Neither Python's nor Ray's C++ stack dump (the driver used to abort with -6).
    assert "Traceback" not in err and "SIGTERM received at time" not in err, err[-3000:]
    assert run.left_running() == [], "processes outlived the driver"


def test_sigterm_during_startup_ends_every_process():
    out = cli_runs.ROOT / "stop_at_startup"
    run = WatchedRun(out, *RUN)
    run.wait_for_rank_actors(1)  # Ray is up, the ranks are starting: torch.distributed, model
    run.descendants()
    run.proc.send_signal(signal.SIGTERM)
    rc, err = run.finish()
    _assert_stopped(run, rc, err, "stopped by SIGTERM during start-up; nothing saved; "
                                  "no checkpoint yet, start it again")
    assert cli_runs.metrics(out) == []
    assert not (out / "checkpoints" / "latest").exists()


def test_sigterm_mid_step_then_again_during_the_save_then_resume():
    out = cli_runs.ROOT / "stop_mid_step"
    run = WatchedRun(out, *RUN)
    run.wait_for_text(f"step 1/{STEPS}")
    run.descendants()
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for_text("saving checkpoint of step")
    # Sent the moment the driver says it starts the save: a Ray call to the rank, which writes
    # and hashes a checkpoint, takes far longer than this read of a pipe.
    run.proc.send_signal(signal.SIGTERM)
    rc, err = run.finish()
    stopped = len(cli_runs.metrics(out))
    assert 1 <= stopped < STEPS, err[-3000:]
    path = out / "checkpoints" / f"step_{stopped:08d}"
    _assert_stopped(run, rc, err, f"stopped by SIGTERM after step {stopped}; a second SIGTERM "
                                  f"during the save let it finish; checkpoint {path} "
                                  "(continue with --resume)")
    assert (out / "checkpoints" / "latest").read_text() == path.name

    resumed = WatchedRun(out, *RUN, "--resume")
    rc, err = resumed.finish()
    assert rc == 0, err[-3000:]
    assert [m["step"] for m in cli_runs.metrics(out)] == list(range(1, STEPS + 1))
    assert (out / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"
