"""The DSA layer's kernels, by name: the one registry that ``model.dsa.kernel`` is validated
against, ``auto`` chooses from, the layer builds from and ``plan`` reads the memory terms of.

Adding a kernel is one module with a ``DSAKernel`` subclass and one ``register`` line here (or a
``register`` call in a plugin). Registration order is ``auto``'s order of preference: the first
candidate that the recipe's device does not refuse.
"""

from __future__ import annotations

from ...registry import AUTO, Registry
from .absorbed import AbsorbedKernel
from .base import DSAKernel, DSAShape, KVDims
from .fused import FusedKernel
from .latent import LatentKernel
from .torch_blocks import TorchKernel
from .unfused import UnfusedKernel

REGISTRY = Registry(DSAKernel, "model.dsa.kernel", "recipes.load_recipe, or dsa.kernels.resolve")
register, unregister, names, get = REGISTRY.register, REGISTRY.unregister, REGISTRY.names, REGISTRY.get


def resolve(name: str, device: str) -> str:
    """``name``, or for ``auto`` the first registered candidate that ``device`` does not refuse
    (latent on a GPU, torch on a CPU)."""
    if name != AUTO:
        return name
    for candidate, cls in REGISTRY.items():
        if cls.auto_candidate and cls.refusal(device) is None:
            return candidate
    raise ValueError(f"model.dsa.kernel=auto has no kernel to pick on run.device={device}")


register(LatentKernel)
register(FusedKernel)
register(TorchKernel)
register(UnfusedKernel)

__all__ = [
    "AUTO", "REGISTRY", "AbsorbedKernel", "DSAKernel", "DSAShape", "FusedKernel", "KVDims",
    "LatentKernel", "TorchKernel", "UnfusedKernel", "get", "names", "register", "resolve", "unregister",
]
