"""Our KimiDeltaAttention equals transformers' glm5_next linear attention (the reference model)
on the same weights: the gate formula, conv taps, L2 norm, gated RMSNorm and projections all agree.

Runs in a spawned process: fla is hidden there so that transformers uses its torch fallbacks.
"""

import torch

from tests.support.ranks import run_ranks

HIDDEN, HEADS, HEAD_DIM = 48, 4, 16


def hf_to_ours(hf) -> dict[str, torch.Tensor]:
    """Name map from transformers' Glm5NextTextLinearAttention to our layer (TP=1)."""
    fg = hf.forget_gate
    return {
        "q_proj.weight": hf.q_proj.weight, "k_proj.weight": hf.k_proj.weight,
        "v_proj.weight": hf.v_proj.weight, "b_proj.weight": hf.b_proj.weight,
        "f_a_weight": fg.f_a_proj.weight, "f_b_proj.weight": fg.f_b_proj.weight,
        "g_a_weight": hf.g_a_proj.weight, "g_b_proj.weight": hf.g_b_proj.weight,
        "A_log": fg.A_log, "dt_bias": fg.dt_bias,
        "conv_weight": hf.conv1d.weight.view(3, HEADS * HEAD_DIM, -1),  # channels [q | k | v]
        "o_norm_weight": hf.o_norm.weight, "o_proj.weight": hf.o_proj.weight,
    }


def _compare(rank, world):
    import sys

    sys.modules["fla"] = None  # transformers would pick fla's Triton kernels, which need a GPU
    import torch.distributed as dist
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    from skyrl_megatron_kda.config import MeshRecipe
    from skyrl_megatron_kda.kda.parity import build_layer
    from skyrl_megatron_kda.distributed.tensor_parallel import load_full_state

    torch.manual_seed(0)
    config = Glm5NextTextConfig(
        vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        hidden_size=HIDDEN, num_hidden_layers=4, linear_num_heads=HEADS, linear_head_dim=HEAD_DIM)
    hf = Glm5NextTextLinearAttention(config, layer_idx=0).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        hf.forget_gate.A_log.uniform_(0, 2.7)  # per-head decay rates break head symmetry
        hf.o_norm.weight.add_(1.0)

    recipe = MeshRecipe(
        model={"hidden_size": HIDDEN, "params_dtype": "float32"},
        kda={"num_heads": HEADS, "head_dim": HEAD_DIM, "gate_low_rank": HEAD_DIM,
             "output_gate_low_rank": HEAD_DIM, "kernel": "torch",
             "gate_lower_bound": config.linear_lower_bound, "norm_eps": config.rms_norm_eps},
        data={"seq_len": 70})
    group = dist.new_group([0])
    ours = build_layer(recipe, group, group, on_cpu=True)
    load_full_state(ours, {k: v.detach() for k, v in hf_to_ours(hf).items()}, 0, 1)

    x = torch.randn(2, 70, HIDDEN)  # [b, T, D]: 70 tokens, not a multiple of the 64-token chunk
    ref = hf(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    out, _ = ours(x.transpose(0, 1).contiguous())
    err = float((out.transpose(0, 1) - ref).abs().max() / ref.abs().max())
    scrambled = hf_to_ours(hf)
    scrambled["conv_weight"] = scrambled["conv_weight"].flip(-1)  # control: reversed conv taps
    load_full_state(ours, {k: v.detach() for k, v in scrambled.items()}, 0, 1)
    bad, _ = ours(x.transpose(0, 1).contiguous())
    control = float((bad.transpose(0, 1) - ref).abs().max() / ref.abs().max())
    return err, control


def test_layer_matches_transformers_glm5_next():
    ((err, control),) = run_ranks(1, _compare)
    assert err < 1e-5, f"ours vs transformers glm5_next: relative error {err:.2e}"
    assert control > 1e-2, f"reversed conv taps went unnoticed ({control:.2e})"
