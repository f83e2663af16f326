"""KimiDeltaAttention plugs into megatron-core's TransformerLayer as its self_attention."""

import torch

from tests.support.ranks import run_ranks


def _layer_in_transformer_layer(rank, world):
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from skyrl_megatron_kda.config import MeshRecipe
    from skyrl_megatron_kda.kda.layer import KimiDeltaAttention, kda_layer_spec
    from skyrl_megatron_kda.megatron_config import transformer_config

    parallel_state.initialize_model_parallel()
    recipe = MeshRecipe(model={"hidden_size": 32, "params_dtype": "float32"},
                         kda={"num_heads": 2, "head_dim": 16, "gate_low_rank": 8,
                              "output_gate_low_rank": 8, "kernel": "torch"},
                         data={"seq_len": 70})
    config = transformer_config(recipe, use_cpu=True)
    config.hidden_dropout = 0.0
    config.normalization = "RMSNorm"
    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=kda_layer_spec(recipe.kda, recipe.parallel.cp_layout),
        self_attn_bda=get_bias_dropout_add))
    torch.manual_seed(0)
    layer = build_module(spec, config=config, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    assert isinstance(layer.self_attention, KimiDeltaAttention)
    x = torch.randn(70, 3, 32)
    out, _ = layer(x, attention_mask=None)
    attn, bias = layer.self_attention(layer.input_layernorm(x))
    assert bias is None
    return float((out - (x + attn)).abs().max()), tuple(out.shape)


def test_kda_is_a_transformer_layer_self_attention():
    ((err, shape),) = run_ranks(1, _layer_in_transformer_layer)
    assert shape == (70, 3, 32)
    assert err < 1e-6, f"TransformerLayer output != x + KDA(norm(x)): {err}"

