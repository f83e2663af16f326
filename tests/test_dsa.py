"""GLM DSA layer on megatron-core equals transformers' Glm5NextTextAttention (CPU, fp32)."""

import pytest
import torch

from tests.distributed import run_ranks

S, B, H = 40, 2, 64
CFG = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
           kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, qk_rope_head_dim=0,
           index_n_heads=2, index_head_dim=16, index_topk=8, index_kpool=4, rms_norm_eps=1e-5)


def _reference(kpool):
    import sys

    sys.modules["fla"] = None  # transformers would pick fla's GPU-only kernels otherwise
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    cfg = Glm5NextTextConfig(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             num_hidden_layers=4, **{**CFG, "index_kpool": kpool})
    cfg._attn_implementation = "eager"
    assert cfg.indexer_types[3] == "full"
    torch.manual_seed(0)
    ref = Glm5NextTextAttention(cfg, layer_idx=3).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.1) + (1.0 if p.ndim == 1 else 0.0))
        ref.indexer.index_kpool_compress_ape.normal_()
        ref.indexer.index_kpool_compress_gate.normal_(std=0.3)
    return ref


def _ours(kpool, dense=False):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from skyrl_megatron_kda.model.dsa import glm_dsa_layer_spec

    topk = S + kpool if dense else CFG["index_topk"]  # dense control: every pool selected
    config = MLATransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=4 * H,
        multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16,
        qk_pos_emb_head_dim=0, v_head_dim=16, rope_type="rope", rotary_scaling_factor=1.0,
        normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False, qk_layernorm=True,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True, dsa_indexer_n_heads=2, dsa_indexer_head_dim=16,
        dsa_indexer_topk=topk - topk % kpool, dsa_indexer_rotate_activation=False,
        dsa_indexer_scoring_relu=True, dsa_indexer_k_norm_epsilon=1e-6,
    )
    return build_module(glm_dsa_layer_spec(kpool), config=config, layer_number=4,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _copy(ref, ours):
    ca, ix, rx = ours.core_attention, ours.core_attention.indexer, ref.indexer
    pairs = [(ref.q_a_proj.weight, ours.linear_q_down_proj.weight),
             (ref.q_a_layernorm.weight, ours.q_layernorm.weight),
             (ref.q_b_proj.weight, ours.linear_q_up_proj.weight),
             (ref.kv_a_proj_with_mqa.weight, ours.linear_kv_down_proj.weight),
             (ref.kv_a_layernorm.weight, ours.kv_layernorm.weight),
             (ref.kv_b_proj.weight, ours.linear_kv_up_proj.weight),
             (ref.o_proj.weight, ours.linear_proj.weight),
             (rx.wq_b.weight, ix.linear_wq_b.weight), (rx.wk.weight, ix.linear_wk.weight),
             (rx.k_norm.weight, ix.k_norm.weight), (rx.k_norm.bias, ix.k_norm.bias),
             (rx.weights_proj.weight, ix.linear_weights_proj.weight),
             (rx.index_kpool_compress_ape, ix.kpool_compress_ape),
             (rx.index_kpool_compress_gate, ix.kpool_compress_gate)]
    with torch.no_grad():
        for src, dst in pairs:
            assert src.shape == dst.shape, (src.shape, dst.shape)
            dst.copy_(src)
    assert ca is not None


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def _compare(rank, world, kpool):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    ref = _reference(kpool)
    ours = _ours(kpool)
    _copy(ref, ours)
    dense = _ours(kpool, dense=True)
    _copy(ref, dense)

    torch.manual_seed(1)
    x = torch.randn(B, S, H, requires_grad=True)
    out_ref, _, _ = ref(x, attention_mask=torch.ones(B, S, dtype=torch.bool))
    out_ref.backward(torch.ones_like(out_ref) / out_ref.numel() ** 0.5)

    xm = x.detach().transpose(0, 1).clone().requires_grad_(True)  # megatron is [s, b, h]
    out, bias = ours(xm, attention_mask=None)
    assert bias is None
    out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    out_dense, _ = dense(x.detach().transpose(0, 1), attention_mask=None)

    # Index parity: same selected token sets per query as the reference indexer.
    q_resid = ref.q_a_layernorm(ref.q_a_proj(x.detach()))
    ref_idx = ref.indexer(x.detach(), q_resid, torch.ones(B, S, dtype=torch.bool), None)
    qr, _ = ours.linear_q_down_proj(xm.detach())
    our_idx = ours.core_attention.indexer(xm.detach(), ours.q_layernorm(qr))
    sets_equal = all(
        set(ref_idx[b, s].tolist()) - {-1} == set(our_idx[b, s].tolist()) - {-1}
        for b in range(B) for s in range(S))
    kept = float((our_idx >= 0).sum(-1).float().mean())
    return dict(
        out=_rel(out.transpose(0, 1), out_ref), grad=_rel(xm.grad.transpose(0, 1), x.grad),
        dense=_rel(out_dense.transpose(0, 1), out_ref), sets_equal=sets_equal, kept=kept)


@pytest.mark.parametrize("kpool", [4, 1])
def test_dsa_matches_transformers(kpool):
    (r,) = run_ranks(1, _compare, kpool)
    print(kpool, r)
    assert r["sets_equal"]
    assert r["kept"] < S / 2, f"top-k should drop keys: {r['kept']} kept of up to {S}"
    assert r["out"] < 1e-5, r
    assert r["grad"] < 1e-5, r
    assert r["dense"] > 1e-3, r  # negative control: all causal keys instead of the top-k
