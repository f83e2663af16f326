"""LoRA adapters on megatron-core's tensor-parallel linears (docs/lora.md).

An adapter adds ``(alpha/r) * B @ A`` to a frozen linear's weight W [out, in] without forming
it: ``y = base(x) + (alpha/r) * B(A(dropout(x)))``, A [r, in], B [out, r], B zero at the start so
the adapted model begins as the base. Each adapter is split as its base weight is under TP:

- column-parallel (W split by output rows): A whole on every rank, B split by output rows. A runs
  on the rank's rows (its sequence share under SP); the r-wide product is all-gathered over the
  sequence under SP, then the rank's B shard gives its output shard, as the base's.
- row-parallel (W split by input columns): A split by input columns, B whole. A's r-wide partial
  products are summed over TP as the base's output is (all-reduce, or reduce-scatter to the
  sequence shards under SP), then B runs on every rank.

Gradients of the pieces every TP rank holds whole are completed inside autograd, so that they are
equal on every TP rank without the trainer's grad finalisation: the r-wide product's gradient is
all-reduced (column, no SP), or the duplicated factor's own gradient is (A of a column linear
under SP, B of a row linear under SP: each rank saw only its sequence share).

The adapter hangs on the linear as its child ``lora`` with a forward hook, so the base keeps its
parameter names (``q_proj.weight``) and the adapter's are ``q_proj.lora.A`` and ``q_proj.lora.B``.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

# SkyRL's (megatron's) module names, each mapped onto the last name component of ours: the
# KDA layer plays megatron's gated-delta-net (``in_proj`` / ``out_proj``), MLA its attention
# (``linear_qkv`` / ``linear_proj``); the dense MLP and the shared experts use megatron's names.
SKYRL_NAMES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                   "linear_kv_down_proj"),
    "linear_proj": ("linear_proj",),
    "linear_fc1": ("linear_fc1",),
    "linear_fc2": ("linear_fc2",),
    "in_proj": ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj"),
    "out_proj": ("o_proj",),
}
# What "all-linear" adapts: every name above whose linears the model calls. ``in_proj`` is left
# out until KDA's projection takes adapted weights (it reads head slices of the weights itself).
ALL_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "out_proj")

_KDA_PROJECTION = "KDA's projection reads head slices of its weight (kda/layer.py, project)"
# Linears whose weight the model reads directly instead of calling them: an adapter on their
# forward would never run.
WEIGHT_READ_DIRECTLY = {
    **{name: _KDA_PROJECTION for name in SKYRL_NAMES["in_proj"]},
    "linear_kv_up_proj": "DSA's kernels take its weight to expand the KV latent",
    "output_layer": "the LM head reads its weight (chunked log-probs, tied embeddings)",
}


class LoRAAdapter(torch.nn.Module):
    """The adapter of one column- or row-parallel linear: this rank's A and B shards, the scale
    ``alpha / rank`` and the input dropout. ``delta(x)`` is the adapter's part of the linear's
    output, in the layout of that output."""

    def __init__(self, linear: ColumnParallelLinear | RowParallelLinear, rank: int, alpha: float,
                 dropout: float, full_a: torch.Tensor):
        super().__init__()
        self.column = isinstance(linear, ColumnParallelLinear)
        self.tp_group = linear.tp_group
        self.sequence_parallel = bool(linear.sequence_parallel)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        weight = linear.weight
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        a = full_a if self.column else full_a.chunk(tp, dim=1)[tp_rank]
        if a.shape[1] != weight.shape[1]:
            raise ValueError(f"A's input width {a.shape[1]} differs from the base's "
                             f"{weight.shape[1]}")
        self.A = torch.nn.Parameter(a.to(weight.dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype,
                                                device=weight.device))
        if self.column:  # B split by output rows, as the base weight
            _tp_split(self.B, dim=0)
        else:  # A split by input columns, as the base weight
            _tp_split(self.A, dim=1)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha/r) B A dropout(x) for the linear's input ``x`` [s(/tp), b, in(/tp)] -> its output
        layout [s, b, out/tp] (column) or [s(/tp), b, out] (row)."""
        x = self.dropout(x)
        group, tp = self.tp_group, self.tp_group.size()
        a_weight, b_weight = self.A, self.B
        if self.column:
            if tp > 1 and self.sequence_parallel:
                a_weight = copy_to_tensor_model_parallel_region(a_weight, group=group)
                low = gather_from_sequence_parallel_region(F.linear(x, a_weight), group=group)
            else:
                low = F.linear(x, a_weight)
                if tp > 1:
                    low = copy_to_tensor_model_parallel_region(low, group=group)
        else:
            low = F.linear(x, a_weight)
            if tp > 1 and self.sequence_parallel:
                low = reduce_scatter_to_sequence_parallel_region(low, group=group)
                b_weight = copy_to_tensor_model_parallel_region(b_weight, group=group)
            elif tp > 1:
                low = reduce_from_tensor_model_parallel_region(low, group=group)
        return F.linear(low, b_weight) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of (alpha/r) B A, the base weight's shape, in fp32."""
        return (self.B.float() @ self.A.float()) * self.scaling


