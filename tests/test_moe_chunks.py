"""``train.moe_chunk_tokens`` (model/moe_layer.py): the loss and every gradient equal those of
megatron's unchunked MoELayer, on one rank and on TP2 +SP with EP2 or ETP2, also under full
recompute; the setting is
validated and refused with the MoE features the chunked forward does not reproduce. One chunk
is bitwise the whole layer; several round the experts' GEMMs differently (see the tolerances)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from skyrl_megatron_kda.recipes import load_recipe
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss

TINY = "glm53_flash_tiny"
SINGLE = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.etp=1",
          "parallel.sequence_parallel=false", "run.num_workers=1"]
TP2_SP_EP2 = ["parallel.tp=2", "parallel.cp=1", "parallel.ep=2", "parallel.etp=1",
              "parallel.sequence_parallel=true", "run.num_workers=2"]
TP2_SP_ETP2 = ["parallel.tp=2", "parallel.cp=1", "parallel.ep=1", "parallel.etp=2",
               "parallel.sequence_parallel=true", "run.num_workers=2"]
CHUNKS = (40, 64, 1000)
"""Rows per chunk: one that leaves a partial last chunk of the 128 (TP1) or 64 (TP2 +SP) rows
a rank holds at seq_len 128, one that cuts TP1's rows in two and is all of TP2's, one larger
than any rank's rows."""

MOE_TOLERANCE = 1e-6
"""Several chunks: relative fp32 gap of the loss and of the MoE layers' own gradients. The
chunks' expert GEMMs have fewer rows than the whole layer's and round differently (CPU GEMM
blocking by row count, ~1e-7), and the routed experts' weight gradients are summed chunk by
chunk; a token routed with another token's weights moves them by more than 1e-2 (the negative
control)."""

TRUNK_TOLERANCE = 1e-4
"""Several chunks: the other layers' gradients. The ~1e-7 differences in the MoE outputs reach
them through the backward, and their smallest gradients (mHC biases and scales, A_log: sums of
cancelling terms, norms of 1e-5 to 1e-4) amplify them to a few 1e-5, as for the fused loss."""


def _loss_and_grads(recipe):
    model = build_on_mesh(recipe)
    ids = token_ids(recipe)
    loss = token_loss(model, ids, ids.roll(-1, 1))
    loss.mean().backward()
    return loss.detach(), {n: q.grad for n, q in model.named_parameters() if q.grad is not None}


