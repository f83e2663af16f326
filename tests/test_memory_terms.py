"""The blocks' terms (``memory/blocks.py``, ``kda.py``, ``dsa.py``, ``moe.py``, ``head.py``): what each
block keeps equals the bytes autograd keeps on CPU for every block except KDA's attention (whose
kernels differ between CPU and GPU), the dense MLP's backward working set equals its census, and
how each term scales."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.memory import GiB, estimate_memory
from skyrl_megatron_kda.memory.blocks import (
    dense_mlp_activation_bytes, dense_mlp_backward_bytes, mhc_activation_bytes,
    norm_activation_bytes)
from skyrl_megatron_kda.memory.dsa import dsa_activation_bytes, dsa_projection_weights
from skyrl_megatron_kda.memory.head import head_activation_bytes
from skyrl_megatron_kda.memory.kda import kda_activation_bytes, kda_backward_bytes
from skyrl_megatron_kda.memory.moe import (
    dispatch_terms, local_assignments, moe_activation_bytes, moe_routed_bytes)
from skyrl_megatron_kda.memory.rows import rows_of
from skyrl_megatron_kda.memory.states import gather_buffer_bytes
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import EP2, EP2_ETP2, SINGLE, TINY, full_recipe, moe_census
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh


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
    rows = rows_of(recipe)
    mhc_norms = (mhc_activation_bytes(recipe)
                 + 2 * norm_activation_bytes(recipe, m.hidden_size, rows.sp))
    print(variant, parts)
    for i, (kind, mlp) in enumerate(zip(m.layer_types(), m.mlp_types())):
        assert parts[f"{i}.mhc_norms"] == mhc_norms, (i, parts[f"{i}.mhc_norms"], mhc_norms)
        want = (dense_mlp_activation_bytes(recipe) if mlp == "dense"
                else moe_activation_bytes(recipe))
        assert parts[f"{i}.mlp"] == want, (i, mlp, parts[f"{i}.mlp"], want)
        if kind == "dsa":
            assert parts[f"{i}.attention"] == dsa_activation_bytes(recipe), (
                i, m.dsa.kernel, parts[f"{i}.attention"], dsa_activation_bytes(recipe))
    assert parts["head"] == head_activation_bytes(recipe)


def test_moe_chunks_keep_only_the_router_and_the_chunk_inputs(census):
    """``train.moe_chunk_tokens``: each MoE block keeps its input, the router's and the shared
    expert's tensors and the dense routing probabilities and map [s, E], instead of the routed
    experts' per-assignment tensors."""
    measured, recipes = census
    chunked, whole = measured["bf16_moe_chunks"], measured["bf16"]
    recipe = recipes["bf16_moe_chunks"]
    r, e = rows_of(recipe), recipe.model.moe
    for i, mlp in enumerate(recipe.model.mlp_types()):
        if mlp == "moe":
            assert whole[f"{i}.mlp"] - chunked[f"{i}.mlp"] == (
                moe_routed_bytes(recipe, r.sp) - r.sp * 5 * e.num_experts) > 0


@pytest.fixture(scope="module")
def moe_ep2():
    """The MoE census at TP2 +SP x EP2 and the MoE backward peaks there: one call of 2 ranks."""
    return moe_census(2, EP2, backward=True)


def _assert_moe_census(recipes, ranks):
    """What each MoE block keeps equals ``moe_activation_bytes`` for the rows that reached the
    rank's experts, its combine's fp32 copy the transient term's (``DispatchTerms``: every
    gathered row under allgather, the rank's assignments under alltoall with ETP > 1, none
    without), and megatron's all-gather buffer ``gather_buffer_bytes``, on every rank; the
    balanced share the plan prices is the ranks' mean. Negative control: the other dispatcher's
    terms miss every unchunked census."""
    other = {"allgather": "alltoall", "alltoall": "allgather"}
    for rank, per_variant in enumerate(ranks):
        for name, got in per_variant.items():
            recipe = recipes[name]
            for i, kept in got["kept"].items():
                n = got["assignments"][i]
                assert kept == moe_activation_bytes(recipe, n), (rank, name, i, kept, n)
                if not recipe.train.moe_chunk_tokens:
                    moe = recipe.model.moe.model_copy(
                        update={"dispatcher": other[recipe.model.moe.dispatcher]})
                    swapped = recipe.model_copy(
                        update={"model": recipe.model.model_copy(update={"moe": moe})})
                    assert kept != moe_activation_bytes(swapped, n), (rank, name, i)
            assert got["gather_buffer"] == gather_buffer_bytes(recipe), (rank, name, got)
            # The combine's fp32 copy of the rows it reduce-scatters, one per chunk.
            terms, D = dispatch_terms(recipe), recipe.model.hidden_size
            for i, cast in got["fp32_combine"].items():
                rows = terms.gathered_rows(recipe, rows_of(recipe).sp, got["assignments"][i])
                assert cast == (4 * D * rows if terms.fp32_combine(recipe) else 0), (rank, name, i)
    for name, recipe in recipes.items():
        for i in ranks[0][name]["assignments"]:
            total = sum(per_variant[name]["assignments"][i] for per_variant in ranks)
            assert total == len(ranks) * local_assignments(recipe, rows_of(recipe).sp), (name, i)


