"""One run per output folder: a run holds an exclusive lock on ``<run.output_dir>/.run.lock``
from before the folder is checked (``train.run_folder.prepare``) until Ray is shut down.

- A run into a folder inside a live run's folder, or holding one below it, is refused the same
  way (``runs/x holds runs/x/run, in use by a live run (...)``): it would write into the live
  run's folder, or ``--overwrite`` would move the live run aside.
- A second run into the folder is refused at once with one line naming the holder: ``runs/x is
  in use by a live run (pid 1234 on host h, since 2026-12-03 07:01:02): wait for it or use
  another run.output_dir`` (``FolderInUse``, an ``OSError``: ``error:`` and exit 2).
- The lock file records the holder (pid, host, start time); a run that ends empties it. A free
  lock whose file still names a holder was left by a run that died: it is taken over, and said
  (``took over the lock of runs/x left by pid N on host h (no longer running)``).
- Readers (``export``, ``checkpoint verify``, ``report``) take no lock; ``live_note`` tells them
  a run is writing (a shared non-blocking ``flock``, released at once).
- A filesystem that refuses locks is refused (``LocksUnsupported``): nothing may silently let
  two runs in.

Why ``fcntl.flock``: the kernel releases it when the holder's descriptor closes, on any death
(SIGKILL and the OOM killer included), so a dead run never blocks the folder and no guess about
whether a pid still lives (pids are reused; another host's cannot be checked) is needed. Linux
gives it on local filesystems and on NFSv4 (as NFS byte-range locks that every client sees). The
descriptor is close-on-exec, so the processes a run starts (Ray) do not inherit the lock.

What it does not cover: it is advisory (only runs take it; ``rm`` does not ask); mounts whose
``flock`` is local to one host (NFS with ``nolock`` or ``local_lock=flock``, Lustre without
``-o flock``) let runs on two hosts both take it; rank processes that outlive a killed driver
hold no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
"""The lock file inside ``run.output_dir``; not part of a run (``run_folder.holds_run``), and
left where it is when ``--overwrite`` moves the old run aside."""

_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
# A reader holds its shared lock for microseconds (``holder``): a busy lock is asked again for
# this long before it is taken for a live run's.
_BUSY_TRIES, _BUSY_WAIT_S = 6, 0.05


class FolderInUse(OSError):
    """``run.output_dir`` is held by a live run."""


class LocksUnsupported(OSError):
    """The filesystem of ``run.output_dir`` refuses file locks."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a folder's lock, as its lock file records it."""

    pid: int | None = None
    host: str | None = None
    since: str | None = None

    def who(self) -> str:
        if self.pid is None:
            return "a process that has not recorded itself yet"
        return f"pid {self.pid} on host {self.host}"


@dataclass
class RunLock:
    """The exclusive lock on ``out``'s lock file, held through the open descriptor ``fd``."""

    out: Path
    fd: int
    created: bool
    """``acquire`` made ``out``: removed again at release when the lock file is all it holds."""
    took_over: Holder | None = None
    """The dead run whose lock this one took over, if any."""

    def release(self) -> None:
        """Empty the lock file (a normal end leaves no holder recorded) and unlock; idempotent."""
        if self.fd < 0:
            return
        path = self.out / LOCK_FILE
        try:
            os.ftruncate(self.fd, 0)
            if self.created and os.listdir(self.out) == [LOCK_FILE]:
                # Removed while still locked: a run that opened the file meanwhile finds it
                # unlinked once it gets the lock, and refuses (``acquire``).
                path.unlink()
                self.out.rmdir()
        finally:
            os.close(self.fd)
            self.fd = -1


def in_use_line(out: str | Path, holder: Holder) -> str:
    return f"{out} is {_live(holder)}: wait for it or use another run.output_dir"


