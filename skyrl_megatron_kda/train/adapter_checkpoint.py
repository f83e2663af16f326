"""What an adapter checkpoint (``train.lora``, docs/lora.md) declares of the LoRA adapters: each
tensor's key, global shape and this rank's slice, so that a checkpoint saved on one mesh (TP, CP,
DP, EP, ETP) loads on another, and the distributed optimizer's ``fully_reshardable`` state (which
takes every parameter's declaration from this dict) follows the adapters.

- An adapter of a dense linear (or of KDA's duplicated raw weight): its A and B by their
  ``tensor_model_parallel`` / ``partition_dim`` marks over the TP group; megatron's linears would
  declare their child's tensors replicated. B of a gated MLP's ``linear_fc1`` holds each TP
  rank's gate rows, then its up rows (as the weight): declared as megatron declares that weight
  (``apply_swiglu_sharded_factory``: two halves, each split over TP).
- A routed expert's own adapter (``share_expert_adapters=false``): as megatron's SequentialMLP
  declares the expert's weights. Keyed by layer and kind (``...mlp.experts.experts.linear_fc1.
  lora.A``, megatron's key of the weight with ``.lora.A``), with a leading axis of the global
  experts on which this rank's expert ``E = ep_rank x E/ep + I`` sits, split over ETP by its
  marks, and replicated over the expert-data-parallel group (replica ids (0, ETP replica,
  expert-DP rank)). So expert E's adapter is found by its global index at any EP size.
- A MoE layer's shared expert adapter (``SharedExpertAdapter``): whole and the same on every
  rank, one key per layer and kind (``...mlp.experts.linear_fc1.lora.A``), replicated (replica ids
  over the dense TP and DP x CP groups: one rank writes it).

The state dict's own keys stay the parameters' names on this rank (``...local_experts.I...``):
what ``load_state_dict`` takes back after ``dist_checkpointing.load``.
"""

from __future__ import annotations

import re

import torch
from megatron.core.transformer.mlp import MLP, apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ..lora.adapter import LoRAAdapter, SharedExpertAdapter

_EXPERT_ADAPTER = re.compile(
    r"^(?P<experts>.*\.experts)\.local_experts\.(?P<i>\d+)\.(?P<fc>linear_fc[12])\.lora$")
"""The adapter of local expert I's linear in megatron's SequentialMLP ``...mlp.experts``."""


def adapter_sharded_state(model: torch.nn.Module, metadata: dict, tp_group=None) -> dict:
    """The adapters' sharded state dict (``metadata["dp_cp_group"]``: the dense DP x CP group),
    keyed by this rank's parameter names, declared as the module docstring says. ``tp_group`` is
    unused (each adapter knows its own group); kept for the callers' signature."""
    del tp_group
    out: dict = {}
    modules = dict(model.named_modules())
    dp_cp_group = metadata["dp_cp_group"]
    for name, module in modules.items():
        if isinstance(module, SharedExpertAdapter):
            out.update(_declared(module, name, name, (), module.tp_group, dp_cp_group))
        elif isinstance(module, LoRAAdapter):
            out.update(_adapter_state(module, name, modules, dp_cp_group))
    return out


def _adapter_state(adapter: LoRAAdapter, name: str, modules: dict, dp_cp_group) -> dict:
    """One ``LoRAAdapter``'s declaration: a dense linear's over TP, a routed expert's by its
    global expert over EP x ETP (megatron's SequentialMLP.sharded_state_dict)."""
    expert = _EXPERT_ADAPTER.match(name) if adapter.expert else None
    offsets: tuple = ()
    if expert is None:
        declared = _declared(adapter, name, name, offsets, adapter.tp_group, dp_cp_group)
    else:
        experts = modules[expert["experts"]]  # megatron's SequentialMLP
        local = experts.num_local_experts
        e = experts.ep_group.rank() * local + int(expert["i"])
        offsets = ((0, e, experts.ep_group.size() * local),)
        key = f"{expert['experts']}.experts.{expert['fc']}.lora"
        # replicated over the expert-DP group, as megatron's replica ids of expert weights
        declared = _declared(adapter, name, key, offsets, adapter.tp_group, experts.dp_group)
    mlp = modules.get(name.removesuffix(".linear_fc1.lora"))  # not an MLP for other linears
    if isinstance(mlp, MLP) and mlp.config.gated_linear_unit:
        b = f"{name}.B"
        declared[b] = apply_swiglu_sharded_factory(declared[b], offsets, tp_group=adapter.tp_group,
                                                   dp_group=dp_cp_group)
    return declared


def _declared(adapter: torch.nn.Module, name: str, key: str, offsets: tuple, tp_group,
              replica_group) -> dict:
    """``adapter``'s A and B as sharded tensors keyed ``{key}.A`` / ``{key}.B`` (dict keys
    ``{name}.A`` / ``{name}.B``), after the leading ``offsets`` (a global expert's axis), split
    over ``tp_group`` by their marks and replicated over ``replica_group``."""
    params = {"A": adapter.A, "B": adapter.B}
    tp_axes = {n: p.partition_dim for n, p in params.items()
               if getattr(p, "tensor_model_parallel", False)}
    declared = make_sharded_tensors_for_checkpoint(params, f"{key}.", tp_axes, offsets,
                                                   tp_group=tp_group, dp_cp_group=replica_group)
    return {f"{name}.{n}": declared[f"{key}.{n}"] for n in params}


def whole_adapter_count(model: torch.nn.Module) -> tuple[int, int]:
    """(tensors, elements) of the whole model's adapters, the same on every mesh: TP/ETP shards
    joined (a marked factor times its group's size), every EP rank's routed experts (a rank's
    per-expert adapters times EP: every EP rank holds as many experts), a shared expert adapter
    once (it is whole on every rank). Local, no collective."""
    tensors = elements = 0
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not isinstance(module, (LoRAAdapter, SharedExpertAdapter)):
            continue
        expert = _EXPERT_ADAPTER.match(name) if isinstance(module, LoRAAdapter) else None
        ep = 1 if expert is None else modules[expert["experts"]].ep_group.size()
        for p in (module.A, module.B):
            split = getattr(p, "tensor_model_parallel", False)
            tensors += ep
            elements += ep * p.numel() * (module.tp_group.size() if split else 1)
    return tensors, elements
