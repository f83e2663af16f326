"""Rank-side code of the KDA CP parity tests (runs inside spawned ranks).

The comparison itself is the package's ``kda.parity.check_exchange``; this file names the cases,
builds their recipes and batches, and injects the layout bugs of the negative controls.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

SBHD_TOKENS, SBHD_BATCH = 96, 2
THD_LENGTHS = (40, 16, 72, 8)  # uneven; each divides by 2*cp for cp in (1, 2, 4)
# Contiguous layout only: a sequence shorter than the conv halo, and pieces cut anywhere.
THD_SHORT_LENGTHS = (40, 2, 14, 72, 8)
# How long a rank waits in a mesh collective for a peer before its case fails. A case takes
# seconds; the wait ends only a case whose peer raised before reaching the collective.
CASE_TIMEOUT_S = 300


@dataclass(frozen=True)
class Setup:
    """Where and how a parity run computes: CPU fp32 with our torch KDA, or CUDA with fla."""

    device: str = "cpu"
    dtype: str = "float32"
    kernel: str = "torch"
    hidden: int = 32
    heads: int = 8
    head_dim: int = 16
    low_rank: int = 8


CPU = Setup()


@dataclass(frozen=True)
class Case:
    exchange: str
    tp: int
    cp: int
    sequence_parallel: bool
    fmt: str  # "sbhd", "sbhd8" (8x longer sequences), "thd" or "thd_short"
    corrupt: str | None = None  # negative controls, see run_case
    layout: str = "zigzag"  # how the model lays tokens over CP ranks

    @property
    def id(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        bad = f"-{self.corrupt}" if self.corrupt else ""
        lay = "" if self.layout == "zigzag" else f"-{self.layout}"
        return f"{self.exchange}-tp{self.tp}{sp}-cp{self.cp}-{self.fmt}{lay}{bad}"


def recipe_for(case: Case, setup: Setup, tokens: int):
    from skyrl_megatron_kda.config import MeshRecipe

    return MeshRecipe(
        model={"hidden_size": setup.hidden, "params_dtype": setup.dtype},
        parallel={"tp": case.tp, "cp": case.cp, "sequence_parallel": case.sequence_parallel,
                  "cp_layout": case.layout},
        kda={"cp_exchange": case.exchange, "kernel": setup.kernel,
             "num_heads": setup.heads,
             "head_dim": setup.head_dim, "gate_low_rank": setup.low_rank,
             "output_gate_low_rank": setup.low_rank},
        data={"seq_len": tokens},
    )


def batch_for(fmt: str, setup: Setup):
    from skyrl_megatron_kda.kda.parity import make_batch

    dtype = getattr(torch, setup.dtype)
    if fmt.startswith("sbhd"):
        tokens = SBHD_TOKENS * (8 if fmt == "sbhd8" else 1)
        return make_batch(setup.hidden, tokens=tokens, batch=SBHD_BATCH, device=setup.device, dtype=dtype)
    lengths = THD_SHORT_LENGTHS if fmt == "thd_short" else THD_LENGTHS
    return make_batch(setup.hidden, lengths=lengths, device=setup.device, dtype=dtype)


def _contiguous_rows(cu_seqlens, cp, tp, cp_rank, tp_rank, sequence_parallel, kind):
    """The layout bug a CP test must catch: plain contiguous CP shards instead of zigzag."""
    rows = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device).view(cp, -1)[cp_rank]
    return rows.chunk(tp)[tp_rank] if sequence_parallel else rows


def _chain_in_rank_order(M, L, cp, cp_rank, kind):
    """The state-passing bug: chain back pieces in ascending instead of descending rank order."""
    M, L = M.clone(), L.clone()
    P = M.shape[1]
    for t in (M, L):
        backs = t.view((cp, P // 2, 2) + t.shape[2:])[:, :, 1]
        backs.copy_(backs.flip(0))
    return _saved_chain(M, L, cp, cp_rank, kind)


_saved_chain = None


def run_case(case: Case, tp_group, cp_group, single_group, setup: Setup = CPU):
    """Negative controls (``case.corrupt``): ``contiguous_shards`` feeds plain contiguous CP
    shards; ``skip_reorder`` leaves exchanged rows out of natural order; ``chain_order`` composes
    back pieces in the wrong order; ``no_halo`` drops the conv halo of the state exchange;
    ``crash_rank0`` raises on rank 0 alone while its peers enter the exchange (a crashing
    configuration, for the test that one crash fails only its own case)."""
    global _saved_chain
    from skyrl_megatron_kda.kda import parity
    from skyrl_megatron_kda.kda import state_pieces as state
    from skyrl_megatron_kda.distributed.cp_layout import RowOrder

    if case.corrupt == "crash_rank0" and dist.get_rank() == 0:
        raise RuntimeError(f"{case.id}: deliberate crash on rank 0")
    batch = batch_for(case.fmt, setup)
    recipe = recipe_for(case, setup, batch.x.shape[0])
    saved = parity.rank_rows, RowOrder.apply, state.chain_entry_states, state.halo_rows
    _saved_chain = state.chain_entry_states
    if case.corrupt == "contiguous_shards":
        parity.rank_rows = _contiguous_rows
    elif case.corrupt == "skip_reorder":
        RowOrder.apply = lambda order, rows: rows  # rows stay in the order they arrived
    elif case.corrupt == "chain_order":
        state.chain_entry_states = _chain_in_rank_order
    elif case.corrupt == "no_halo":
        state.halo_rows = lambda tails, plan: saved[3](tails, plan) * 0
    try:
        return parity.check_exchange(recipe, batch, tp_group, cp_group, single_group)
    finally:
        parity.rank_rows, RowOrder.apply, state.chain_entry_states, state.halo_rows = saved


def mesh_groups(rank: int, meshes, timeout_s: float = CASE_TIMEOUT_S):
    """TP and CP groups of every (tp, cp) mesh on ranks 0..tp*cp-1 (Megatron order: TP fastest).

    Every rank must create every group (gloo), so all meshes are built up front."""
    mine = {}
    timeout = timedelta(seconds=timeout_s)
    for tp, cp in meshes:
        tp_groups = [dist.new_group([c * tp + t for t in range(tp)], timeout=timeout) for c in range(cp)]
        cp_groups = [dist.new_group([c * tp + t for c in range(cp)], timeout=timeout) for t in range(tp)]
        if rank < tp * cp:
            mine[(tp, cp)] = (tp_groups[rank // tp], cp_groups[rank % tp])
    return mine


@dataclass(frozen=True)
class CaseFailure:
    """What a rank reports for a case that raised on it, in place of its ParityResult."""

    rank: int
    error: str  # the traceback


def parity_matrix(rank: int, world: int, cases: list[Case], setup: Setup = CPU,
                  timeout_s: float = CASE_TIMEOUT_S):
    """{case id: ParityResult or CaseFailure} of the cases whose mesh holds this rank.

    A case that raises is recorded for that case alone and the matrix goes on: a peer left waiting
    in a collective fails its wait after ``timeout_s``, and the failed case's mesh gets fresh
    groups, since a collective one rank skipped leaves the old groups out of step."""
    meshes = sorted({(c.tp, c.cp) for c in cases})
    groups = mesh_groups(rank, meshes, timeout_s)
    singles = [dist.new_group([r]) for r in range(world)]
    results = {}
    for case in cases:
        failed = torch.zeros(1)
        if rank < case.tp * case.cp:
            tp_group, cp_group = groups[(case.tp, case.cp)]
            try:
                results[case.id] = run_case(case, tp_group, cp_group, singles[rank], setup)
            except Exception:  # noqa: BLE001 - reported as this case's outcome
                results[case.id] = CaseFailure(rank, traceback.format_exc())
                failed += 1
        dist.all_reduce(failed)  # also the barrier between cases
        if failed.item():
            groups.update(mesh_groups(rank, [(case.tp, case.cp)], timeout_s))
    return results


def merge_ranks(per_rank: list[dict]) -> dict[str, list]:
    """{case id: [outcome of each rank of its mesh]} from ``parity_matrix``'s per-rank results."""
    merged = {}
    for rank_results in per_rank:
        for case_id, outcome in rank_results.items():
            merged.setdefault(case_id, []).append(outcome)
    return merged