def _tp_split(param: torch.Tensor, dim: int) -> None:
    # megatron's marks of a TP-split parameter (checkpoints and grad-norm reductions read them)
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def _add_delta(linear, args, kwargs, output):
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + linear.lora.delta(x), bias


def _needs_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_(True)
    return output


def _full_a(name: str, rank: int, in_features: int, seed: int,
            init_method: str = "kaiming") -> torch.Tensor:
    """A's whole [r, in] initial value, from a generator seeded by ``seed`` and the module name,
    so the adapter is the same at every TP size: uniform in +-bound, peft's kaiming-uniform
    (a = sqrt(5): bound 1/sqrt(in)) or xavier-uniform (bound sqrt(6/(in + rank)))."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if init_method == "kaiming":
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_ with a=sqrt(5) on fan_in
    elif init_method == "xavier":
        bound = math.sqrt(6.0 / (in_features + rank))  # xavier_uniform_ on [rank, in]
    else:
        raise ValueError(f"lora init_method={init_method!r} must be 'kaiming' or 'xavier'")
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1) * bound


def _expand(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        if name == "all-linear":
            out.extend(n for key in ALL_LINEAR for n in SKYRL_NAMES[key])
        else:
            out.extend(SKYRL_NAMES.get(name, (name,)))
    return out


def _matches(module_name: str, patterns: Sequence[str]) -> bool:
    """A pattern with a wildcard matches the whole dotted name, a plain one its last component."""
    last = module_name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(module_name, p) if any(c in p for c in "*?[") else last == p
               for p in patterns)


def _attends_by_rows(parent) -> bool:
    """Whether ``parent`` is a DSA layer on its rows path, which reads its linears' weights."""
    if parent is None or not hasattr(parent, "forward_by_rows"):
        return False
    return parent.kernel.dsa.attends_by_rows(parent.pg_collection.tp.size(),
                                             parent.config.sequence_parallel)


def lora_targets(model: torch.nn.Module, target_modules: Sequence[str] | str = "all-linear",
                 exclude_modules: Sequence[str] = ()) -> list[str]:
    """The names of ``model``'s linears that ``target_modules`` minus ``exclude_modules`` select
    (SkyRL's names, ours, or wildcard patterns on the dotted name); refuses a target that selects
    nothing, a linear the model never calls and a routed expert's."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    patterns, excluded = _expand(targets), _expand(exclude_modules)
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    chosen = [n for n in linears if _matches(n, patterns) and not _matches(n, excluded)]
    if not chosen:
        raise ValueError(f"lora target_modules={targets} select no linear of the model")
    modules = dict(model.named_modules())
    for name in chosen:
        last = name.rsplit(".", 1)[-1]
        if last in WEIGHT_READ_DIRECTLY:
            raise ValueError(f"lora target {name}: not supported, {WEIGHT_READ_DIRECTLY[last]}")
        if _attends_by_rows(modules.get(name.rpartition(".")[0])):
            raise ValueError(f"lora target {name}: not supported under model.dsa.tp_split=sequence "
                             "(the layer gathers this linear's weight instead of calling it)")
        if linears[name].is_expert:
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
    ``lora_targets``; A drawn by ``init_method``, ``_full_a``); returns the adapted linears'
    names. Call before megatron's DDP wraps the model, so that its buffers and the optimizer
    hold the adapters only."""
    if rank < 1:
        raise ValueError(f"lora rank={rank} must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora dropout={dropout} must be in [0, 1)")
    chosen = lora_targets(model, target_modules, exclude_modules)
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        # The layers' reentrant recompute (``train.recompute``) gives its output a gradient only
        # when an input needs one; with the embedding frozen none would, and the adapters inside
        # would get no gradient.
        embedding.register_forward_hook(_needs_grad)
    for name in chosen:
        linear = modules[name]
        if hasattr(linear, "lora"):
            raise ValueError(f"{name} already has a LoRA adapter")
        in_features = linear.input_size
        full_a = _full_a(name, rank, in_features, seed, init_method)
        linear.lora = LoRAAdapter(linear, rank, alpha, dropout, full_a)
        linear._lora_hook = linear.register_forward_hook(_add_delta, with_kwargs=True)
    return chosen


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
    for name, module in model.named_modules():
        adapter = getattr(module, "lora", None)
        if not isinstance(adapter, LoRAAdapter):
            continue
        weight = module.weight
        weight.copy_((weight.float() + adapter.delta_weight()).to(weight.dtype))
        module._lora_hook.remove()
        del module._lora_hook
        del module.lora
        merged.append(name)
    return merged
