"""The pooled test ranks (``tests/support/ranks.py``): a call sees what a fresh rank would, and a
failing rank raises with its traceback and leaves the next call a working group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import run_ranks


def _dirty(rank: int, world: int) -> dict:
    """Change every piece of process-wide state the pool puts back, and report the fresh values."""
    from megatron.core import parallel_state

    seen = {"env": os.environ.get("RANKS_TEST_VAR"), "grad": torch.is_grad_enabled(),
            "dtype": torch.get_default_dtype(), "draw": torch.rand(1).item(),
            "groups": len(dist.distributed_c10d._world.pg_map),
            "megatron": parallel_state.model_parallel_is_initialized()}
    os.environ["RANKS_TEST_VAR"] = "set"
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    dist.new_group(list(range(world)))
    return seen


def test_a_call_sees_a_fresh_rank():
    first, second = run_ranks(2, _dirty), run_ranks(2, _dirty)
    assert first == second  # the same draw too: the default generator's state is put back
    assert first[0]["env"] is None and first[0]["grad"] and first[0]["dtype"] == torch.float32
    assert not first[0]["megatron"] and first[0]["groups"] == 1


def _fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits for its failed peer, as a collective in a real test would
    return rank


def _sum_ranks(rank: int, world: int) -> int:
    total = torch.tensor([rank])
    dist.all_reduce(total)
    return int(total)


def test_a_failed_rank_raises_and_the_next_call_gets_a_working_group():
    with pytest.raises(RuntimeError, match="rank 1:(.|\n)*rank 1 fails on purpose"):
        run_ranks(2, _fail_on_rank_1)
    assert run_ranks(2, _sum_ranks) == [1, 1]


_HELD_GROUPS = []


def _pid_holding_a_group(rank: int, world: int) -> int:
    """This rank's pid, after making a process group that a module global keeps referenced (as a
    leak would): destroying it leaves its transport threads running."""
    _HELD_GROUPS.append(dist.new_group(list(range(world))))
    return os.getpid()


def test_a_group_whose_ranks_gather_threads_is_retired(monkeypatch):
    """A rank over ``MAX_RANK_THREADS`` after a call ends its group: that call still returns, the
    next one runs on fresh ranks. Under the limit the same ranks serve again."""
    from tests.support import ranks

    first = run_ranks(2, _pid_holding_a_group)
    assert run_ranks(2, _pid_holding_a_group) == first  # pooled: the same processes
    monkeypatch.setattr(ranks, "MAX_RANK_THREADS", 1)
    assert run_ranks(2, _pid_holding_a_group) == first  # over the limit: answered, then retired
    monkeypatch.undo()
    fresh = run_ranks(2, _pid_holding_a_group)
    assert set(fresh).isdisjoint(first)
    assert run_ranks(2, _sum_ranks) == [1, 1]
