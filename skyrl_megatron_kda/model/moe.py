"""GLM-5.3-Flash's MoE block as megatron-core's own MoELayer (router, experts, shared expert).

Everything is expressed through stock ``TransformerConfig`` fields; the layer is megatron's
MoELayer through ``model/moe_layer.py``'s ``GLMMoELayer``, which adds two memory fixes (routing
state released after each forward, ``train.moe_chunk_tokens``) and nothing to the arithmetic. The GLM feature -> megatron field map (see ``moe_transformer_config_kwargs``):

=====================================  =========================================================
GLM (transformers ``Glm5NextTextMoE``)  megatron-core 0.19.2
=====================================  =========================================================
sigmoid router scores                  ``moe_router_score_function="sigmoid"``
``e_score_correction_bias`` (noaux_tc,  ``moe_router_enable_expert_bias=True``; the buffer is
selection only)                        ``router.expert_bias`` (added to the scores for top-k only)
top-k                                  ``moe_router_topk``
``norm_topk_prob``                     implicit: megatron's sigmoid path always divides the top-k
                                       scores by their sum (+1e-20) when top-k > 1
``routed_scaling_factor``              ``moe_router_topk_scaling_factor`` (applied after the
                                       normalisation; its docstring says "pre-softmax only", the
                                       code applies it for every score function)
n_group = topk_group = 1               ``moe_router_num_groups/group_topk=None`` (same selection)
fp32 router                            ``moe_router_dtype="fp32"`` (logits, scores and probs fp32)
no auxiliary loss                      ``moe_router_load_balancing_type="none"``, coeff 0
shared expert (n_shared x expert ffn)  ``moe_shared_expert_intermediate_size``, no shared gate
SwiGLU with clamp (gate <= L,          ``gated_linear_unit=True``, ``activation_func=F.silu``,
up in [-L, L])                         ``activation_func_clamp_value=L``, ``glu_linear_offset=0``
                                       and ``bias_activation_fusion=False`` (see below)
=====================================  =========================================================

The clamp: megatron's unfused GLU path (``MLP.forward`` and the experts' ``glu``) clamps exactly as
GLM does: ``x_glu.clamp(max=L)``, ``x_linear.clamp(-L, L)``, then ``silu(x_glu) * x_linear``. The
fused SwiGLU kernel (``bias_activation_fusion=True``), TE's activation modules
(``use_te_activation_func``) and the TE op fuser's ``ScaledSwiGLU`` silently ignore
``activation_func_clamp_value`` (its docstring says "only quick_gelu"), so
``check_glm_moe_config`` refuses those combinations.

Not expressible: ``norm_topk_prob=False`` with sigmoid scores and top-k > 1 (megatron always
normalises), ``norm_topk_prob=True`` with top-k = 1 (megatron does not normalise a single sigmoid
score, and refuses a softmax over one logit), and the score-correction bias with softmax scores;
``MoEConfig`` refuses all three when the recipe is built. Differences that are only rounding: GLM
multiplies the routing weight after the expert's down projection, megatron before it (inside the
activation); the same in fp32 up to rounding, slightly different in bf16.

Token dispatcher: ``moe.dispatcher`` is ``moe_token_dispatcher_type``. ``alltoall`` (every
recipe's default) sends each routed row to its expert's rank and serves ranks with different row
counts; ``allgather`` gathers every row of the TP x EP group and needs equal counts; ``flex`` is
DeepEP (GPU, ``deep_ep``, ep x etp > 1). Each expert computes the same rows, so outputs and
gradients agree up to fp32 summation order (tests/test_moe_dispatcher.py); ``recipe_rules``
refuses what a dispatcher cannot run, and ``distributed/cpu.py`` lets ``alltoall`` run on gloo
ranks (docs/model.md).

Bias training: with ``moe_router_enable_expert_bias`` megatron counts tokens per expert in the
forward and updates ``expert_bias`` by ``moe_router_bias_update_rate`` in
``finalize_model_grads`` (DeepSeek-V3's aux-loss-free balancing). To keep the checkpoint's bias
frozen, pass ``bias_update_rate=0``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.moe.moe_layer import MoELayer

from ..config import MoEConfig
from ..distributed.mesh_init import init_shard_from_full, name_seed
from .moe_layer import GLMMoELayer

def moe_transformer_config_kwargs(
    moe: MoEConfig,
    *,
    grouped_gemm: bool = False,
    bias_update_rate: float = 1e-3,
) -> dict:
    """``TransformerConfig`` keyword arguments that make megatron's MoELayer compute GLM's MoE.

    They also set the (dense and shared) MLP activation to the clamped SwiGLU, which GLM's dense
    FFN uses as well. ``moe`` was validated: the router variants megatron cannot express are
    refused by ``MoEConfig`` (see the module docstring)."""
    # softmax over all experts then renormalised top-k == softmax over the top-k logits; the
    # sigmoid path ignores the flag.
    pre_softmax = moe.score_function == "softmax" and not moe.norm_topk_prob
    kwargs = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=(
            moe.ffn_hidden_size * moe.num_shared_experts if moe.num_shared_experts else None
        ),
        moe_shared_expert_gate=False,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=pre_softmax,
        moe_router_enable_expert_bias=moe.score_correction_bias,
        moe_router_bias_update_rate=bias_update_rate,
        moe_router_topk_scaling_factor=(
            None if moe.routed_scaling_factor == 1.0 else moe.routed_scaling_factor
        ),
        moe_router_num_groups=None,
        moe_router_group_topk=None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_fusion=False,
        moe_apply_probs_on_input=False,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=grouped_gemm,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        activation_func_clamp_value=moe.swiglu_limit,
        glu_linear_offset=0.0,
        bias_activation_fusion=False,
        use_te_activation_func=False,
    )
    return kwargs


def check_glm_moe_config(config) -> None:
    """Refuse a TransformerConfig on which megatron would silently skip GLM's SwiGLU clamp."""
    if config.activation_func_clamp_value is None:
        return
    reasons = []
    if config.bias_activation_fusion:
        reasons.append("bias_activation_fusion=True (the fused swiglu kernel has no clamp)")
    if config.use_te_activation_func:
        reasons.append("use_te_activation_func=True (TE's SwiGLU has no clamp)")
    if getattr(config, "use_te_op_fuser", False):
        reasons.append("use_te_op_fuser=True (TE's ScaledSwiGLU op has no clamp)")
    if config.activation_func is not F.silu or not config.gated_linear_unit:
        reasons.append("activation is not SwiGLU (gated_linear_unit with F.silu)")
    if config.glu_linear_offset != 0.0:
        reasons.append(f"glu_linear_offset={config.glu_linear_offset} (GLM has none)")
    if reasons:
        raise ValueError("GLM's clamped SwiGLU would not be computed: " + "; ".join(reasons))


