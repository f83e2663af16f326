"""memory.py: parameter counts equal the built megatron model exactly (single rank, and every
rank of TP2 x CP2 x EP2 and TP2 x EP2 x ETP2 meshes on gloo); activation terms equal the bytes
autograd keeps on CPU for every block except KDA's (whose kernels differ between CPU and GPU);
structural properties of the activation model; the full model's size against the model card;
the ``plan`` table."""

from __future__ import annotations

import re

import pytest
import torch

from skyrl_megatron_kda import cli, memory
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss

TINY = "glm53_flash_tiny"
FULL = "glm53_flash_1m"
SINGLE = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.etp=1",
          "parallel.sequence_parallel=false", "run.num_workers=1"]

MODEL_CARD_TOTAL = 321.3e9
"""GLM-5.3-Flash's parameter count with its MTP layer (its model card)."""


# --- parameters against the real model -----------------------------------------------------

_COMPONENT_PATTERNS = [
    (r"^embedding\.", "embedding"),
    (r"^output_layer\.", "output_layer"),
    (r"^final_norm\.", "final_norm"),
    (r"^layers\.\d+\.(attn_hc|ffn_hc)\.", "mhc"),
    (r"^layers\.\d+\.(input_layernorm|pre_mlp_layernorm)\.", "layer_norms"),
    (r"^layers\.\d+\.self_attention\.core_attention\.indexer\.", "dsa_indexer"),
    (r"^layers\.\d+\.self_attention\.(q_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj|o_proj|"
     r"f_a_weight|g_a_weight|o_norm_weight|conv_weight|A_log|dt_bias)", "kda"),
    (r"^layers\.\d+\.self_attention\.", "dsa"),
    (r"^layers\.\d+\.mlp\.router\.", "moe_router"),
    (r"^layers\.\d+\.mlp\.shared_experts\.", "moe_shared"),
    (r"^layers\.\d+\.mlp\.experts\.", "moe_experts"),
    (r"^layers\.\d+\.mlp\.linear_fc", "dense_mlp"),
]


def _component(name: str) -> str:
    for pattern, component in _COMPONENT_PATTERNS:
        if re.match(pattern, name):
            return component
    raise AssertionError(f"parameter {name} belongs to no component")


def _model_counts(model) -> tuple[dict, int]:
    counts: dict[tuple[str, int, bool], int] = {}
    for name, p in model.named_parameters():
        key = (_component(name), p.element_size(), p.requires_grad)
        counts[key] = counts.get(key, 0) + p.numel()
    buffers = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    return counts, buffers


def _count_on_rank(rank, world, overrides_list):
    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        counts, buffers = _model_counts(build_on_mesh(recipe))
        out.append((counts, buffers, memory.param_counts(memory.rank_parameters(recipe)),
                    memory.rank_buffers_bytes(recipe)))
    return out


def _assert_counts(results):
    for rank, per_recipe in enumerate(results):
        for i, (model, model_buffers, formula, formula_buffers) in enumerate(per_recipe):
            assert formula == model, f"rank {rank} recipe {i}: formula {formula} != model {model}"
            assert formula_buffers == model_buffers, (rank, i)


def test_parameter_count_equals_model_single_rank():
    """fp32 (the tiny recipe) and bf16 (where the fp32-kept tensors differ from the rest)."""
    variants = [SINGLE, SINGLE + ["model.params_dtype=bfloat16"],
                SINGLE + ["model.tie_word_embeddings=true"]]
    (result,) = run_ranks(1, _count_on_rank, variants)
    _assert_counts([result])
    bf16 = result[1][0]
    assert any(dtype == 4 for (_, dtype, _) in bf16), "bf16 model keeps fp32 tensors (mHC, A_log)"


def test_parameter_count_equals_model_on_mesh():
    """Every rank of the tiny recipe's mesh (TP2 x CP2 +SP, EP2) and of TP2 x EP2 x ETP2."""
    results = run_ranks(4, _count_on_rank, [[]])
    _assert_counts(results)
    results = run_ranks(2, _count_on_rank, [["parallel.cp=1", "run.num_workers=2"]])
    _assert_counts(results)
    results = run_ranks(4, _count_on_rank, [["parallel.cp=1", "parallel.etp=2", "run.num_workers=4"]])
    _assert_counts(results)


def test_negative_control_wrong_sharding_is_caught():
    """The comparison is not vacuous: counting experts unsharded by ETP changes the total."""
    recipe = load_recipe(TINY, ["parallel.cp=1", "parallel.etp=2", "run.num_workers=4"]).recipe
    good = memory.param_counts(memory.rank_parameters(recipe))
    no_etp = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"etp": 1})})
    assert memory.param_counts(memory.rank_parameters(no_etp)) != good


