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
import errno
import logging
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from torch.distributed.checkpoint import CheckpointException

logger = logging.getLogger(__name__)

WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
"""Where megatron-core 0.19.2's shard writer logs a failed write, with the error's text."""

_WORKER_ERROR = re.compile(r"Local worker \d+ encountered an error: (.+)")


NO_SPACE = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
"""How a full disk reads, whichever layer failed the write."""

FULL_BELOW_BYTES = 1 << 20
"""A filesystem with less than this free is full: after a failed write, what is left is less
than the write needed."""

# torch.save's zip writer (megatron writes the common state with it) loses the errno of a short
# write: "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", or "PytorchStreamWriter
# failed writing file ...".
_ZIP_WRITER_FAILED = re.compile(r"inline_container\.cc|PytorchStreamWriter failed|unexpected pos")


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or of its
    nearest existing parent)."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    st = os.statvfs(existing)
    return st.f_bavail * st.f_frsize


def disk_full_cause(text: str, path: str | Path) -> str:
    """``text`` (a failed write's error), or "[Errno 28] No space left on device (...)" where it
    is torch's zip writer failing on a full filesystem (``FULL_BELOW_BYTES``)."""
    if _ZIP_WRITER_FAILED.search(text) and free_bytes(path) < FULL_BELOW_BYTES:
        return f"{NO_SPACE} (torch's writer: {text})"
    return text


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
    known = [(r, 0, disk_full_cause(_first_line(wrapped[0]), path))
             for r, wrapped in err.failures.items()]
    known += [(rank, 1, disk_full_cause(text, path)) for text in write_errors[:1]]
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
    checkpoint ``path``): torch's ``CheckpointException`` becomes ``CheckpointFailed``, and so
    does torch's zip writer failing (megatron's common state, written by rank 0 alone), which
    on a full disk reads ``[Errno 28] No space left on device``."""
    writes = _WriteErrors()
    writer_log = logging.getLogger(WRITER_LOGGER)
    writer_log.addHandler(writes)
    try:
        yield
    except CheckpointException as err:
        raise CheckpointFailed(failure_line(action, Path(path), err, writes.errors)) from err
    except RuntimeError as err:
        if not _ZIP_WRITER_FAILED.search(str(err)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CheckpointFailed(f"{action} checkpoint {path} failed on rank {rank}: "
                               f"{disk_full_cause(_first_line(err), path)}") from err
    finally:
        writer_log.removeHandler(writes)


class NoSpaceForCheckpoint(OSError):
    """A save refused before writing: the checkpoint does not fit in the free space."""


ITEM_BYTES = 2048
"""What torch's checkpoint writer adds to each item beyond its data (each tensor goes through
torch.save's container) plus its entry in ``.metadata``."""


def written_bytes(request: dict) -> int:
    """Bytes this rank writes for ``request`` (a sharded state dict): megatron's save writes each
    shard once, from its main replica (a factory's shards as it builds them), each with
    ``ITEM_BYTES`` around it; objects (RNG, common state) count ``ITEM_BYTES`` each."""
    total = 0
    for item in nested_values(request):
        if isinstance(item, ShardedTensorFactory):
            built = item.build()
            shards = nested_values(built) if isinstance(built, (dict, list)) else [built]
        else:
            shards = [item]
        for shard in shards:
            if isinstance(shard, ShardedTensor) and is_main_replica(shard.replica_id):
                total += shard.data.numel() * shard.data.element_size() + ITEM_BYTES
            elif isinstance(shard, ShardedObject) and is_main_replica(shard.replica_id):
                total += ITEM_BYTES
    return total


def check_free_space(request: dict, path: Path, what: str, kept: str, reclaimed: int,
                     device: torch.device) -> None:
    """Refuse the save of ``what`` (``step 3``; every rank, nothing written) when its tensors,
    summed over the ranks, exceed the free space where rank 0 writes (a shared filesystem) plus
    ``reclaimed`` (an unfinished save's folder the save removes first): a save that fills the
    disk fails midway, in whichever layer's words. ``kept``: what stays to resume from.
    Collective."""
    need = torch.tensor([float(written_bytes(request))], dtype=torch.float64, device=device)
    dist.all_reduce(need)
    verdict: list = [None]
    if dist.get_rank() == 0:
        free = free_bytes(path) + reclaimed
        if need.item() > free:
            verdict[0] = (f"{what}: the checkpoint needs {need.item() / 2**20:.1f} MiB, "
                          f"{path.parent} has {free / 2**20:.1f} MiB free: {NO_SPACE}; not saved "
                          f"({kept}): free space there or set run.output_dir on a larger disk")
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        err = NoSpaceForCheckpoint(verdict[0])
        err.errno = errno.ENOSPC
        raise err
