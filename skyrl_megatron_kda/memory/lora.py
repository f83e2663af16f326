"""What LoRA (``train.lora``, docs/lora.md) changes in a rank's memory, from the recipe alone.

Under ``train.lora.rank`` r > 0 every base parameter stays, in its dtype and its TP/EP shard, but
is frozen: megatron's DDP and distributed optimizer, built after ``model.lora.apply_lora``, see
only parameters that need a gradient, so the base gets no gradient buffer and no optimizer state.
Each adapted linear W [out, in] gets A [r, in] and B [out, r] in W's dtype, split under TP as W:

- column-parallel (W split by output rows): A whole on every rank, B [out/tp, r];
- row-parallel (W split by input columns): A [r, in/tp], B whole.

The adapters train: DDP's gradient buffer (fp32 under ``train.grad_reduce_in_fp32``) and the
distributed optimizer's state over DP x CP, as any dense parameter (``census.py`` lists them as
the ``lora`` component; ``states.py`` prices whatever is trainable).

Routed experts' ``linear_fc1``/``linear_fc2`` (``model.lora``'s ``_adapt_expert``), of rank
``rank // top_k`` (at least 1) under ``normalize_moe_lora``:

- shared (``share_expert_adapters``, the default): one adapter per MoE layer and kind, whole on
  every rank (A [r, in], B [out, r] of the expert's whole fc1 [2F, D] / fc2 [D, F]), a dense
  parameter: gradient and optimizer state over DP x CP;
- per expert: each of the rank's E/ep experts its own, split under ETP as the expert's weight
  (fc1: A [r, D], B [2F/etp, r]; fc2: A [r, F/etp], B [D, r]), expert parameters: their
  optimizer state sharded over the expert-DP group (world / (ep * etp * pp)) as the experts'.

Which linears: ``target_modules`` minus ``exclude_modules`` by ``lora.names``' rules (SkyRL's
names, ours, wildcard patterns on the dotted name; ``apply_lora`` selects by them too), over the
linears ``model/glm.py`` builds (``model_linears``); ``tests/test_memory_lora.py`` checks the
selection equals ``lora_targets`` on a built model. The plan refuses what ``apply_lora`` refuses:
the output layer.

Activations: each adapter keeps its r-wide product for B's backward (``A x``: the rows of B's
input x r); a routed expert's adapter on the rows routed to that expert (the balanced share),
and nothing past the chunk under ``train.moe_chunk_tokens`` (the chunk's checkpoint rebuilds it;
its r-wide part of the rebuilt chunk is not priced). Everything else a layer keeps is unchanged
(the adapter's A reads the base's input, which is kept already)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Recipe
from ..lora.names import REFUSED, WEIGHT_READ_DIRECTLY, expand, matches
from .rows import DTYPE_BYTES, act_bytes, rows_of

LORA_LABEL = "LoRA adapters (r-wide products)"
"""The plan table's label of the adapters' kept activations."""


@dataclass(frozen=True)
class Linear:
    """One linear of the model, whole (before TP): W [out_features, in_features]."""

    name: str  # dotted module name, as ``model/lora.py``'s ``lora_targets`` names it
    split: str  # "column" (W split by output rows), "row" (by input columns), "duplicated"
    in_features: int
    out_features: int
    layer: int | None = None  # its layer; None for the output layer
    block: str = "attention"  # "attention", "mlp" or "head"
    expert: bool = False  # a routed expert's
    reads_weight: bool = False  # the model reads its weight instead of calling it: the adapter
    # enters as the adapted weight W + (alpha/r) B A (``lora.adapter.adapted_weight``)


def model_linears(recipe: Recipe) -> list[Linear]:
    """Every linear ``model/glm.py`` builds, and the raw weights that play one (KDA's
    ``f_a_proj``/``g_a_proj``, duplicated over TP): KDA's projections, MLA's, the dense MLP's,
    the shared and routed experts' (this rank's E/ep), and the output layer."""
    m, k, a, e, p = recipe.model, recipe.kda, recipe.model.dsa, recipe.model.moe, recipe.parallel
    D, HK, H = m.hidden_size, k.num_heads * k.head_dim, k.num_heads
    rows_path = a.attends_by_rows(p.tp, p.sequence_parallel)
    out: list[Linear] = []

    def add(name, split, fan_in, fan_out, layer, block="attention", expert=False):
        last = name.rsplit(".", 1)[-1]
        reads = last in WEIGHT_READ_DIRECTLY or (rows_path and ".self_attention.linear_" in name)
        out.append(Linear(name, split, fan_in, fan_out, layer, block, expert, reads))

    for i, (kind, mlp) in enumerate(zip(m.layer_types(), m.mlp_types())):
        at = f"layers.{i}.self_attention."
        if kind == "kda":
            add(at + "f_a_proj", "duplicated", D, k.gate_low_rank, i)
            add(at + "g_a_proj", "duplicated", D, k.output_gate_low_rank, i)
            for name, fan_in, fan_out in (("q_proj", D, HK), ("k_proj", D, HK), ("v_proj", D, HK),
                                          ("f_b_proj", k.gate_low_rank, HK),
                                          ("g_b_proj", k.output_gate_low_rank, HK),
                                          ("b_proj", D, H)):
                add(at + name, "column", fan_in, fan_out, i)
            add(at + "o_proj", "row", HK, D, i)
        else:
            n, dq = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
            add(at + "linear_proj", "row", n * a.v_head_dim, D, i)
            add(at + "linear_q_down_proj", "column", D, a.q_lora_rank, i)
            add(at + "linear_q_up_proj", "column", a.q_lora_rank, n * dq, i)
            add(at + "linear_kv_down_proj", "column", D, a.kv_lora_rank + a.qk_rope_head_dim, i)
            add(at + "linear_kv_up_proj", "column", a.kv_lora_rank,
                n * (a.qk_nope_head_dim + a.v_head_dim), i)
        swiglu = []
        if mlp == "dense":
            swiglu.append((f"layers.{i}.mlp.", m.dense_ffn_hidden_size, False))
        else:
            swiglu += [(f"layers.{i}.mlp.experts.local_experts.{j}.", e.ffn_hidden_size, True)
                       for j in range(e.num_experts // p.ep)]
            if e.num_shared_experts:
                swiglu.append((f"layers.{i}.mlp.shared_experts.",
                               e.ffn_hidden_size * e.num_shared_experts, False))
        for prefix, F, expert in swiglu:  # fc1 [2F, D] (gate and up), fc2 [D, F]
            add(prefix + "linear_fc1", "column", D, 2 * F, i, "mlp", expert)
            add(prefix + "linear_fc2", "row", F, D, i, "mlp", expert)
    add("output_layer", "column", D, m.vocab_size, None, "head")
    return out


def lora_linears(recipe: Recipe) -> list[Linear]:
    """The linears ``train.lora`` adapts (none at rank 0). Refuses what ``apply_lora`` refuses
    by name: a selection that is empty, or holds the output layer."""
    if not recipe.train.lora.enabled:
        return []
    # The plan asks per layer and per term: the selection is computed once per recipe's content.
    key = tuple(section.model_dump_json() for section in
                (recipe.model, recipe.kda, recipe.parallel, recipe.train.lora))
    if key not in _SELECTIONS:
        if len(_SELECTIONS) >= 64:
            _SELECTIONS.clear()
        _SELECTIONS[key] = _select(recipe)
    return list(_SELECTIONS[key])


_SELECTIONS: dict[tuple[str, ...], tuple[Linear, ...]] = {}


def _select(recipe: Recipe) -> tuple[Linear, ...]:
    lora = recipe.train.lora
    patterns, excluded = expand(lora.target_modules), expand(lora.exclude_modules)
    chosen = [lin for lin in model_linears(recipe)
              if matches(lin.name, patterns) and not matches(lin.name, excluded)]
    if not chosen:
        raise ValueError(f"lora target_modules={lora.target_modules} select no linear of the model")
    for lin in chosen:
        last = lin.name.rsplit(".", 1)[-1]
        if last in REFUSED:
            raise ValueError(f"lora target {lin.name}: not supported, {REFUSED[last]}")
    return tuple(chosen)


def expert_lora_rank(recipe: Recipe) -> int:
    """The routed experts' adapter rank: ``rank // top_k`` (at least 1) under
    ``normalize_moe_lora``, else ``rank`` (``model.lora.expert_rank``)."""
    lora = recipe.train.lora
    return max(1, lora.rank // recipe.model.moe.top_k) if lora.normalize_moe_lora else lora.rank


def lora_rank(recipe: Recipe, lin: Linear) -> int:
    """The rank of ``lin``'s adapter."""
    return expert_lora_rank(recipe) if lin.expert else recipe.train.lora.rank