# --- activations against autograd's saved tensors on CPU -----------------------------------


class _SavedTensorCensus:
    """Bytes of the storages autograd holds for backward at the end of a forward, by the module
    that first saved each one; parameter storages are left out (they are counted as params).

    A storage counts while at least one saved reference to it is alive (a graph that forward
    built and dropped releases its tensors), so reused addresses are not confused."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list] = {}  # ptr -> [refcount, nbytes, module]
        self.stack = [""]
        names = {mod: n for n, mod in model.named_modules()}
        for mod in model.modules():
            mod.register_forward_pre_hook(lambda mod, args: self.stack.append(names[mod]))
            mod.register_forward_hook(lambda mod, args, out: (self.stack.pop(), None)[1])

    def pack(self, t):
        census = self

        class Holder:
            def __init__(self):
                self.t, self.ptr = t, t.untyped_storage().data_ptr()
                entry = census.live.setdefault(self.ptr, [0, t.untyped_storage().nbytes(),
                                                          census.stack[-1]])
                entry[0] += 1

            def __del__(self):
                entry = census.live.get(self.ptr)
                if entry is not None:
                    entry[0] -= 1
                    if entry[0] == 0:
                        del census.live[self.ptr]

        return Holder()

    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ptr, (_, nbytes, module) in self.live.items():
            if ptr not in self.params:
                out[module] = out.get(module, 0) + nbytes
        return out


def _part(module: str) -> str:
    if not module.startswith("layers."):
        return "head"
    parts = module.split(".")
    layer = parts[1]
    if len(parts) == 2 or parts[2] in ("attn_hc", "ffn_hc", "input_layernorm", "pre_mlp_layernorm"):
        return f"{layer}.mhc_norms"
    return f"{layer}.{'attention' if parts[2] == 'self_attention' else 'mlp'}"


def _census_on_rank(rank, world, overrides_list):
    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        model = build_on_mesh(recipe)
        census = _SavedTensorCensus(model)
        ids = token_ids(recipe)
        with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda h: h.t):
            # Labels in their own storage, as the trainer's: the fused loss keeps them.
            loss = token_loss(model, ids, ids.roll(-1, 1))
        parts: dict[str, int] = {}
        for module, nbytes in census.by_module().items():
            parts[_part(module)] = parts.get(_part(module), 0) + nbytes
        loss.sum().backward()  # the held tensors are what backward needs
        out.append(parts)
    return out


@pytest.fixture(scope="module")
def census():
    variants = {
        "fp32": SINGLE,
        "bf16": SINGLE + ["model.params_dtype=bfloat16"],
        "bf16_T96": SINGLE + ["model.params_dtype=bfloat16", "data.seq_len=96"],
        "fp32_unfused": SINGLE + ["model.dsa.kernel=unfused"],
        "bf16_unfused": SINGLE + ["model.params_dtype=bfloat16", "model.dsa.kernel=unfused"],
        "full": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=full"],
        "selective": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=selective"],
        "selective_kda": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=selective",
                                   "train.recompute_layers=[kda]"],
        "full_dsa": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=full",
                              "train.recompute_layers=[dsa]"],
        "offload": SINGLE + ["model.params_dtype=bfloat16", "train.offload_activations=true"],
        # the fused loss, with chunks that do not divide the 256 tokens
        "fp32_fused_loss": SINGLE + ["train.loss_chunk_tokens=100"],
        "bf16_fused_loss": SINGLE + ["model.params_dtype=bfloat16", "train.loss_chunk_tokens=100"],
        # MoE token chunks that do not divide the 256 rows
        "fp32_moe_chunks": SINGLE + ["train.moe_chunk_tokens=100"],
        "bf16_moe_chunks": SINGLE + ["model.params_dtype=bfloat16", "train.moe_chunk_tokens=100"],
    }
    (result,) = run_ranks(1, _census_on_rank, list(variants.values()))
    return dict(zip(variants, result)), {k: load_recipe(TINY, v).recipe for k, v in variants.items()}


@pytest.mark.parametrize("variant", ["fp32", "bf16", "bf16_T96", "fp32_unfused", "bf16_unfused",
                                     "fp32_fused_loss", "bf16_fused_loss", "fp32_moe_chunks",
                                     "bf16_moe_chunks"])
def test_activation_terms_equal_saved_tensors(census, variant):
    """Every block but KDA attention, exactly: mHC + norms per layer, DSA (both kernels), dense
    MLP, MoE (whole, and in ``train.moe_chunk_tokens`` chunks), head (with megatron's loss, and
    with ``train.loss_chunk_tokens``)."""
    measured, recipes = census
    parts, recipe = measured[variant], recipes[variant]
    m = recipe.model
    rows = memory.rows_of(recipe)
    mhc_norms = (memory.mhc_activation_bytes(recipe)
                 + 2 * memory.norm_activation_bytes(recipe, m.hidden_size, rows.sp))
    print(variant, parts)
    for i, (kind, mlp) in enumerate(zip(m.layer_types(), m.mlp_types())):
        assert parts[f"{i}.mhc_norms"] == mhc_norms, (i, parts[f"{i}.mhc_norms"], mhc_norms)
        want = (memory.dense_mlp_activation_bytes(recipe) if mlp == "dense"
                else memory.moe_activation_bytes(recipe))
        assert parts[f"{i}.mlp"] == want, (i, mlp, parts[f"{i}.mlp"], want)
        if kind == "dsa":
            assert parts[f"{i}.attention"] == memory.dsa_activation_bytes(recipe), (
                i, m.dsa.kernel, parts[f"{i}.attention"], memory.dsa_activation_bytes(recipe))
    assert parts["head"] == memory.head_activation_bytes(recipe)


@pytest.mark.parametrize("variant", ["full", "selective", "selective_kda", "full_dsa"])
def test_recompute_keeps_what_the_plan_says(census, variant):
    """Bytes autograd keeps under each recompute setting equal the plan's kept activations
    (full: the layer inputs; selective: the attention inputs instead of the norm + attention
    tensors; layer types left out of recompute_layers keep everything)."""
    measured, recipes = census
    parts, recipe = measured[variant], recipes[variant]
    est = memory.estimate_memory(recipe)
    assert sum(parts.values()) < sum(measured["bf16"].values())
    # KDA's attention term models fla's kernels; the CPU torch kernel keeps other tensors.
    kda = [f"{i}.attention" for i, kind in enumerate(recipe.model.layer_types()) if kind == "kda"]
    kept = sum(v for part, v in parts.items() if part not in kda)
    assert kept == sum(v for label, v in est.activations.items() if label != "KDA attention"), (
        parts, est.activations)


def test_moe_chunks_keep_only_the_router_and_the_chunk_inputs(census):
    """``train.moe_chunk_tokens``: each MoE block keeps its input, the router's and the shared
    expert's tensors and the dense routing probabilities and map [s, E], instead of the routed
    experts' per-assignment tensors."""
    measured, recipes = census
    chunked, whole = measured["bf16_moe_chunks"], measured["bf16"]
    recipe = recipes["bf16_moe_chunks"]
    r, e = memory.rows_of(recipe), recipe.model.moe
    for i, mlp in enumerate(recipe.model.mlp_types()):
        if mlp == "moe":
            assert whole[f"{i}.mlp"] - chunked[f"{i}.mlp"] == (
                memory.moe_routed_bytes(recipe, r.sp) - r.sp * 5 * e.num_experts) > 0


