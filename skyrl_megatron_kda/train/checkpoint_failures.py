"""Why a checkpoint save or load failed, in one line: ``explained_failures`` turns torch's
``CheckpointException`` into ``CheckpointFailed`` naming the checkpoint, the rank and its error.

torch's exception (a ``BaseException``) reads ``CheckpointException ranks:dict_keys([0])`` and
says neither. Its ``failures`` map each failed rank to its exception where a collective step of
torch's checkpointing shared them; megatron's save gathers the write results on rank 0 alone, so
the other ranks raise with no failures (``ranks:dict_keys([])``), and of a failed shard write it
keeps only the error's type (``<class 'OSError'>``). The error itself reaches only megatron's
writer log (``Local worker 0 encountered an error: [Errno 28] No space left on device``): those
records are collected while the call runs. Every rank raises at the same call, so the ranks then
pool what they know with one all-gather, and each rank's line names the cause wherever it was
seen (the driver reports whichever rank answers first).
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

logger = logging.getLogger(__name__)

WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
"""Where megatron-core 0.19.2's shard writer logs a failed write, with the error's text."""

_WORKER_ERROR = re.compile(r"Local worker \d+ encountered an error: (.+)")


class CheckpointFailed(RuntimeError):
    """megatron's ``dist_checkpointing`` save or load failed: one line naming the checkpoint, the
    rank and the cause (torch's ``CheckpointException`` is the ``__cause__``)."""


class _WriteErrors(logging.Handler):
    """The errors megatron's shard writer logs: the text of each failed write."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = _WORKER_ERROR.match(record.getMessage())
        if found:
            self.errors.append(found.group(1))


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def failure_line(action: str, path: Path, err: CheckpointException,
                 write_errors: list[str]) -> str:
    """One line for ``err``: the lowest rank that failed and its own error. Collective: every
    rank calls it (each adds the write errors it saw; a failed pooling keeps its own)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    # (rank, how telling, text): a logged write error says more than megatron's type-only one.
    known = [(r, 0, _first_line(wrapped[0])) for r, wrapped in err.failures.items()]
    known += [(rank, 1, text) for text in write_errors[:1]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        pooled: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(pooled, known)
            known = [item for part in pooled for item in part]
        except Exception as gather_err:  # noqa: BLE001 - keep this rank's own account
            logger.warning("could not pool the checkpoint failure over the ranks: %s", gather_err)
    best: dict[int, tuple[int, str]] = {}
    for r, telling, text in known:
        if r not in best or telling > best[r][0]:
            best[r] = (telling, text)
    if not best:
        return (f"{action} checkpoint {path} failed on another rank, which torch did not name "
                f"({_first_line(err)})")
    first, *others = sorted(best)
    also = f" (also on rank {', '.join(map(str, others))})" if others else ""
    return f"{action} checkpoint {path} failed on rank {first}: {best[first][1]}{also}"


@contextlib.contextmanager
def explained_failures(action: str, path: str | Path):
    """Around a ``dist_checkpointing.save`` or ``load`` (``action``: ``saving`` or ``loading``
    checkpoint ``path``): torch's ``CheckpointException`` becomes ``CheckpointFailed``."""
    writes = _WriteErrors()
    writer_log = logging.getLogger(WRITER_LOGGER)
    writer_log.addHandler(writes)
    try:
        yield
    except CheckpointException as err:
        raise CheckpointFailed(failure_line(action, Path(path), err, writes.errors)) from err
    finally:
        writer_log.removeHandler(writes)
