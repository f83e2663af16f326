"""Fixtures shared by the tests. Helper code (spawned ranks, KDA cases, training runs) lives in
``tests/support``."""

from __future__ import annotations

import pytest

from skyrl_megatron_kda.console import HARMLESS_WARNINGS


def pytest_configure(config):
    """The library notices the CLI hides are hidden in the tests' summary too: pytest applies its
    ``filterwarnings`` lines inside every test's own warning capture."""
    for message, category, module in HARMLESS_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category.__name__}:{module}")

# Logical CPUs of the test session's Ray: room for the largest in-process group (the demo's and
# test_workers' 2 ranks) with one to spare; Ray does not check them against the cores.
RAY_TEST_CPUS = 4


@pytest.fixture(scope="session")
def _ray_session():
    """One Ray instance for the whole test session, started on first use: every start waits on
    Ray's own processes, and on a busy machine that wait is where start-ups failed."""
    import ray

    from skyrl_megatron_kda.workers.group import init_ray

    if ray.is_initialized():
        raise RuntimeError("Ray was already initialised before the test session's Ray fixture")
    init_ray(num_cpus=RAY_TEST_CPUS)
    yield
    ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_session):
    """The session's Ray; placement groups (and their actors) a test leaves behind are removed
    after it, so that one test's failure does not starve the next of CPUs."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    yield ray.cluster_resources()
    for pg_id, info in ray.util.placement_group_table().items():
        if info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