def _live_tensors(model, exclude: list) -> dict[int, tuple]:
    """Storages of every tensor the garbage collector sees, but the model's parameters,
    gradients and buffers and the ``exclude`` tensors: (bytes, shape, dtype) by address."""
    import gc

    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *exclude]}
    known |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
            ptr = obj.untyped_storage().data_ptr()
            if ptr not in known and obj.untyped_storage().nbytes():
                out[ptr] = (obj.untyped_storage().nbytes(), tuple(obj.shape), obj.dtype)
    return out


def _after_backward_on_rank(rank, world, overrides_list, keep_dispatch_state):
    from skyrl_megatron_kda.model.moe_layer import GLMMoELayer

    if keep_dispatch_state:  # negative control: megatron's dispatcher as it is
        GLMMoELayer._release_dispatch_state = lambda self: None
    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        model = build_on_mesh(recipe)
        ids = token_ids(recipe)
        labels = ids.roll(-1, 1)
        with torch.no_grad():  # fills the caches meant to last (the KDA CP layout of the batch)
            token_loss(model, ids, labels)
        cached = _live_tensors(model, [ids, labels])
        for _ in range(2):  # the second step starts from what the first left behind
            token_loss(model, ids, labels).sum().backward()
        live = _live_tensors(model, [ids, labels])
        out.append({ptr: v for ptr, v in live.items() if ptr not in cached})
    return out


