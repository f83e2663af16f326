"""One layer's activations from its blocks' terms, under its recompute mode.

``train.recompute`` (for the layer types of ``train.recompute_layers``): ``full`` keeps only
each layer's input streams and rebuilds one layer at a time in backward, ``selective`` keeps the
attention block's input instead of its tensors. Under ``train.lora`` a layer also keeps its
adapters' r-wide products (``lora.py``)."""

from __future__ import annotations

from ..config import Recipe
from .blocks import dense_mlp_activation_bytes, mhc_activation_bytes, norm_activation_bytes
from .dsa import dsa_activation_bytes
from .kda import kda_activation_bytes
from .lora import LORA_LABEL, lora_activation_bytes
from .moe import moe_activation_bytes
from .rows import act_bytes, rows_of


def attention_activation_bytes(recipe: Recipe, index: int) -> int:
    """The attention block of layer ``index`` (KDA or DSA; exchange excluded)."""
    if recipe.model.layer_types()[index] == "kda":
        return kda_activation_bytes(recipe)
    return dsa_activation_bytes(recipe)


def mlp_activation_bytes(recipe: Recipe, index: int) -> int:
    """The FFN block of layer ``index`` (dense MLP or MoE)."""
    if recipe.model.mlp_types()[index] == "dense":
        return dense_mlp_activation_bytes(recipe)
    return moe_activation_bytes(recipe)


def layer_parts(recipe: Recipe, index: int) -> dict[str, int]:
    """What layer ``index`` keeps for backward without recompute (exchange excluded), by the
    plan table's labels."""
    m, r = recipe.model, rows_of(recipe)
    parts = {
        "dense MLP" if m.mlp_types()[index] == "dense" else "MoE": mlp_activation_bytes(recipe, index),
        "mHC + norms": mhc_activation_bytes(recipe) + 2 * norm_activation_bytes(recipe, m.hidden_size, r.sp),
        f"{m.layer_types()[index].upper()} attention": attention_activation_bytes(recipe, index),
    }
    if recipe.train.lora.enabled:
        parts[LORA_LABEL] = lora_activation_bytes(recipe, index)
    return parts


def layer_activation_bytes(recipe: Recipe, index: int) -> int:
    """Everything layer ``index`` keeps for backward without recompute (exchange excluded)."""
    return sum(layer_parts(recipe, index).values())


def checkpoint_input_bytes(recipe: Recipe, mode: str) -> int:
    """What a recompute keeps to rebuild from: the layer's input streams [s, N, D] (``full``),
    the attention block's input [s, D] (``selective``), nothing (``none``)."""
    m, r, w = recipe.model, rows_of(recipe), act_bytes(recipe)
    width = {"full": m.hyper_connections.num_streams * m.hidden_size, "selective": m.hidden_size, "none": 0}
    return r.sp * width[mode] * w


def layer_kept_bytes(recipe: Recipe, index: int) -> dict[str, int]:
    """What layer ``index`` keeps for backward at the end of the forward, under its recompute
    mode (``train.recompute_of``), by the plan table's labels: ``full`` keeps its input streams
    (the checkpoint); ``selective`` keeps the attention block's input [s, D] instead of its
    norm and attention tensors; ``none`` keeps everything."""
    m = recipe.model
    kind = m.layer_types()[index]
    mode = recipe.train.recompute_of(kind)
    if mode == "full":
        return {"layer inputs (checkpoints)": checkpoint_input_bytes(recipe, mode)}
    kept = layer_parts(recipe, index)
    if mode == "selective":
        del kept[f"{kind.upper()} attention"]
        kept["mHC + norms"] -= norm_activation_bytes(recipe, m.hidden_size, rows_of(recipe).sp)
        if LORA_LABEL in kept:
            kept[LORA_LABEL] -= lora_activation_bytes(recipe, index, "attention")
        kept["attention inputs (checkpoints)"] = checkpoint_input_bytes(recipe, mode)
    return kept


def layer_backward_bytes(recipe: Recipe, index: int) -> int:
    """What layer ``index`` holds while its attention block runs backward (its FFN has finished
    backward): its tensors without the FFN's, rebuilt ones included, plus the checkpoint input
    that a recompute keeps."""
    mode = recipe.train.recompute_of(recipe.model.layer_types()[index])
    return (layer_activation_bytes(recipe, index) - mlp_activation_bytes(recipe, index)
            - lora_activation_bytes(recipe, index, "mlp") + checkpoint_input_bytes(recipe, mode))


def ffn_backward_bytes(recipe: Recipe, index: int) -> int:
    """What layer ``index`` holds while its FFN block (MoE or dense MLP) runs backward (first in
    the layer): under full recompute the whole rebuilt layer and its checkpoint input; otherwise
    what it kept (its attention block is rebuilt only after, under selective recompute)."""
    mode = recipe.train.recompute_of(recipe.model.layer_types()[index])
    if mode == "full":
        return layer_activation_bytes(recipe, index) + checkpoint_input_bytes(recipe, mode)
    return sum(layer_kept_bytes(recipe, index).values())
