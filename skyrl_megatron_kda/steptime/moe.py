"""The MoE layers' part of the step: routed and shared experts and the router at the measured
MoE rates, and the dispatcher's collectives (``model.moe.dispatcher``), each over the link its
group crosses.

- ``allgather``: the EP x ETP group gathers every residual row (hidden, fp32 probabilities,
  routing map) and reduce-scatters the outputs back, over one group of ep * etp ranks.
- ``alltoall``: only the routed copies of the rank's rows move: an all-to-all over EP (each row
  to the ranks of its top-k experts, with its fp32 routing weight), then an all-gather over ETP;
  the combine reduce-scatters over ETP in the probabilities' fp32 and returns by all-to-all.
- ``flex`` (DeepEP) is not priced: no run or published number covers it on these links.
"""

from __future__ import annotations

from ..config import Recipe
from ..memory.rows import act_bytes, rows_of
from . import calibration as cal
from .common import Part, crosses_nodes, forward_passes, group_link, scale, seconds
from .lora import frozen_gemms, lora_part_s

PRICED_DISPATCHERS = ("alltoall", "allgather")


def unpriced_dispatcher(recipe: Recipe) -> str | None:
    """Why the step-time model cannot price this recipe's MoE dispatch, or None."""
    p, name = recipe.parallel, recipe.model.moe.dispatcher
    if name in PRICED_DISPATCHERS or "moe" not in recipe.model.mlp_types() or p.ep * p.etp == 1:
        return None
    return (f"model.moe.dispatcher={name} has no step-time rates (DeepEP's kernels have no run "
            f"here): price the step with model.moe.dispatcher={' or '.join(PRICED_DISPATCHERS)}")


def with_dispatcher(recipe: Recipe, name: str) -> Recipe:
    """The recipe with ``model.moe.dispatcher`` set to ``name`` (nothing else changes)."""
    moe = recipe.model.moe.model_copy(update={"dispatcher": name})
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"moe": moe})})


def moe_pairs(recipe: Recipe) -> float:
    """(row, expert) pairs this rank's local experts compute per forward: each row of the EP x
    ETP group whose top-k experts fall on this rank's E/ep experts, in proportion (balanced
    routing). Both dispatchers bring the same pairs: allgather every row, alltoall the routed
    ones."""
    p, e = recipe.parallel, recipe.model.moe
    return p.ep * p.etp * rows_of(recipe).sp * e.top_k / p.ep


def moe_dispatch_s(recipe: Recipe) -> float:
    """Seconds of one forward's dispatch and combine on this rank (the backward mirrors them)."""
    p, m = recipe.parallel, recipe.model
    rows, D, e = rows_of(recipe).sp, m.hidden_size, act_bytes(recipe)
    if p.ep * p.etp == 1:
        return 0.0
    if m.moe.dispatcher == "allgather":
        group = p.ep * p.etp
        hidden = (group - 1) * rows * D * e
        routing = (group - 1) * rows * m.moe.num_experts * (4 + 1)  # fp32 probs + bool map
        return seconds(2 * hidden + routing, group_link(recipe, 1, group))
    routed = rows * m.moe.top_k  # the rank's routed copies; balanced, it receives as many
    total = 0.0
    if p.ep > 1:
        remote = (p.ep - 1) / p.ep
        link = group_link(recipe, p.etp, p.ep)
        total += seconds(routed * (D * e + 4) * remote, link, a2a=True)  # rows + weights
        total += seconds(routed * D * e * remote, link, a2a=True)  # the combine back
    if p.etp > 1:
        link = group_link(recipe, 1, p.etp)
        total += seconds((p.etp - 1) * routed * (D * e + 4), link)  # all-gather over ETP
        total += seconds((p.etp - 1) * routed * D * 4, link)  # fp32 reduce-scatter
    return total


def moe_part(recipe: Recipe) -> Part:
    """The MoE layers: routed experts (``moe_pairs`` x three GEMMs of D x F/etp), the shared
    expert (TP-sharded over the CP rank's rows) and the router, at the measured MoE rate (times
    the block's measured cost under ``alltoall``); under ``train.moe_chunk_tokens`` each chunk's
    experts run forward once more in backward. The dispatcher's collectives run in each forward
    pass and once in backward."""
    m, p, e = recipe.model, recipe.parallel, recipe.model.moe
    n = m.mlp_types().count("moe")
    if n == 0:
        return Part("MoE", 0, 0.0, 0.0)
    why = unpriced_dispatcher(recipe)
    if why is not None:
        raise ValueError(why)
    rows, D = rows_of(recipe), m.hidden_size
    fwd = forward_passes(recipe, m.layer_types()[m.mlp_types().index("moe")])
    expert_passes = fwd + (1 if recipe.train.moe_chunk_tokens else 0)
    routed = 2 * moe_pairs(recipe) * 3 * D * (e.ffn_hidden_size // p.etp)
    shared = 2 * rows.cp * 3 * D * (e.ffn_hidden_size * e.num_shared_experts // p.tp)
    router = 2 * rows.sp * D * e.num_experts
    backward = 2 - frozen_gemms(recipe)  # GEMMs per forward GEMM in backward (LoRA: dX only)
    flops = routed * (expert_passes + backward) + (shared + router) * (fwd + backward)
    hw = scale(recipe)
    compute = (flops / cal.MOE_FLOP_PER_S * hw.gemm
               + moe_pairs(recipe) * D * cal.MOE_S_PER_PAIR_ELEMENT * (fwd + 2) / 4 * hw.memory)
    if e.dispatcher == "alltoall":
        compute *= cal.MOE_ALLTOALL_SHARE
    comm = (fwd + 1) * moe_dispatch_s(recipe)
    if p.tp > 1 and e.num_shared_experts:
        comm += (fwd + 1) * 2 * seconds(rows.cp * D * act_bytes(recipe) * (p.tp - 1) / p.tp,
                                        group_link(recipe, 1, p.tp))
    where = "between nodes" if crosses_nodes(recipe, 1, p.ep * p.etp) else "inside a node"
    compute, comm = n * compute, n * comm
    if recipe.train.lora.enabled:  # the shared experts' adapters
        extra = lora_part_s(recipe, "moe", cal.MOE_FLOP_PER_S)
        compute, comm = compute + extra[0], comm + extra[1]
    return Part("MoE", n, compute, comm,
                f"{e.dispatcher} dispatcher over EP{p.ep} x ETP{p.etp} ({where})")