def test_nothing_outlives_the_backward():
    """After forward and backward nothing of the step is alive but parameters and gradients,
    with every recompute mode and MoE chunks. Negative control: megatron's dispatcher keeps its
    last routing state; under full recompute the rebuilt ``local_probs`` holds the layer's
    detached input streams and their gradient (two [s, N, D] tensors per MoE layer)."""
    base = SINGLE + ["model.params_dtype=bfloat16", "data.seq_len=96"]
    variants = [base + ["train.recompute=full"], base + ["train.recompute=selective"], base,
                base + ["train.recompute=full", "train.moe_chunk_tokens=40"]]
    for overrides, live in zip(variants, run_ranks(1, _after_backward_on_rank, variants, False)[0]):
        assert live == {}, (overrides, live)
    (leaked,) = run_ranks(1, _after_backward_on_rank, variants[:1], True)[0]
    recipe = load_recipe(TINY, variants[0]).recipe
    streams = (96, 1, recipe.model.hyper_connections.num_streams, recipe.model.hidden_size)
    n_moe = recipe.model.mlp_types().count("moe")
    assert sum(shape == streams for _, shape, _ in leaked.values()) == 2 * n_moe, leaked


def test_offload_leaves_only_the_head_saved_on_the_device(census):
    """Under train.offload_activations every tensor the layers save for backward goes through the
    model's host offload hooks (the census's hooks, outside them, see none of them); the head's
    stay on the device, as the plan says (saved last and read first)."""
    measured, recipes = census
    assert sum(measured["bf16"].values()) > 0
    on_device = {part: v for part, v in measured["offload"].items() if v}
    recipe = recipes["offload"]
    assert on_device == {"head": memory.head_activation_bytes(recipe)
                         - sum(memory.embedding_tensor_bytes(recipe))}, on_device


# --- structure of the activation model -----------------------------------------------------


ON_GPU_UNFUSED_LOSS = ("train.offload_activations=false", "train.loss_chunk_tokens=null")
"""The 1M recipe without two of its levers: activations kept on the GPU, megatron's loss."""


def _full(*overrides: str):
    return load_recipe(FULL, list(overrides)).recipe


def test_activations_linear_in_sequence_length():
    """Every kept term doubles with seq_len, except KDA's concatenated projection weights and
    the DSA attention's gathered kv up-projection weight (tp_split=sequence), both constants:
    affine there, exactly linear elsewhere."""
    a, b, c = (memory.estimate_memory(_full("train.recompute=none", "kda.cp_exchange=a2a", f"data.seq_len={t}"))
               for t in (131072, 262144, 524288))
    for label, value in a.activations.items():
        if label in ("KDA attention", "DSA attention"):
            assert c.activations[label] - b.activations[label] == 2 * (b.activations[label] - value)
            assert b.activations[label] < 2 * value
        else:
            assert b.activations[label] == 2 * value, label
    assert b.exchange_buffers == 2 * a.exchange_buffers


def test_cp_halves_sequence_sharded_terms():
    """Doubling CP halves every per-token term; what stays is the part independent of the
    tokens (KDA's concatenated projection weights; nothing elsewhere) and DSA's whole-sequence
    KV latent and gathered kv up-projection weight."""
    def recipe(cp, seq_len):
        return _full("train.recompute=none", "kda.cp_exchange=a2a", f"data.seq_len={seq_len}",
                     f"parallel.cp={cp}")

    for fn in (memory.kda_activation_bytes, memory.moe_activation_bytes,
               memory.dense_mlp_activation_bytes, memory.mhc_activation_bytes,
               memory.head_activation_bytes):
        fixed = [2 * fn(recipe(cp, 131072)) - fn(recipe(cp, 262144)) for cp in (1, 2)]
        assert fixed[0] == fixed[1], fn.__name__
        assert (fixed[0] > 0) == (fn is memory.kda_activation_bytes), fn.__name__
        one, two = fn(recipe(1, 262144)) - fixed[0], fn(recipe(2, 262144)) - fixed[0]
        assert one == 2 * two, fn.__name__
    a = _full().model.dsa
    # Independent of CP: the whole-sequence latent and (tp_split=sequence) the gathered weight.
    fixed = 262144 * a.kv_lora_rank * 2 + a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank * 2
    dsa = memory.dsa_activation_bytes
    assert a.tp_split == "sequence"
    assert dsa(recipe(1, 262144)) - fixed == 2 * (dsa(recipe(2, 262144)) - fixed)


