"""``memory/phases.py``: the peak is the largest phase, the head is freed before the layers'
backward, offloaded layers leave one on the GPU, chunks shrink the MoE phase, and nothing of a
step outlives its backward."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.memory import GiB, estimate_memory, memory_lines
from skyrl_megatron_kda.memory.kda import kda_activation_bytes, kda_backward_bytes
from skyrl_megatron_kda.memory.layers import layer_activation_bytes
from skyrl_megatron_kda.memory.moe import moe_activation_bytes, moe_phase_label, moe_routed_bytes
from skyrl_megatron_kda.memory.rows import rows_of
from skyrl_megatron_kda.memory.table import H200_BYTES
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import ON_GPU_UNFUSED_LOSS, SINGLE, TINY, full_recipe
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss


def test_peak_is_the_largest_phase_and_the_head_is_freed_before_layers():
    """Under full recompute the head's tensors (fp32 logits) are freed by the loss backward, so
    they do not add to a rebuilt layer; fla's kernel backward adds to the KDA phase only."""
    recipe = full_recipe("train.recompute=full", "data.seq_len=262144", *ON_GPU_UNFUSED_LOSS)
    est = estimate_memory(recipe)
    assert est.total == est.states + max(est.phases.values())
    inputs, head = est.activations["layer inputs (checkpoints)"], est.activations["embedding + head + loss"]
    kda_phase = est.phases["KDA layer backward (largest)"]
    assert kda_phase > inputs + kda_backward_bytes(recipe) + kda_activation_bytes(recipe)
    assert kda_phase < inputs + head + kda_backward_bytes(recipe) + max(
        layer_activation_bytes(recipe, i) for i in range(recipe.model.num_layers))
    assert est.phases["loss: kept + head + bf16 logits"] > inputs + head


def test_offload_keeps_only_one_layer_on_the_gpu():
    """With the kept activations on the host, a layer's backward phase holds only that layer's
    tensors and working set, and the loss phase only the head's and the logits."""
    on_gpu = estimate_memory(full_recipe("train.recompute=none", *ON_GPU_UNFUSED_LOSS))
    offload = estimate_memory(full_recipe("train.recompute=none", "train.offload_activations=true",
                                           "train.loss_chunk_tokens=null"))
    assert offload.activations == on_gpu.activations and offload.offloaded
    head = on_gpu.activations["embedding + head + loss"]
    for label in ("loss: kept + head + bf16 logits", "KDA layer backward (largest)"):
        assert offload.phases[label] < on_gpu.phases[label] / 10, label
    assert offload.phases["loss: kept + head + bf16 logits"] > head


@pytest.mark.parametrize("dispatcher, shrink", [("allgather", 3), ("alltoall", 2)])
def test_moe_chunks_shrink_the_moe_phase(dispatcher, shrink):
    """The MoE backward phase of the 1M recipe: without chunks the dispatcher's transients (the
    allgather dispatcher's over the 64 ranks of EP32 x ETP2, the alltoall dispatcher's over the
    rank's 16 assignments per row) and the rebuilt layer's expert tensors make it the peak,
    beyond an H200; with ``train.moe_chunk_tokens`` it grows linearly with the chunk (its
    transients and one chunk's rebuilt experts), while what the MoE layers keep does not depend
    on the chunk."""
    d = f"model.moe.dispatcher={dispatcher}"
    whole_recipe = full_recipe(d, "train.moe_chunk_tokens=0")
    whole = estimate_memory(whole_recipe)
    assert whole.peak_phase[0] == moe_phase_label(whole_recipe) and whole.total > H200_BYTES
    phases, kept = {}, {}
    for chunk in (2048, 4096, 8192):
        recipe = full_recipe(d, f"train.moe_chunk_tokens={chunk}")
        phases[chunk] = estimate_memory(recipe).phases[moe_phase_label(recipe)]
        kept[chunk] = moe_activation_bytes(recipe)
    assert phases[8192] - phases[4096] == 2 * (phases[4096] - phases[2048]) > 0
    assert phases[8192] < whole.peak_phase[1] / shrink
    assert len(set(kept.values())) == 1
    recipe = full_recipe(d, "train.moe_chunk_tokens=8192")
    r, e = rows_of(recipe), recipe.model.moe
    assert moe_activation_bytes(whole_recipe) - kept[8192] == (
        moe_routed_bytes(recipe, r.sp) - r.sp * 5 * e.num_experts)
    assert any(line.lstrip().startswith(f"MoE layer backward, {dispatcher}, chunks of 8192")
               for line in memory_lines(recipe))