def test_moe_terms_equal_saved_tensors_at_ep2(moe_ep2):
    """Each dispatcher, whole and in 40-row chunks, on both ranks of TP2 +SP x EP2."""
    recipes, ranks = moe_ep2[:2]
    _assert_moe_census(recipes, ranks)


def test_moe_terms_equal_saved_tensors_at_ep2_etp2():
    """The same on the 4 ranks of TP2 +SP x EP2 x ETP2, where the allgather dispatch's
    [s ep etp, D] rows outgrow the SP gather's [S, D] in megatron's buffer and the alltoall
    dispatch's all-gather over ETP takes none of it."""
    recipes, ranks = moe_census(4, EP2_ETP2)
    _assert_moe_census(recipes, ranks)
    assert ranks[0]["allgather"]["gather_buffer"] == 2 * ranks[0]["alltoall"]["gather_buffer"]


def test_moe_backward_holds_the_dispatch_transients(moe_ep2):
    """TP2 +SP x EP2, unchunked, on a shape where the tokens' tensors dominate: on every rank the
    MoE block's backward allocates at least its dispatcher's transients for the rows that
    reached the rank's experts (``moe_transient_bytes``: allgather's fp32 combine copy and its
    cast over every gathered row, alltoall's expert outputs over the rank's assignments).
    Negative control: alltoall priced with allgather's transients exceeds its whole peak. The
    working set is not a bound from above here: some of the backward's tensors are freed by
    the garbage collector, so the peak depends on when it runs (measured with it off; the
    smaller of two passes, since a buffer freed late only raises it). ETP > 1
    is not measured: on gloo the uneven all-gathers and reduce-scatters over ETP run through
    padded CPU copies that NCCL does not make."""
    from skyrl_megatron_kda.memory.moe import moe_transient_bytes

    _, _, recipes, ranks = moe_ep2
    for rank, peaks in enumerate(ranks):
        for name, (peak, n) in peaks.items():
            recipe = recipes[name]
            low = moe_transient_bytes(recipe, rows_of(recipe).sp, n)
            assert low <= peak, (rank, name, peak, n, low)
        gathered = recipes["allgather"]
        assert moe_transient_bytes(gathered, rows_of(gathered).sp) > peaks["alltoall"][0]


def test_cp_halves_sequence_sharded_terms():
    """Doubling CP halves every per-token term; what stays is the part independent of the
    tokens (KDA's concatenated projection weights; nothing elsewhere) and DSA's whole-sequence
    KV latent and (tp_split=sequence) the projections' whole weights, gathered over TP."""
    def recipe(cp, seq_len):
        return full_recipe("train.recompute=none", "kda.cp_exchange=a2a", f"data.seq_len={seq_len}",
                     f"parallel.cp={cp}")

    for fn in (kda_activation_bytes, moe_activation_bytes,
               dense_mlp_activation_bytes, mhc_activation_bytes,
               head_activation_bytes):
        fixed = [2 * fn(recipe(cp, 131072)) - fn(recipe(cp, 262144)) for cp in (1, 2)]
        assert fixed[0] == fixed[1], fn.__name__
        assert (fixed[0] > 0) == (fn is kda_activation_bytes), fn.__name__
        one, two = fn(recipe(1, 262144)) - fixed[0], fn(recipe(2, 262144)) - fixed[0]
        assert one == 2 * two, fn.__name__
    a = full_recipe().model.dsa
    # Independent of CP: the whole-sequence latent and (tp_split=sequence) the gathered weights.
    fixed = 262144 * a.kv_lora_rank * 2 + dsa_projection_weights(full_recipe()) * 2
    dsa = dsa_activation_bytes
    assert a.tp_split == "sequence"
    assert dsa(recipe(1, 262144)) - fixed == 2 * (dsa(recipe(2, 262144)) - fixed)


