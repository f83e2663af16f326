"""How the training driver answers SIGTERM and SIGINT (Ctrl-C), in each phase of a run.

- starting (Ray, the rank actors, the model build, a resume's load): stop at once;
- training: the first signal lets the step in flight finish and saves a checkpoint after it; a
  second one stops at once, without saving (the last checkpoint stays the one to resume from);
- saving: the save finishes first, whatever arrives meanwhile (a half-written checkpoint would be
  worth nothing, and the save is what makes the run resumable);
- stopping (ending the ranks and Ray): signals are acknowledged and the stopping goes on.

"At once" interrupts the driver's wait on Ray with ``KeyboardInterrupt``: Ray turns any other
exception raised by a signal handler during ``ray.get`` / ``ray.wait`` into a ``SystemError``
once the wait ends by itself, which may be never. ``run`` turns it into ``Interrupted``.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(RuntimeError):
    """The run stopped on SIGTERM or SIGINT; the message says when and what was saved. The CLI
    exits with ``128 + signum``."""

    def __init__(self, signum: int, message: str, step: int | None = None,
                 path: Path | None = None, *, exit_at_once: bool = False):
        super().__init__(message)
        self.signum, self.step, self.path = signum, step, path
        self.exit_at_once = exit_at_once
        """Stopped inside ``ray.init``: Ray's processes are ended, but its half-made core worker
        in this process may crash the interpreter's own shutdown (SIGSEGV after the line), so
        the command ends the process without it (``cli``)."""


class StopSignals:
    """The driver's SIGTERM / SIGINT handler for one run (main thread only; elsewhere signals
    keep their handlers). ``signum`` is the first signal received, ``None`` if none."""

    def __init__(self):
        self.signum: int | None = None
        self.phase = "starting"
        self.second: str | None = None  # what a later signal did, for the final line
        self.trained = False  # whether the run got past start-up
        self.step = 0  # the last step done (the driver keeps it)
        self._previous: dict = {}

    def begin(self, phase: str) -> None:
        """Enter ``phase`` ("training", "saving" or "stopping")."""
        self.phase = phase
        self.trained = self.trained or phase == "training"

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def install(self) -> None:
        """(Re)install the handler: ``ray.init`` replaces SIGTERM's with Ray's own (its C++
        core's handler dumps a stack and aborts the process), so ``run`` calls this again once
        Ray is up."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        first = self.signum is None
        if first:
            self.signum = signum
        if self.phase == "starting" or (self.phase == "training" and not first):
            if not first:
                self.second = f"a second {name} stopped it without saving"
            self.phase = "stopping"  # a further signal must not interrupt the clean-up
            raise KeyboardInterrupt
        if self.phase == "training":
            _say(f"{name}: saving a checkpoint after this step (again to stop without saving)")
        elif self.phase == "saving":
            if not first:
                self.second = f"a second {name} during the save let it finish"
            _say(f"{name}: the checkpoint save in progress finishes first, then the run stops")
        else:
            _say(f"{name}: already stopping; ending the rank processes")

    def stopped_line(self, step: int, latest: Path | None) -> str:
        """The line for a stop without a checkpoint of this moment: where, and what resumes."""
        name = signal.Signals(self.signum).name
        where = f"during step {step + 1}" if self.trained else "during start-up"
        cause = f"; {self.second}" if self.second else ""
        resume = (f"--resume continues from {latest}" if latest is not None
                  else "no checkpoint yet, start it again")
        return f"stopped by {name} {where}{cause}; nothing saved; {resume}"

    def saved_line(self, step: int, path: Path) -> str:
        """The line for a stop after the checkpoint of ``step`` was written."""
        cause = f"; {self.second}" if self.second else ""
        return (f"stopped by {signal.Signals(self.signum).name} after step {step}{cause}; "
                f"checkpoint {path} (continue with --resume)")


def _say(text: str) -> None:
    print(f"\n{text}", file=sys.stderr, flush=True)