def test_alltoall_moves_fewer_rows_than_allgather():
    """At the 1M recipe's chunk (8,192 rows of EP32 x ETP2) the allgather dispatcher's combine
    holds every gathered row (524,288) and the alltoall dispatcher's its 131,072 assignments:
    the transients differ by the rows' ratio, ep / top_k = 4, and only allgather grows
    megatron's all-gather buffer (16,384-row chunks: 8 GiB against the SP gather's 4 GiB)."""
    from skyrl_megatron_kda.memory.moe import moe_transient_bytes
    from skyrl_megatron_kda.memory.states import gather_buffer_bytes

    gather, a2a = (full_recipe(f"model.moe.dispatcher={d}") for d in ("allgather", "alltoall"))
    assert moe_transient_bytes(gather, 8192) == 4 * moe_transient_bytes(a2a, 8192)
    assert moe_transient_bytes(a2a, 8192) == 131072 * 4096 * (2 + 4)
    big = ("train.moe_chunk_tokens=16384",)
    assert gather_buffer_bytes(full_recipe("model.moe.dispatcher=allgather", *big)) == 8 * GiB
    assert gather_buffer_bytes(full_recipe("model.moe.dispatcher=alltoall", *big)) == 4 * GiB


def test_slice_phases_the_gpu_measured():
    """The full-width slice at 131,072 tokens with every lever (the GPU run of
    docs/benchmarks.md): its peak phase is the dense first layer's MLP backward, and the mHC map
    backward without row chunks would have been far larger (the run that ran out of memory)."""
    levers = ["model.num_layers=4", "data.seq_len=131072", "train.recompute=full",
              "train.offload_activations=true", "train.loss_chunk_tokens=8192",
              "train.grad_reduce_in_fp32=false", "kda.kernel_head_group=16", "train.moe_chunk_tokens=8192"]
    chunked = estimate_memory(load_recipe("glm53_flash_slice", levers).recipe)
    assert chunked.peak_phase[0] == "dense MLP backward (largest)", chunked.phases
    whole = estimate_memory(load_recipe(
        "glm53_flash_slice", [*levers, "model.hyper_connections.map_chunk_rows=131072"]).recipe)
    assert whole.peak_phase[0] == "mHC map backward (largest)", whole.phases
    assert whole.total - chunked.total > 20 * GiB


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
    """Per recipe, after two steps: what is alive beyond the model's state and the first
    forward's caches, and the dispatcher's attributes that still hold autograd history."""
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
        graphs = {name for layer in model.layers if isinstance(layer.mlp, GLMMoELayer)
                  for name, v in vars(layer.mlp.token_dispatcher).items()
                  if isinstance(v, torch.Tensor) and v.grad_fn is not None}
        out.append(({ptr: v for ptr, v in live.items() if ptr not in cached}, graphs))
    return out


def test_nothing_outlives_the_backward():
    """After forward and backward nothing of the step is alive but parameters and gradients,
    with every recompute mode and MoE chunks, for both dispatchers. Negative control: megatron's
    dispatchers keep their last routing state; under full recompute the rebuilt probabilities
    (allgather's ``local_probs``, alltoall's ``probs``: what SkyRL's
    ``patch_moe_release_dispatcher_probs`` releases) hold the layer's detached input streams and
    their gradient (two [s, N, D] tensors per MoE layer)."""
    base = SINGLE + ["model.params_dtype=bfloat16", "data.seq_len=96"]
    full = base + ["train.recompute=full"]
    variants = [full, base + ["train.recompute=selective"], base,
                full + ["train.moe_chunk_tokens=40"], full + ["model.moe.dispatcher=allgather"]]
    for overrides, (live, graphs) in zip(variants, run_ranks(1, _after_backward_on_rank, variants, False)[0]):
        assert live == {} and graphs == set(), (overrides, live, graphs)
    controls = {"alltoall": full + ["model.moe.dispatcher=alltoall"], "allgather": variants[-1]}
    leaks = run_ranks(1, _after_backward_on_rank, list(controls.values()), True)[0]
    recipe = load_recipe(TINY, full).recipe
    streams = (96, 1, recipe.model.hyper_connections.num_streams, recipe.model.hidden_size)
    n_moe = recipe.model.mlp_types().count("moe")
    holders = {"alltoall": {"probs"}, "allgather": {"local_probs"}}
    for dispatcher, (leaked, graphs) in zip(controls, leaks):
        assert sum(shape == streams for _, shape, _ in leaked.values()) == 2 * n_moe, leaked
        assert graphs == holders[dispatcher], (dispatcher, graphs)