def local_factors(recipe: Recipe, lin: Linear) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's A and B shapes: A [r, in] and B [out/tp, r] column-parallel; A [r, in/tp] and
    B [out, r] row-parallel; both whole where the weight is duplicated. A routed expert's
    adapter is split over ETP instead of TP, or whole when shared by the layer's experts."""
    r, tp = lora_rank(recipe, lin), recipe.parallel.tp
    if lin.expert:
        if recipe.train.lora.share_expert_adapters:
            return (r, lin.in_features), (lin.out_features, r)
        tp = recipe.parallel.etp
    if lin.split == "column":
        return (r, lin.in_features), (lin.out_features // tp, r)
    if lin.split == "row":
        return (r, lin.in_features // tp), (lin.out_features, r)
    return (r, lin.in_features), (lin.out_features, r)


def adapter_numel(recipe: Recipe, lin: Linear) -> int:
    """Elements of ``lin``'s A and B on one rank (``local_factors``)."""
    (ar, ac), (br, bc) = local_factors(recipe, lin)
    return ar * ac + br * bc


def lora_numels(recipe: Recipe) -> tuple[int, int]:
    """Elements of the adapters on one rank: (dense parameters, expert parameters). A shared
    routed-expert adapter is one per MoE layer and kind (counted with the layer's first local
    expert), dense; per-expert adapters are expert parameters."""
    dense = expert = 0
    shared = recipe.train.lora.share_expert_adapters
    for lin in lora_linears(recipe):
        if not lin.expert:
            dense += adapter_numel(recipe, lin)
        elif not shared:
            expert += adapter_numel(recipe, lin)
        elif ".local_experts.0." in lin.name:
            dense += adapter_numel(recipe, lin)
    return dense, expert


def lora_numel(recipe: Recipe) -> int:
    """Elements of every adapter on one rank (0 without LoRA)."""
    return sum(lora_numels(recipe))


def adapter_rows(recipe: Recipe, lin: Linear) -> tuple[int, int]:
    """Rows of (A's input, B's input) on one rank for a called linear: a column adapter runs A
    on the rank's rows of the base's input (its sequence share under SP) and B on the CP rank's
    rows (the r-wide product gathered over TP); a row adapter runs A on the CP rank's rows and B
    on the sum of the partial products (reduce-scattered to the sequence share under SP)."""
    p, rows = recipe.parallel, rows_of(recipe)
    if lin.expert:
        routed = expert_rows(recipe)
        return routed, routed
    shared = rows.sp if p.sequence_parallel and p.tp > 1 else rows.cp
    return (shared, rows.cp) if lin.split == "column" else (rows.cp, shared)


def expert_rows(recipe: Recipe) -> int:
    """Rows one routed expert of this rank computes per forward, under balanced routing: the
    EP x ETP group's rows (the rank's SP share each), top_k assignments each, 1/E of them (as
    ``memory.moe.local_assignments`` per local expert)."""
    p, e = recipe.parallel, recipe.model.moe
    return rows_of(recipe).sp * p.ep * p.etp * e.top_k // e.num_experts


def adapter_kept_bytes(recipe: Recipe, lin: Linear) -> int:
    """What ``lin``'s adapter keeps for backward: a called linear's r-wide product (B's input,
    ``adapter_rows``' second count x r, activation dtype); a weight the model reads, the adapted
    weight shard [out/tp, in] (or [out, in/tp], or whole), which the model's GEMM keeps in the
    parameters' dtype."""
    if lin.reads_weight:
        (_, a_cols), (b_rows, _) = local_factors(recipe, lin)
        return b_rows * a_cols * DTYPE_BYTES[recipe.model.params_dtype]
    if lin.expert and recipe.train.moe_chunk_tokens:
        return 0  # inside the chunk's checkpoint: rebuilt in backward, not kept
    return adapter_rows(recipe, lin)[1] * lora_rank(recipe, lin) * act_bytes(recipe)


def lora_activation_bytes(recipe: Recipe, layer: int | None, block: str | None = None) -> int:
    """What the adapters of ``layer`` (of its ``block``, if given) keep for backward."""
    return sum(adapter_kept_bytes(recipe, lin) for lin in lora_linears(recipe)
               if lin.layer == layer and (block is None or lin.block == block))
