"""LoRA on a built model (docs/lora.md): ``apply_lora`` hangs an adapter (``lora.adapter``) on each
linear a target list selects (``lora.names``), ``merge_lora`` folds them back.

The adapter hangs on the linear as its child ``lora`` with a forward hook, so the base keeps its
parameter names (``q_proj.weight``) and the adapter's are ``q_proj.lora.A`` and ``q_proj.lora.B``.
Routed experts' linears (megatron's SequentialMLP, ``is_expert``) take either one adapter each
(``...experts.local_experts.{i}.linear_fc1.lora.A``, an expert parameter, A drawn from the
global expert's name) or, shared (``share_expert_adapters``), one adapter per MoE layer and kind
held by a ``SharedExpertSlot`` (``...mlp.experts.linear_fc1.lora.A``) that every local expert's
hook uses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from ..lora.adapter import (LoRAAdapter, LoRAWeightSlot, SharedExpertAdapter, SharedExpertSlot,
                            initial_a)
from ..lora.names import REFUSED, WEIGHT_READ_DIRECTLY, expand, matches


def _add_delta(linear, args, kwargs, output):
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + linear.lora.delta(x), bias


def _add_shared_delta(linear, args, kwargs, output):
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + linear.__dict__["_shared_lora"].delta(x), bias


_EXPERT = re.compile(r"^(?P<moe>.*)\.experts\.local_experts\.(?P<i>\d+)\.(?P<fc>linear_fc[12])$")
_GROUPED = ("TEGroupedMLP", "GroupedMLP")


def _expert_of(name: str) -> tuple[str, int, str] | None:
    """(the MoE layer's name, local expert index, ``linear_fc1``/``linear_fc2``) of a routed
    expert's linear in megatron's SequentialMLP, else None."""
    m = _EXPERT.match(name)
    return None if m is None else (m["moe"], int(m["i"]), m["fc"])


def expert_rank(rank: int, topk: int, normalize: bool) -> int:
    """The routed experts' adapter rank: ``rank // topk`` (at least 1) under
    ``normalize_moe_lora``, else ``rank``."""
    return max(1, rank // topk) if normalize else rank


def _needs_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_(True)
    return output


def _attends_by_rows(parent) -> bool:
    """Whether ``parent`` is a DSA layer on its rows path, which reads its linears' weights."""
    if parent is None or not hasattr(parent, "forward_by_rows"):
        return False
    return parent.kernel.dsa.attends_by_rows(parent.pg_collection.tp.size(),
                                             parent.config.sequence_parallel)


def _reads_weight(name: str, modules: dict[str, torch.nn.Module]) -> str | None:
    """Why the model reads the weight of the linear ``name`` instead of calling it, or None."""
    owner, _, last = name.rpartition(".")
    if last in WEIGHT_READ_DIRECTLY:
        return WEIGHT_READ_DIRECTLY[last]
    if _attends_by_rows(modules.get(owner)):
        return "under model.dsa.tp_split=sequence the layer gathers its weight over TP"
    return None


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every megatron linear of ``model`` by name, and every raw weight that plays one
    (``LORA_WEIGHTS`` of its owner, e.g. KDA's ``...self_attention.f_a_proj``) with its owner."""
    out: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            out[name] = module
        for linear in getattr(module, "LORA_WEIGHTS", {}):
            out[f"{name}.{linear}" if name else linear] = module
    return out


def lora_targets(model: torch.nn.Module, target_modules: Sequence[str] | str = "all-linear",
                 exclude_modules: Sequence[str] = ()) -> list[str]:
    """The names of ``model``'s linears (and of the raw weights that play linears: KDA's
    ``f_a_proj``, ``g_a_proj``) that ``target_modules`` minus ``exclude_modules`` select (SkyRL's
    names, ours, or wildcard patterns on the dotted name); refuses a target that selects
    nothing, the LM head and routed experts under grouped GEMM."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    patterns, excluded = expand(targets), expand(exclude_modules)
    linears = _linears(model)
    chosen = [n for n in linears if matches(n, patterns) and not matches(n, excluded)]
    for name, module in model.named_modules():
        grouped = type(module).__name__ in _GROUPED
        kinds = (f"{name}.linear_fc1", f"{name}.linear_fc2")
        if grouped and any(matches(k, patterns) and not matches(k, excluded) for k in kinds):
            raise ValueError(f"lora target {name}: routed experts under grouped GEMM "
                             f"({type(module).__name__}) take no adapter; model/moe.py builds "
                             "SequentialMLP experts with moe_grouped_gemm=False")
    if not chosen:
        raise ValueError(f"lora target_modules={targets} select no linear of the model")
    for name in chosen:
        last = name.rsplit(".", 1)[-1]
        if last in REFUSED:
            raise ValueError(f"lora target {name}: not supported, {REFUSED[last]}")
        if getattr(linears[name], "is_expert", False) and _expert_of(name) is None:
            raise ValueError(f"lora target {name}: a routed expert's linear outside megatron's "
                             "SequentialMLP (experts.local_experts.N)")
        if getattr(linears[name], "gather_output", False):
            raise ValueError(f"lora target {name}: a column-parallel linear gathering its output")
    return chosen


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float = 16.0, dropout: float = 0.0,
               target_modules: Sequence[str] | str = "all-linear",
               exclude_modules: Sequence[str] = (), seed: int = 0,
               init_method: str = "kaiming", share_expert_adapters: bool = True,
               normalize_moe_lora: bool = False) -> list[str]:
    """Freeze every parameter of ``model`` and hang an adapter on each targeted linear (see
    ``lora_targets``; A drawn by ``init_method``, ``lora.adapter.initial_a``); returns the adapted linears'
    names. Call before megatron's DDP wraps the model, so that its buffers and the optimizer
    hold the adapters only. Routed experts' linears take one adapter per MoE layer and kind
    (``share_expert_adapters``) or one each, of rank ``rank // top_k`` under
    ``normalize_moe_lora`` (``expert_rank``)."""
    if rank < 1:
        raise ValueError(f"lora rank={rank} must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora dropout={dropout} must be in [0, 1)")
    chosen = lora_targets(model, target_modules, exclude_modules)
    modules = dict(model.named_modules())
    for name in chosen:
        if dropout > 0 and _expert_of(name) is not None:
            raise ValueError(f"lora dropout={dropout} on {name}: not supported on routed experts "
                             "(their rows' order and count depend on the dispatch, so no mask "
                             "is the same on every mesh); use dropout=0 or exclude "
                             "'*.experts.*'")
        why = _reads_weight(name, modules) if dropout > 0 else None
        if why is not None:
            raise ValueError(f"lora dropout={dropout} on {name}: not supported ({why}, so the "
                             "adapter's input cannot be dropped alone); use dropout=0")
    for param in model.parameters():
        param.requires_grad_(False)
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        # The layers' reentrant recompute (``train.recompute``) gives its output a gradient only
        # when an input needs one; with the embedding frozen none would, and the adapters inside
        # would get no gradient.
        embedding.register_forward_hook(_needs_grad)
    for name in chosen:
        linear = modules.get(name)
        if linear is None:  # a raw weight playing a linear: a slot of that name holds its adapter
            _adapt_raw_weight(modules, name, rank, alpha, dropout,
                              lambda width: initial_a(name, rank, width, seed, init_method))
            continue
        if (hasattr(linear, "lora") or "_shared_lora" in linear.__dict__
                or isinstance(linear, LoRAWeightSlot)):
            raise ValueError(f"{name} already has a LoRA adapter")
        expert = _expert_of(name)
        if expert is not None:
            _adapt_expert(modules, name, linear, expert, rank, alpha, seed, init_method,
                          share_expert_adapters, normalize_moe_lora)
            continue
        in_features = linear.input_size
        full_a = initial_a(name, rank, in_features, seed, init_method)
        linear.lora = LoRAAdapter(linear, rank, alpha, dropout, full_a)
        linear._lora_hook = linear.register_forward_hook(_add_delta, with_kwargs=True)
    return chosen


def _adapt_expert(modules, name, linear, expert, rank, alpha, seed, init_method, shared,
                  normalize) -> None:
    """A routed expert's linear: its own adapter, split under ETP as its weight and drawn from
    the global expert's name (so the adapters do not depend on EP), or a hook onto the MoE
    layer's shared adapter of that kind (made by the layer's first expert)."""
    moe_name, local, fc = expert
    moe = modules[moe_name]
    r = expert_rank(rank, moe.config.moe_router_topk, normalize)
    if not shared:
        e = moe.local_expert_indices[local]
        full_a = initial_a(f"{moe_name}.experts.local_experts.{e}.{fc}", r, linear.input_size,
                           seed, init_method)
        linear.lora = LoRAAdapter(linear, r, alpha, 0.0, full_a)
        linear._lora_hook = linear.register_forward_hook(_add_delta, with_kwargs=True)
        return
    experts = modules[f"{moe_name}.experts"]
    slot = experts._modules.get(fc)
    if slot is None:
        full_a = initial_a(f"{moe_name}.experts.{fc}", r, linear.input_size, seed, init_method)
        adapter = SharedExpertAdapter(
            "column" if isinstance(linear, ColumnParallelLinear) else "row", linear.output_size,
            r, alpha, full_a, linear.tp_group, moe.tp_group,
            glu=fc == "linear_fc1" and moe.config.gated_linear_unit,
            dtype=linear.weight.dtype, device=linear.weight.device)
        slot = SharedExpertSlot(adapter)
        setattr(experts, fc, slot)
    linear.__dict__["_shared_lora"] = slot.lora  # a reference, not a child: registered once
    linear._lora_hook = linear.register_forward_hook(_add_shared_delta, with_kwargs=True)


def _adapt_raw_weight(modules, name, rank, alpha, dropout, full_a) -> None:
    """Hang an adapter for the raw weight that plays the linear ``name`` on a ``LoRAWeightSlot``
    of that name under its owner; ``full_a(in_features)`` draws A."""
    owner_name, _, last = name.rpartition(".")
    owner = modules[owner_name]
    param_name = owner.LORA_WEIGHTS[last]
    weight = getattr(owner, param_name)
    slot = LoRAWeightSlot(param_name, weight, owner.tp_group)
    slot.lora = LoRAAdapter(slot, rank, alpha, dropout, full_a(slot.input_size), weight=weight)
    setattr(owner, last, slot)


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapters' parameters by name (``...q_proj.lora.A``): what trains and what an adapter
    checkpoint holds."""
    return {n: p for n, p in model.named_parameters() if ".lora." in f".{n}"}


@torch.no_grad()
def merge_lora(model: torch.nn.Module) -> list[str]:
    """Fold every adapter into its base weight shard (W + (alpha/r) B A, summed in fp32, cast to
    W's dtype) and remove it; the model then computes what the adapted one did without adapters.
    Returns the merged linears' names."""
    merged = []
    modules = dict(model.named_modules())
    for name, module in modules.items():  # routed experts' shared adapters
        adapter = module.__dict__.pop("_shared_lora", None)
        if adapter is None:
            continue
        module._lora_hook.remove()
        del module._lora_hook
        weight = module.weight
        weight.copy_((weight.float() + adapter.delta_weight()).to(weight.dtype))
        merged.append(name)
    for name, module in modules.items():
        if isinstance(module, SharedExpertSlot):
            owner_name, _, last = name.rpartition(".")
            delattr(modules[owner_name], last)
    for name, module in modules.items():
        adapter = module._modules.get("lora")
        if not isinstance(adapter, LoRAAdapter):
            continue
        if isinstance(module, LoRAWeightSlot):
            owner_name, _, last = name.rpartition(".")
            owner = modules[owner_name]
            weight = getattr(owner, module.param_name)
            delattr(owner, last)
        else:
            weight = module.weight
            module._lora_hook.remove()
            del module._lora_hook
            del module.lora
        weight.copy_((weight.float() + adapter.delta_weight()).to(weight.dtype))
        merged.append(name)
    return merged
