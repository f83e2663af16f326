"""megatron-core's MoELayer, configured by model/moe.py and loaded by model/hf_io.py, computes
transformers' Glm5NextTextMoE: on one rank, over EP2, and on a TP2 x EP2 x ETP2 mesh."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from skyrl_megatron_kda.config import MoEConfig
from skyrl_megatron_kda.model.hf_io import load_hf_tensors, moe_layer_entries
from skyrl_megatron_kda.model.moe import (
    check_glm_moe_config,
    moe_transformer_config_kwargs,
    moe_weight_name_map,
)
from tests.support.ranks import run_ranks

TINY = dict(num_experts=8, top_k=2, ffn_hidden_size=16, num_shared_experts=1, routed_scaling_factor=2.5)
HIDDEN = 32
TP2_EP2_ETP2 = dict(tp=2, ep=2, etp=2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _reference(moe: MoEConfig):
    """GLM's MoE with random weights (same on every rank); sizes chosen so that the clamp fires and
    the correction bias changes the selection of many tokens."""
    import sys

    sys.modules["fla"] = None  # keep transformers on its torch fallbacks (fla's kernels are GPU-only)
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE

    cfg = Glm5NextTextConfig(
        hidden_size=HIDDEN, n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.ffn_hidden_size, n_shared_experts=moe.num_shared_experts,
        routed_scaling_factor=moe.routed_scaling_factor, n_group=1, topk_group=1,
        norm_topk_prob=moe.norm_topk_prob, swiglu_limit=moe.swiglu_limit, hidden_act="silu",
        vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    ref = Glm5NextTextMoE(cfg)
    with torch.no_grad():
        ref.gate.weight.normal_(0, 0.05)
        ref.gate.e_score_correction_bias.normal_(0, 0.1)
        ref.experts.gate_up_proj.normal_(0, 0.4)
        ref.experts.down_proj.normal_(0, 0.1)
        for lin in (ref.shared_experts.gate_proj, ref.shared_experts.up_proj):
            lin.weight.normal_(0, 0.4)
        ref.shared_experts.down_proj.weight.normal_(0, 0.1)
    return ref


def _checkpoint_tensors(ref) -> dict:
    """The reference's weights under the names a glm5_next checkpoint stores (relative to the
    layer's ``mlp.``): transformers fuses the routed experts when it loads (``gate_up_proj``
    [E, 2I, H] with the gate rows first, ``down_proj`` [E, H, I]) and saves them one tensor per
    expert and projection."""
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    for e in range(len(gate_up)):
        gate, up = gate_up[e].chunk(2)
        state[f"experts.{e}.gate_proj.weight"] = gate.contiguous()
        state[f"experts.{e}.up_proj.weight"] = up.contiguous()
        state[f"experts.{e}.down_proj.weight"] = down[e].contiguous()
    return state


def _megatron_layer(moe: MoEConfig, mesh: dict, checkpoint: dict, **overrides):
    """Our MoE layer on this rank of ``mesh``, its weights loaded from ``checkpoint`` by
    model/hf_io.py (the loader of whole models: names, GLU fc1 shards, EP experts)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from skyrl_megatron_kda.model.moe import moe_layer_spec

    kwargs = moe_transformer_config_kwargs(moe.model_copy(update={"dispatcher": "allgather"}))
    kwargs.update(overrides)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, params_dtype=torch.float32,
        use_cpu_initialization=True, tensor_model_parallel_size=mesh["tp"],
        expert_model_parallel_size=mesh["ep"], expert_tensor_parallel_size=mesh["etp"],
        sequence_parallel=mesh["tp"] > 1,  # megatron requires SP for MoE with TP
        gradient_accumulation_fusion=False, **kwargs,
    )
    check_glm_moe_config(config)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    layer = moe_layer_spec(moe)(config=config, layer_number=1, pg_collection=pgs)
    entries = moe_layer_entries(moe, ep_rank=pgs.ep.rank(), ep_size=pgs.ep.size())
    load_hf_tensors(layer, entries, checkpoint.__getitem__, tp=pgs.tp, etp=pgs.expt_tp)
    return layer