def acquire(out: str | Path) -> RunLock:
    """Take ``out``'s lock (making ``out`` if needed) and record this process in it; refuses at
    once with ``FolderInUse`` naming the holder, or ``LocksUnsupported``. ``hold`` is what a run
    uses (reentrant in a process, released at its end)."""
    out = Path(out)
    # Asked before ``out`` or its lock file is made (nothing written beside a live run) and again
    # once the lock is held.
    _refuse_inside_live_run(out)
    if out.is_dir():
        _refuse_live_run_below(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _lock_exclusive(fd, out)
        if not _names(path, fd):  # its holder removed it while we waited: its folder is gone
            raise FolderInUse(f"{out}: the run lock changed hands while it was taken; try again")
        _refuse_inside_live_run(out)
        _refuse_live_run_below(out)
        previous = _read_holder(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        if created:  # nobody else can hold a lock in a folder this call made and failed in
            with contextlib.suppress(OSError):
                path.unlink()
                out.rmdir()
        raise
    return RunLock(out, fd, created, previous)


_held: dict[Path, RunLock] = {}
"""The locks ``hold`` took in this process, by resolved folder."""


@contextlib.contextmanager
def hold(out: str | Path, say: Callable[[str], None] | None = None) -> Iterator[RunLock]:
    """Hold ``out``'s lock for the ``with`` block, unless this process holds it already. A dead
    run's lock taken over is said through ``say`` (default: a logged warning)."""
    key = Path(out).expanduser().resolve()
    if key in _held:
        yield _held[key]
        return
    lock = _held[key] = acquire(out)
    try:
        if lock.took_over is not None:
            (say or logger.warning)(f"took over the lock of {out} left by "
                                    f"{lock.took_over.who()} (no longer running)")
        yield lock
    finally:
        del _held[key]
        lock.release()


def holds_output_dir(fn):
    """Decorator of ``fn(recipe, ...)``: runs it inside ``hold(recipe.run.output_dir)``."""

    @functools.wraps(fn)
    def holding(recipe, *args, **kwargs):
        with hold(recipe.run.output_dir):
            return fn(recipe, *args, **kwargs)

    return holding


def holder(out: str | Path) -> Holder | None:
    """Who holds ``out``'s lock now; None when no run is live there (or the filesystem cannot
    tell). Takes no lock: a shared non-blocking ``flock`` is tried and released at once."""
    try:
        fd = os.open(Path(out) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file, or no folder
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd) or Holder()
    except OSError:  # no locks on this filesystem: nothing can be said
        return None
    finally:
        os.close(fd)  # also releases a shared lock taken above
    return None


def live_note(run_dir: str | Path) -> str | None:
    """The line a reader of ``run_dir`` prints while a run is live there, or None."""
    live = holder(run_dir)
    if live is None:
        return None
    return f"note: a run is live in {run_dir} ({live.who()}); reading what it has written so far"


def note_if_live(run_dir: str | Path) -> None:
    """Print ``live_note`` to stderr when a run is live in ``run_dir``."""
    note = live_note(run_dir)
    if note is not None:
        print(note, file=sys.stderr)


def _refuse_inside_live_run(out: Path) -> None:
    """Refuse ``out`` inside a live run's folder: a run there would write into that run's folder.
    Asked again once ``out``'s lock is held (as ``_refuse_live_run_below`` is), so of two runs
    starting at once, one inside the other, at least one sees the other."""
    for folder in out.absolute().resolve().parents:
        live = holder(folder)
        if live is not None:
            raise FolderInUse(f"{out} is inside {folder}, {_live(live)}: a run may not write into "
                              "a live run's folder; use a run.output_dir outside it")


def _refuse_live_run_below(out: Path) -> None:
    """Refuse ``out`` holding a live run's folder below it: ``--overwrite`` would move it aside
    with the live run inside (which then goes on writing half into the moved folder, half into
    a new one), and a run would write into the folder around it."""
    own = out.resolve()
    for folder, dirs, files in os.walk(own):
        if LOCK_FILE in files and Path(folder) != own:
            live = holder(folder)
            if live is not None:
                raise FolderInUse(f"{out} holds {folder}, {_live(live)}: a run may not write "
                                  "into, overwrite or move a folder holding a live run's; wait "
                                  "for it or use another run.output_dir")
        dirs.sort()


def _live(live: Holder) -> str:
    since = f", since {live.since}" if live.since else ""
    return f"in use by a live run ({live.who()}{since})"


def _lock_exclusive(fd: int, out: Path) -> None:
    for attempt in range(_BUSY_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(_BUSY_WAIT_S)
        except OSError as err:
            if err.errno in _NO_LOCKS:
                raise LocksUnsupported(
                    f"cannot lock {out / LOCK_FILE}: its filesystem does not support file locks "
                    f"({os.strerror(err.errno)}), so one run per folder cannot be guaranteed: use "
                    "a run.output_dir on a local disk or NFSv4") from None
            raise
    raise FolderInUse(in_use_line(out, _read_holder(fd) or Holder()))


def _read_holder(fd: int) -> Holder | None:
    """The record in the lock file; None when it is empty (released, or never recorded)."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        record = json.loads(text)
        return Holder(int(record["pid"]), str(record["host"]), str(record["since"]))
    except (ValueError, KeyError, TypeError):
        return Holder()  # cut short by a death while writing it


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)
