"""Glue between our config and megatron-core: its TransformerConfig, and loading full (unsharded)
weights into a TP-sharded module."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from .config import LayerRecipe

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_config(recipe: LayerRecipe, *, use_cpu: bool, initialize: bool = True) -> TransformerConfig:
    """Megatron's config for a model built from ``recipe``.

    On CPU, weights are initialised as full tensors and then sliced (``use_cpu_initialization``),
    which also makes the model independent of the TP size for a given seed. ``initialize=False``
    skips random initialisation (for weights that are loaded right after).
    """
    return TransformerConfig(
        num_layers=1,
        hidden_size=recipe.model.hidden_size,
        num_attention_heads=recipe.kda.num_heads,
        **mesh_config_kwargs(recipe, use_cpu=use_cpu, initialize=initialize),
    )


def mesh_config_kwargs(recipe: LayerRecipe, *, use_cpu: bool, initialize: bool = True) -> dict:
    """The ``TransformerConfig`` fields every model of ``recipe`` shares: mesh sizes, dtype,
    CPU initialisation (see ``transformer_config``)."""
    dtype = _DTYPES[recipe.model.params_dtype]
    par = recipe.parallel
    return dict(
        tensor_model_parallel_size=par.tp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu,
        perform_initialization=initialize,
        gradient_accumulation_fusion=False,
    )


@torch.no_grad()
def load_full_state(module: torch.nn.Module, full_state: dict[str, torch.Tensor], tp_rank: int, tp: int) -> None:
    """Copy unsharded tensors into ``module``, slicing TP-parallel parameters along their
    ``partition_dim`` (the attribute megatron-core sets on every TP-sharded parameter).

    A plain contiguous slice: right for the KDA layer, wrong for a SwiGLU fc1 whose TP shard is
    [gate shard; up shard] (use ``model.moe.hf_moe_to_megatron`` for MoE layers)."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(full_state))
    if missing:
        raise KeyError(f"full state lacks parameters {missing}")
    for name, param in params.items():
        full = full_state[name]
        if getattr(param, "tensor_model_parallel", False):
            full = full.chunk(tp, dim=param.partition_dim)[tp_rank]
        if full.shape != param.shape:
            raise ValueError(f"{name}: expected shard shape {tuple(param.shape)}, got {tuple(full.shape)}")
        param.copy_(full)


def gather_full_grads(module: torch.nn.Module, tp_group) -> dict[str, torch.Tensor]:
    """Unsharded gradients: TP-parallel gradients are all-gathered along ``partition_dim``."""
    out = {}
    tp = tp_group.size()
    for name, param in module.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(grad) for _ in range(tp)]
            torch.distributed.all_gather(parts, grad.contiguous(), group=tp_group)
            grad = torch.cat(parts, dim=param.partition_dim)
        out[name] = grad
    return out


def shard_of(full: torch.Tensor, param: torch.Tensor, rank: int, size: int, *, glu: bool = False) -> torch.Tensor:
    """This rank's piece of the unsharded ``full`` for ``param``: a slice along its
    ``partition_dim`` when megatron marks it tensor-parallel, else ``full`` itself.

    ``glu``: a SwiGLU fc1 [gate; up], whose shard is [gate shard; up shard], not a plain slice."""
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    if glu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=param.partition_dim)[rank]


def unshard(local: torch.Tensor, param: torch.Tensor, group, *, glu: bool = False) -> torch.Tensor:
    """Inverse of ``shard_of`` over ``group`` (an all-gather; every rank gets the full tensor)."""
    size = group.size()
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    if glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=param.partition_dim)
