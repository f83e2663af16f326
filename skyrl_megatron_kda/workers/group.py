"""Ray actors, one per rank, sharing one torch.distributed world (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import functools
import logging
import os
import socket
from typing import Any, Callable

import ray
import ray._private.ray_constants as ray_constants
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import Recipe, RunConfig
from ..distributed.cpu import prepare_cpu_rank
from .errors import RankError, WorkerError
from .placement import BundleLocation, assign_ranks, node_block, with_cpu_slots

logger = logging.getLogger(__name__)


# Ray's start-up waits assume an idle machine. On a small CPU host that is busy (a test suite next
# to other jobs) a worker process can need minutes to start Python and register with its raylet,
# and Ray kills workers that miss the wait (default 60 s), so an actor dies for no fault of its
# own. A process that truly fails to start still fails: it exits, or misses these longer waits.
RAY_START_CONFIG = {"worker_register_timeout_seconds": 600, "raylet_start_wait_time_s": 600}


ALLOCATOR_CONF = "expandable_segments:True"
"""CUDA's caching allocator for the rank actors, unless the driver's environment sets
``PYTORCH_CUDA_ALLOC_CONF``: segments that grow in place, so blocks freed by one phase of a step
serve the next phase's differently sized ones. With fixed segments the full-width slice at
131,072 tokens ran out of memory with 22.6 GiB reserved but unallocated (138.9 GiB held, 116.4
allocated)."""


REACH_TIMEOUT_S = 10.0
"""Seconds ``check_reachable`` waits for a TCP connection to ``run.ray_address``."""


class RayUnreachable(ConnectionError):
    """Nothing answers at ``run.ray_address``: ``ray.init`` would retry for minutes."""


def check_reachable(address: str | None) -> None:
    """Refuse a ``run.ray_address`` (``HOST:PORT`` or ``ray://HOST:PORT``) where nothing accepts
    a TCP connection, in one line, within ``REACH_TIMEOUT_S``: ``ray.init`` itself only logs
    connection warnings and retries for about 10 minutes. ``None`` (a Ray started here), ``auto``
    (Ray looks it up) and an address without a port are left to Ray."""
    if address is None or address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    host = host.strip("[]")  # an IPv6 literal
    try:
        with socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S):
            pass
    except OSError as err:
        why = (f"no answer in {REACH_TIMEOUT_S:g} s" if isinstance(err, TimeoutError)
               else err.strerror or str(err))
        raise RayUnreachable(
            f"run.ray_address={address}: nothing listens at {host}:{port} ({why}); start the "
            "cluster there (ray start --head) or set run.ray_address to its head's address "
            "(HOST:6379, ray://HOST:10001 or auto)") from None


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """``ray.init`` as the package starts or joins Ray: no dashboard, no worker logs on the
    driver; a cluster started here gets ``RAY_START_CONFIG`` (joining one keeps its own).
    ``address=None`` starts a new local cluster: Ray's own ``None`` would join the cluster named
    by ``RAY_ADDRESS`` or the one ``ray start`` last started on this machine. The workers get
    ``ALLOCATOR_CONF``. An address where nothing listens is refused first
    (``check_reachable``). Ray's C++ failure-signal handler is left out of this process, so that
    a SIGTERM reaches Python's handlers."""
    check_reachable(address)
    # Ray's C++ failure-signal handler, which ray.init installs in this process, answers SIGTERM
    # with a stack dump and SIGABRT (the commands install their own once Ray is up: train.stop).
    # Without it a SIGTERM in between reaches Ray's Python handler, a SystemExit that
    # ``train.run.start_ray`` turns into one line. Only this process: the ranks keep theirs.
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    env = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONF)}
    ray.init(address=address or "local", num_cpus=num_cpus, include_dashboard=False,
             log_to_driver=False,
             _system_config=RAY_START_CONFIG if address is None else None,
             runtime_env={"worker_process_setup_hook": "skyrl_megatron_kda.console.quiet_warnings",
                          "env_vars": env})


