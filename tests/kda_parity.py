"""Rank-side code of the KDA CP parity tests (runs inside spawned gloo ranks).

Every case builds a CP=1/TP=1 reference layer and the sharded layer from the same full weights,
feeds both the same global batch (the sharded one in Megatron's zigzag CP layout, SP-sliced), and
returns relative errors of outputs, input grads and param grads (CP-summed, TP-gathered) plus the
bytes each exchange counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

HIDDEN, HEADS, HEAD_DIM, LOW_RANK = 32, 8, 16, 8
SBHD_TOKENS, SBHD_BATCH = 96, 2
THD_LENGTHS = (40, 16, 72, 8)  # uneven; each divides by 2*cp for cp in (1, 2, 4)


@dataclass(frozen=True)
class Case:
    exchange: str
    tp: int
    cp: int
    sequence_parallel: bool
    fmt: str  # "sbhd" or "thd"
    corrupt: str | None = None  # negative controls: "contiguous_shards", "skip_reorder"

    @property
    def id(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        bad = f"-{self.corrupt}" if self.corrupt else ""
        return f"{self.exchange}-tp{self.tp}{sp}-cp{self.cp}-{self.fmt}{bad}"


@dataclass
class CaseResult:
    errors: dict[str, float] = field(default_factory=dict)
    measured_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    model_bytes: dict[str, int] = field(default_factory=dict)


def _recipe(case: Case, tokens: int):
    from skyrl_megatron_kda.config import LayerRecipe

    return LayerRecipe(
        model={"hidden_size": HIDDEN, "params_dtype": "float32"},
        parallel={"tp": case.tp, "cp": case.cp, "sequence_parallel": case.sequence_parallel},
        kda={"cp_exchange": case.exchange, "kernel": "torch", "num_heads": HEADS,
             "head_dim": HEAD_DIM, "gate_low_rank": LOW_RANK, "output_gate_low_rank": LOW_RANK},
        data={"seq_len": tokens},
    )


def _build(recipe, tp_group, cp_group, ledger=None):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from skyrl_megatron_kda.kda.layer import KDASubmodules, KimiDeltaAttention
    from skyrl_megatron_kda.parallel import transformer_config

    return KimiDeltaAttention(
        transformer_config(recipe, use_cpu=True), KDASubmodules(), layer_number=1,
        kda=recipe.kda, pg_collection=ProcessGroupCollection(tp=tp_group, cp=cp_group),
        ledger=ledger,
    )


def _batch(fmt: str):
    from megatron.core.packed_seq_params import PackedSeqParams

    gen = torch.Generator().manual_seed(99)
    if fmt == "sbhd":
        tokens, batch, packed = SBHD_TOKENS, SBHD_BATCH, None
        cu = torch.tensor([0, tokens])
    else:
        cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        tokens, batch = int(cu[-1]), 1
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(THD_LENGTHS), max_seqlen_kv=max(THD_LENGTHS))
    x = torch.randn(tokens, batch, HIDDEN, generator=gen)
    w_out = torch.randn(tokens, batch, HIDDEN, generator=gen)
    return x, w_out, cu, packed


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rows_of_rank(case: Case, cu, cp_rank: int, tp_rank: int) -> torch.Tensor:
    from skyrl_megatron_kda.kda.layout import zigzag_positions

    tokens = int(cu[-1])
    if case.corrupt == "contiguous_shards":  # the layout bug a CP test must catch
        rows = torch.arange(tokens).view(case.cp, -1)[cp_rank]
    else:
        rows = zigzag_positions(cu, case.cp)[cp_rank]
    if case.sequence_parallel:
        rows = rows.chunk(case.tp)[tp_rank]
    return rows


def run_case(case: Case, tp_group, cp_group, single_group) -> CaseResult:
    from skyrl_megatron_kda.kda import exchange as exchange_module
    from skyrl_megatron_kda.kda.exchange import CommLedger, ExchangeShape, EXCHANGES
    from skyrl_megatron_kda.parallel import gather_full_grads, load_full_state

    x, w_out, cu, packed = _batch(case.fmt)
    tokens, batch = x.shape[:2]
    recipe = _recipe(case, tokens)
    ref_recipe = _recipe(Case("a2a", 1, 1, False, case.fmt), tokens)

    torch.manual_seed(1234)
    ref = _build(ref_recipe, single_group, single_group)
    with torch.no_grad():  # break the symmetry of the default norm weight
        ref.o_norm_weight.add_(0.1 * torch.randn(HEAD_DIM))
    full_state = {n: p.detach().clone() for n, p in ref.named_parameters()}
    x_ref = x.clone().requires_grad_()
    out_ref, _ = ref(x_ref, packed_seq_params=packed)
    (out_ref * w_out).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    ledger = CommLedger()
    layer = _build(recipe, tp_group, cp_group, ledger)
    tp_rank, cp_rank = tp_group.rank(), cp_group.rank()
    load_full_state(layer, full_state, tp_rank, case.tp)
    rows = _rows_of_rank(case, cu, cp_rank, tp_rank)
    x_loc = x[rows].clone().requires_grad_()
    original_sort_index = exchange_module.sort_index
    if case.corrupt == "skip_reorder":  # forget to put gathered rows into natural order
        exchange_module.sort_index = lambda positions: torch.arange(positions.numel())
    try:
        out, _ = layer(x_loc, packed_seq_params=packed)
        (out * w_out[rows]).sum().backward()
    finally:
        exchange_module.sort_index = original_sort_index

    grads = gather_full_grads(layer, tp_group)
    result = CaseResult()
    for name, grad in grads.items():
        dist.all_reduce(grad, group=cp_group)  # the DP x CP gradient reduction
        result.errors[f"grad.{name}"] = _rel(grad, ref_grads[name])
    result.errors["out"] = _rel(out.detach(), out_ref.detach()[rows])
    result.errors["dx"] = _rel(x_loc.grad, x_ref.grad[rows])
    result.measured_bytes = ledger.as_dict()
    shape = ExchangeShape(tokens=tokens, batch=batch, hidden=HIDDEN, num_heads=HEADS,
                          head_dim=HEAD_DIM, tp=case.tp, cp=case.cp,
                          sequence_parallel=case.sequence_parallel, element_size=x.element_size())
    result.model_bytes = EXCHANGES[case.exchange].bytes_moved(shape)
    return result


def mesh_groups(rank: int, meshes):
    """TP and CP groups of every (tp, cp) mesh on ranks 0..tp*cp-1 (Megatron order: TP fastest).

    Every rank must create every group (gloo), so all meshes are built up front."""
    mine = {}
    for tp, cp in meshes:
        tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
        cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
        if rank < tp * cp:
            mine[(tp, cp)] = (tp_groups[rank // tp], cp_groups[rank % tp])
    return mine


def parity_matrix(rank: int, world: int, cases: list[Case]) -> dict[str, CaseResult]:
    meshes = sorted({(c.tp, c.cp) for c in cases})
    groups = mesh_groups(rank, meshes)
    singles = [dist.new_group([r]) for r in range(world)]
    results = {}
    for case in cases:
        if rank < case.tp * case.cp:
            tp_group, cp_group = groups[(case.tp, case.cp)]
            results[case.id] = run_case(case, tp_group, cp_group, singles[rank])
        dist.barrier()
    return results
