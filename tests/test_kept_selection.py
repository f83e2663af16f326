"""Under recompute a DSA layer's indexer runs once per step (``dsa/kept_selection.py``).

* The compact form round-trips every layout a kernel returns (pools of consecutive tokens, -1
  pools, the tail; fewer visible pools than ``index_topk / index_kpool``), and a selection of
  another width is refused.
* On one rank of the tiny model under ``full`` and ``selective`` recompute: the indexer runs once
  per DSA layer per step with ``train.keep_dsa_selection`` (twice without), the loss and every
  gradient equal the reselecting run's bit for bit, and a corrupted kept selection changes them
  (so the recompute really attends with the kept one). What the holders keep after the forward
  is ``plan``'s term (``memory.dsa.dsa_kept_selection_bytes``), and backward frees all of it.

The loss and gradients of each setting against keeping every activation, and against
transformers, are in ``tests/test_glm_model.py`` (its ``MEMORY_VARIANTS``).
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.dsa import kept_selection
from skyrl_megatron_kda.dsa.pool_topk import select_pools
from skyrl_megatron_kda.dsa.pools import pool_starts, pool_token_indices
from tests.support.ranks import run_ranks

KPOOL, TOPK = 4, 16


def _round_trip(indices: torch.Tensor) -> torch.Tensor:
    first, tail = kept_selection.compact(indices, KPOOL, TOPK)
    assert first.dtype == tail.dtype == torch.int32
    assert first.shape[-1] + tail.shape[-1] == TOPK // KPOOL + KPOOL - 1
    return kept_selection.expand(first, tail, KPOOL).to(indices.dtype)


@pytest.mark.parametrize("docs", [(40,), (13, 20, 7), (9,)])
def test_compact_form_round_trips_the_oracle_selection(docs):
    """``select_pools`` (the unfused kernel's), including rows with fewer visible pools than
    index_topk / index_kpool, a sequence with fewer pools than that, and documents whose length
    is no multiple of kpool."""
    gen = torch.Generator().manual_seed(0)
    T, heads, d = sum(docs), 3, 8
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()])
    pos = torch.arange(T)
    doc_start = cu[torch.bucketize(pos, cu[1:], right=True)]
    q = torch.randn(T, 1, heads, d, generator=gen)
    idx = select_pools(q, torch.rand(T, 1, heads, generator=gen), torch.randn(T, 1, d, generator=gen),
                       torch.randn(T, 1, d, generator=gen), torch.randn(KPOOL, d, generator=gen),
                       pos, doc_start, cu, KPOOL, TOPK)
    assert idx.shape == (1, T, TOPK + KPOOL - 1)
    assert (idx[0, :8, 2 * KPOOL:TOPK] == -1).all(), "rows 0-7 see at most two pools"
    assert torch.equal(_round_trip(idx), idx)


def test_compact_form_round_trips_pool_token_indices():
    """The absorbed kernels' layout (``pool_token_indices`` of pool ids, -1 and invisible pools
    included), int32 as they return it."""
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 37, 64])
    starts = pool_starts(cu, KPOOL)
    pos = torch.randint(0, 64, (50,), generator=gen)
    doc_start = cu[torch.bucketize(pos, cu[1:], right=True)]
    pools = torch.randint(-1, starts.numel(), (50, TOPK // KPOOL), generator=gen)
    idx = pool_token_indices(pools, starts, pos, doc_start, KPOOL).to(torch.int32)
    assert (idx == -1).any() and (idx >= 0).any()
    assert torch.equal(_round_trip(idx), idx)


def test_a_selection_of_another_width_is_refused():
    with pytest.raises(ValueError, match="index_topk \\+ index_kpool - 1 = 19"):
        kept_selection.compact(torch.zeros(2, 20, dtype=torch.int32), KPOOL, TOPK)


def _steps(rank, world):
    """Loss, gradients and indexer calls of one step per setting; then the corrupted control."""
    from megatron.core import parallel_state

    from skyrl_megatron_kda.config.dotpath import merge
    from skyrl_megatron_kda.dsa.layer import GlmKPoolIndexer
    from skyrl_megatron_kda.memory.dsa import dsa_kept_selection_bytes
    from skyrl_megatron_kda.model.glm import GLMDecoderLayer, build_model
    from tests.support.tiny_models import token_loss
    from tests.test_glm_model import _batch, tiny_recipe

    parallel_state.initialize_model_parallel()
    base = tiny_recipe()
    ids, labels = _batch()
    calls = []
    indexer_forward = GlmKPoolIndexer.forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return indexer_forward(self, *args, **kwargs)

    GlmKPoolIndexer.forward = counted
    holders = []
    make_holder = GLMDecoderLayer.kept_selection

    def recorded(self):
        holder = make_holder(self)
        if holder is not None:
            holders.append(holder)
        return holder

    GLMDecoderLayer.kept_selection = recorded

    def step(recompute: str, keep: bool) -> dict:
        recipe = type(base).model_validate(merge(base.model_dump(), {"train": {
            "recompute": recompute, "keep_dsa_selection": keep}}))
        torch.manual_seed(0)
        model = build_model(recipe, use_cpu=True)
        calls.clear()
        holders.clear()
        loss = token_loss(model, ids, labels).mean()
        # The saved-tensor census of the kept selections: what the holders hold after the forward.
        kept = sum(t.nbytes for h in holders if h.compact is not None for t in h.compact)
        loss.backward()
        layers = len(set(calls))
        return dict(indexer_calls=len(calls), dsa_layers=layers, kept_bytes=kept,
                    # plan counts one row of data.seq_len tokens; the batch holds ids.shape[0]
                    planned_bytes=dsa_kept_selection_bytes(recipe) * layers * ids.shape[0],
                    holding_after_backward=sum(h.compact is not None for h in holders),
                    grads={n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None})

    out = {f"{mode}/{keep}": step(mode, keep) for mode in ("none", "full", "selective")
           for keep in (True, False)}
    expand = kept_selection.expand
    # Negative control: the recompute gets every kept pool one token earlier.
    kept_selection.expand = lambda first, tail, kpool: expand(
        torch.where(first > 0, first - 1, first), tail, kpool)
    try:
        out["corrupted"] = step("full", True)
    finally:
        kept_selection.expand = expand
    return out


@pytest.fixture(scope="module")
def steps():
    (out,) = run_ranks(1, _steps)
    return out


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_indexer_runs_once_per_step_with_the_same_gradients(steps, mode):
    kept, reselecting, plain = steps[f"{mode}/True"], steps[f"{mode}/False"], steps["none/True"]
    layers = plain["dsa_layers"]
    assert layers >= 1 and plain["indexer_calls"] == layers
    assert kept["indexer_calls"] == layers, "the recompute selected again"
    assert reselecting["indexer_calls"] == 2 * layers
    assert kept["grads"].keys() == reselecting["grads"].keys()
    unequal = [n for n, g in kept["grads"].items() if not torch.equal(g, reselecting["grads"][n])]
    assert not unequal, f"keeping the selection changed gradients: {unequal}"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_kept_selections_are_what_plan_counts_and_freed_by_backward(steps, mode):
    kept, reselecting = steps[f"{mode}/True"], steps[f"{mode}/False"]
    assert kept["kept_bytes"] > 0 and kept["kept_bytes"] == kept["planned_bytes"], kept
    assert kept["holding_after_backward"] == 0
    assert reselecting["kept_bytes"] == reselecting["planned_bytes"] == 0
    assert steps["none/True"]["kept_bytes"] == steps["none/True"]["planned_bytes"] == 0


def test_a_corrupted_kept_selection_changes_the_gradients(steps):
    kept, corrupted = steps["full/True"]["grads"], steps["corrupted"]["grads"]
    changed = [n for n, g in kept.items() if not torch.allclose(g, corrupted[n], atol=1e-6)]
    assert any("self_attention" in n for n in changed), changed
