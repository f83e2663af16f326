"""The DSA layer's memory terms: what megatron's MLA keeps around the attention, and what the
kernel of ``model.dsa.kernel`` keeps and works in (``DSAKernel.kept_bytes`` and
``working_sets``, read from the kernel on this rank's ``DSAShape``)."""

from __future__ import annotations

from ..config import Recipe
from ..dsa import kernels as dsa_kernels
from ..dsa.kept_selection import kept_bytes_per_row
from ..dsa.kernels import DSAShape
from .rows import act_bytes, rows_of


def dsa_shape(recipe: Recipe) -> DSAShape:
    """One rank's DSA layer for the kernel's memory terms. Its attention share
    (``model.dsa.tp_split``): heads: the CP rank's rows with heads/tp; sequence (TP > 1 under
    SP): a balanced share of the CP rank's rows, as many as its own, with every head."""
    p, a, r = recipe.parallel, recipe.model.dsa, rows_of(recipe)
    by_rows = a.attends_by_rows(p.tp, p.sequence_parallel)
    rows = r.sp if by_rows else r.cp
    return DSAShape(dsa=a, whole=r.whole, cp_rows=r.cp, sp_rows=r.sp, tp=p.tp, cp=p.cp,
                    act_bytes=act_bytes(recipe), rows=rows,
                    heads=a.num_heads if by_rows else a.num_heads // p.tp, index_rows=rows,
                    by_rows=by_rows)


def dsa_kernel(recipe: Recipe) -> type[dsa_kernels.DSAKernel]:
    """The kernel class of ``model.dsa.kernel`` (resolved: ``auto`` is refused)."""
    return dsa_kernels.get(recipe.model.dsa.kernel)


def dsa_activation_bytes(recipe: Recipe) -> int:
    """One DSA layer (dsa/layer.py on megatron's MLA), per rank.

    Every kernel keeps: the layer input [s, D]; the q and KV latent norms; the q latent
    [s, q_lora] (under the sequence split the share's, as many rows); the normalised KV latent
    of the whole sequence [T, kv_lora]; the output [S, heads/tp * v_head_dim] the output
    projection reads (the share's rows with every head: the same bytes); under the sequence
    split the projections' whole weights (``dsa_projection_weights``, gathered over TP by
    ``GlmDSASelfAttention.forward_by_rows``). The indexer runs without gradient: nothing kept
    but the token indices the attention saves. Then what the kernel keeps
    (``DSAKernel.kept_bytes``)."""
    m, p, w = recipe.model, recipe.parallel, act_bytes(recipe)
    a, r = m.dsa, rows_of(recipe)
    total = r.sp * m.hidden_size * w
    # torch.nn.RMSNorm (LatentRMSNorm) keeps its fp32 input and fp32 normalised tensor.
    total += r.sp * (8 * a.q_lora_rank + 4) + r.sp * a.q_lora_rank * w
    total += r.sp * (8 * a.kv_lora_rank + 4)
    total += r.whole * a.kv_lora_rank * w
    total += r.cp * (a.num_heads // p.tp) * a.v_head_dim * w
    if a.attends_by_rows(p.tp, p.sequence_parallel):
        total += dsa_projection_weights(recipe) * w
    return total + dsa_kernel(recipe).kept_bytes(dsa_shape(recipe))


def dsa_projection_weights(recipe: Recipe) -> int:
    """Elements of one DSA layer's five trainable projections, whole (not TP-sharded): q and kv
    down, q and kv up, the output projection."""
    m, a = recipe.model, recipe.model.dsa
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    return (m.hidden_size * (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim)
            + a.num_heads * (a.q_lora_rank * qk + a.kv_lora_rank * (a.qk_nope_head_dim + a.v_head_dim))
            + a.num_heads * a.v_head_dim * m.hidden_size)


ROW_EXCHANGE_LABEL = "row all-to-alls"


def dsa_row_exchange_bytes(recipe: Recipe) -> int:
    """Under the sequence split, the layer's all-to-alls between the rank's rows and its share
    (``DSABatchRows.to_share`` / ``from_share``): the largest, the output's [rows, hidden],
    alive four times (the projection's output, its send order, the rows received, their
    arrangement; the backward moves the gradient the same way). 0 under the heads split."""
    p, a = recipe.parallel, recipe.model.dsa
    if not a.attends_by_rows(p.tp, p.sequence_parallel):
        return 0
    return 4 * rows_of(recipe).sp * max(a.q_lora_rank, recipe.model.hidden_size) * act_bytes(recipe)


SELECTION_LABEL = "DSA selections (kept for the recompute)"


def dsa_kept_selection_bytes(recipe: Recipe) -> int:
    """What one recomputed DSA layer keeps from its forward to its backward under
    ``train.keep_dsa_selection``: its indexer's selection in compact form, int32, for each of
    the indexer's query rows (``dsa.kept_selection``). Held by the checkpoint, not saved for
    autograd: it stays on the GPU under ``train.offload_activations``. 0 when the layer is not
    recomputed or the recompute selects again."""
    t, a = recipe.train, recipe.model.dsa
    if t.recompute_of("dsa") == "none" or not t.keep_dsa_selection:
        return 0
    return dsa_shape(recipe).index_rows * kept_bytes_per_row(a.index_kpool, a.index_topk)


def dsa_transient_bytes(recipe: Recipe) -> int:
    """Working set of one DSA layer that is not kept between forward and backward, per rank:
    its largest stage, the kernel's (``DSAKernel.working_sets``) or the layer's row all-to-alls
    (``dsa_row_exchange_bytes``)."""
    stages = dsa_kernel(recipe).working_sets(dsa_shape(recipe))
    return max(*stages.values(), dsa_row_exchange_bytes(recipe))
