"""What LoRA (``train.lora``, docs/lora.md) changes in the step: the frozen base skips its weight
gradients, the adapters add small GEMMs and r-wide TP exchanges, and the DP gradient reduction
carries the adapters only (``host.optimizer_part`` prices what is trainable: ``memory.census``).

- **Frozen base**: a linear whose weight needs no gradient runs its forward GEMM and, in
  backward, its input-gradient GEMM, not its weight-gradient GEMM: ``BACKWARD_GEMMS`` 2 -> 1 per
  forward-equivalent in every part that prices linears by forward passes (KDA's projections,
  MLA's, the dense MLP, the shared and routed experts, the router). A linear whose weight the
  model reads instead of calling it (``memory.lora.Linear.reads_weight``) and that is adapted
  reads ``W + (alpha/r) B A``, whose gradient feeds A and B: its weight-gradient GEMM stays
  (``kept_weight_gradient_flops``).
- **Adapters** of a called linear: two r-wide GEMMs in each forward pass (A x, then B on the
  product), each with an input- and a weight-gradient GEMM in backward; the scale and the add to
  the base's output; and the exchanges of docs/lora.md's table over TP. Of a linear whose weight
  is read: the adapted weight W + (alpha/r) B A (one ``addmm`` of the weight's size per forward
  pass, the two factors' gradient GEMMs in backward), and the all-reduce of the TP-duplicated
  factor's gradient. An
  r-wide GEMM moves as many bytes as it multiplies (its intensity is about r FLOP per byte), so
  each is priced at the larger of the measured GEMM rate and the H200's HBM bandwidth
  (``hardware.MEASURED_ON``): modelled, not measured.
- Routed experts' adapters (``memory.lora``: shared or per expert) run on each local expert's
  routed rows (``memory.lora.expert_rows``), once more under ``train.moe_chunk_tokens`` (the
  chunk's recompute); a per-expert adapter all-reduces its ETP-whole factor's gradient over ETP
  (A of fc1, B of fc2), a shared one exchanges nothing inside the layer (its TP sum in
  ``finalize_model_grads`` is r-wide and not priced).
- Not changed: the head (model/fused_loss.py computes the output weight's gradient whether or
  not it is frozen), the mHC maps (their projection's backward is measured as a whole), DSA's
  rows-path weight gathers.
"""

from __future__ import annotations

from ..config import Recipe
from ..memory.lora import Linear, adapter_rows, local_factors, lora_linears, lora_rank
from ..memory.rows import DTYPE_BYTES, act_bytes, rows_of
from . import calibration as cal
from .common import forward_passes, group_link, scale, seconds
from .hardware import MEASURED_ON

BACKWARD_GEMMS = 2
"""GEMMs per forward GEMM in backward for a trainable weight: the input and weight gradients."""


def frozen_gemms(recipe: Recipe) -> int:
    """Backward GEMMs the frozen base skips per forward GEMM: 1 (the weight gradient) under
    LoRA, else 0."""
    return 1 if recipe.train.lora.enabled else 0


def _layer_kind(recipe: Recipe, lin: Linear) -> str:
    return recipe.model.layer_types()[lin.layer]


def part_linears(recipe: Recipe, part: str) -> list[Linear]:
    """The adapted linears priced in ``part``: "kda" and "dsa" (the attention blocks), "dense"
    and "moe" (the FFN blocks)."""
    m = recipe.model
    out = []
    for lin in lora_linears(recipe):
        if lin.layer is None:
            continue
        kind = m.layer_types()[lin.layer] if lin.block == "attention" else m.mlp_types()[lin.layer]
        if kind == part:
            out.append(lin)
    return out


def _base_forward_flops(recipe: Recipe, lin: Linear) -> float:
    """One forward GEMM of ``lin``'s base weight shard over the CP rank's rows."""
    (_, a_in), (b_out, _) = local_factors(recipe, lin)
    return 2.0 * rows_of(recipe).cp * a_in * b_out


def kept_weight_gradient_flops(recipe: Recipe, part: str) -> float:
    """Weight-gradient GEMM FLOPs that run under LoRA in ``part`` per step: those of the adapted
    linears whose weight the model reads (the adapted weight's gradient feeds A and B)."""
    return sum(_base_forward_flops(recipe, lin) for lin in part_linears(recipe, part)
               if lin.reads_weight)


def _gemm(recipe: Recipe, flops: float, nbytes: float) -> float:
    """A GEMM at the larger of its multiply-add time and its memory time."""
    hw = scale(recipe)
    return max(flops / cal.GEMM_FLOP_PER_S * hw.gemm, _memory(recipe, nbytes))


def _memory(recipe: Recipe, nbytes: float) -> float:
    return nbytes / (MEASURED_ON.hbm_tb_s * 1e12) * scale(recipe).memory