def test_kda_backward_working_set_is_per_head_token():
    """fla's chunk_kda_bwd allocations: linear in the rank's tokens and in its heads (TP halves
    them), 6,664 bytes per head-token at GLM's K = 128, chunk 64, bf16; with
    ``kda.kernel_head_group`` (the 1M recipe's 4) those of the largest group."""
    whole = "kda.kernel_head_group=null"
    one = kda_backward_bytes(full_recipe("data.seq_len=262144", "parallel.cp=1", whole))
    assert kda_backward_bytes(full_recipe("data.seq_len=524288", "parallel.cp=1", whole)) == 2 * one
    assert kda_backward_bytes(full_recipe("data.seq_len=524288", "parallel.cp=2", whole)) == one
    tp8 = full_recipe("data.seq_len=262144", "parallel.cp=1", whole)
    assert one == 262144 * (64 // tp8.parallel.tp) * 6664
    grouped = full_recipe("data.seq_len=262144", "parallel.cp=1")
    assert kda_backward_bytes(grouped) == one * grouped.kda.kernel_head_group // (64 // 8)


def test_exchange_buffers_come_from_the_cost_model():
    from skyrl_megatron_kda.kda import exchanges
    from skyrl_megatron_kda.kda.exchanges import ExchangeShape

    def extra_memory_bytes(name, shape):
        return exchanges.get(name).extra_memory_bytes(shape)

    shape_of = ExchangeShape.of

    recipe = full_recipe("train.recompute=none", "kda.cp_exchange=a2a")
    est = estimate_memory(recipe)
    assert est.exchange == "a2a"
    assert est.exchange_buffers == extra_memory_bytes("a2a", shape_of(recipe))  # one layer
    assert est.exchange_buffers > 0


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
    ``dense_mlp_backward_bytes`` on three shapes (rows, FFN width, hidden each changed
    alone), within the 2 bytes of a scalar."""
    shapes = [[], ["data.seq_len=512"], ["model.dense_ffn_hidden_size=256"], ["model.hidden_size=128"]]
    peaks = run_ranks(1, _ffn_backward_census, shapes)[0]
    for overrides, peak in zip(shapes, peaks):
        planned = dense_mlp_backward_bytes(load_recipe(TINY, SINGLE + ["model.params_dtype=bfloat16", *overrides]).recipe)
        assert 0 <= peak - planned <= 2, (overrides, peak, planned)
    assert len(set(peaks)) == len(peaks)  # each shape moved it: the census sees the terms


def test_fused_loss_replaces_the_logits():
    """``train.loss_chunk_tokens``: the head keeps 16 bytes per token instead of the fp32 softmax
    over the vocabulary shard, and the loss phase holds one chunk's logits instead of all."""
    plain = estimate_memory(full_recipe("train.loss_chunk_tokens=null"))
    fused_recipe = full_recipe("train.loss_chunk_tokens=8192")
    fused = estimate_memory(fused_recipe)
    r, m = rows_of(fused_recipe), fused_recipe.model
    head = "embedding + head + loss"
    assert plain.activations[head] - fused.activations[head] == r.cp * (m.vocab_size // 8 * 4 + 9 - 16)
    loss = "loss: kept + head + fused loss chunk of 8192"
    assert fused.phases[loss] < plain.phases["loss: kept + head + bf16 logits"] - 40 * GiB
    # The chunk's logits scale with the chunk, not with the rank's tokens.
    half = estimate_memory(full_recipe("train.loss_chunk_tokens=4096"))
    assert (fused.phases[loss] - half.phases["loss: kept + head + fused loss chunk of 4096"]
            == 4096 * (m.vocab_size // 8) * (4 + 2))


def test_flex_dispatcher_is_refused_with_its_reason():
    """``flex`` runs DeepEP's GPU kernels: no CPU census can check its buffers, so the plan
    refuses it in one line (the recipe check refuses it first where ``deep_ep`` is missing)."""
    recipe = full_recipe()
    moe = recipe.model.moe.model_copy(update={"dispatcher": "flex"})
    flex = recipe.model_copy(update={"model": recipe.model.model_copy(update={"moe": moe})})
    with pytest.raises(ValueError, match=r"^model.moe.dispatcher=flex has no memory terms: its "
                                         r"DeepEP kernels run on GPUs only") as refused:
        estimate_memory(flex)
    assert "\n" not in str(refused.value)
