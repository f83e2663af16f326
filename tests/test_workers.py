"""The Ray actor group: ranks share one gloo world, and a failing rank ends the run by name."""

import pytest

from skyrl_megatron_kda.workers.group import ActorGroup, WorkerError


def _sum_of_ranks(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return world, float(t)


def _rank_one_fails(rank, world):
    if rank == 1:
        raise ValueError("bad shard on purpose")
    return rank


def test_ranks_form_one_world(ray_cluster):
    group = ActorGroup(2, "cpu")
    try:
        assert group.run(_sum_of_ranks) == [(2, 1.0), (2, 1.0)]
    finally:
        group.shutdown()


def test_failing_rank_is_named(ray_cluster):
    group = ActorGroup(2, "cpu")
    with pytest.raises(WorkerError, match="rank 1 failed.*bad shard on purpose") as err:
        group.run(_rank_one_fails)
    assert err.value.rank == 1


def test_unplaceable_group_is_refused(ray_cluster):
    world = int(ray_cluster["CPU"]) + 1  # one worker more than the module's Ray has CPUs
    with pytest.raises(RuntimeError, match=f"could not place {world} workers"):
        ActorGroup(world, "cpu", ready_timeout_s=2)