def ensure_ray(run: RunConfig) -> bool:
    """Start or join Ray for a run's ranks unless this process has it already (a test session, a
    caller's cluster); True when started here. A local CPU cluster gets one CPU per rank."""
    if ray.is_initialized():
        return False
    local_cpu = run.ray_address is None and run.device == "cpu"
    init_ray(run.ray_address, run.num_workers if local_cpu else None)
    return True


# Seconds the driver waits for Ray to confirm that the rank actors it killed are gone (a kill is
# a message to the actor's raylet, so it can lag on a busy host).
KILL_CONFIRM_S = 60.0


def _on_rank(method: Callable) -> Callable:
    """A ``RankActor`` method whose exceptions reach the driver as ``RankError`` (rank, type,
    message and traceback as text), never as Ray's ``UnserializableException``."""

    @functools.wraps(method)
    def wrapped(self, *args):
        try:
            return method(self, *args)
        except Exception as err:
            raise RankError.of(self.rank, err) from None

    return wrapped


@ray.remote
class RankActor:
    """One process, one rank: reports where it runs, then initialises torch.distributed as the
    rank the group gives it and runs functions sent to it."""

    def __init__(self, world: int, device: str):
        self.rank, self.world, self.device = None, world, device

    def pid(self) -> int:
        return os.getpid()

    def location(self, bundle: int) -> BundleLocation:
        """Where this actor (in placement-group bundle ``bundle``) runs; the GPU id is the one
        Ray gave it on its node (None on CPU: ``placement.with_cpu_slots`` numbers the slots)."""
        node = ray.get_runtime_context().get_node_id()
        ip = ray.util.get_node_ip_address()
        gpu = None
        if self.device == "gpu":
            ids = ray.get_gpu_ids()
            if len(ids) != 1 or not str(ids[0]).isdigit():
                raise RuntimeError(f"bundle {bundle} on node {ip}/{node[:8]} has GPU ids {ids}; "
                                   "expected one numeric id (CUDA_VISIBLE_DEVICES with UUIDs?)")
            gpu = int(ids[0])
        return BundleLocation(bundle, node, ip, gpu)

    def free_address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    @_on_rank
    def init_distributed(self, rank: int, address: str, port: int, cwd: str) -> None:
        self.rank = rank
        # A worker starts in the directory its raylet was started in (``ray start``), not the
        # driver's: run there, so the recipe's relative paths mean what they mean to the driver.
        if not os.path.isdir(cwd):
            raise FileNotFoundError(
                f"the driver's working directory {cwd} does not exist on node "
                f"{ray.util.get_node_ip_address()}: every node needs the same paths")
        os.chdir(cwd)
        if self.device == "cpu":
            prepare_cpu_rank()
            backend = "gloo"
        else:
            torch.cuda.set_device(0)  # Ray exposes exactly the GPU of this actor's bundle
            backend = "nccl"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}",
                                rank=self.rank, world_size=self.world)

    @_on_rank
    def call(self, fn: Callable, *args) -> Any:
        return fn(self.rank, self.world, *args)

    @_on_rank
    def hold(self, factory: Callable, *args) -> None:
        """Keep ``factory(rank, world, *args)`` in this process (e.g. a rank's trainer)."""
        self.held = factory(self.rank, self.world, *args)

    @_on_rank
    def call_held(self, method: Callable, *args) -> Any:
        return method(self.held, *args)


