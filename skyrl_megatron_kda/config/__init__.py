"""Pydantic configuration of a recipe: the model, its parallel layout, the KDA layer and its CP
exchange, data, training loop, run and cluster, one module per section.

Every invalid combination is refused at config time, with a message that names the values and
the fix; nothing downstream falls back. This package imports nothing else of the package, nor
torch or megatron-core (a recipe is read without them): the rules that ask a registry (the names
``kda.cp_exchange`` and ``model.dsa.kernel`` may take, an exchange's mesh rule, a DSA kernel's
device and split, the CP layout's row multiple) are ``recipe_rules``'s, applied wherever a recipe
is loaded. Environment variables are read only by ``loading.env_cp_exchange``.
"""

from .base import NonNegativeInt, PositiveInt
from .cluster import LINK_PRESETS, ClusterConfig, InterNodeKind, LinkConfig
from .data import DataConfig
from .dotpath import DuplicateKey, flatten, load_yaml, merge, parse_overrides, unflatten
from .kda import KDAConfig
from .lora import LoRAConfig
from .loading import CP_EXCHANGE_ENV, apply_env_overrides, env_cp_exchange
from .model import (
    KERNEL_OPTIONS,
    DSAConfig,
    FusedOptions,
    HyperConnectionConfig,
    LatentOptions,
    LayerType,
    MLPType,
    ModelConfig,
    MoEConfig,
    TorchOptions,
)
from .parallel import ParallelConfig
from .recipe import MeshRecipe, Recipe
from .run import RunConfig
from .train import TrainConfig

__all__ = [
    "CP_EXCHANGE_ENV", "DuplicateKey", "KERNEL_OPTIONS", "LINK_PRESETS", "ClusterConfig", "DSAConfig", "DataConfig",
    "FusedOptions", "HyperConnectionConfig", "InterNodeKind", "KDAConfig", "LatentOptions",
    "LayerType", "LinkConfig", "LoRAConfig", "MLPType", "MeshRecipe", "ModelConfig",
    "MoEConfig",
    "NonNegativeInt", "ParallelConfig", "PositiveInt", "Recipe", "RunConfig", "TorchOptions",
    "TrainConfig", "apply_env_overrides", "env_cp_exchange", "flatten",
    "load_yaml", "merge", "parse_overrides", "unflatten",
]
