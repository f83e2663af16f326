"""LoRA on a built model (docs/lora.md): ``apply_lora`` hangs an adapter (``lora.adapter``) on each
linear a target list selects (``lora.names``), ``merge_lora`` folds them back.

The adapter hangs on the linear as its child ``lora`` with a forward hook, so the base keeps its
parameter names (``q_proj.weight``) and the adapter's are ``q_proj.lora.A`` and ``q_proj.lora.B``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from ..lora.adapter import LoRAAdapter, LoRAWeightSlot, initial_a
from ..lora.names import REFUSED, WEIGHT_READ_DIRECTLY, expand, matches


def _add_delta(linear, args, kwargs, output):
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + linear.lora.delta(x), bias


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
    nothing, the LM head and a routed expert's linear."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    patterns, excluded = expand(targets), expand(exclude_modules)
    linears = _linears(model)
    chosen = [n for n in linears if matches(n, patterns) and not matches(n, excluded)]
    if not chosen:
        raise ValueError(f"lora target_modules={targets} select no linear of the model")
    for name in chosen:
        last = name.rsplit(".", 1)[-1]
        if last in REFUSED:
            raise ValueError(f"lora target {name}: not supported, {REFUSED[last]}")
        if getattr(linears[name], "is_expert", False):
            raise ValueError(f"lora target {name}: adapters on routed experts are not supported "
                             "yet; exclude_modules=['*.experts.*'] leaves them out")
        if getattr(linears[name], "gather_output", False):
            raise ValueError(f"lora target {name}: a column-parallel linear gathering its output")
    return chosen


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float = 16.0, dropout: float = 0.0,
               target_modules: Sequence[str] | str = "all-linear",
               exclude_modules: Sequence[str] = (), seed: int = 0,
               init_method: str = "kaiming") -> list[str]:
    """Freeze every parameter of ``model`` and hang an adapter on each targeted linear (see
    ``lora_targets``; A drawn by ``init_method``, ``lora.adapter.initial_a``); returns the adapted linears'
    names. Call before megatron's DDP wraps the model, so that its buffers and the optimizer
    hold the adapters only."""
    if rank < 1:
        raise ValueError(f"lora rank={rank} must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora dropout={dropout} must be in [0, 1)")
    chosen = lora_targets(model, target_modules, exclude_modules)
    modules = dict(model.named_modules())
    for name in chosen:
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
        if hasattr(linear, "lora") or isinstance(linear, LoRAWeightSlot):
            raise ValueError(f"{name} already has a LoRA adapter")
        in_features = linear.input_size
        full_a = initial_a(name, rank, in_features, seed, init_method)
        linear.lora = LoRAAdapter(linear, rank, alpha, dropout, full_a)
        linear._lora_hook = linear.register_forward_hook(_add_delta, with_kwargs=True)
    return chosen


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