def build_moe_layer(moe: MoEConfig, *, config, layer_number: int, pg_collection,
                    chunk_tokens: int = 0):
    """megatron's MoELayer for GLM (``moe_layer_spec``) with initial weights that do not depend
    on the mesh.

    megatron's CPU initialisation draws the router, then this EP rank's experts, then the shared
    expert from one generator: an EP rank would draw expert 0's values for its first expert, and
    every tensor built after the layer would shift with the number of local experts. So the layer
    is built on a forked generator (the outer stream advances by one draw, the same on every mesh)
    and each of its tensors is then drawn whole from a seed of its own (global) name and sliced to
    this rank's TP / ETP shard (``distributed.mesh_init``). Without CPU initialisation (GPU:
    megatron's per-rank CUDA streams) the layer is built as megatron builds it.
    ``chunk_tokens``: ``train.moe_chunk_tokens`` (``GLMMoELayer``; 0: no chunks)."""
    spec = moe_layer_spec(moe, chunk_tokens=chunk_tokens)
    if not (config.use_cpu_initialization and config.perform_initialization):
        return spec(config=config, layer_number=layer_number, pg_collection=pg_collection)
    base = int(torch.randint(2**62, ()))
    with torch.random.fork_rng(devices=[]):
        layer = spec(config=config, layer_number=layer_number, pg_collection=pg_collection)
    _draw_mesh_independent(layer, config, base, pg_collection)
    return layer


def _draw_mesh_independent(layer, config, base: int, pg_collection) -> None:
    """Every parameter of a SequentialMLP ``layer`` drawn as ``build_moe_layer`` says, with the
    init method megatron gives it (fc2: the output-layer init)."""
    tp, etp, ep = pg_collection.tp, pg_collection.expt_tp, pg_collection.ep
    # parameter name -> (name its seed is drawn from, init method, group sharding it, GLU fc1)
    draws = {"router.weight": ("router.weight", config.init_method, None, False)}
    local = layer.experts.local_experts
    for i in range(len(local)):
        e = ep.rank() * len(local) + i  # the global expert: its name is the same on every mesh
        for fc, init_method, glu in (("linear_fc1", config.init_method, True),
                                     ("linear_fc2", config.output_layer_init_method, False)):
            draws[f"experts.local_experts.{i}.{fc}.weight"] = (
                f"experts.{e}.{fc}.weight", init_method, etp, glu)
    if layer.shared_experts is not None:
        for fc, init_method, glu in (("linear_fc1", config.init_method, True),
                                     ("linear_fc2", config.output_layer_init_method, False)):
            name = f"shared_experts.{fc}.weight"
            draws[name] = (name, init_method, tp, glu)
    params = dict(layer.named_parameters())
    if params.keys() != draws.keys():
        raise RuntimeError(f"MoE parameters {sorted(params)} are not the ones drawn mesh-"
                           f"independently {sorted(draws)}: megatron's MoELayer changed")
    for name, (seed_name, init_method, group, glu) in draws.items():
        rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
        init_shard_from_full(params[name], init_method, name_seed(base, seed_name), rank, size,
                             glu=glu)