def _glm_vs_megatron(rank, world, mesh, moe_fields=TINY):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=mesh["tp"], expert_model_parallel_size=mesh["ep"],
        expert_tensor_parallel_size=mesh["etp"])
    moe = MoEConfig(**moe_fields)
    ref = _reference(moe)
    checkpoint = _checkpoint_tensors(ref)
    layer = _megatron_layer(moe, mesh, checkpoint)

    # Each rank routes its own tokens (with SP, its own part of the sequence).
    gen = torch.Generator().manual_seed(100 + rank)
    x = 3.0 * torch.randn(24, 2, HIDDEN, generator=gen)  # megatron's [s, b, h]
    dy = torch.randn(24, 2, HIDDEN, generator=gen)

    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref.transpose(0, 1).contiguous()).transpose(0, 1)
    y_ref.backward(dy)
    x_meg = x.clone().requires_grad_()
    y_meg, bias = layer(x_meg)
    y_meg.backward(dy)
    out = {"bias_is_none": bias is None, "out": _rel(y_meg, y_ref), "dx": _rel(x_meg.grad, x_ref.grad),
           "y": y_meg.detach(), "x_grad": x_meg.grad}

    with torch.no_grad():  # how much the test exercises: clamp hits, selections the bias changed
        flat = x.reshape(-1, HIDDEN)
        gu = torch.einsum("th,eih->tei", flat, ref.experts.gate_up_proj)
        gate, up = gu.chunk(2, dim=-1)
        out["clamped_frac"] = float(((gate > 10) | (up.abs() > 10)).float().mean())
        scores = torch.sigmoid(flat @ ref.gate.weight.T)
        with_bias = (scores + ref.gate.e_score_correction_bias).topk(moe.top_k).indices.sort().values
        without = scores.topk(moe.top_k).indices.sort().values
        out["bias_changed_frac"] = float((with_bias != without).any(-1).float().mean())

    if world == 1:  # parameter gradients see the same tokens only on one rank
        out["grad_router"] = _rel(layer.router.weight.grad, ref.gate.weight.grad)
        fc1 = torch.stack([e.linear_fc1.weight.grad for e in layer.experts.local_experts])
        out["grad_experts_fc1"] = _rel(fc1, ref.experts.gate_up_proj.grad)
        out["grad_shared_fc2"] = _rel(layer.shared_experts.linear_fc2.weight.grad,
                                      ref.shared_experts.down_proj.weight.grad)
        controls = {
            "no_correction_bias": dict(moe=moe.model_copy(update={"score_correction_bias": False})),
            "softmax_scores": dict(moe=moe.model_copy(
                update={"score_function": "softmax", "score_correction_bias": False})),
            "no_clamp": dict(moe=moe.model_copy(update={"swiglu_limit": None})),
            "no_scaling": dict(moe=moe.model_copy(update={"routed_scaling_factor": 1.0})),
        }
        with torch.no_grad():
            for name, c in controls.items():
                bad = _megatron_layer(c["moe"], mesh, checkpoint)
                out["control_" + name] = _rel(bad(x)[0], y_ref)
    if mesh["etp"] > 1:
        ranks = (parallel_state.get_tensor_model_parallel_rank(),
                 parallel_state.get_expert_model_parallel_rank(),
                 parallel_state.get_expert_tensor_parallel_rank())
        out["tp_ep_etp_ranks"] = ranks
        out["loaded"] = {k: v.detach().clone() for k, v in layer.state_dict().items()
                         if not k.endswith("_extra_state")}
        out["hf_runtime"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        # Negative control: each expert's fc1 as a plain ETP slice of [gate; up] (what a loader
        # that ignored the GLU layout would give) must change the output.
        with torch.no_grad():
            for local, expert in enumerate(layer.experts.local_experts):
                e = ranks[1] * len(layer.experts.local_experts) + local
                full = ref.experts.gate_up_proj[e]
                expert.linear_fc1.weight.copy_(full.chunk(mesh["etp"], dim=0)[ranks[2]])
            out["control_plain_fc1_slice"] = _rel(layer(x)[0], y_ref)
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ep1():
    (res,) = run_ranks(1, _glm_vs_megatron, dict(tp=1, ep=1, etp=1))
    return res


@pytest.fixture(scope="module")
def tp2_ep2_etp2():
    """4 ranks: the shared expert sharded over TP2 (with SP), routed experts over EP2 x ETP2."""
    return run_ranks(4, _glm_vs_megatron, TP2_EP2_ETP2)


def test_megatron_moe_equals_glm_reference(ep1):
    print({k: v for k, v in ep1.items() if not isinstance(v, torch.Tensor)})
    assert ep1["bias_is_none"]
    assert ep1["clamped_frac"] > 0.05, "the SwiGLU clamp is not exercised"
    assert ep1["bias_changed_frac"] > 0.1, "the correction bias does not change the selection"
    for key in ("out", "dx", "grad_router", "grad_experts_fc1", "grad_shared_fc2"):
        assert ep1[key] < 1e-5, f"{key}: relative error {ep1[key]:.3g} vs transformers"


def test_negative_controls_differ(ep1):
    """Dropping any GLM feature changes the output, so the comparison above can fail."""
    for name in ("no_correction_bias", "softmax_scores", "no_clamp", "no_scaling"):
        assert ep1["control_" + name] > 1e-3, f"{name}: {ep1['control_' + name]:.3g}"


def test_expert_parallel_2_equals_reference_and_ep1(ep1):
    """Allgather dispatcher, 4 experts per rank, each rank its own tokens (rank 0's = EP1's)."""
    res = run_ranks(2, _glm_vs_megatron, dict(tp=1, ep=2, etp=1))
    for rank, r in enumerate(res):
        print(f"EP2 rank {rank}: out {r['out']:.3g}, dx {r['dx']:.3g}")
        assert r["out"] < 1e-5 and r["dx"] < 1e-5, f"EP2 rank {rank}: {r}"
    ep_gap = max(_rel(res[0]["y"], ep1["y"]), _rel(res[0]["x_grad"], ep1["x_grad"]))
    print(f"EP2 vs EP1: {ep_gap:.3g}")
    assert ep_gap < 1e-6


@pytest.mark.parametrize("fields, field", [
    (dict(norm_topk_prob=False), r"model\.moe\.norm_topk_prob=false with model\.moe\.top_k=2"),
    (dict(top_k=1), r"model\.moe\.top_k=1 with model\.moe\.norm_topk_prob=true"),
    (dict(top_k=1, score_function="softmax", score_correction_bias=False),
     r"model\.moe\.top_k=1 with model\.moe\.norm_topk_prob=true: .*softmax"),
    (dict(score_function="softmax"), r"model\.moe\.score_correction_bias=true with .*softmax"),
], ids=["sigmoid-unnormalised-top2", "normalised-top1", "softmax-normalised-top1",
        "softmax-with-bias"])
def test_unexpressible_router_variants_are_refused_naming_the_field(fields, field):
    with pytest.raises(ValidationError, match=field):
        MoEConfig(**{**TINY, **fields})


ROUTER_GRID = [dict(score_function=f, score_correction_bias=b, norm_topk_prob=n, top_k=k)
               for f in ("sigmoid", "softmax") for b in (True, False) for n in (True, False)
               for k in (1, 2)]


@pytest.mark.parametrize("fields", ROUTER_GRID, ids=lambda f: "-".join(map(str, f.values())))
def test_every_accepted_router_variant_builds_a_megatron_config(fields):
    """What MoEConfig accepts, megatron's TransformerConfig accepts too: a refusal comes when the
    recipe is built, never after Ray has started."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        moe = MoEConfig(**{**TINY, **fields})
    except ValidationError as err:
        assert "model.moe." in str(err)
        return
    TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                      use_cpu_initialization=True, gradient_accumulation_fusion=False,
                      **moe_transformer_config_kwargs(moe))


def test_top_1_routing_equals_reference():
    """top_k=1 runs when it is expressible (norm_topk_prob=false: the weight is the score)."""
    (r,) = run_ranks(1, _glm_vs_megatron, dict(tp=1, ep=1, etp=1),
                     {**TINY, "top_k": 1, "norm_topk_prob": False})
    print(f"top-1: out {r['out']:.3g}, dx {r['dx']:.3g}, router grad {r['grad_router']:.3g}")
    assert r["out"] < 1e-5 and r["dx"] < 1e-5 and r["grad_router"] < 1e-5, r


def test_clamp_dropping_configs_are_refused():
    good = SimpleNamespace(activation_func_clamp_value=10.0, bias_activation_fusion=False,
                           use_te_activation_func=False, use_te_op_fuser=False,
                           activation_func=F.silu, gated_linear_unit=True, glu_linear_offset=0.0)
    check_glm_moe_config(good)
    for field, value in (("bias_activation_fusion", True), ("use_te_activation_func", True),
                         ("use_te_op_fuser", True), ("glu_linear_offset", 1.0)):
        with pytest.raises(ValueError, match=field):
            check_glm_moe_config(SimpleNamespace(**{**vars(good), field: value}))


def test_tp2_ep2_etp2_equals_reference(tp2_ep2_etp2):
    """Loaded through model/hf_io.py on a TP2 x EP2 x ETP2 mesh, every rank's tokens give
    transformers' output and input gradient; plain-sliced GLU shards do not (negative control)."""
    for rank, r in enumerate(tp2_ep2_etp2):
        print(f"TP2xEP2xETP2 rank {rank} {r['tp_ep_etp_ranks']}: out {r['out']:.3g}, "
              f"dx {r['dx']:.3g}, plain fc1 slice {r['control_plain_fc1_slice']:.3g}")
        assert r["bias_is_none"]
        assert r["out"] < 1e-5 and r["dx"] < 1e-5, f"rank {rank}: out {r['out']}, dx {r['dx']}"
        assert r["control_plain_fc1_slice"] > 1e-3, f"rank {rank}: {r['control_plain_fc1_slice']}"
    # Every pair of EP and ETP ranks holds its shards (so each expert shard was checked).
    assert {r["tp_ep_etp_ranks"][1:] for r in tp2_ep2_etp2} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_weight_map_shards_glu_and_experts(tp2_ep2_etp2):
    """EP splits routed experts; ETP/TP shards of fc1 are [gate shard; up shard]. Checked on the
    tensors model/hf_io.py loaded into the rank with TP, EP and ETP rank 1."""
    moe = MoEConfig(**TINY)
    E, I, H = moe.num_experts, moe.ffn_hidden_size, HIDDEN
    (r,) = [r for r in tp2_ep2_etp2 if r["tp_ep_etp_ranks"] == (1, 1, 1)]
    hf, s = r["hf_runtime"], r["loaded"]
    assert hf["experts.gate_up_proj"].shape == (E, 2 * I, H)
    names = moe_weight_name_map(moe, ep_rank=1, ep_size=2)
    assert names["experts.local_experts.0.linear_fc1.weight"] == ("experts.gate_up_proj[4]",)
    assert set(s) == set(names)
    gate, up = hf["experts.gate_up_proj"][5].chunk(2)
    torch.testing.assert_close(s["experts.local_experts.1.linear_fc1.weight"],
                               torch.cat([gate[I // 2:], up[I // 2:]]))
    torch.testing.assert_close(s["experts.local_experts.1.linear_fc2.weight"],
                               hf["experts.down_proj"][5][:, I // 2:])
    torch.testing.assert_close(s["shared_experts.linear_fc1.weight"],
                               torch.cat([hf["shared_experts.gate_proj.weight"][I // 2:],
                                          hf["shared_experts.up_proj.weight"][I // 2:]]))
    # Every other loaded tensor too: the router replicated, each local expert's ETP shards.
    torch.testing.assert_close(s["router.weight"], hf["gate.weight"])
    torch.testing.assert_close(s["router.expert_bias"], hf["gate.e_score_correction_bias"])
    torch.testing.assert_close(s["shared_experts.linear_fc2.weight"],
                               hf["shared_experts.down_proj.weight"][:, I // 2:])
    for local in range(E // 2):
        gate, up = hf["experts.gate_up_proj"][4 + local].chunk(2)
        torch.testing.assert_close(s[f"experts.local_experts.{local}.linear_fc1.weight"],
                                   torch.cat([gate[I // 2:], up[I // 2:]]))
        torch.testing.assert_close(s[f"experts.local_experts.{local}.linear_fc2.weight"],
                                   hf["experts.down_proj"][4 + local][:, I // 2:])