class ActorGroup:
    """``world`` rank actors in one placement group (one CPU or GPU slot each), with ranks dealt
    out node after node (``workers.placement``) so that every ``block`` consecutive ranks share a
    node; ``ranks`` says where each rank is. ``connect=False`` stops there (a placement dry run:
    no torch.distributed world)."""

    def __init__(self, world: int, device: str = "cpu", ready_timeout_s: float = 120, *,
                 block: int = 1, connect: bool = True):
        self.actors: list = []
        self.placement = None
        self.ranks: list[BundleLocation] = []
        bundle = {"CPU": 1} if device == "cpu" else {"CPU": 1, "GPU": 1}
        try:
            self.placement = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
            ready, _ = ray.wait([self.placement.ready()], timeout=ready_timeout_s)
            if not ready:
                raise RuntimeError(
                    f"Ray could not place {world} workers with {bundle} each within "
                    f"{ready_timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}")
            # In bundle order until the ranks are dealt out (shutdown ends them either way).
            self.actors = [
                RankActor.options(
                    num_cpus=1, num_gpus=0 if device == "cpu" else 1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement, placement_group_bundle_index=b),
                ).remote(world, device)
                for b in range(world)
            ]
            located = ray.get([a.location.remote(b) for b, a in enumerate(self.actors)])
            if device == "cpu":
                located = with_cpu_slots(located)
            self.ranks = assign_ranks(located, block)
            self.actors = [self.actors[loc.bundle] for loc in self.ranks]
            if connect:
                address, port = ray.get(self.actors[0].free_address.remote())
                self._gather([a.init_distributed.remote(r, address, port, os.getcwd())
                              for r, a in enumerate(self.actors)])
        except BaseException:
            # Also on Ctrl-C or a stop signal in the middle of start-up: the caller never gets
            # this group, so it cannot end the actors that already exist.
            self.shutdown()
            raise

    @classmethod
    def for_recipe(cls, recipe: Recipe, *, connect: bool = True) -> ActorGroup:
        """The group of ``recipe``'s ranks, each TP and expert-TP group inside one node."""
        p = recipe.parallel
        return cls(recipe.run.num_workers, recipe.run.device, block=node_block(p.tp, p.etp),
                   connect=connect)

    def run(self, fn: Callable, *args) -> list:
        """``fn(rank, world, *args)`` on every rank; results in rank order."""
        return self._gather([a.call.remote(fn, *args) for a in self.actors])

    def hold(self, factory: Callable, *args) -> None:
        """Build ``factory(rank, world, *args)`` on every rank and keep it in the actor, so that
        later ``call_held`` calls reach the same object (a trainer with its model and state)."""
        self._gather([a.hold.remote(factory, *args) for a in self.actors])

    def call_held(self, method: Callable, *args) -> list:
        """``method(held, *args)`` on every rank, ``method`` a function of the held object's
        class (``RankTrainer.train_step``: a reference an editor follows, not a name); results
        in rank order."""
        return self._gather([a.call_held.remote(method, *args) for a in self.actors])

    def _gather(self, refs) -> list:
        # Wait for whichever finishes first, so a failed rank ends the run instead of leaving the
        # others blocked in a collective.
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        while pending:
            (done,), _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done)
            try:
                results[rank] = ray.get(done)
            except ray.exceptions.RayError as err:
                rank, err = self._root_cause(pending, rank, err)
                self.shutdown()
                raise WorkerError(rank, err) from err
        return results

    def _root_cause(self, pending: dict, rank: int, err: BaseException,
                    grace_s: float = 5.0) -> tuple[int, BaseException]:
        """When a rank dies, its peers fail too (their collectives lose a member), and one of
        them may report first: wait briefly for the others and name a dead rank if there is one."""
        if isinstance(err, ray.exceptions.RayActorError) or not pending:
            return rank, err
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as died:
                return pending[ref], died
            except ray.exceptions.RayError:
                pass
        return rank, err

    def shutdown(self) -> None:
        """Kill every rank actor and free the placement group, then wait until Ray reports each
        actor gone (what a driver joining a cluster can know of remote processes; a driver that
        started Ray also ends the processes themselves, ``workers.lifetime``). Safe to call
        again."""
        actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor)
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
        if not actors:
            return
        # A call on a killed actor fails with RayActorError once Ray has recorded its death.
        probes = [actor.pid.remote() for actor in actors]
        _, alive = ray.wait(probes, num_returns=len(probes), timeout=KILL_CONFIRM_S)
        if alive:
            logger.warning("%d of %d rank actors not reported gone %.0f s after they were killed",
                           len(alive), len(actors), KILL_CONFIRM_S)