def moe_layer_spec(moe: MoEConfig, *, use_te: bool = False, grouped_gemm: bool = False,
                   chunk_tokens: int = 0):
    """Megatron's MoELayer builder (TopKRouter, experts, SharedExpertMLP) for ``GLMMoELayer``,
    called as ``spec(config=..., layer_number=..., pg_collection=...)`` or used as a layer's
    ``mlp``.

    ``use_te=False`` gives SequentialMLP experts of local ColumnParallel/RowParallel linears (CPU);
    ``use_te=True`` TE linears and, with ``grouped_gemm``, TEGroupedMLP."""
    if use_te:
        # Imported only here: the module needs Transformer Engine, which CPU installs lack.
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    megatron_spec = get_moe_module_spec_for_backend(
        backend=backend, num_experts=moe.num_experts, moe_grouped_gemm=grouped_gemm
    )
    if megatron_spec.func is not MoELayer:
        raise RuntimeError(f"megatron's MoE spec builds {megatron_spec.func}, not MoELayer: "
                           "GLMMoELayer no longer applies")
    return partial(GLMMoELayer, *megatron_spec.args, **megatron_spec.keywords, chunk_tokens=chunk_tokens)


# --- HF names of one MoE layer's weights ----------------------------------------------------

HF_MOE_NAMES = {
    "router": "gate.weight",
    "bias": "gate.e_score_correction_bias",
    "experts_gate_up": "experts.gate_up_proj",  # [E, 2I, H], gate rows first (chunk(2))
    "experts_down": "experts.down_proj",  # [E, H, I]
    "shared_gate": "shared_experts.gate_proj.weight",
    "shared_up": "shared_experts.up_proj.weight",
    "shared_down": "shared_experts.down_proj.weight",
}
"""Names in transformers' ``Glm5NextTextMoE`` state dict (prefix ``model.layers.{i}.mlp.``).
Checkpoints store the routed experts one tensor per expert and projection
(``experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``); ``model.hf_io`` maps these fused
names to those and loads them."""


def moe_weight_name_map(
    moe: MoEConfig, *, ep_rank: int = 0, ep_size: int = 1, grouped_gemm: bool = False
) -> dict[str, tuple[str, ...]]:
    """megatron MoELayer name -> the HF names it is built from, for this EP rank's experts.

    fc1 of a SwiGLU is ``cat([gate, up])`` along the output dim (megatron's ``torch.chunk(2)``
    order, the same as HF's ``gate_up_proj``); fc2 is the down projection."""
    if moe.num_experts % ep_size:
        raise ValueError(f"num_experts={moe.num_experts} must be divisible by ep_size={ep_size}")
    n_local = moe.num_experts // ep_size
    out: dict[str, tuple[str, ...]] = {"router.weight": (HF_MOE_NAMES["router"],)}
    if moe.score_correction_bias:
        out["router.expert_bias"] = (HF_MOE_NAMES["bias"],)
    for local in range(n_local):
        e = ep_rank * n_local + local
        if grouped_gemm:
            fc1, fc2 = f"experts.linear_fc1.weight{local}", f"experts.linear_fc2.weight{local}"
        else:
            fc1 = f"experts.local_experts.{local}.linear_fc1.weight"
            fc2 = f"experts.local_experts.{local}.linear_fc2.weight"
        out[fc1] = (f"{HF_MOE_NAMES['experts_gate_up']}[{e}]",)
        out[fc2] = (f"{HF_MOE_NAMES['experts_down']}[{e}]",)
    if moe.num_shared_experts:
        out["shared_experts.linear_fc1.weight"] = (HF_MOE_NAMES["shared_gate"], HF_MOE_NAMES["shared_up"])
        out["shared_experts.linear_fc2.weight"] = (HF_MOE_NAMES["shared_down"],)
    return out
