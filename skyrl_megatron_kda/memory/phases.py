"""The phases of a step that may hold the most activation memory, each the activations alive then
plus its working set; the estimate takes the largest.

Backward runs the loss first and then the layers from the last one, a layer's FFN before its
attention; each layer's saved tensors are freed after its backward. So at a layer's backward the
head and the later layers are gone. The phases:

- the loss: the head's tensors and the bf16 logits, or under ``train.loss_chunk_tokens`` one
  chunk's fp32 logits and the hidden and weight gradients;
- a KDA layer's kernel backward (fla's ``chunk_kda_bwd`` allocations; that layer's FFN is freed
  by then; a recomputed layer's rebuilt tensors are alive), or the exchange's transient buffers,
  which live around the projection and the exchange, not during the kernel's backward: the
  larger of the two counts;
- a DSA layer's working set (``model.dsa.kernel``: one block of the torch kernel, or the
  unfused path's indexer scores and whole-sequence keys);
- an mHC map projection's backward;
- an MoE layer's backward (the whole rebuilt layer, the token dispatcher's token-sized
  transients, ``model.moe.dispatcher``, and, under ``train.moe_chunk_tokens``, one chunk's
  rebuilt experts), or a dense MLP's;
- with a bf16 gradient buffer, the optimizer step, when the distributed optimizer holds fp32
  casts of the rank's gradient shard and no activation is alive.

Offloaded activations (``train.offload_activations``) live on the host until their layer's
backward copies them back.
"""

from __future__ import annotations

from ..config import Recipe
from .blocks import dense_mlp_backward_bytes, mhc_map_backward_bytes
from .dsa import SELECTION_LABEL, dsa_kept_selection_bytes, dsa_kernel, dsa_transient_bytes
from .head import HEAD_LABEL, head_activation_bytes, loss_working_bytes
from .kda import exchange_extra_bytes, kda_backward_bytes
from .layers import ffn_backward_bytes, layer_backward_bytes, layer_kept_bytes
from .moe import moe_phase_label, moe_working_bytes


def kept_activations(recipe: Recipe) -> tuple[dict[str, int], list[int]]:
    """What the forward keeps for backward, all layers and the head, by the plan table's labels;
    and on the GPU what the layers before layer ``i`` keep, at index ``i``."""
    activations: dict[str, int] = {}
    kept_below = [0]
    for i, kind in enumerate(recipe.model.layer_types()):
        kept = layer_kept_bytes(recipe, i)
        for label, nbytes in kept.items():
            activations[label] = activations.get(label, 0) + nbytes
        # A kept DSA selection is the checkpoint's, not a saved tensor: never offloaded.
        selection = dsa_kept_selection_bytes(recipe) if kind == "dsa" else 0
        if selection:
            activations[SELECTION_LABEL] = activations.get(SELECTION_LABEL, 0) + selection
        on_gpu = 0 if recipe.train.offload_activations else sum(kept.values())
        kept_below.append(kept_below[-1] + on_gpu + selection)
    activations[HEAD_LABEL] = head_activation_bytes(recipe)
    return activations, kept_below


def _largest(kept_below: list[int], own: dict[int, int]) -> int:
    """The largest of a phase over the layers ``own`` names: what the layers before each keep
    plus what it holds itself."""
    return max(kept_below[i] + nbytes for i, nbytes in own.items())


def _attention_backward(recipe: Recipe, kind: str, working: int) -> dict[int, int]:
    """What each layer of attention ``kind`` holds in its attention backward with ``working``."""
    kinds = recipe.model.layer_types()
    return {i: layer_backward_bytes(recipe, i) + working for i in range(len(kinds)) if kinds[i] == kind}


def dsa_layer_bytes(recipe: Recipe) -> int:
    """The largest DSA layer's own tensors and working set: its phase without what the layers
    before it keep (0 without DSA layers)."""
    if "dsa" not in recipe.model.layer_types():
        return 0
    return max(_attention_backward(recipe, "dsa", dsa_transient_bytes(recipe)).values())


def step_phases(recipe: Recipe, activations: dict[str, int], kept_below: list[int],
                step_casts: int) -> dict[str, int]:
    """Each phase's label and bytes, in the plan table's order (``kept_activations`` gives the
    first two arguments; ``step_casts`` are the optimizer step's fp32 gradient casts)."""
    m = recipe.model
    kinds = m.layer_types()
    loss_label, loss_working = loss_working_bytes(recipe)
    head = activations[HEAD_LABEL]
    kept = (head + activations.get(SELECTION_LABEL, 0) if recipe.train.offload_activations
            else sum(activations.values()))
    phases = {f"loss: kept + head + {loss_label}": kept + loss_working}
    if "kda" in kinds:
        working = max(exchange_extra_bytes(recipe)[1], kda_backward_bytes(recipe))
        own = _attention_backward(recipe, "kda", working)
        phases["KDA layer backward (largest)"] = _largest(kept_below, own)
    if "dsa" in kinds:
        label = f"DSA layer + {dsa_kernel(recipe).working_set_label} (largest)"
        own = _attention_backward(recipe, "dsa", dsa_transient_bytes(recipe))
        phases[label] = _largest(kept_below, own)
    map_backward = mhc_map_backward_bytes(recipe)
    phases["mHC map backward (largest)"] = max(
        kept_below[i] + layer_backward_bytes(recipe, i) + map_backward for i in range(m.num_layers))
    for mlp, working, label in (("moe", moe_working_bytes, moe_phase_label(recipe)),
                                ("dense", dense_mlp_backward_bytes, "dense MLP backward (largest)")):
        layers = [i for i, kind in enumerate(m.mlp_types()) if kind == mlp]
        if layers:
            phases[label] = max(kept_below[i] + ffn_backward_bytes(recipe, i) + working(recipe)
                                for i in layers)
    if step_casts:
        # The distributed optimizer casts the bf16 gradient shard to fp32 before Adam runs, when
        # every activation is freed; the casts live until the gradients are zeroed.
        phases["optimizer step: fp32 casts of bf16 grads"] = step_casts
    return phases
