"""One run per output folder (``train.run_lock``): a live run's lock refuses a second ``run`` (and
``--overwrite``) before Ray starts, a dead run's lock is taken over and said so, and readers say
when a run is live. The live holder is a child process holding the lock; no Ray starts here (the
run itself is replaced where a run must start)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.recipes import get_recipe
from skyrl_megatron_kda.train import run_lock
from skyrl_megatron_kda.train.run_lock import LOCK_FILE
from tests.test_cli import TINY, fake_run, no_env_override, no_ray, refused, run_in  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()
_TAKE = ("import os, sys; from skyrl_megatron_kda.train import run_lock; "
         "lock = run_lock.acquire(sys.argv[1]); ")
HOLD = _TAKE + "print('held', flush=True); sys.stdin.read(); lock.release()"
DIE = _TAKE + "os._exit(0)"  # dies holding it: the kernel frees the lock, the file stays


@contextlib.contextmanager
def live_run(out: Path):
    """A child process holding ``out``'s run lock until the block ends (then released as a run
    ends); yields its pid."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == "held\n"
        yield child.pid
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def dead_run(out: Path) -> int:
    """The pid of a child process that took ``out``'s lock and died without releasing it."""
    child = subprocess.Popen([sys.executable, "-c", DIE, str(out)], cwd=ROOT)
    assert child.wait(timeout=60) == 0
    return child.pid


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(out.rglob("*"))}


@pytest.fixture
def fake_train(monkeypatch):
    """``train.run.run`` replaced: records who holds the folder's lock while it runs."""
    import skyrl_megatron_kda.train.run as train_run

    seen = []

    def run(recipe, *, start=None, progress=None, choices=None):
        out = Path(recipe.run.output_dir)
        seen.append((run_lock.holder(out), (out / LOCK_FILE).is_file()))
        return []

    monkeypatch.setattr(train_run, "run", run)
    return seen


def test_run_into_a_live_folder_is_refused_naming_the_holder(capsys, tmp_path, no_ray):
    out = tmp_path / "run"
    with live_run(out) as pid:
        before = snapshot(out)
        line = refused(capsys, run_in(out))
        assert snapshot(out) == before  # untouched, the holder's record included
    assert line.startswith(f"error: {out} is in use by a live run (pid {pid} on host {HOST}, "
                           "since ")
    assert line.endswith("): wait for it or use another run.output_dir")


def test_a_dead_runs_lock_is_taken_over_and_said(capsys, tmp_path, fake_train):
    out = tmp_path / "run"
    pid = dead_run(out)
    assert (out / LOCK_FILE).is_file()  # what a killed run leaves; not a run (holds_run)
    assert cli.main(run_in(out)) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"took over the lock of {out} left by pid {pid} on host {HOST} "
                      "(no longer running)")
    assert not any(line.startswith(("error", "note")) for line in err)
    (holder, lock_file), = fake_train
    assert holder.pid == os.getpid() and holder.host == HOST and lock_file  # held during the run
    assert (out / LOCK_FILE).read_text() == ""  # a normal end leaves no holder recorded


def test_overwrite_of_a_live_folder_is_refused_and_moves_nothing(capsys, tmp_path, no_ray):
    out = tmp_path / "run"
    fake_run(out)
    with live_run(out) as pid:
        before = snapshot(out)
        line = refused(capsys, run_in(out, "--overwrite"))
        assert snapshot(out) == before
    assert f"{out} is in use by a live run (pid {pid} on host {HOST}" in line
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no run.replaced-*


def test_overwrite_keeps_the_live_lock_in_the_output_folder(capsys, tmp_path, fake_train):
    out = tmp_path / "run"
    fake_run(out)
    assert cli.main(run_in(out, "--overwrite")) == 0
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert (moved / "metrics.jsonl").is_file() and not (moved / LOCK_FILE).exists()
    (holder, lock_file), = fake_train
    assert holder.pid == os.getpid() and lock_file  # the lock never left the output folder


def test_checkpoint_verify_of_a_live_folder_notes_it_and_verifies(capsys, tmp_path):
    out = tmp_path / "run"
    fake_run(out)
    with live_run(out) as pid:
        assert cli.main(["checkpoint", "verify", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"note: a run is live in {out} (pid {pid} on host {HOST}); reading what it has written "
        "so far"]
    assert captured.out.splitlines()[0].endswith("ok, step 2, 1 files, 0.0 MiB match their "
                                                 "sha256; mesh world4 tp2 cp2 ep2 etp1")


@pytest.mark.parametrize("before", ["no lock", "released"])
def test_a_free_folder_starts_without_a_note(capsys, tmp_path, fake_train, before):
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    fake_run(out)
    fresh.mkdir()
    if before == "released":
        run_lock.acquire(out).release()
        with run_lock.hold(fresh):
            pass
    assert run_lock.holder(out) is None and run_lock.holder(fresh) is None
    assert cli.main(["checkpoint", "verify", str(out)]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(run_in(fresh)) == 0
    err = capsys.readouterr().err.splitlines()
    assert not any(line.startswith(("took over", "note", "error")) for line in err), err
    (holder, lock_file), = fake_train
    assert holder.pid == os.getpid() and lock_file
    assert (fresh / LOCK_FILE).read_text() == ""


def test_a_filesystem_without_locks_is_refused(capsys, tmp_path, monkeypatch, no_ray):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    line = refused(capsys, run_in(tmp_path / "run"))
    assert f"cannot lock {tmp_path / 'run' / LOCK_FILE}: its filesystem does not support file " \
           "locks" in line
    assert not (tmp_path / "run").exists()  # made for the lock, removed with the refusal


def test_python_run_takes_the_lock_too(tmp_path, no_ray):
    from skyrl_megatron_kda.train.run import run

    out = tmp_path / "run"
    recipe = get_recipe(TINY, [f"run.output_dir={out}"], environ={})
    with live_run(out) as pid, pytest.raises(run_lock.FolderInUse, match=f"pid {pid} on host"):
        run(recipe)
    with run_lock.hold(out) as held, run_lock.hold(out) as again:  # reentrant in one process
        assert again is held and run_lock.holder(out).pid == os.getpid()
    assert run_lock.holder(out) is None and not out.exists()
