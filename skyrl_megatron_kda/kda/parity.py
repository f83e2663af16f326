"""Check a KDA CP exchange against CP=1 on the live mesh.

Runs inside every rank of a (tp, cp) mesh: builds a CP=1/TP=1 reference layer and the sharded
layer from the same full weights, feeds both the same global batch (the sharded one in Megatron's
zigzag CP layout, SP-sliced) and reports relative errors of outputs, input grads and param grads
(CP-summed, TP-gathered), plus the bytes the exchange counted next to the analytic model. The CLI
demo, the CPU test suite and the GPU tests all use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection

from ..config import MeshRecipe
from ..distributed.cp_layout import rank_rows
from ..distributed.tensor_parallel import gather_full_grads, load_full_state
from ..megatron_config import transformer_config
from . import exchanges
from .exchanges import CommLedger, ExchangeShape
from .layer import KDASubmodules, KimiDeltaAttention


def fp32_tolerance(exchange: str) -> float:
    """Relative tolerance against CP=1 in fp32: summation order only for the exact exchanges;
    the fp32 state chain of ``state``, whose error on the CPU test shapes sits well inside
    1e-4."""
    return 1e-5 if exchanges.get(exchange).exact else 1e-4


@dataclass
class ParityResult:
    """Max relative error per tensor on this rank, and bytes moved per group and pass."""

    errors: dict[str, float] = field(default_factory=dict)
    measured_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    model_bytes: dict[str, int] = field(default_factory=dict)  # forward, per group
    model_bytes_bwd: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Batch:
    """One global batch: [T, b, D] rows in natural order, and packed boundaries for THD."""

    x: torch.Tensor
    grad_out: torch.Tensor
    cu_seqlens: torch.Tensor
    packed: PackedSeqParams | None


def make_batch(hidden: int, *, lengths: tuple[int, ...] | None = None, tokens: int = 0,
               batch: int = 1, device="cpu", dtype=torch.float32, seed: int = 99) -> Batch:
    """[s, b, h] batch of ``batch`` sequences of ``tokens``, or packed THD of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        cu, packed = torch.tensor([0, tokens], device=device), None
    else:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        tokens, batch = int(cu[-1]), 1
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    x = torch.randn(tokens, batch, hidden, generator=gen).to(device, dtype)
    grad_out = torch.randn(tokens, batch, hidden, generator=gen).to(device, dtype)
    return Batch(x, grad_out, cu, packed)


def build_layer(recipe: MeshRecipe, tp_group, cp_group, *, on_cpu: bool, ledger=None):
    """A KDA layer for ``recipe`` on the given groups (random init on CPU only)."""
    return KimiDeltaAttention(
        transformer_config(recipe, use_cpu=on_cpu, initialize=on_cpu), KDASubmodules(),
        layer_number=1, kda=recipe.kda, cp_layout=recipe.parallel.cp_layout,
        pg_collection=ProcessGroupCollection(tp=tp_group, cp=cp_group), ledger=ledger,
    )


def _single_rank(recipe: MeshRecipe, **kda_changes) -> MeshRecipe:
    return recipe.model_copy(update={
        "parallel": recipe.parallel.model_copy(update={"tp": 1, "cp": 1, "sequence_parallel": False}),
        "kda": recipe.kda.model_copy(update={"cp_exchange": "a2a", **kda_changes}),
    })


def reference_weights(recipe: MeshRecipe, group, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Full (TP=1) fp32 weights initialised on CPU from ``seed``: identical on every rank."""
    torch.manual_seed(seed)
    ref = _single_rank(recipe, kernel="torch")
    ref = ref.model_copy(update={"model": ref.model.model_copy(update={"params_dtype": "float32"})})
    layer = build_layer(ref, group, group, on_cpu=True)
    with torch.no_grad():  # break the symmetry of the default (all-ones) norm weight
        layer.o_norm_weight.add_(0.1 * torch.randn(layer.o_norm_weight.shape))
    return {n: p.detach().clone() for n, p in layer.named_parameters()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_exchange(recipe: MeshRecipe, batch: Batch, tp_group, cp_group, single_group) -> ParityResult:
    """Compare this mesh's layer with a CP=1/TP=1 layer on the same weights and batch."""
    on_cpu = batch.x.device.type == "cpu"
    full_state = reference_weights(recipe, single_group)
    ref = build_layer(_single_rank(recipe), single_group, single_group, on_cpu=on_cpu)
    load_full_state(ref, full_state, 0, 1)
    x_ref = batch.x.clone().requires_grad_()
    out_ref, _ = ref(x_ref, packed_seq_params=batch.packed)
    (out_ref * batch.grad_out).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    par = recipe.parallel
    ledger = CommLedger()
    layer = build_layer(recipe, tp_group, cp_group, on_cpu=on_cpu, ledger=ledger)
    load_full_state(layer, full_state, tp_group.rank(), par.tp)
    rows = rank_rows(batch.cu_seqlens, par.cp, par.tp, cp_group.rank(), tp_group.rank(),
                     par.sequence_parallel, par.cp_layout)
    x = batch.x[rows].clone().requires_grad_()
    out, _ = layer(x, packed_seq_params=batch.packed)
    (out * batch.grad_out[rows]).sum().backward()

    result = ParityResult()
    for name, grad in gather_full_grads(layer, tp_group).items():
        dist.all_reduce(grad, group=cp_group)  # the DP x CP gradient reduction
        result.errors[f"grad.{name}"] = relative_error(grad, ref_grads[name])
    result.errors["out"] = relative_error(out.detach(), out_ref.detach()[rows])
    result.errors["dx"] = relative_error(x.grad, x_ref.grad[rows])
    result.measured_bytes = ledger.as_dict()
    tokens, b = batch.x.shape[:2]
    shape = ExchangeShape.of(recipe, tokens=tokens, batch=b, element_size=batch.x.element_size(),
                             sequences=batch.cu_seqlens.numel() - 1)
    exchange = exchanges.get(recipe.kda.cp_exchange)
    result.model_bytes = exchange.bytes_moved(shape)
    result.model_bytes_bwd = exchange.backward_bytes(shape)
    return result