def test_full_recompute_reduces_kept_activations():
    none = memory.estimate_memory(_full("train.recompute=none", "train.moe_chunk_tokens=0"))
    full = memory.estimate_memory(_full("train.recompute=full", "train.moe_chunk_tokens=0"))
    # Full recompute keeps each layer's input streams and the head only: about 15x less at 1M
    # tokens (the MoE, KDA and mHC tensors dominate what recompute=none keeps without MoE
    # chunks).
    assert sum(full.activations.values()) < sum(none.activations.values()) / 15
    recipe = _full("train.recompute=full")
    assert full.activations["layer inputs (checkpoints)"] == (
        recipe.model.num_layers * memory.checkpoint_input_bytes(recipe, "full"))
    assert full.states == none.states


def test_peak_is_the_largest_phase_and_the_head_is_freed_before_layers():
    """Under full recompute the head's tensors (fp32 logits) are freed by the loss backward, so
    they do not add to a rebuilt layer; fla's kernel backward adds to the KDA phase only."""
    recipe = _full("train.recompute=full", "data.seq_len=262144", *ON_GPU_UNFUSED_LOSS)
    est = memory.estimate_memory(recipe)
    assert est.total == est.states + max(est.phases.values())
    inputs, head = est.activations["layer inputs (checkpoints)"], est.activations["embedding + head + loss"]
    kda_phase = est.phases["KDA layer backward (largest)"]
    assert kda_phase > inputs + memory.kda_backward_bytes(recipe) + memory.kda_activation_bytes(recipe)
    assert kda_phase < inputs + head + memory.kda_backward_bytes(recipe) + max(
        memory.layer_activation_bytes(recipe, i) for i in range(recipe.model.num_layers))
    assert est.phases["loss: kept + head + bf16 logits"] > inputs + head


