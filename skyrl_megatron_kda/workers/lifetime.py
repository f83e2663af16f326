"""A local Ray that one command starts, and the end of every process that came with it."""

from __future__ import annotations

import logging
import time

import psutil
import ray

from ..config import RunConfig
from .group import ensure_ray

logger = logging.getLogger(__name__)

# Seconds Ray's processes get to exit after ``ray.shutdown`` before they are killed.
EXIT_GRACE_S = 15.0


class StartedRay:
    """``ensure_ray`` for one command. When it started Ray here, ``shutdown`` ends all of it:
    ``ray.shutdown`` stops Ray's own processes (GCS, raylet, agents), but the worker processes
    the raylet started (the rank actors) exit on their own afterwards, so a driver that returns
    at once could leave ranks running; this waits for each and kills what outlives the grace."""

    def __init__(self, run: RunConfig):
        before = {p.pid for p in psutil.Process().children()}
        self.started = ensure_ray(run)
        # The processes ray.init started are this process's new children; the workers are
        # their children.
        self.roots = ([p for p in psutil.Process().children() if p.pid not in before]
                      if self.started else [])

    def shutdown(self) -> None:
        """Shut down a Ray started here and end every process it started; no-op otherwise."""
        if not self.started:
            return
        self.started = False
        # Listed before ray.shutdown: once a raylet exits, its workers are no longer ours.
        procs = list(self.roots)
        for root in self.roots:
            try:
                procs += root.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        ray.shutdown()
        alive = _wait_ended(procs, EXIT_GRACE_S)
        if not alive:
            return
        logger.warning("%d Ray processes still running %.0f s after ray.shutdown; killing them",
                       len(alive), EXIT_GRACE_S)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        _wait_ended(alive, EXIT_GRACE_S)


def _running(proc: psutil.Process) -> bool:
    # A zombie has ended; it waits only for its parent (or init, for an orphan) to reap it.
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_ended(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``procs`` to end; those still running. (``psutil.wait_procs``
    counts a zombie whose reaper is not this process as running.)"""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    return alive
