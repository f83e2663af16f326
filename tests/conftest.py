"""Fixtures shared by the tests. Helper code (spawned ranks, KDA cases, training runs) lives in
``tests/support``."""

from __future__ import annotations

import contextlib
import tempfile

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


@pytest.fixture(scope="session")
def census():
    """What autograd keeps on CPU for the tiny recipe's variants, by part, and their recipes
    (``tests/support/memory_recipes.saved_tensor_census``): built once for every memory test
    module that reads it, as it spawns a rank and builds 14 models."""
    from tests.support.memory_recipes import saved_tensor_census

    return saved_tensor_census()


@pytest.fixture
def ray_cluster(_ray_module):
    """The module's Ray; placement groups (and their actors) a test leaves behind are removed
    after it, so that one test's failure does not starve the next of CPUs."""
    import ray

    yield ray.cluster_resources()
    _remove_placement_groups()


def _remove_placement_groups() -> None:
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for pg_id, info in ray.util.placement_group_table().items():
        if info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))


# The local multi-node cluster: a head node with 4 CPUs (and a "head" resource, so that a test
# can reserve CPUs there) and a second raylet with 2, on this one host.
HEAD_CPUS, WORKER_CPUS = 4, 2


@contextlib.contextmanager
def local_cluster(head_cpus: int, worker_cpus: int | None = None, **head_args):
    """Ray's local cluster (``ray.cluster_utils.Cluster``: raylets on this host, each with its
    own resources; a second node with ``worker_cpus``), as ``ray start`` would start it; shut
    down on exit, raylets and all. Its address is recorded as "the cluster ray start last
    started" under Ray's temp folder, where any process on this host calling ray.init() without
    an address would join it: a private temp folder (``RAY_TMPDIR``, inherited by the processes
    started meanwhile) keeps other test runs on this host off it."""
    from ray.cluster_utils import Cluster

    from skyrl_megatron_kda.workers.group import RAY_START_CONFIG

    with (tempfile.TemporaryDirectory(prefix="ray_", ignore_cleanup_errors=True) as temp,
          pytest.MonkeyPatch.context() as env):
        env.setenv("RAY_TMPDIR", temp)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "include_dashboard": False, "_system_config": RAY_START_CONFIG,
            **head_args})
        try:
            if worker_cpus is not None:
                cluster.add_node(num_cpus=worker_cpus)
                cluster.wait_for_nodes()
            yield cluster
        finally:
            cluster.shutdown()


@pytest.fixture(scope="module")
def _two_node_module():
    """The local multi-node cluster, joined by this process as a driver the way a driver joins
    a cluster started by ``ray start``."""
    import ray

    from skyrl_megatron_kda.workers.group import init_ray

    if ray.is_initialized():
        raise RuntimeError("Ray was already initialised before the two-node cluster fixture")
    with local_cluster(HEAD_CPUS, WORKER_CPUS, resources={"head": 1}) as cluster:
        try:
            init_ray(cluster.address)
            yield cluster
        finally:
            ray.shutdown()


@pytest.fixture
def two_node_cluster(_two_node_module):
    """The module's two-node cluster; placement groups a test leaves behind are removed after it."""
    yield _two_node_module
    _remove_placement_groups()
