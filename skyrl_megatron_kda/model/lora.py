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

Where the model reads a linear's weight instead of calling it (KDA's input projections, DSA's
``kv_b`` and the ``tp_split=sequence`` rows path), it reads ``adapted_weight(linear)``: the
autograd expression ``W + (alpha/r) B A`` of the rank's shard, the duplicated factor entering
through ``copy_to_tensor_model_parallel_region`` (its gradient summed over TP), or ``W`` itself
without an adapter. KDA's raw low-rank weights (``f_a_weight``, ``g_a_weight``: HF's ``f_a_proj``
and ``g_a_proj``, duplicated over TP) take adapters under those linear names
(``adapted_raw_weight``); their reader completes the gradient over TP.
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
    # glm5_next's packed ``in_proj_qkvbfg_a`` (SkyRL's vLLM patch): f_a/g_a, not f_b/g_b
    "in_proj": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj"),
    "out_proj": ("o_proj",),
}
# What "all-linear" adapts: megatron's all-linear, every name above.
ALL_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")

# Linears whose weight the model reads instead of calling them: their adapter reaches the model
# through ``adapted_weight``, and input dropout (which would drop the adapter's input alone) is
# refused on them. (The ``tp_split=sequence`` rows path reads every MLA linear: ``_reads_weight``.)
_KDA_PROJECTION = "KDA's projection reads head slices of its weight (kda/layer.py, project)"
WEIGHT_READ_DIRECTLY = {
    **{name: _KDA_PROJECTION
       for name in ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj")},
    "f_a_proj": "KDA reads its low-rank f_a weight itself (kda/layer.py, project)",
    "g_a_proj": "KDA reads its low-rank g_a weight itself (kda/layer.py, project)",
    "linear_kv_up_proj": "DSA's kernels take its weight to expand the KV latent",
}
# Refused outright, with the reason.
REFUSED = {
    "output_layer": "the LM head reads its weight in the chunked log-probs (model/glm.py, "
                    "_vocab_weight) and a tied head is the embedding's",
}


class LoRAWeightSlot(torch.nn.Module):
    """Stands in the module tree, under the name of the linear it plays (KDA's ``f_a_proj``), for
    a raw weight that its layer reads itself (``f_a_weight``, duplicated over TP): holds that
    weight's adapter ``lora``, so the adapter's parameters are named as a linear's
    (``f_a_proj.lora.A``). Made by ``apply_lora``, removed by ``merge_lora``."""

    def __init__(self, param_name: str, weight: torch.Tensor, tp_group):
        super().__init__()
        self.param_name = param_name
        self.input_size = weight.shape[1]
        self.tp_group = tp_group
        self.sequence_parallel = False


class LoRAAdapter(torch.nn.Module):
    """The adapter of one column- or row-parallel linear (or of a TP-duplicated raw weight, held
    by a ``LoRAWeightSlot``): this rank's A and B shards, the scale ``alpha / rank`` and the input
    dropout. ``delta(x)`` is the adapter's part of a called linear's output, in the layout of that
    output; ``adapted(W)`` the adapted weight, for a layer that reads it."""

    def __init__(self, linear: ColumnParallelLinear | RowParallelLinear | LoRAWeightSlot,
                 rank: int, alpha: float, dropout: float, full_a: torch.Tensor,
                 weight: torch.Tensor | None = None):
        super().__init__()
        self.split = ("column" if isinstance(linear, ColumnParallelLinear)
                      else "row" if isinstance(linear, RowParallelLinear) else "duplicated")
        self.column = self.split == "column"
        self.tp_group = linear.tp_group
        self.sequence_parallel = bool(linear.sequence_parallel)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.dropout = dropout
        weight = linear.weight if weight is None else weight
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        a = full_a.chunk(tp, dim=1)[tp_rank] if self.split == "row" else full_a
        if a.shape[1] != weight.shape[1]:
            raise ValueError(f"A's input width {a.shape[1]} differs from the base's "
                             f"{weight.shape[1]}")
        self.A = torch.nn.Parameter(a.to(weight.dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(weight.shape[0], rank, dtype=weight.dtype,
                                                device=weight.device))
        if self.split == "column":  # B split by output rows, as the base weight
            _tp_split(self.B, dim=0)
        elif self.split == "row":  # A split by input columns, as the base weight
            _tp_split(self.A, dim=1)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """Input dropout, its mask drawn whole (the TP1 input's shape) from the default generator
        and cut as the input is: the same mask as at TP1, distinct on TP-distinct shards (a
        row-parallel input's columns, a column-parallel one's SP rows), equal on every TP rank
        where the input is (a column-parallel one without SP). The default generator is the
        same on every TP rank (``train.setup.seed_everything``) and replayed by torch's reentrant
        recompute, which megatron's model-parallel tracker is not (model/glm.py uses torch's)."""
        if self.dropout == 0 or not self.training:
            return x
        tp, dim = self.tp_group.size(), None
        if tp > 1 and self.split == "row":
            dim = x.dim() - 1
        elif tp > 1 and self.sequence_parallel:
            dim = 0
        shape = list(x.shape)
        if dim is not None:
            shape[dim] *= tp
        keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - self.dropout)
        if dim is not None:
            keep = keep.chunk(tp, dim)[self.tp_group.rank()]
        return x * keep / (1 - self.dropout)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha/r) B A dropout(x) for the linear's input ``x`` [s(/tp), b, in(/tp)] -> its output
        layout [s, b, out/tp] (column) or [s(/tp), b, out] (row)."""
        x = self._drop(x)
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

    def adapted(self, weight: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """``weight[rows] + (alpha/r) B[rows] A``: this rank's shard of the adapted weight (or its
        ``rows``), an autograd expression in W's dtype (one ``addmm``: the product accumulates in
        fp32 on the GPU and is rounded once with the sum). The gradient reaching it is the shard's
        whole one (the readers gather rows, or weights, over TP), so the factor every TP rank
        holds whole (A of a column-parallel linear, B of a row-parallel one) sums its gradient
        over TP; a duplicated raw weight's reader completes its gradient itself (KDA's ``_dup``)."""
        a_weight, b_weight = self.A, self.B
        if self.tp_group.size() > 1 and self.split == "column":
            a_weight = copy_to_tensor_model_parallel_region(a_weight, group=self.tp_group)
        elif self.tp_group.size() > 1 and self.split == "row":
            b_weight = copy_to_tensor_model_parallel_region(b_weight, group=self.tp_group)
        if rows is not None:
            weight, b_weight = weight[rows], b_weight[rows]
        return torch.addmm(weight, b_weight, a_weight, alpha=self.scaling)

    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of (alpha/r) B A, the base weight's shape, in fp32."""
        return (self.B.float() @ self.A.float()) * self.scaling


