"""Host memory of ``train.offload_activations``: which tensors are copied to the host, and the
pinned blocks torch's caching host allocator takes for them."""

from __future__ import annotations

from ..config import Recipe
from .head import embedding_tensor_bytes
from .layers import checkpoint_input_bytes, layer_kept_bytes


def pinned_block_bytes(nbytes: int) -> int:
    """Host bytes torch's caching host allocator takes for a pinned tensor of ``nbytes``: the
    next power of two (its rounding under the default config)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def offloaded_tensor_bytes(recipe: Recipe) -> list[int] | None:
    """Sizes of the tensors ``train.offload_activations`` copies to the host per forward, one
    entry per tensor (model/host_offload.py copies each once), when every layer is under full
    recompute: the token ids and each layer's input streams. The head's tensors stay on the
    device: saved last and read first, moving them would lower no peak. None otherwise: layers
    that keep their own tensors are modelled in bytes per block, not tensor by tensor."""
    m, t = recipe.model, recipe.train
    if any(t.recompute_of(kind) != "full" for kind in m.layer_types()):
        return None
    return embedding_tensor_bytes(recipe) + [checkpoint_input_bytes(recipe, "full")] * m.num_layers


def host_activation_bytes(recipe: Recipe) -> tuple[int, bool]:
    """(host bytes of the offloaded activations per rank, whether exact). Exact under full
    recompute: each tensor in its own pinned block on a GPU (``pinned_block_bytes``), as it is on
    CPU; otherwise the kept bytes, a lower bound (the pinned blocks round each tensor up)."""
    if not recipe.train.offload_activations:
        return 0, True
    sizes = offloaded_tensor_bytes(recipe)
    if sizes is None:
        kept = sum(sum(layer_kept_bytes(recipe, i).values()) for i in range(recipe.model.num_layers))
        return kept + sum(embedding_tensor_bytes(recipe)), False
    pinned = recipe.run.device == "gpu"
    return sum(pinned_block_bytes(n) if pinned else n for n in sizes), True
