"""The MoE block's memory terms (model/moe_layer.py on megatron's MoELayer), under balanced
routing: what it keeps, the routed experts' share, the token dispatcher's kept tensors and
transients, and the working set of its backward, whole or in chunks of
``train.moe_chunk_tokens``.

Each of megatron-core 0.19.2's token dispatchers (``model.moe.dispatcher``, read once, in
``dispatch_terms``) moves the tokens differently, so each keeps and allocates its own tensors.
For one call on ``r`` rows of the rank's residual stream, with ``n = r etp k`` assignments
landing on the rank's ``E/ep`` experts (balanced routing; the same count for every dispatcher):

- ``allgather`` gathers every row of the EP x ETP group (``g = r ep etp`` rows, into megatron's
  global all-gather buffer) with its probabilities and routing map, and keeps the local
  experts' map and probabilities for all ``g`` rows; its combine reduce-scatters ``[g, D]`` in
  the probabilities' dtype (fp32).
- ``alltoall`` sends only the routed rows: its permutation keeps an argsort of the rank's whole
  ``[E, r]`` routing map (the probabilities' index is a view of it) and one token index per
  assignment sent; the ``r k`` sent rows are exchanged over EP and all-gathered over ETP into
  ``n`` rows (fresh tensors, not the global buffer); its combine reduce-scatters ``[n, D]`` over
  ETP in fp32 when ETP > 1.
- ``flex`` runs DeepEP's kernels, which run on GPUs only: no CPU census can check their
  buffers, so it is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Recipe
from .rows import act_bytes, rows_of


@dataclass(frozen=True)
class DispatchTerms:
    """What one token dispatcher keeps and allocates for one call on ``rows`` rows of the rank's
    residual stream (bytes, per rank)."""

    name: str

    def gathered_rows(self, recipe: Recipe, rows: int, assignments: int) -> int:
        """Rows of the tokens' D-wide tensors the dispatch puts on this rank for ``rows`` rows,
        ``assignments`` of them landing on the rank's experts."""
        raise NotImplementedError

    def kept_bytes(self, recipe: Recipe, rows: int, assignments: int) -> int:
        """What autograd keeps of the dispatch (not the experts' own tensors), with
        ``assignments`` rows landing on the rank's experts."""
        raise NotImplementedError

    def fp32_combine(self, recipe: Recipe) -> bool:
        """Whether the combine reduce-scatters an fp32 copy of its rows (the router's fp32
        probabilities set its dtype; no collective, no copy)."""
        raise NotImplementedError

    def gather_buffer_rows(self, recipe: Recipe, rows: int) -> int:
        """Rows of ``[., D]`` the dispatch requests from megatron's global all-gather buffer."""
        raise NotImplementedError

    def transient_bytes(self, recipe: Recipe, rows: int, assignments: int) -> int:
        """Token-sized tensors alive around the combine: the expert outputs in the dispatch's
        row order ``[rows', D]`` and, when the combine reduce-scatters in fp32 (a bf16 model),
        its fp32 copy ``[rows', D]`` (the backward mirrors them: the all-gathered fp32 output
        gradient and its cast), ``rows'`` the dispatcher's ``gathered_rows``."""
        w, D = act_bytes(recipe), recipe.model.hidden_size
        per_row = w + (4 if self.fp32_combine(recipe) and w != 4 else 0)
        return self.gathered_rows(recipe, rows, assignments) * D * per_row


class AllGatherTerms(DispatchTerms):
    """megatron's ``MoEAllGatherTokenDispatcher``: every row of the TP x EP group (ETP x EP)."""

    def gathered_rows(self, recipe: Recipe, rows: int, assignments: int) -> int:
        p = recipe.parallel
        return rows * p.ep * p.etp

    def kept_bytes(self, recipe: Recipe, rows: int, assignments: int) -> int:
        """The local experts' routing map (bool) and probabilities (fp32) of every gathered row,
        saved by the probabilities' ``masked_select``; one int64 token index per local
        assignment (the permutation's ``index_select``)."""
        local_experts = recipe.model.moe.num_experts // recipe.parallel.ep
        return self.gathered_rows(recipe, rows, assignments) * local_experts * 5 + assignments * 8

    def fp32_combine(self, recipe: Recipe) -> bool:
        p = recipe.parallel
        return p.ep * p.etp > 1

    def gather_buffer_rows(self, recipe: Recipe, rows: int) -> int:
        return self.gathered_rows(recipe, rows, 0) if self.fp32_combine(recipe) else 0


class AllToAllTerms(DispatchTerms):
    """megatron's ``MoEAlltoAllTokenDispatcher``: the routed rows, all-to-all over EP, then
    all-gathered over ETP."""

    def gathered_rows(self, recipe: Recipe, rows: int, assignments: int) -> int:
        return assignments

    def kept_bytes(self, recipe: Recipe, rows: int, assignments: int) -> int:
        """The argsort of the rank's ``[E, rows]`` routing map (int64; the probabilities are
        indexed with a view of it, which keeps all of it) and the int64 token index of each of
        the ``rows k`` assignments sent (the permutation's ``index_select``, and the
        unpermutation's ``scatter_add`` on the same storage)."""
        e = recipe.model.moe
        return rows * (e.num_experts + e.top_k) * 8

    def fp32_combine(self, recipe: Recipe) -> bool:
        return recipe.parallel.etp > 1

    def gather_buffer_rows(self, recipe: Recipe, rows: int) -> int:
        return 0


DISPATCHERS: dict[str, DispatchTerms] = {
    "allgather": AllGatherTerms("allgather"),
    "alltoall": AllToAllTerms("alltoall"),
}


