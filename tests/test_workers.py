"""The Ray actor group: ranks share one gloo world, and a failing rank ends the run by name, with
its own message first whatever the exception was."""

import pytest

from skyrl_megatron_kda.console import error_lines
from skyrl_megatron_kda.train.data.records import RecordRules, parse_record
from skyrl_megatron_kda.workers.group import ALLOCATOR_CONF, ActorGroup, WorkerError


def _sum_of_ranks(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return world, float(t)


def _allocator_conf(rank, world):
    import os

    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


def _rank_one_fails(rank, world):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    return rank


class _TwoFieldError(Exception):
    """Like many libraries' exceptions: the constructor does not take its own ``args`` back, so
    pickle cannot rebuild it on the driver (Ray then reports ``UnserializableException``)."""

    def __init__(self, path: str, line: int):
        super().__init__(f"{path}:{line}: cannot use this line")


def _rank_one_raises_unpicklable(rank, world):
    if rank == 1:
        raise _TwoFieldError("data.jsonl", 17)
    return rank


def _rank_one_reads_a_bad_record(rank, world, path):
    if rank == 1:
        parse_record(b"{not json", RecordRules(vocab_size=16, max_tokens=8), path, 17)
    return rank


def test_ranks_form_one_world(ray_cluster):
    group = ActorGroup(2, "cpu")
    try:
        assert group.run(_sum_of_ranks) == [(2, 1.0), (2, 1.0)]
    finally:
        group.shutdown()


def test_ranks_get_the_allocator_setting(ray_cluster):
    """Each rank's process starts with CUDA's allocator setting (expandable segments) unless the
    driver's environment chose one."""
    import os

    group = ActorGroup(2, "cpu")
    try:
        assert group.run(_allocator_conf) == [os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONF)] * 2
    finally:
        group.shutdown()


def test_failing_rank_is_named(ray_cluster):
    group = ActorGroup(2, "cpu")
    with pytest.raises(WorkerError, match="^rank 1: bad shard on purpose") as err:
        group.run(_rank_one_fails)
    assert err.value.rank == 1


def test_unplaceable_group_is_refused(ray_cluster):
    world = int(ray_cluster["CPU"]) + 1  # one worker more than the module's Ray has CPUs
    with pytest.raises(RuntimeError, match=f"could not place {world} workers"):
        ActorGroup(world, "cpu", ready_timeout_s=2)


def test_unpicklable_error_arrives_as_the_rank_message(ray_cluster):
    group = ActorGroup(2, "cpu")
    with pytest.raises(WorkerError) as err:
        group.run(_rank_one_raises_unpicklable)
    assert str(err.value) == "rank 1: data.jsonl:17: cannot use this line"
    assert err.value.kind == "_TwoFieldError"
    assert any("raise _TwoFieldError" in note for note in err.value.__notes__)


def test_bad_record_on_a_rank_names_file_and_line_first(ray_cluster):
    group = ActorGroup(2, "cpu")
    with pytest.raises(WorkerError) as err:
        group.run(_rank_one_reads_a_bad_record, "corpus.jsonl")
    lines, status = error_lines(err.value, "run")
    assert status == 1
    assert lines == ["error: rank 1: corpus.jsonl:17: invalid_json: not valid JSON (Expecting "
                     "property name enclosed in double quotes at column 2) (run failed, BadRecord)"]
