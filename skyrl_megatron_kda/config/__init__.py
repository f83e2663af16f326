"""Pydantic configuration of a recipe: the model, its parallel layout, the KDA layer and its CP
exchange, data, training loop, run and cluster, one module per section.

Every invalid combination is refused here, at config time, with a message that names the values
and the fix; nothing downstream falls back. ``kda.cp_exchange`` is checked against the live
exchange registry (``kda.exchanges``), and whether an exchange can run on the mesh against that
exchange's own rule; the registry and the CP layout kinds are the only torch-importing
dependencies. Environment variables are read only by ``loading.env_cp_exchange``.
"""

from .base import NonNegativeInt, PositiveInt
from .cluster import LINK_PRESETS, ClusterConfig, InterNodeKind, LinkConfig
from .data import DataConfig
from .dotpath import flatten, merge, parse_overrides, unflatten
from .kda import KDAConfig, cp_exchange_choices
from .loading import (
    CP_EXCHANGE_ENV,
    apply_env_overrides,
    env_cp_exchange,
    load_mesh_recipe,
    load_recipe_dict,
)
from .model import DSAConfig, HyperConnectionConfig, LayerType, MLPType, ModelConfig, MoEConfig
from .parallel import ParallelConfig
from .recipe import MeshRecipe, Recipe
from .run import RunConfig
from .train import TrainConfig

__all__ = [
    "CP_EXCHANGE_ENV", "LINK_PRESETS", "ClusterConfig", "DSAConfig", "DataConfig",
    "HyperConnectionConfig", "InterNodeKind", "KDAConfig", "LayerType", "LinkConfig", "MLPType",
    "MeshRecipe", "ModelConfig", "MoEConfig", "NonNegativeInt", "ParallelConfig", "PositiveInt",
    "Recipe", "RunConfig", "TrainConfig", "apply_env_overrides", "cp_exchange_choices",
    "env_cp_exchange",
    "flatten", "load_mesh_recipe", "load_recipe_dict", "merge", "parse_overrides", "unflatten",
]