def test_kda_backward_working_set_is_per_head_token():
    """fla's chunk_kda_bwd allocations: linear in the rank's tokens and in its heads (TP halves
    them), 6,664 bytes per head-token at GLM's K = 128, chunk 64, bf16; with
    ``kda.kernel_head_group`` (the 1M recipe's 4) those of the largest group."""
    whole = "kda.kernel_head_group=null"
    one = memory.kda_backward_bytes(_full("data.seq_len=262144", "parallel.cp=1", whole))
    assert memory.kda_backward_bytes(_full("data.seq_len=524288", "parallel.cp=1", whole)) == 2 * one
    assert memory.kda_backward_bytes(_full("data.seq_len=524288", "parallel.cp=2", whole)) == one
    tp8 = _full("data.seq_len=262144", "parallel.cp=1", whole)
    assert one == 262144 * (64 // tp8.parallel.tp) * 6664
    grouped = _full("data.seq_len=262144", "parallel.cp=1")
    assert memory.kda_backward_bytes(grouped) == one * grouped.kda.kernel_head_group // (64 // 8)


def test_estimate_within_15_percent_of_the_measured_device_peaks():
    """The one-H200 slice runs of docs/benchmarks-log.md (bench/results/slice_cp1_h200.json: peak =
    torch's max_memory_allocated on the busiest rank): the plan stays within 15% of each."""
    import json
    from pathlib import Path

    runs = json.loads((Path(__file__).parents[1] / "bench/results/slice_cp1_h200.json").read_text())
    assert len(runs) >= 4
    for run in runs:
        recipe = load_recipe("glm53_flash_slice", [f"model.num_layers={run['layers']}",
                                                   f"data.seq_len={run['seq_len']}",
                                                   f"parallel.cp={run['cp']}", f"run.num_workers={run['cp']}",
                                                   f"kda.cp_exchange={run['exchange']}",
                                                   f"train.recompute={run.get('recompute', 'full')}",
                                                   f"train.offload_activations={str(run.get('offload', False)).lower()}",
                                                   # measured before the torch DSA kernel existed
                                                   f"model.dsa.kernel={run.get('dsa_kernel', 'unfused')}"]).recipe
        ratio = memory.estimate_memory(recipe).total / 2**30 / run["peak_gib"]
        assert 0.85 <= ratio <= 1.15, (run["layers"], run["seq_len"], ratio)


def test_exchange_buffers_come_from_the_cost_model():
    from skyrl_megatron_kda.kda import exchanges
    from skyrl_megatron_kda.kda.exchanges import ExchangeShape

    def extra_memory_bytes(name, shape):
        return exchanges.get(name).extra_memory_bytes(shape)

    shape_of = ExchangeShape.of

    recipe = _full("train.recompute=none", "kda.cp_exchange=a2a")
    est = memory.estimate_memory(recipe)
    assert est.exchange == "a2a"
    assert est.exchange_buffers == extra_memory_bytes("a2a", shape_of(recipe))  # one layer
    assert est.exchange_buffers > 0


def test_optimizer_shards_dense_over_dp_cp_and_experts_over_expert_dp():
    recipe = _full()
    assert memory.optimizer_shards(recipe) == (64 // 8, 64 // (32 * 2))
    groups = memory.rank_parameters(recipe)
    dense = sum(g.numel * (12 if g.dtype_bytes == 2 else 8) for g in groups
                if g.trainable and not g.expert)
    expert = sum(g.numel * 12 for g in groups if g.expert)
    assert memory.estimate_memory(recipe).optimizer == dense // 8 + expert


def test_recompute_modes_order_the_kept_activations():
    kept = {mode: sum(memory.estimate_memory(_full(f"train.recompute={mode}")).activations.values())
            for mode in ("none", "selective", "full")}
    assert kept["full"] < kept["selective"] < kept["none"]
    # Recomputing only the DSA layers leaves every KDA layer's attention tensors kept.
    dsa_only = memory.estimate_memory(_full("train.recompute=selective", "train.recompute_layers=[dsa]"))
    recipe = _full()
    n_kda = recipe.model.layer_types().count("kda")
    assert dsa_only.activations["KDA attention"] == n_kda * memory.kda_activation_bytes(recipe)
    assert "DSA attention" not in dsa_only.activations


def test_offload_keeps_only_one_layer_on_the_gpu():
    """With the kept activations on the host, a layer's backward phase holds only that layer's
    tensors and working set, and the loss phase only the head's and the logits."""
    on_gpu = memory.estimate_memory(_full("train.recompute=none", *ON_GPU_UNFUSED_LOSS))
    offload = memory.estimate_memory(_full("train.recompute=none", "train.offload_activations=true",
                                           "train.loss_chunk_tokens=null"))
    assert offload.activations == on_gpu.activations and offload.offloaded
    head = on_gpu.activations["embedding + head + loss"]
    for label in ("loss: kept + head + bf16 logits", "KDA layer backward (largest)"):
        assert offload.phases[label] < on_gpu.phases[label] / 10, label
    assert offload.phases["loss: kept + head + bf16 logits"] > head


def _host_census_on_rank(rank, world, overrides_list):
    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        model = build_on_mesh(recipe)
        ids = token_ids(recipe)
        loss = token_loss(model, ids, ids.roll(-1, 1))
        saved = sorted(model.host_offload.saved)
        loss.sum().backward()
        out.append((saved, model.host_offload.held, model.host_offload.peak))
    return out


def test_host_offload_holds_what_the_plan_says():
    """Under full recompute, train.offload_activations copies each layer's input streams and
    the head's tensors to the host, once each and no parameter: the copies equal the plan's
    list tensor by tensor, their pinned blocks its host figure for a GPU run, and backward gives
    every byte back."""
    base = SINGLE + ["model.params_dtype=bfloat16", "data.seq_len=96", "train.recompute=full",
                     "train.offload_activations=true"]
    variants = [base, base + ["train.loss_chunk_tokens=100"]]
    for overrides, (saved, held, peak) in zip(variants, run_ranks(1, _host_census_on_rank, variants)[0]):
        recipe = load_recipe(TINY, overrides).recipe
        assert saved == sorted(memory.offloaded_tensor_bytes(recipe)), overrides
        assert held == 0 and peak == sum(saved) == memory.host_activation_bytes(recipe)[0]
        gpu = load_recipe(TINY, overrides + ["run.device=gpu"]).recipe
        pinned = sum(memory.pinned_block_bytes(n) for n in saved)
        assert memory.host_activation_bytes(gpu) == (pinned, True) and pinned > sum(saved)
    # Not modelled tensor by tensor without full recompute: a lower bound, said so.
    assert memory.offloaded_tensor_bytes(load_recipe(TINY, SINGLE + ["train.offload_activations=true"]).recipe) is None


def test_pinned_blocks_round_up_to_a_power_of_two():
    assert [memory.pinned_block_bytes(n) for n in (0, 1, 3, 4, 5, 2**31, 2**31 + 1)] == [
        0, 1, 4, 4, 8, 2**31, 2**32]


def test_fused_loss_replaces_the_logits():
    """``train.loss_chunk_tokens``: the head keeps 16 bytes per token instead of the fp32 softmax
    over the vocabulary shard, and the loss phase holds one chunk's logits instead of all."""
    plain = memory.estimate_memory(_full("train.loss_chunk_tokens=null"))
    fused_recipe = _full("train.loss_chunk_tokens=8192")
    fused = memory.estimate_memory(fused_recipe)
    r, m = memory.rows_of(fused_recipe), fused_recipe.model
    head = "embedding + head + loss"
    assert plain.activations[head] - fused.activations[head] == r.cp * (m.vocab_size // 8 * 4 + 9 - 16)
    loss = "loss: kept + head + fused loss chunk of 8192"
    assert fused.phases[loss] < plain.phases["loss: kept + head + bf16 logits"] - 40 * memory.GiB
    # The chunk's logits scale with the chunk, not with the rank's tokens.
    half = memory.estimate_memory(_full("train.loss_chunk_tokens=4096"))
    assert (fused.phases[loss] - half.phases["loss: kept + head + fused loss chunk of 4096"]
            == 4096 * (m.vocab_size // 8) * (4 + 2))


# --- the full model against its model card -------------------------------------------------


def test_full_model_size_matches_model_card():
    """Our trunk has no MTP layer; with one (a KDA + MoE decoder layer, as layer 45 of the
    pattern, plus its [D, 2D] projection and two norms) the total is the card's 321.3B."""
    trunk = _full()
    total = memory.total_parameters(trunk)
    with_mtp_layer = memory.total_parameters(
        trunk.model_copy(update={"model": trunk.model.model_copy(update={"num_layers": 46})}))
    D = trunk.model.hidden_size
    mtp = with_mtp_layer - total + 2 * D * D + 2 * D
    assert total < MODEL_CARD_TOTAL
    assert abs(total + mtp - MODEL_CARD_TOTAL) / MODEL_CARD_TOTAL < 0.005, (total, mtp)
    active = memory.active_parameters(trunk)
    assert 16.5e9 < active < 18.0e9, active  # card: 18B active, MTP included


# --- the plan table ------------------------------------------------------------------------


def test_plan_prints_memory_table(capsys):
    assert cli.main(["plan", FULL]) == 0
    out = capsys.readouterr().out
    assert "per-GPU memory estimate" in out and "choice:" in out
    est = memory.estimate_memory(_full())
    assert f"{est.total / memory.GiB:.2f}" in out
    assert "vs. H200" in out


def test_plan_gpu_memory_unknown_on_cpu(capsys):
    assert cli.main(["plan", TINY]) == 0
    assert "GPU memory: unknown" in capsys.readouterr().out


def test_moe_chunks_shrink_the_moe_phase():
    """The MoE backward phase of the 1M recipe: without chunks the allgather dispatcher's
    transients over the 64 ranks of EP32 x ETP2 make it the peak, far beyond an H200; with
    ``train.moe_chunk_tokens`` it grows linearly with the chunk (its transients and one chunk's
    rebuilt experts), while what the MoE layers keep does not depend on the chunk."""
    whole = memory.estimate_memory(_full("train.moe_chunk_tokens=0"))
    assert whole.peak_phase[0] == "MoE layer backward (largest)" and whole.total > memory.H200_BYTES
    phases, kept = {}, {}
    for chunk in (2048, 4096, 8192):
        recipe = _full(f"train.moe_chunk_tokens={chunk}")
        phases[chunk] = memory.estimate_memory(recipe).phases[memory.moe_phase_label(recipe)]
        kept[chunk] = memory.moe_activation_bytes(recipe)
    assert phases[8192] - phases[4096] == 2 * (phases[4096] - phases[2048]) > 0
    assert phases[8192] < whole.phases["MoE layer backward (largest)"] / 3
    assert len(set(kept.values())) == 1
    recipe = _full("train.moe_chunk_tokens=8192")
    r, e = memory.rows_of(recipe), recipe.model.moe
    assert memory.moe_activation_bytes(_full("train.moe_chunk_tokens=0")) - kept[8192] == (
        memory.moe_routed_bytes(recipe, r.sp) - r.sp * 5 * e.num_experts)
    assert any(line.lstrip().startswith("MoE layer backward, chunks of 8192")
               for line in memory.memory_lines(recipe))


def test_1m_recipe_fits_an_h200_with_its_levers():
    """glm53_flash_1m turns on what it needs (full recompute with the layer inputs on the host,
    the chunked loss, MoE token chunks, bf16 gradient reduction, fla's backward over groups of
    heads): at most 130 GiB per GPU, megatron's all-gather buffer counted, host memory said; its
    peak is a chunked MoE layer's backward. Without the head groups a KDA layer's backward is
    the peak and the total is above 130 GiB."""
    recipe = _full()
    est = memory.estimate_memory(recipe)
    assert est.total <= 130 * memory.GiB, est.total / memory.GiB
    assert est.gather_buffer == memory.gather_buffer_bytes(recipe) > 0
    assert est.peak_phase[0] == memory.moe_phase_label(recipe), est.phases
    whole_heads = memory.estimate_memory(_full("kda.kernel_head_group=null"))
    assert whole_heads.peak_phase[0] == "KDA layer backward (largest)", whole_heads.phases
    assert whole_heads.total > 130 * memory.GiB
    lines = memory.memory_lines(recipe)
    assert any(line.endswith("-> fits") for line in lines)
    host, exact = memory.host_activation_bytes(recipe)
    assert exact and f"host memory per node: {8 * host / memory.GiB:.2f} GiB" in "\n".join(lines)
    # Without its levers the same model does not fit.
    bare = memory.estimate_memory(_full(*ON_GPU_UNFUSED_LOSS, "train.grad_reduce_in_fp32=true"))
    assert bare.total > memory.H200_BYTES


def _ffn_backward_census(rank, world, overrides_list):
    """Bytes megatron's dense MLP (layer 0 of the tiny model, bf16) allocates at the highest
    point of its backward, per recipe: LiveBytes over ``backward`` of its output."""
    from tests.support.live_bytes import LiveBytes

    peaks = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, SINGLE + ["model.params_dtype=bfloat16", *overrides]).recipe
        mlp = build_on_mesh(recipe).layers[0].mlp
        x = torch.randn(recipe.data.seq_len, 1, recipe.model.hidden_size,
                        dtype=torch.bfloat16, requires_grad=True)
        out, _ = mlp(x)
        grad = torch.randn_like(out)
        with LiveBytes() as live:
            out.backward(grad)
        peaks.append(live.peak)
    return peaks


def test_dense_mlp_backward_working_set_is_the_plans():
    """The dense MLP's backward working set (the phase the full-width slice's GPU peak hit at
    131,072 tokens: the rebuilt first layer with its MLP's gradients) equals
    ``memory.dense_mlp_backward_bytes`` on three shapes (rows, FFN width, hidden each changed
    alone), within the 2 bytes of a scalar."""
    shapes = [[], ["data.seq_len=512"], ["model.dense_ffn_hidden_size=256"], ["model.hidden_size=128"]]
    peaks = run_ranks(1, _ffn_backward_census, shapes)[0]
    for overrides, peak in zip(shapes, peaks):
        planned = memory.dense_mlp_backward_bytes(load_recipe(TINY, SINGLE + ["model.params_dtype=bfloat16", *overrides]).recipe)
        assert 0 <= peak - planned <= 2, (overrides, peak, planned)
    assert len(set(peaks)) == len(peaks)  # each shape moved it: the census sees the terms


def test_slice_phases_the_gpu_measured():
    """The full-width slice at 131,072 tokens with every lever (the GPU run of
    docs/benchmarks.md): its peak phase is the dense first layer's MLP backward, and the mHC map
    backward without row chunks would have been far larger (the run that ran out of memory)."""
    levers = ["model.num_layers=4", "data.seq_len=131072", "train.recompute=full",
              "train.offload_activations=true", "train.loss_chunk_tokens=8192",
              "train.grad_reduce_in_fp32=false", "kda.kernel_head_group=16", "train.moe_chunk_tokens=8192"]
    chunked = memory.estimate_memory(load_recipe("glm53_flash_slice", levers).recipe)
    assert chunked.peak_phase[0] == "dense MLP backward (largest)", chunked.phases
    whole = memory.estimate_memory(load_recipe(
        "glm53_flash_slice", [*levers, "model.hyper_connections.map_chunk_rows=131072"]).recipe)
    assert whole.peak_phase[0] == "mHC map backward (largest)", whole.phases
    assert whole.total - chunked.total > 20 * memory.GiB


def test_plan_within_10_percent_of_the_lever_runs():
    """The slice runs with the memory levers on one H200 (bench/results/
    h200_slice_memory_levers_131k/slice.json: 131,072 tokens with every lever, 32,768 without
    and with host offload; peak = max_memory_allocated over the steps), rebuilt with the
    benchmark's own recipe function: the plan is within 10% of each measured peak (the issue's
    bound)."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("model_slice", root / "bench/model_slice.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs = json.loads((root / "bench/results/h200_slice_memory_levers_131k/slice.json").read_text())
    assert [run["seq_len"] for run in runs] == [131072, 32768, 32768]
    for run in runs:
        recipe = bench.slice_recipe(run["layers"], run["seq_len"], run["cp"], run["exchange"], 3,
                                    "unused", run["recompute"], tuple(run["levers"]))
        ratio = memory.estimate_memory(recipe).total / 2**30 / run["peak_gib"]
        assert 0.9 <= ratio <= 1.1, (run["seq_len"], run["levers"], ratio)
