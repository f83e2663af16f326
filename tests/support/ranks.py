"""Spawned ranks for tests: run ``fn(rank, world, *args)`` on every rank and collect what each
returns (picklable). gloo on CPU; NCCL with one GPU per rank."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from skyrl_megatron_kda.distributed.cpu import redirect_cuda_device_queries


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, backend: str, fn, args) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        redirect_cuda_device_queries()
        torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_ranks(world: int, fn, *args, backend: str = "gloo") -> list:
    """Results of ``fn`` on each rank, in rank order; a failing rank raises with its traceback."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, _free_port(), out_dir, backend, fn, args), nprocs=world, join=True)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in enumerate(results) if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [payload for _, payload in results]
