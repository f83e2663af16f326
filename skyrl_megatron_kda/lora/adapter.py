"""LoRA adapters on megatron-core's tensor-parallel linears, and the adapted weight that a layer
reading a linear's weight takes instead (docs/lora.md).

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

Where the model reads a linear's weight instead of calling it (KDA's input projections, DSA's
``kv_b`` and the ``tp_split=sequence`` rows path), it reads ``adapted_weight(linear)``: the
autograd expression ``W + (alpha/r) B A`` of the rank's shard, the duplicated factor entering
through ``copy_to_tensor_model_parallel_region`` (its gradient summed over TP), or ``W`` itself
without an adapter. KDA's raw low-rank weights (``f_a_weight``, ``g_a_weight``: HF's ``f_a_proj``
and ``g_a_proj``, duplicated over TP) take adapters under those linear names
(``adapted_raw_weight``); their reader completes the gradient over TP.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


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
            tp_split(self.B, dim=0)
        elif self.split == "row":  # A split by input columns, as the base weight
            tp_split(self.A, dim=1)
        # A routed expert's linear (its tp_group is the expert-TP group): the dispatcher moves
        # its rows (``explicit_expert_comm``), and its parameters are expert parameters, as
        # megatron marks the expert's weight: ``allreduce = False`` makes DDP reduce their
        # gradients over the expert-data-parallel group and the distributed optimizer shard
        # their state there (the grad norm takes them once per expert-TP group).
        self.expert = bool(getattr(linear, "is_expert", False))
        if self.expert:
            self.A.allreduce = self.B.allreduce = False

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
        if self.expert:
            # The dispatcher gathers the expert's rows over ETP and sums its ETP partial outputs
            # (and, backward, the input's partial gradients): the adapter gives partials as the
            # base does, and only the factor every ETP rank holds whole sums its gradient.
            if tp > 1 and self.column:
                a_weight = copy_to_tensor_model_parallel_region(a_weight, group=group)
            elif tp > 1:
                b_weight = copy_to_tensor_model_parallel_region(b_weight, group=group)
            return F.linear(F.linear(x, a_weight), b_weight) * self.scaling
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


class SharedExpertAdapter(torch.nn.Module):
    """One adapter shared by every routed expert's ``linear_fc1`` (or ``linear_fc2``) of a MoE
    layer, on every EP rank (``train.lora.share_expert_adapters``). A [r, in] and B [out, r] are
    whole on every rank (the expert's whole in/out: fc1 [2F, D] with B's rows gate then up, fc2
    [D, F]); each expert linear uses the rows or columns of its ETP shard (``local``): B's rows of
    a column-parallel fc1 ([gate shard; up shard], as its weight), A's columns of a row-parallel
    fc2. Each rank's gradient is its own tokens' part, with no exchange inside autograd (the
    dispatcher sums the partial outputs and input gradients over ETP, as the base's); the whole
    gradient is the sum over every rank: DDP's over DP x CP (a dense parameter), and megatron's
    ``finalize_model_grads`` over TP (the ``sequence_parallel`` mark, set where TP > 1: the
    dense TP ranks hold distinct rows under SP). Held by a ``LoRAWeightSlot``-like holder
    ``experts.linear_fc1`` so its parameters are ``...mlp.experts.linear_fc1.lora.A`` / ``.B``
    and registered once; the expert linears' hooks reference it."""

    def __init__(self, split: str, out_features: int, rank: int, alpha: float,
                 full_a: torch.Tensor, etp_group, tp_group, *, glu: bool,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.split, self.glu, self.etp_group = split, glu, etp_group
        # The dense TP group: A and B are whole and the same on every rank, a replica per TP
        # rank as any TP-duplicated dense parameter (what a checkpoint declares them by).
        self.tp_group = tp_group
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.A = torch.nn.Parameter(full_a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        if tp_group.size() > 1:  # partial over the TP ranks' rows: finalize_model_grads sums
            self.A.sequence_parallel = self.B.sequence_parallel = True

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) as this rank's expert shard uses them: A's ETP columns (row-parallel fc2), B's
        ETP rows (column-parallel fc1: [gate shard; up shard] under a gated unit)."""
        a, b = self.A, self.B
        etp, j = self.etp_group.size(), self.etp_group.rank()
        if etp == 1:
            return a, b
        if self.split == "row":
            return a.chunk(etp, dim=1)[j], b
        if self.glu:
            gate, up = b.chunk(2, dim=0)
            return a, torch.cat([gate.chunk(etp, dim=0)[j], up.chunk(etp, dim=0)[j]])
        return a, b.chunk(etp, dim=0)[j]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha/r) B A x on this rank's expert shard: a partial output, as the base's."""
        a, b = self.local()
        return F.linear(F.linear(x, a), b) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """This rank's expert weight shard of (alpha/r) B A, in fp32."""
        a, b = self.local()
        return (b.float() @ a.float()) * self.scaling


class SharedExpertSlot(torch.nn.Module):
    """Holds a ``SharedExpertAdapter`` as its child ``lora`` under a MoE layer's experts, named as
    the linear kind it adapts (``experts.linear_fc1``). Made by ``apply_lora``, removed by
    ``merge_lora``."""

    def __init__(self, adapter: SharedExpertAdapter):
        super().__init__()
        self.lora = adapter


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


def tp_split(param: torch.Tensor, dim: int) -> None:
    # megatron's marks of a TP-split parameter (checkpoints and grad-norm reductions read them)
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def initial_a(name: str, rank: int, in_features: int, seed: int,
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