def adapter_compute_s(recipe: Recipe, lin: Linear) -> float:
    """Seconds of ``lin``'s adapter per step (all forward passes and the backward)."""
    r = lora_rank(recipe, lin)
    (_, a_in), (b_out, _) = local_factors(recipe, lin)
    passes = _passes(recipe, lin)
    if lin.expert and recipe.train.lora.share_expert_adapters:  # the expert's ETP shard of it
        etp = recipe.parallel.etp
        a_in, b_out = (a_in // etp, b_out) if lin.split == "row" else (a_in, b_out // etp)
    if lin.reads_weight:  # W + s B A as one addmm: [b_out, r] x [r, a_in], reading W
        w = DTYPE_BYTES[recipe.model.params_dtype]
        cells = b_out * a_in
        forward = _gemm(recipe, 2.0 * cells * r, 2 * cells * w)
        return passes * forward + 2 * _gemm(recipe, 2.0 * cells * r, cells * w)  # dB, dA
    e = act_bytes(recipe)
    rows_a, rows_b = adapter_rows(recipe, lin)
    gemms = (_gemm(recipe, 2.0 * rows_a * a_in * r, (rows_a * a_in + rows_a * r) * e)
             + _gemm(recipe, 2.0 * rows_b * r * b_out, (rows_b * r + rows_b * b_out) * e))
    forward = gemms + _memory(recipe, 5 * rows_b * b_out * e)  # scale: read + write; add: 3
    return passes * forward + 2 * gemms + _memory(recipe, 2 * rows_b * b_out * e)


def _passes(recipe: Recipe, lin: Linear) -> int:
    """Forward passes of ``lin`` per step: its layer's, and a routed expert's once more under
    ``train.moe_chunk_tokens`` (the chunk's checkpoint reruns it in backward)."""
    passes = forward_passes(recipe, _layer_kind(recipe, lin))
    return passes + (1 if lin.expert and recipe.train.moe_chunk_tokens else 0)


def adapter_comm_s(recipe: Recipe, lin: Linear) -> float:
    """Seconds of ``lin``'s adapter's TP exchanges per step (docs/lora.md's table): forward ones
    in each forward pass, backward ones once. A per-expert adapter all-reduces the gradient of
    its ETP-whole factor over ETP; a shared expert adapter exchanges nothing in the layer."""
    p = recipe.parallel
    if lin.expert:
        if p.etp == 1 or recipe.train.lora.share_expert_adapters:
            return 0.0
        (ar, ac), (br, bc) = local_factors(recipe, lin)
        whole = ar * ac if lin.split == "column" else br * bc
        w = DTYPE_BYTES[recipe.model.params_dtype]
        return seconds(2 * whole * w * (p.etp - 1) / p.etp, group_link(recipe, 1, p.etp))
    if p.tp == 1:
        return 0.0
    r, w, e = recipe.train.lora.rank, DTYPE_BYTES[recipe.model.params_dtype], act_bytes(recipe)
    passes = forward_passes(recipe, _layer_kind(recipe, lin))
    link, remote = group_link(recipe, 1, p.tp), (p.tp - 1) / p.tp
    sp = p.sequence_parallel
    (ar, ac), (br, bc) = local_factors(recipe, lin)
    if lin.reads_weight:  # the TP-duplicated factor's gradient all-reduced (A of a column
        # linear, B of a row one, both of a duplicated weight)
        dup = (ar * ac if lin.split != "row" else 0) + (br * bc if lin.split != "column" else 0)
        return seconds(2 * dup * w * remote, link)
    low = rows_of(recipe).cp * r * e * remote  # the r-wide product, as a gather brings it
    if lin.split == "column" and sp:  # gather / reduce-scatter, A's gradient all-reduced
        return passes * seconds(low, link) + seconds(low, link) + seconds(2 * ar * ac * w * remote, link)
    if lin.split == "column":  # the product's gradient all-reduced
        return seconds(2 * low, link)
    if sp:  # reduce-scatter / all-gather, B's gradient all-reduced
        return passes * seconds(low, link) + seconds(low, link) + seconds(2 * br * bc * w * remote, link)
    return passes * seconds(2 * low, link)  # the partial products all-reduced


def lora_part_s(recipe: Recipe, part: str, flop_per_s: float) -> tuple[float, float]:
    """(compute, communication) seconds per step that LoRA adds to ``part``, all its layers
    together: its adapters, and the weight-gradient GEMMs that stay (at the part's GEMM rate
    ``flop_per_s``)."""
    linears = part_linears(recipe, part)
    kept = kept_weight_gradient_flops(recipe, part) / flop_per_s * scale(recipe).gemm
    return (kept + sum(adapter_compute_s(recipe, lin) for lin in linears),
            sum(adapter_comm_s(recipe, lin) for lin in linears))