def case_results(merged: dict[str, list], case: Case) -> list:
    """The ParityResults of ``case`` on every rank; fails the calling test, with each failing
    rank's traceback, when the case raised."""
    outcomes = merged[case.id]
    failures = [o for o in outcomes if isinstance(o, CaseFailure)]
    if failures:
        raise AssertionError(f"case {case.id} raised\n" + "\n".join(
            f"rank {f.rank}:\n{f.error}" for f in failures))
    return outcomes


def saved_bytes(fn, exclude=()) -> tuple[object, int]:
    """``fn()`` and the bytes of the distinct storages autograd saves for its backward, the
    storages of the ``exclude`` tensors (parameters) left out: the activation memory held
    between forward and backward."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _layer_saved_bytes(layer, x: torch.Tensor) -> int:
    return saved_bytes(lambda: layer(x.clone().requires_grad_()), list(layer.parameters()))[1]


def saved_activation_bytes(rank: int, world: int, exchanges: tuple[str, ...], setup: Setup, tokens: int):
    """Activation bytes one KDA layer keeps for backward on this rank, per exchange at CP=world
    (TP1), and for the CP=1 layer on the whole sequence."""
    from skyrl_megatron_kda.kda import parity
    from skyrl_megatron_kda.distributed.cp_layout import rank_rows

    cp_group = dist.new_group(list(range(world)))
    single = [dist.new_group([r]) for r in range(world)][rank]
    batch = parity.make_batch(setup.hidden, tokens=tokens)
    rows = rank_rows(batch.cu_seqlens, world, 1, rank, 0, False)
    torch.manual_seed(0)
    result = {}
    for name in exchanges:
        recipe = recipe_for(Case(name, 1, world, False, "sbhd"), setup, tokens)
        result[name] = _layer_saved_bytes(parity.build_layer(recipe, single, cp_group, on_cpu=True), batch.x[rows])
    recipe = recipe_for(Case("a2a", 1, 1, False, "sbhd"), setup, tokens)
    result["cp1"] = _layer_saved_bytes(parity.build_layer(recipe, single, single, on_cpu=True), batch.x)
    return result
