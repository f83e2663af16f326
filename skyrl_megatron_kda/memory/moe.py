"""The MoE block's memory terms (model/moe_layer.py on megatron's MoELayer, allgather dispatcher),
under balanced routing: what it keeps, the routed experts' share, the dispatcher's transients
and the working set of its backward, whole or in chunks of ``train.moe_chunk_tokens``."""

from __future__ import annotations

from ..config import Recipe
from .rows import act_bytes, rows_of


def moe_activation_bytes(recipe: Recipe) -> int:
    """One MoE block (model/moe_layer.py on megatron's MoELayer, allgather dispatcher), per rank.

    Kept: the input [s, D] (router, shared expert and dispatcher read the same tensor); the
    router's fp32 scores [E], top-k indices and weights; the shared expert like a dense MLP of
    width I * n_shared (on the rows gathered over TP under SP). Without
    ``train.moe_chunk_tokens`` also what the routed experts keep for all s rows
    (``moe_routed_bytes``); with it, only what each chunk's checkpoint keeps to rebuild from:
    its views of the input and of the router's dense fp32 probabilities and boolean routing map
    [s, E] (5 E bytes per row)."""
    m, p, w, r = recipe.model, recipe.parallel, act_bytes(recipe), rows_of(recipe)
    e = m.moe
    total = r.sp * m.hidden_size * w + r.sp * (4 * e.num_experts + 12 * e.top_k + 4)
    total += r.cp * e.ffn_hidden_size * e.num_shared_experts // p.tp * 6 * w
    if recipe.train.moe_chunk_tokens:
        return total + r.sp * 5 * e.num_experts
    return total + moe_routed_bytes(recipe, r.sp)


def moe_call_rows(recipe: Recipe) -> int:
    """Rows of the rank's residual stream one MoE call covers: all of them, or one chunk of
    ``train.moe_chunk_tokens``."""
    sp, chunk = rows_of(recipe).sp, recipe.train.moe_chunk_tokens
    return min(chunk, sp) if chunk else sp


def local_assignments(recipe: Recipe, rows: int) -> int:
    """Token-to-expert assignments of ``rows`` rows that land on this rank's experts, under
    balanced routing: rows * ep * etp gathered rows, top_k each, local / E of them here."""
    p, e = recipe.parallel, recipe.model.moe
    return rows * p.ep * p.etp * e.top_k * (e.num_experts // p.ep) // e.num_experts


def moe_routed_bytes(recipe: Recipe, rows: int) -> int:
    """What the dispatcher and the routed experts keep for ``rows`` rows of the rank's residual
    stream (all of them, or one chunk of ``train.moe_chunk_tokens``): the routing map and
    probabilities of the local experts for every row gathered over EP x ETP, and one int64
    index per assignment; per assignment to a local expert (balanced routing:
    rows * ep * etp * top_k * local / E of them) the permuted input [D], six intermediates of
    width I/etp, the routing weight and the fc2 input cast."""
    m, p, w = recipe.model, recipe.parallel, act_bytes(recipe)
    e, D = m.moe, m.hidden_size
    gathered = rows * p.ep * p.etp
    assignments = local_assignments(recipe, rows)
    total = gathered * (e.num_experts // p.ep) * 5 + assignments * 8
    return total + assignments * (D * w + 7 * e.ffn_hidden_size // p.etp * w + 4)


def moe_transient_bytes(recipe: Recipe, rows: int) -> int:
    """The allgather dispatcher's token-sized transients for one call on ``rows`` rows, per
    rank (g = rows * ep * etp gathered rows): the expert outputs scattered back to the gathered
    rows [g, D] and, when the dispatch gathers (ep * etp > 1), the fp32 copy the combine
    reduce-scatters [g, D] (a bf16 model; the backward mirrors them: the all-gathered fp32
    output gradient, its cast). The gathered inputs land in megatron's all-gather buffer, a
    state of its own (``gather_buffer_bytes``)."""
    m, p, w = recipe.model, recipe.parallel, act_bytes(recipe)
    g = rows * p.ep * p.etp
    per_row = w
    if p.ep * p.etp > 1:
        per_row += 4 if w != 4 else 0
    return g * m.hidden_size * per_row


def moe_working_bytes(recipe: Recipe) -> int:
    """An MoE layer's working set during its backward on top of what it keeps, for one call on
    r rows (all s, or under ``train.moe_chunk_tokens`` = c, r = min(c, s)): the dispatcher's
    transients (``moe_transient_bytes``); the routed experts' output gradient gathered for
    every assignment and their input gradient concatenated back, [assignments, D] each (the
    unpermute's and the experts' split's backward); under chunks, one chunk's rebuilt tensors
    (``moe_routed_bytes`` of r rows)."""
    m, w, rows = recipe.model, act_bytes(recipe), moe_call_rows(recipe)
    gradients = 2 * local_assignments(recipe, rows) * m.hidden_size * w
    rebuilt = moe_routed_bytes(recipe, rows) if recipe.train.moe_chunk_tokens else 0
    return moe_transient_bytes(recipe, rows) + gradients + rebuilt


def moe_phase_label(recipe: Recipe) -> str:
    chunk = recipe.train.moe_chunk_tokens
    return f"MoE layer backward, chunks of {chunk} (largest)" if chunk else "MoE layer backward (largest)"
