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

# Logical CPUs of a test module's Ray: room for the largest in-process group (the demo's and
# test_workers' 2 ranks) with one to spare; Ray does not check them against the cores.
RAY_TEST_CPUS = 4


@pytest.fixture(scope="module")
def _ray_module():
    """One Ray instance per test module that asks for it, started on first use: every start waits
    on Ray's own processes, and on a busy machine that wait is where start-ups failed. It is shut
    down with the module, because a running Ray changes what later tests' libraries do (SkyRL's
    policy-loss registry moves into a Ray actor while Ray is up)."""
    import ray

    from skyrl_megatron_kda.workers.group import init_ray

    if ray.is_initialized():
        raise RuntimeError("Ray was already initialised before the test module's Ray fixture")
    init_ray(num_cpus=RAY_TEST_CPUS)
    yield
    ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_module):
    """The module's Ray; placement groups (and their actors) a test leaves behind are removed
    after it, so that one test's failure does not starve the next of CPUs."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    yield ray.cluster_resources()
    for pg_id, info in ray.util.placement_group_table().items():
        if info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
