"""A `skyrl-kda run` subprocess watched as it goes: its stderr as it arrives (to act on a line the
moment it is written), its rank actor processes, and every process it started (to check that
none outlives it)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import psutil

from tests.support import cli_runs


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:  # ended, or a zombie, since it was listed
        return []


def running(proc: psutil.Process) -> bool:
    """Not ended; a zombie has ended (it only waits to be reaped by its parent or init)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class WatchedRun:
    def __init__(self, out: Path, *extra: str, with_stdout: bool = False):
        """``with_stdout``: stdout goes into the same pipe as stderr (a console or a log file
        that takes both), so ``stderr`` holds both streams in the order they were written."""
        streams = ({"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if with_stdout
                   else {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE})
        self.proc = subprocess.Popen(cli_runs.command(out, *extra), env=cli_runs.env(), **streams)
        self._pipe = self.proc.stdout if with_stdout else self.proc.stderr
        self.started: dict[int, psutil.Process] = {}
        self._text = ""
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # Raw reads: the progress line is rewritten with \r and has no newline until the end.
        while chunk := self._pipe.read1(4096):
            with self._changed:
                self._text += chunk.decode(errors="replace")
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def stderr(self) -> str:
        with self._changed:
            return self._text

    def wait_for_text(self, text: str, timeout: float = 600) -> None:
        """Return as soon as ``text`` is on stderr (the reader wakes this thread at once)."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: text in self._text or not self._reader.is_alive(), timeout)
            if text not in self._text:
                self.proc.kill()
                raise AssertionError(f"{text!r} not on stderr ({'run ended' if found else 'timeout'}): "
                                     f"{self._text[-3000:]}")

    def descendants(self) -> list[psutil.Process]:
        """The run's processes now (Ray's, the rank actors); each is also remembered."""
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.started.update((p.pid, p) for p in procs)
        return procs

    def rank_actors(self) -> list[psutil.Process]:
        return [p for p in self.descendants() if any("RankActor" in c for c in _cmdline(p))]

    def wait_for_rank_actors(self, count: int, timeout: float = 600) -> None:
        """Until ``count`` rank actor processes exist (start-up is under way)."""
        deadline = time.monotonic() + timeout
        while len(self.rank_actors()) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"fewer than {count} rank actors: {self.stderr[-3000:]}")
            time.sleep(0.2)  # polling interval, not a limit

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        rc = self.proc.wait(timeout)
        self._reader.join(timeout)
        return rc, self.stderr

    def left_running(self) -> list[str]:
        """Processes the run started (as seen by ``descendants``) that are still running."""
        return [f"{p.pid} {_cmdline(p)[:2]}" for p in self.started.values() if running(p)]
