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
        was_up = ray.is_initialized()
        try:
            self.started = ensure_ray(run)
        except BaseException:
            # Stopped inside ray.init (Ctrl-C; Ray's own SIGTERM handler exits with SystemExit):
            # end the processes it started so far, which ray.shutdown alone does not know of yet.
            if not was_up:
                self.started, self.roots = True, _new_children(before)
                self.shutdown()
            raise
        # The processes ray.init started are this process's new children; the workers are
        # their children.
        self.roots = _new_children(before) if self.started else []

    def shutdown(self) -> None:
        """Shut down a Ray started here and end every process it started; no-op otherwise."""
        if not self.started:
            return
        self.started = False
        # Listed before ray.shutdown: once a raylet exits, its workers leave our process tree.
        procs = list(self.roots)
        for root in self.roots:
            try:
                procs += root.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        ray.shutdown()
        # ray.shutdown has already stopped the processes it knows of; after an interrupted
        # ray.init it knows none, and SIGTERM is how Ray itself asks them to stop.
        _send(self.roots, psutil.Process.terminate)
        alive = _wait_ended(procs, EXIT_GRACE_S)
        if not alive:
            return
        logger.warning("Ray processes still running %.0f s after ray.shutdown, killed: %s",
                       EXIT_GRACE_S, ", ".join(f"{p.pid} ({_name(p)})" for p in alive))
        _send(alive, psutil.Process.kill)
        _wait_ended(alive, EXIT_GRACE_S)


def _send(procs: list[psutil.Process], action) -> None:
    for proc in procs:
        if _running(proc):
            try:
                action(proc)
            except psutil.NoSuchProcess:
                pass


def _new_children(before: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if p.pid not in before]


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[:3]) or proc.name()
    except psutil.Error:
        return "?"


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
