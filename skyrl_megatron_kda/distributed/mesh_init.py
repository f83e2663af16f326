"""Initial weights that do not depend on the mesh: each tensor drawn whole from its own seed, then
sliced to this rank's shard (``tensor_parallel.shard_of``).

megatron-core's CPU initialisation (``use_cpu_initialization``) already draws every TP-sharded
weight as a full tensor and slices it, but from one generator in construction order: a module
that builds a mesh-dependent number of tensors (an expert-parallel rank builds only its own
experts) shifts every draw after it. A tensor drawn from a seed of its own name is the same on
every mesh.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from .tensor_parallel import is_tp_sharded, shard_of


def name_seed(base: int, name: str) -> int:
    """A 63-bit seed for tensor ``name`` under ``base``: stable across processes and Python runs
    (unlike ``hash``), different for every name."""
    digest = hashlib.sha256(f"{base}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def init_shard_from_full(param: torch.Tensor, init_method: Callable[[torch.Tensor], None],
                         seed: int, rank: int, size: int, *, glu: bool = False) -> None:
    """Draw ``param``'s full (unsharded) tensor with ``init_method`` from ``seed`` alone and copy
    this rank's shard into it (``rank`` of ``size`` in the group megatron shards it over; ``glu``:
    a SwiGLU fc1). Drawn in fp32 and then cast, as megatron's CPU initialisation does; the global
    generator's state is left as it was."""
    shape = list(param.shape)
    if is_tp_sharded(param):
        shape[param.partition_dim] *= size
    full = torch.empty(shape, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init_method(full)
    param.copy_(shard_of(full.to(param.dtype), param, rank, size, glu=glu))
