"""Spawned ranks for tests: run ``fn(rank, world, *args)`` on every rank and collect what each
returns (picklable). gloo on CPU; NCCL with one GPU per rank.

On gloo the ranks of each world size start once per test session and serve every call after:
starting a rank is a fresh interpreter importing torch and megatron-core, seconds of a 2-core
machine, and most of a small test's time. Between calls each rank puts back what a test may
change process-wide, so that a call sees what a fresh rank would: megatron's parallel state, its
MoE aux-loss scale and metrics, every process group but the world's, the environment, the working
directory, torch's default dtype, thread count, grad mode, deterministic switch and default RNG
state; a group whose ranks have gathered more native threads than ``MAX_RANK_THREADS`` is
retired after its call. A rank that fails or dies ends its whole group (its peers may be waiting for it in a
collective); the next call starts a fresh one. NCCL ranks are spawned for each call, as a GPU
test wants its devices to itself.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import socket
import tempfile
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from skyrl_megatron_kda.distributed.cpu import prepare_cpu_rank

# The largest group kept between calls: the suite's groups of 1, 2 and 4 ranks stay (7 idle
# processes holding torch and megatron-core); a rarer larger group is ended after its call, so
# that its memory is not held through the Ray and SkyRL jobs that follow.
MAX_POOLED_WORLD = 4
# How long the other ranks of a group get to report after one rank fails, before the group is
# ended: a peer waiting in a collective for the failed rank never reports. Only what the failure
# message includes depends on it.
PEER_REPORT_S = 20.0
# The most native threads a pooled rank may hold after a call before its group is retired (the
# next call starts a fresh one). A destroyed gloo group whose object something still references
# keeps its transport threads, which wake and poll: over a session they add up to hundreds per
# rank and cost the 2-core machine a core. A fresh rank holds a few dozen.
MAX_RANK_THREADS = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _native_threads() -> int:
    """This process's threads, native ones included (0 where /proc does not list them)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _call(fn, rank: int, world: int, args) -> tuple[str, object]:
    try:
        return "ok", fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        return "error", traceback.format_exc()


class _FreshState:
    """What a fresh rank holds process-wide and a test may change; ``restore`` puts it back."""

    def __init__(self):
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.rng = torch.get_rng_state()
        self.grad = torch.is_grad_enabled()

    def restore(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.moe import moe_logging
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        parallel_state.destroy_model_parallel()
        # The MoE aux-loss scale and metrics megatron keeps across layers, as a fresh import has them.
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        moe_logging._MOE_METRICS_TRACKER = None
        world_group = dist.GroupMember.WORLD
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not world_group:
                dist.destroy_process_group(group)
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_rng_state(self.rng)
        torch.set_grad_enabled(self.grad)
        gc.collect()


def _serve(rank: int, world: int, port: int, conn) -> None:
    """A pooled gloo rank: runs each call it receives until its parent closes the pipe."""
    prepare_cpu_rank()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    fresh = _FreshState()
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:
            break
        fn, args = _loads(request)
        status, payload = _call(fn, rank, world, args)
        fresh.restore()
        threads = _native_threads()
        try:
            reply = _dumps((status, payload, threads))
        except Exception:  # noqa: BLE001 - an unpicklable result is the test's error
            reply = _dumps(("error", f"the result could not be sent back:\n{traceback.format_exc()}",
                            threads))
        conn.send_bytes(reply)
    dist.destroy_process_group()


class _RankGroup:
    """``world`` pooled gloo ranks with their world process group, and the pipes to them."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world = world
        self.threads = 0  # the most native threads a rank held after the last call
        self.processes, self.pipes = [], []
        for rank in range(world):
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(rank, world, port, child_end),
                                  name=f"test-rank-{rank}-of-{world}")
            process.start()
            child_end.close()
            self.processes.append(process)
            self.pipes.append(parent_end)

    def call(self, fn, args) -> list[tuple[str, object]]:
        """Each rank's (status, payload); a failed or dead rank ends the group (``alive`` False)."""
        request = _dumps((fn, args))
        for pipe in self.pipes:
            pipe.send_bytes(request)
        replies: dict[int, tuple[str, object]] = {}
        waiting = dict(enumerate(self.pipes))
        failed = False
        while waiting:
            ready = wait(list(waiting.values()), timeout=PEER_REPORT_S if failed else None)
            if not ready:
                break
            for rank in [r for r, pipe in waiting.items() if pipe in ready]:
                replies[rank] = self._reply(rank)
                del waiting[rank]
                if replies[rank][0] == "error":
                    # Its peers may wait for it in a collective: ending it ends their wait.
                    failed = True
                    self.processes[rank].kill()
        for rank in waiting:
            replies[rank] = ("error", "no reply: ended after another rank failed")
        if failed:
            self.close(kill=True)
        return [replies[r] for r in range(self.world)]

    def _reply(self, rank: int) -> tuple[str, object]:
        try:
            status, payload, threads = _loads(self.pipes[rank].recv_bytes())
            self.threads = max(self.threads, threads)
            return status, payload
        except (EOFError, OSError):
            process = self.processes[rank]
            process.join(timeout=5)
            return "error", f"the rank's process ended (exit code {process.exitcode})"

    @property
    def alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def close(self, kill: bool = False) -> None:
        """End the ranks: each leaves its loop when its pipe closes; ``kill`` ends them now."""
        for pipe in self.pipes:
            pipe.close()
        for process in self.processes:
            if kill:
                process.kill()
            process.join()
        self.processes, self.pipes = [], []


_GROUPS: dict[int, _RankGroup] = {}


@atexit.register
def _close_groups() -> None:
    for group in _GROUPS.values():
        group.close()
    _GROUPS.clear()


def _pooled(world: int, fn, args) -> list[tuple[str, object]]:
    if world > MAX_POOLED_WORLD:
        group = _RankGroup(world)
        try:
            return group.call(fn, args)
        finally:
            group.close(kill=not group.alive)
    group = _GROUPS.get(world)
    if group is None or not group.alive:
        group = _GROUPS[world] = _RankGroup(world)
    group.threads = 0
    try:
        return group.call(fn, args)
    except BaseException:
        # Interrupted mid-call (Ctrl-C, an unpicklable argument): its replies would answer the
        # next call, so the group ends here.
        group.close(kill=True)
        raise
    finally:
        if group.alive and group.threads > MAX_RANK_THREADS:
            group.close()


def _spawn_entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result = _call(fn, rank, world, args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawned(world: int, fn, args) -> list[tuple[str, object]]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_spawn_entry, args=(world, _free_port(), out_dir, fn, args), nprocs=world,
                 join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


def run_ranks(world: int, fn, *args, backend: str = "gloo") -> list:
    """Results of ``fn`` on each rank, in rank order; a failing rank raises with its traceback."""
    if backend == "gloo":
        results = _pooled(world, fn, args)
    elif backend == "nccl":
        results = _spawned(world, fn, args)
    else:
        raise ValueError(f"backend must be gloo or nccl, not {backend!r}")
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in enumerate(results)
              if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [payload for _, payload in results]
