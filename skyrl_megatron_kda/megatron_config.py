"""Our recipe as megatron-core's ``TransformerConfig``: mesh sizes, dtype, initialisation."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from .config import MeshRecipe

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``model.params_dtype`` -> the torch dtype megatron's configs take."""


def transformer_config(recipe: MeshRecipe, *, use_cpu: bool, initialize: bool = True) -> TransformerConfig:
    """Megatron's config for a model built from ``recipe``.

    On CPU, weights are initialised as full tensors and then sliced (``use_cpu_initialization``),
    which also makes the model independent of the TP size for a given seed. ``initialize=False``
    skips random initialisation (for weights that are loaded right after).
    """
    return TransformerConfig(
        num_layers=1,
        hidden_size=recipe.model.hidden_size,
        num_attention_heads=recipe.kda.num_heads,
        **mesh_config_kwargs(recipe, use_cpu=use_cpu, initialize=initialize),
    )


def mesh_config_kwargs(recipe: MeshRecipe, *, use_cpu: bool, initialize: bool = True) -> dict:
    """The ``TransformerConfig`` fields every model of ``recipe`` shares: mesh sizes, dtype,
    CPU initialisation (see ``transformer_config``)."""
    dtype = PARAM_DTYPES[recipe.model.params_dtype]
    par = recipe.parallel
    return dict(
        tensor_model_parallel_size=par.tp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu,
        perform_initialization=initialize,
        gradient_accumulation_fusion=False,
    )
