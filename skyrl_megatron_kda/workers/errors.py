"""How a rank's failure reaches the driver: one line that names the rank and says what went
wrong, whatever the exception was and whether Ray could pickle it."""

from __future__ import annotations

import traceback

import ray


class RankError(Exception):
    """An exception raised on a rank, reduced to plain text on that rank.

    Ray pickles a task's exception to send it to the driver. An exception whose constructor does
    not take its own ``args`` back (``train.data.records.BadRecord(file, line, reason, detail)``) cannot
    be rebuilt there and arrives as ``UnserializableException``, its message at the end of a
    traceback; this one is rebuilt from four strings, so the rank's message always arrives."""

    def __init__(self, rank: int, kind: str, message: str, trace: str):
        super().__init__(rank, kind, message, trace)
        self.rank, self.kind, self.message, self.trace = rank, kind, message, trace

    @classmethod
    def of(cls, rank: int, err: BaseException) -> RankError:
        return cls(rank, type(err).__name__, str(err), "".join(traceback.format_exception(err)))

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


class WorkerError(RuntimeError):
    """A rank failed or died, as the driver reports it: ``rank 1: <the rank's message>`` for an
    exception on the rank, ``rank 1 died: <Ray's account>`` for a lost process. ``kind`` is the
    exception's type name and ``message`` its own text, without the rank; the rank's traceback
    is attached as a note (``--debug`` shows it)."""

    def __init__(self, rank: int, error: BaseException):
        # A task error carries the worker's own exception (a RankError from RankActor); a dead
        # actor only Ray's account of it.
        cause = getattr(error, "cause", None) or error
        self.rank, self.died = rank, isinstance(error, ray.exceptions.RayActorError)
        if isinstance(cause, RankError):
            self.kind, self.message, text = cause.kind, cause.message, str(cause)
        else:
            self.kind, self.message = type(cause).__name__, str(cause)
            text = f"rank {rank} {'died' if self.died else 'failed'}: {cause}"
        super().__init__(text)
        if isinstance(cause, RankError):
            self.add_note(f"rank {rank}'s traceback:\n{cause.trace}")
