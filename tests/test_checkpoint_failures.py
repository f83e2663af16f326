"""A failed checkpoint save or load names its cause in one line: torch's ``CheckpointException``
(``CheckpointException ranks:dict_keys([0])``, a ``BaseException``) is unwrapped by
``checkpoint_failures.explained_failures`` into ``CheckpointFailed`` with the rank and its own error, on
every rank, also where torch handed a rank no failures at all (``ranks:dict_keys([])``)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.api import _wrap_exception

from skyrl_megatron_kda.train.checkpoint_failures import CheckpointFailed, explained_failures
from skyrl_megatron_kda.workers.errors import RankError, WorkerError
from tests.support.ranks import run_ranks


def _wrapped(err: BaseException):
    """``err`` raised and wrapped the way torch's ``_DistWrapper`` puts it in ``failures``."""
    try:
        raise err
    except BaseException as raised:  # noqa: BLE001
        return _wrap_exception(raised)


def test_checkpoint_exception_becomes_one_line_with_the_rank_and_its_error(tmp_path):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "__0_0.distcp"))
    shape = ValueError("Global shape mismatch for loaded (torch.Size([64, 256])) and expected "
                       "((32, 256)) tensor for key embedding.word_embeddings.weight")
    failures = {2: _wrapped(shape), 0: _wrapped(full)}
    err = CheckpointException("write", failures)
    assert str(err).startswith("CheckpointException ranks:dict_keys([2, 0])")  # what users saw
    with pytest.raises(CheckpointFailed) as caught:
        with explained_failures("saving", tmp_path / "step_00000003"):
            raise err
    assert str(caught.value) == (
        f"saving checkpoint {tmp_path / 'step_00000003'} failed on rank 0: [Errno 28] No space "
        f"left on device: '{tmp_path / '__0_0.distcp'}' (also on rank 2)")
    assert caught.value.__cause__ is err
    # The driver's line for the rank that raised it (RankActor turns it into a RankError).
    worker = WorkerError(3, RankError.of(3, caught.value))
    assert str(worker) == f"rank 3: {caught.value}" and worker.kind == "CheckpointFailed"


def test_checkpoint_exception_without_failures_still_says_where(tmp_path):
    # megatron's save raises it so on every rank but the coordinator (the cause is on rank 0).
    with pytest.raises(CheckpointFailed, match=r"^loading checkpoint .*step_00000001 failed on "
                       r"another rank, which torch did not name \(CheckpointException ranks:"
                       r"dict_keys\(\[\]\)\)$"):
        with explained_failures("loading", tmp_path / "step_00000001"):
            raise CheckpointException("write", {})


def _save_then_load_on_rank(rank: int, world: int, full_rank: int) -> dict:
    """On every rank: a real megatron save whose shard file on ``full_rank`` is a symlink to
    /dev/full (its write fails with ENOSPC), then a real load of a good checkpoint into a
    tensor of another shape; returns each one's error line."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from skyrl_megatron_kda.distributed.cpu import cuda_names_cpu

    def sharded(rows: int) -> dict:
        local = torch.full((rows, 4), float(rank))
        return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world), replica_id=0)}

    base = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(base, src=0)
    full, good = Path(base[0]) / "full", Path(base[0]) / "good"
    if rank == 0:
        full.mkdir()
        good.mkdir()
        os.symlink("/dev/full", full / f"__{full_rank}_0.distcp")
    dist.barrier()
    lines = {}
    with cuda_names_cpu(True):
        try:
            with explained_failures("saving", full):
                dist_checkpointing.save(sharded(8), str(full))
        except CheckpointFailed as err:
            assert isinstance(err.__cause__, CheckpointException)
            lines["save"] = str(err)
        dist_checkpointing.save(sharded(8), str(good))
        try:
            with explained_failures("loading", good):
                dist_checkpointing.load(sharded(6), str(good))
        except CheckpointFailed as err:
            lines["load"] = str(err)
    lines["base"] = base[0]
    return lines


@pytest.mark.parametrize("full_rank", [0, 1])
def test_a_full_disk_during_a_save_says_no_space_left_on_device(full_rank):
    """Two gloo ranks, one of whose shard files is /dev/full. megatron's writer keeps only the
    error's type and rank 1 receives no failures; every rank's line still names the ENOSPC. The load of a checkpoint into another shape names megatron's shape message."""
    results = run_ranks(2, _save_then_load_on_rank, full_rank)
    base = Path(results[0]["base"])
    shard = base / "full" / f"__{full_rank}_0.distcp"
    for lines in results:
        assert lines["save"] == (f"saving checkpoint {base / 'full'} failed on rank {full_rank}: "
                                 "[Errno 28] No space left on device")
        assert lines["load"].startswith(f"loading checkpoint {base / 'good'} failed on rank 0: "
                                        "Global shape mismatch for loaded (torch.Size([16, 4])) "
                                        "and expected ((12, 4)) tensor for key w")
    os.unlink(shard)
    for path in sorted(base.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    base.rmdir()

