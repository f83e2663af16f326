"""Tensor-parallel sharding of full (unsharded) tensors: the one ``shard_of`` / ``unshard`` pair
that initialisation, HF weight loading and export, and the parity checks all use.

megatron-core marks every TP-sharded parameter with ``tensor_model_parallel`` and its
``partition_dim``; a rank's shard is the contiguous ``1/size`` slice along that dimension, except
for a SwiGLU fc1 ``[gate; up]``, whose shard is ``[gate shard; up shard]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether megatron marks ``param`` as split over a tensor-parallel group."""
    return getattr(param, "tensor_model_parallel", False)


def shard_of(full: torch.Tensor, param: torch.Tensor, rank: int, size: int, *, glu: bool = False) -> torch.Tensor:
    """This rank's piece of the unsharded ``full`` for ``param``: a slice along its
    ``partition_dim`` when megatron marks it tensor-parallel, else ``full`` itself.

    ``glu``: a SwiGLU fc1 [gate; up], whose shard is [gate shard; up shard], not a plain slice."""
    if not is_tp_sharded(param) or size == 1:
        return full
    if glu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=param.partition_dim)[rank]


def all_gathered(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``tensor`` of ``group`` (same shapes), in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def unshard(local: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup, *, glu: bool = False) -> torch.Tensor:
    """Inverse of ``shard_of`` over ``group`` (an all-gather; every rank gets the full tensor)."""
    if not is_tp_sharded(param) or group.size() == 1:
        return local
    parts = all_gathered(local, group)
    if glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=param.partition_dim)


@torch.no_grad()
def load_full_state(module: torch.nn.Module, full_state: dict[str, torch.Tensor], tp_rank: int, tp: int) -> None:
    """Copy unsharded tensors into ``module``, each TP-sharded parameter taking its plain slice.

    Right for modules without a SwiGLU fc1 (the KDA and DSA layers); whole models load through
    ``model.hf_io``, which knows which tensors are GLU."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(full_state))
    if missing:
        raise KeyError(f"full state lacks parameters {missing}")
    for name, param in params.items():
        piece = shard_of(full_state[name], param, tp_rank, tp)
        if piece.shape != param.shape:
            raise ValueError(f"{name}: expected shard shape {tuple(param.shape)}, got {tuple(piece.shape)}")
        param.copy_(piece)


def gather_full_grads(module: torch.nn.Module, tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Unsharded gradients of ``module`` (zeros where a parameter has none)."""
    return {name: unshard(param.grad if param.grad is not None else torch.zeros_like(param), param, tp_group)
            for name, param in module.named_parameters()}
