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

Which linears: ``target_modules`` minus ``exclude_modules`` by ``lora.names``' rules (SkyRL's
names, ours, wildcard patterns on the dotted name; ``apply_lora`` selects by them too), over the
linears ``model/glm.py`` builds (``model_linears``); ``tests/test_memory_lora.py`` checks the
selection equals ``lora_targets`` on a built model. The plan refuses what ``apply_lora`` refuses:
routed experts (adapters on them are not built, and their split over EP x ETP is not decided)
and the output layer.

Activations: each adapter keeps its r-wide product for B's backward (``A x``: the rows of B's
input x r); everything else a layer keeps is unchanged (the adapter's A reads the base's input,
which is kept already)."""

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
    by name: a selection that is empty, or holds the output layer or a routed expert's linear."""
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
        if lin.expert:
            raise ValueError(f"lora target {lin.name}: adapters on routed experts are not supported "
                             "yet; train.lora.exclude_modules=['*.experts.*'] leaves them out")
    return tuple(chosen)


def local_factors(recipe: Recipe, lin: Linear) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's A and B shapes: A [r, in] and B [out/tp, r] column-parallel; A [r, in/tp] and
    B [out, r] row-parallel; both whole where the weight is duplicated."""
    r, tp = recipe.train.lora.rank, recipe.parallel.tp
    if lin.split == "column":
        return (r, lin.in_features), (lin.out_features // tp, r)
    if lin.split == "row":
        return (r, lin.in_features // tp), (lin.out_features, r)
    return (r, lin.in_features), (lin.out_features, r)


def adapter_numel(recipe: Recipe, lin: Linear) -> int:
    """Elements of ``lin``'s A and B on one rank (``local_factors``)."""
    (ar, ac), (br, bc) = local_factors(recipe, lin)
    return ar * ac + br * bc


def lora_numel(recipe: Recipe) -> int:
    """Elements of every adapter on one rank (0 without LoRA)."""
    return sum(adapter_numel(recipe, lin) for lin in lora_linears(recipe))


def adapter_rows(recipe: Recipe, lin: Linear) -> tuple[int, int]:
    """Rows of (A's input, B's input) on one rank for a called linear: a column adapter runs A
    on the rank's rows of the base's input (its sequence share under SP) and B on the CP rank's
    rows (the r-wide product gathered over TP); a row adapter runs A on the CP rank's rows and B
    on the sum of the partial products (reduce-scattered to the sequence share under SP)."""
    p, rows = recipe.parallel, rows_of(recipe)
    shared = rows.sp if p.sequence_parallel and p.tp > 1 else rows.cp
    return (shared, rows.cp) if lin.split == "column" else (rows.cp, shared)


def adapter_kept_bytes(recipe: Recipe, lin: Linear) -> int:
    """What ``lin``'s adapter keeps for backward: a called linear's r-wide product (B's input,
    ``adapter_rows``' second count x r, activation dtype); a weight the model reads, the adapted
    weight shard [out/tp, in] (or [out, in/tp], or whole), which the model's GEMM keeps in the
    parameters' dtype."""
    if lin.reads_weight:
        (_, a_cols), (b_rows, _) = local_factors(recipe, lin)
        return b_rows * a_cols * DTYPE_BYTES[recipe.model.params_dtype]
    return adapter_rows(recipe, lin)[1] * recipe.train.lora.rank * act_bytes(recipe)


def lora_activation_bytes(recipe: Recipe, layer: int | None, block: str | None = None) -> int:
    """What the adapters of ``layer`` (of its ``block``, if given) keep for backward."""
    return sum(adapter_kept_bytes(recipe, lin) for lin in lora_linears(recipe)
               if lin.layer == layer and (block is None or lin.block == block))