def _gaps_on_rank(rank, world, mesh, roll_chunk_probs=False):
    """Per chunk size, against the unchunked run of the same weights: the loss's relative gap,
    the largest of the MoE layers' gradients and of the others', and how many of the loss and
    gradients are bitwise equal, of how many."""
    if roll_chunk_probs:  # negative control: each chunk routes with its neighbour row's weights
        from skyrl_megatron_kda.model.moe_layer import GLMMoELayer

        on_chunk = GLMMoELayer._routed_experts_on_chunk
        GLMMoELayer._routed_experts_on_chunk = (
            lambda self, h, probs, m: on_chunk(self, h, probs.roll(1, 0), m))
    base = mesh + ["data.seq_len=128", "train.recompute=none"]
    loss0, grads0 = _loss_and_grads(load_recipe(TINY, base).recipe)
    out = {}
    # the chunk sizes, and the smallest under full recompute (chunks rebuilt inside a rebuilt layer)
    runs = {chunk: [] for chunk in CHUNKS} | {f"{CHUNKS[0]} full": ["train.recompute=full"]}
    for name, extra in runs.items():
        chunk = int(str(name).split()[0])
        loss1, grads1 = _loss_and_grads(load_recipe(TINY, base + [f"train.moe_chunk_tokens={chunk}", *extra]).recipe)
        assert grads1.keys() == grads0.keys()
        gaps = {n: float((grads1[n] - grads0[n]).norm() / grads0[n].norm()) for n in grads0}
        bitwise = torch.equal(loss1, loss0) + sum(torch.equal(grads1[n], grads0[n]) for n in grads0)
        out[name] = dict(
            loss=float((loss1 - loss0).norm() / loss0.norm()),
            moe=max(v for n, v in gaps.items() if ".mlp." in n),
            trunk=max(v for n, v in gaps.items() if ".mlp." not in n),
            bitwise=bitwise, total=1 + len(grads0), one_chunk=chunk >= 128 // world)
    return out


def _assert_equal(results):
    for rank, per_chunk in enumerate(results):
        for chunk, gap in per_chunk.items():
            print(f"rank {rank} chunk {chunk}: {gap}")
            if gap["one_chunk"]:  # the same operations in the same order
                assert gap["bitwise"] == gap["total"], (rank, chunk, gap)
            else:
                assert gap["loss"] <= MOE_TOLERANCE and gap["moe"] <= MOE_TOLERANCE, (rank, chunk, gap)
                assert gap["trunk"] <= TRUNK_TOLERANCE, (rank, chunk, gap)


def test_chunks_equal_the_whole_layer_on_one_rank():
    _assert_equal(run_ranks(1, _gaps_on_rank, SINGLE))


@pytest.mark.parametrize("mesh", [TP2_SP_EP2, TP2_SP_ETP2], ids=["tp2_sp_ep2", "tp2_sp_etp2"])
def test_chunks_equal_the_whole_layer_on_a_mesh(mesh):
    """Every rank of the dispatcher's TP x EP group runs the same chunks (the all-gathers and
    reduce-scatters pair up); the loss and gradients on each rank equal the unchunked ones."""
    _assert_equal(run_ranks(2, _gaps_on_rank, mesh))


def test_negative_control_misrouted_chunk_is_caught():
    (gaps,) = run_ranks(1, _gaps_on_rank, SINGLE, True)
    print(gaps)
    for gap in gaps.values():
        assert gap["loss"] > 1e3 * MOE_TOLERANCE and gap["moe"] > 1e-2, gaps


def _with_other_levers_on_rank(rank, world):
    base = SINGLE + ["data.seq_len=128", f"train.moe_chunk_tokens={CHUNKS[0]}"]
    loss0, grads0 = _loss_and_grads(load_recipe(TINY, base).recipe)
    out = {}
    for levers in (["train.offload_activations=true"], ["train.recompute=selective"],
                   ["train.recompute=full", "train.offload_activations=true"]):
        loss1, grads1 = _loss_and_grads(load_recipe(TINY, base + levers).recipe)
        out[" ".join(levers)] = torch.equal(loss1, loss0) and all(
            torch.equal(grads1[n], grads0[n]) for n in grads0)
    return out


def test_chunks_with_the_other_memory_levers_are_bitwise_the_same():
    """Host offload (the chunks' saved inputs go to the host), selective and full recompute
    leave the chunked layer's loss and gradients bitwise as they are."""
    (same,) = run_ranks(1, _with_other_levers_on_rank)
    assert all(same.values()), same


def test_moe_chunk_tokens_is_validated():
    assert load_recipe(TINY, []).recipe.train.moe_chunk_tokens == 0
    with pytest.raises(ValidationError, match="moe_chunk_tokens"):
        load_recipe(TINY, ["train.moe_chunk_tokens=-1"]).recipe


def test_chunks_refuse_what_they_do_not_reproduce():
    from skyrl_megatron_kda.model.moe_layer import _check_chunkable

    class Layer:  # the attributes _check_chunkable reads, as a MoELayer has them
        moe_layer_recompute = True
        config = type("Config", (), dict(
            moe_latent_size=None, moe_shared_expert_overlap=False,
            overlap_dispatch_backward_with_experts_wgrad=False, moe_expert_capacity_factor=1.5,
            transformer_impl="local"))

    with pytest.raises(ValueError, match="recompute_modules 'moe'.*moe_expert_capacity_factor"):
        _check_chunkable(Layer())