def dispatch_terms(recipe: Recipe) -> DispatchTerms:
    """The memory terms of the recipe's ``model.moe.dispatcher``; ``flex`` is refused."""
    name = recipe.model.moe.dispatcher
    if name not in DISPATCHERS:
        raise ValueError(
            f"model.moe.dispatcher={name} has no memory terms: its DeepEP kernels run on GPUs "
            "only, so no CPU census checks their buffers; plan with alltoall or allgather")
    return DISPATCHERS[name]


def moe_activation_bytes(recipe: Recipe, assignments: int | None = None) -> int:
    """One MoE block (model/moe_layer.py on megatron's MoELayer), per rank.

    Kept: the input [s, D] (router, shared expert and dispatcher read the same tensor); the
    router's fp32 scores [E], top-k indices and weights; the shared expert like a dense MLP of
    width I * n_shared (on the rows gathered over TP under SP). Without
    ``train.moe_chunk_tokens`` also what the dispatcher and the routed experts keep for all s
    rows (``moe_routed_bytes``); with it, only what each chunk's checkpoint keeps to rebuild
    from: its views of the input and of the router's dense fp32 probabilities and boolean
    routing map [s, E] (5 E bytes per row), for every dispatcher. ``assignments``: the rows
    that land on the rank's experts (None: the balanced share)."""
    m, p, w, r = recipe.model, recipe.parallel, act_bytes(recipe), rows_of(recipe)
    e = m.moe
    total = r.sp * m.hidden_size * w + r.sp * (4 * e.num_experts + 12 * e.top_k + 4)
    total += r.cp * e.ffn_hidden_size * e.num_shared_experts // p.tp * 6 * w
    if recipe.train.moe_chunk_tokens:
        return total + r.sp * 5 * e.num_experts
    return total + moe_routed_bytes(recipe, r.sp, assignments)


def moe_call_rows(recipe: Recipe) -> int:
    """Rows of the rank's residual stream one MoE call covers: all of them, or one chunk of
    ``train.moe_chunk_tokens``."""
    sp, chunk = rows_of(recipe).sp, recipe.train.moe_chunk_tokens
    return min(chunk, sp) if chunk else sp


def local_assignments(recipe: Recipe, rows: int) -> int:
    """Token-to-expert assignments of ``rows`` rows that land on this rank's experts, under
    balanced routing: rows * ep * etp rows of the EP x ETP group, top_k each, local / E of them
    here."""
    p, e = recipe.parallel, recipe.model.moe
    return rows * p.ep * p.etp * e.top_k * (e.num_experts // p.ep) // e.num_experts


def expert_kept_bytes(recipe: Recipe, assignments: int) -> int:
    """What the routed experts keep for ``assignments`` rows: per row the permuted input [D],
    six intermediates of width I/etp and the fc2 input cast, and its fp32 routing weight."""
    m, p, w = recipe.model, recipe.parallel, act_bytes(recipe)
    return assignments * (m.hidden_size * w + 7 * m.moe.ffn_hidden_size // p.etp * w + 4)


def moe_routed_bytes(recipe: Recipe, rows: int, assignments: int | None = None) -> int:
    """What the dispatcher and the routed experts keep for ``rows`` rows of the rank's residual
    stream (all of them, or one chunk of ``train.moe_chunk_tokens``): the dispatcher's kept
    tensors (``DispatchTerms.kept_bytes``) and the experts' (``expert_kept_bytes``), for
    ``assignments`` rows landing on the rank's experts (None: the balanced share)."""
    if assignments is None:
        assignments = local_assignments(recipe, rows)
    dispatch = dispatch_terms(recipe).kept_bytes(recipe, rows, assignments)
    return dispatch + expert_kept_bytes(recipe, assignments)


def moe_transient_bytes(recipe: Recipe, rows: int, assignments: int | None = None) -> int:
    """The dispatcher's token-sized transients for one call on ``rows`` rows, per rank
    (``DispatchTerms.transient_bytes``), ``assignments`` of them landing on the rank's experts
    (None: the balanced share). The allgather dispatcher's gathered inputs land in megatron's
    all-gather buffer, a state of its own (``states.gather_buffer_bytes``)."""
    if assignments is None:
        assignments = local_assignments(recipe, rows)
    return dispatch_terms(recipe).transient_bytes(recipe, rows, assignments)


def moe_working_bytes(recipe: Recipe, assignments: int | None = None) -> int:
    """An MoE layer's working set during its backward on top of what it keeps, for one call on
    r rows (all s, or under ``train.moe_chunk_tokens`` = c, r = min(c, s)): the dispatcher's
    transients (``moe_transient_bytes``); the routed experts' output gradient gathered for
    every assignment and their input gradient concatenated back, [assignments, D] each (the
    unpermute's and the experts' split's backward); under chunks, one chunk's rebuilt tensors
    (``moe_routed_bytes`` of r rows). ``assignments``: the call's rows landing on the rank's
    experts (None: the balanced share)."""
    m, w, rows = recipe.model, act_bytes(recipe), moe_call_rows(recipe)
    if assignments is None:
        assignments = local_assignments(recipe, rows)
    gradients = 2 * assignments * m.hidden_size * w
    rebuilt = moe_routed_bytes(recipe, rows, assignments) if recipe.train.moe_chunk_tokens else 0
    return moe_transient_bytes(recipe, rows, assignments) + gradients + rebuilt


def moe_phase_label(recipe: Recipe) -> str:
    chunk = recipe.train.moe_chunk_tokens
    dispatcher = dispatch_terms(recipe).name
    how = f"{dispatcher}, chunks of {chunk}" if chunk else dispatcher
    return f"MoE layer backward, {how} (largest)"