def adapted_weight(linear: torch.nn.Module, rows: slice | None = None) -> torch.Tensor:
    """What a layer that reads ``linear``'s weight (or its ``rows``) instead of calling it should
    read: ``W + (alpha/r) B A`` when LoRA adapts the linear, else ``linear.weight`` itself."""
    adapter = linear._modules.get("lora")
    if adapter is None:
        return linear.weight if rows is None else linear.weight[rows]
    return adapter.adapted(linear.weight, rows)


def adapted_raw_weight(owner: torch.nn.Module, name: str) -> torch.Tensor:
    """``owner``'s raw weight that plays the linear ``name`` (``owner.LORA_WEIGHTS``: KDA's
    ``f_a_proj`` -> ``f_a_weight``), adapted when ``apply_lora`` hung an adapter for it."""
    weight = getattr(owner, owner.LORA_WEIGHTS[name])
    slot = owner._modules.get(name)
    return weight if slot is None else slot.lora.adapted(weight)


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
    patterns, excluded = _expand(targets), _expand(exclude_modules)
    linears = _linears(model)
    chosen = [n for n in linears if _matches(n, patterns) and not _matches(n, excluded)]
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
    ``lora_targets``; A drawn by ``init_method``, ``_full_a``); returns the adapted linears'
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
                              lambda width: _full_a(name, rank, width, seed, init_method))
            continue
        if hasattr(linear, "lora") or isinstance(linear, LoRAWeightSlot):
            raise ValueError(f"{name} already has a LoRA adapter")
        in_features = linear.input_size
        full_a = _full_a(name, rank, in_features, seed, init_method)
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
