"""Sparse NoPE-MLA core in the absorbed layout, the pool -> token index builder and the blocked
pooled indexer (CPU, single process).

* ``SparseLatentAttention`` equals a gather + softmax + matmul reference under autograd (output and
  both gradients, fp32, relative 1e-5) for block sizes that do and do not divide the query count,
  with masked entries and a query with nothing selected; fp64 gradcheck on a tiny case, and of
  ``absorbed_sparse_mla`` (queries, latent and the kv up-projection weight).
* ``absorbed_sparse_mla`` equals per-head attention with the up-projected keys and values, both
  a hand-written one and megatron's ``unfused_dsa_fn`` (what ``dsa/layer.py`` runs today).
* ``pool_token_indices`` is causal and per-document over packed documents, always holds the tail,
  and equals ``dsa.select_pools``' indices; ``blocked_pool_topk`` selects the same pools as
  ``select_pools``, ties included; ``index_violations`` catches a non-causal index.
* Memory: the bytes the core keeps for backward per query are the same at T=256 and T=1024 and
  hardly grow with top-k, unlike a gather reference (grows with top-k) and a masked dense one
  (grows with T).
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron_kda.dsa.pool_topk import select_pools
from skyrl_megatron_kda.dsa.pools import (
    document_starts,
    index_violations,
    pool_starts,
    pool_token_indices,
    pooled_keys,
)
from skyrl_megatron_kda.dsa.pool_topk import blocked_pool_topk
from skyrl_megatron_kda.dsa.sparse_mla import absorbed_sparse_mla, sparse_latent_attention
from tests.support.kda_cases import saved_bytes
from tests.support.interpreted import run_interpreted

TOL = 1e-5
TQ, TK, HEADS, RANK, TOPK = 37, 45, 3, 16, 12
DOC_LENGTHS = (22, 3, 17, 8)  # not multiples of kpool: incomplete pools at every document end
INDEXER_LENGTHS = (61, 5, 90, 36)  # long enough that many pools compete for the top-k
KPOOL = 4


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def _random_indices(tq, tk, topk, gen, masked=0.25):
    """Distinct keys per query, about ``masked`` of them -1, and query 3 with nothing selected."""
    idx = torch.stack([torch.randperm(tk, generator=gen)[:topk] for _ in range(tq)])
    idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < masked, -1)
    idx[3] = -1
    return idx


def _gather_reference(q_abs, latent, indices, scale):
    """The obvious path under autograd: gather the selected rows, softmax, weighted sum."""
    valid = indices >= 0
    rows = latent[indices.clamp(min=0)]  # [Tq, k, R]
    scores = torch.einsum("qhr,qkr->qhk", q_abs, rows) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    any_valid = valid.any(-1)[:, None, None]
    probs = torch.where(any_valid, scores, 0.0).softmax(-1) * any_valid
    return torch.einsum("qhk,qkr->qhr", probs, rows)


def _masked_dense_reference(q_abs, latent, indices, scale):
    """Full [H, Tq, Tk] scores with the selection as a mask (megatron's absorbed unfused path)."""
    mask = torch.zeros(indices.shape[0], latent.shape[0] + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(indices < 0, latent.shape[0], indices), True)
    scores = torch.einsum("qhr,kr->hqk", q_abs, latent) * scale
    probs = scores.masked_fill(~mask[None, :, :-1], float("-inf")).softmax(-1)
    return torch.einsum("hqk,kr->qhr", probs, latent)


def _inputs(gen, dtype=torch.float32, tq=TQ, tk=TK, heads=HEADS, rank=RANK):
    q = torch.randn(tq, heads, rank, generator=gen, dtype=dtype).requires_grad_()
    latent = torch.randn(tk, rank, generator=gen, dtype=dtype).requires_grad_()
    return q, latent


@pytest.mark.parametrize("block_size", [1, 5, 37, 64])
def test_core_matches_gather_reference(block_size):
    gen = torch.Generator().manual_seed(0)
    q, latent = _inputs(gen)
    idx = _random_indices(TQ, TK, TOPK, gen)
    grad = torch.randn(TQ, HEADS, RANK, generator=gen)
    scale = RANK**-0.5

    out = sparse_latent_attention(q, latent, idx, scale, block_size)
    dq, dl = torch.autograd.grad(out, (q, latent), grad)
    ref = _gather_reference(q, latent, idx, scale)
    rq, rl = torch.autograd.grad(ref, (q, latent), grad)
    errors = {"out": _rel(out, ref), "dq": _rel(dq, rq), "dlatent": _rel(dl, rl)}
    print(block_size, errors, "max abs", [float((a - b).detach().abs().max())
                                          for a, b in ((out, ref), (dq, rq), (dl, rl))])
    assert max(errors.values()) < TOL, errors
    assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.equal(dq[3], torch.zeros_like(dq[3]))
    assert torch.isfinite(dq).all() and torch.isfinite(dl).all()


def test_core_gradcheck_float64():
    gen = torch.Generator().manual_seed(1)
    q, latent = _inputs(gen, torch.float64, tq=6, tk=7, heads=2, rank=3)
    idx = _random_indices(6, 7, 4, gen)
    assert torch.autograd.gradcheck(
        lambda a, b: sparse_latent_attention(a, b, idx, 0.7, 4), (q, latent))


def test_absorbed_gradcheck_float64():
    """The fused absorption (q @ W_UK and @ W_UV^T inside the blocks): gradients of the queries,
    the latent and the whole kv up-projection weight."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(6, 2, 3, generator=gen, dtype=torch.float64).requires_grad_()
    latent = torch.randn(7, 4, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(2 * (3 + 2), 4, generator=gen, dtype=torch.float64).requires_grad_()
    idx = _random_indices(6, 7, 4, gen)
    assert torch.autograd.gradcheck(
        lambda a, b, w: absorbed_sparse_mla(a, b, w, idx, 0.7, v_head_dim=2, block_size=4),
        (q, latent, weight))


def test_nothing_selected_gives_zero():
    q, latent = _inputs(torch.Generator().manual_seed(2), tq=4, tk=5)
    idx = torch.full((4, 3), -1)
    out = sparse_latent_attention(q, latent, idx, 1.0, 3)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(latent.grad, torch.zeros_like(latent))


@pytest.mark.parametrize("bad, message", [
    (lambda i: i.float(), "integer"), (lambda i: i[:-1], "indices must be"),
    (lambda i: i.masked_fill(i == i.max(), TK), "lie in"), (lambda i: i - 2, "lie in")])
def test_bad_indices_are_refused(bad, message):
    q, latent = _inputs(torch.Generator().manual_seed(3))
    idx = _random_indices(TQ, TK, TOPK, torch.Generator().manual_seed(4), masked=0)
    with pytest.raises(ValueError, match=message):
        sparse_latent_attention(q, latent, bad(idx), 1.0)


# ---------------------------------------------------------------------------------------------
# Absorbed layout == per-head attention with up-projected keys and values.

def _mla_inputs(gen, t=40, heads=4, dn=8, dv=6, rank=16):
    q_nope = torch.randn(t, heads, dn, generator=gen).requires_grad_()
    latent = torch.randn(t, rank, generator=gen).requires_grad_()
    weight = (torch.randn(heads * (dn + dv), rank, generator=gen) * 0.3).requires_grad_()
    return q_nope, latent, weight


def _causal_pool_indices(t, gen, n_select=3):
    """What the indexer would pick on two packed documents: every query sees its tail or its own
    complete pool, so none attends to nothing (the unabsorbed references would give NaN)."""
    cu = torch.tensor([0, 23, t])
    starts = pool_starts(cu, KPOOL)
    pos = torch.arange(t)
    doc = document_starts(cu, pos)
    q, weights, keys, gate, ape = _indexer_inputs(gen, t, heads=4)
    ids = blocked_pool_topk(q, weights, pooled_keys(keys, gate, ape, starts, KPOOL), starts, pos,
                            doc, KPOOL, n_select)
    return pool_token_indices(ids, starts, pos, doc, KPOOL), pos, cu


def _unabsorbed(q_nope, latent, weight, indices, scale, dv):
    t, heads, dn = q_nope.shape
    kv = (latent @ weight.T).view(latent.shape[0], heads, dn + dv)
    key, value = kv.split([dn, dv], -1)
    valid = indices >= 0
    k_sel, v_sel = key[indices.clamp(min=0)], value[indices.clamp(min=0)]  # [Tq, k, H, d]
    scores = torch.einsum("qhd,qkhd->qhk", q_nope, k_sel) * scale
    probs = scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1)
    return torch.einsum("qhk,qkhd->qhd", probs, v_sel)


def _megatron_unfused(q_nope, latent, weight, indices, scale, dv, pos, cu):
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    t, heads, dn = q_nope.shape
    kv = (latent @ weight.T).view(t, 1, heads, dn + dv)
    key, value = kv.split([dn, dv], -1)
    out = unfused_dsa_fn(q_nope[:, None], key.contiguous(), value.contiguous(), indices[None], scale,
                         varlen_starts=document_starts(cu, pos), varlen_ends=pos + 1)
    return out.view(t, heads, dv)


@pytest.mark.parametrize("path", ["per_head", "megatron_unfused"])
def test_absorbed_equals_unabsorbed(path):
    gen = torch.Generator().manual_seed(5)
    q_nope, latent, weight = _mla_inputs(gen)
    indices, pos, cu = _causal_pool_indices(q_nope.shape[0], gen)
    grad = torch.randn(q_nope.shape[0], 4, 6, generator=gen)
    scale = 8**-0.5  # 1/sqrt(qk_head_dim): the unabsorbed layer's scale, not 1/sqrt(kv_lora_rank)
    inputs = (q_nope, latent, weight)

    out = absorbed_sparse_mla(q_nope, latent, weight, indices, scale, v_head_dim=6, block_size=7)
    grads = torch.autograd.grad(out, inputs, grad)
    if path == "per_head":
        ref = _unabsorbed(q_nope, latent, weight, indices, scale, 6)
    else:
        ref = _megatron_unfused(q_nope, latent, weight, indices, scale, 6, pos, cu)
    ref_grads = torch.autograd.grad(ref, inputs, grad)
    errors = {"out": _rel(out, ref)} | {
        f"d{n}": _rel(g, r) for n, g, r in zip(("q", "latent", "weight"), grads, ref_grads)}
    print(path, errors, "max abs out", float((out - ref).detach().abs().max()))
    assert max(errors.values()) < TOL, errors


# ---------------------------------------------------------------------------------------------
# Pool ids -> token indices, and the blocked indexer, against dsa.select_pools.

def _packed_positions(lengths=DOC_LENGTHS):
    cu = torch.tensor([0, *lengths]).cumsum(0)
    pos = torch.arange(int(cu[-1]))
    return cu, pos, document_starts(cu, pos)


def test_pool_indices_are_causal_per_document_with_tail():
    cu, pos, doc = _packed_positions()
    starts = pool_starts(cu, KPOOL)
    gen = torch.Generator().manual_seed(6)
    # Any distinct pool ids, most of them not visible to the query: the builder must drop those.
    ids = torch.stack([torch.randperm(starts.numel() + 1, generator=gen)[:5] - 1 for _ in pos])
    idx = pool_token_indices(ids, starts, pos, doc, KPOOL)
    assert idx.shape == (pos.numel(), 5 * KPOOL + KPOOL - 1)
    assert index_violations(idx, pos, doc) == 0
    for s in range(pos.numel()):
        chosen = idx[s][idx[s] >= 0].tolist()
        assert len(chosen) == len(set(chosen)), f"query {s}: a token twice"
        tail_n = (int(pos[s] - doc[s]) + 1) % KPOOL
        assert set(range(int(pos[s]) + 1 - tail_n, int(pos[s]) + 1)) <= set(chosen), f"query {s}: tail"
        kept_pools = {int(starts[i]) for i in ids[s].tolist()
                      if i >= 0 and starts[i] >= doc[s] and starts[i] + KPOOL - 1 <= pos[s]}
        assert set(chosen) == {p + j for p in kept_pools for j in range(KPOOL)} | set(
            range(int(pos[s]) + 1 - tail_n, int(pos[s]) + 1))
    # Negative controls: one index past its query, one in the previous document.
    past = idx.clone()
    past[30, 0] = 31
    across = idx.clone()
    across[23, 0] = 21  # document 2 starts at 22; 21 is document 1
    assert index_violations(past, pos, doc) == 1
    assert index_violations(across, pos, doc) == 1


def _indexer_inputs(gen, t, heads, dim=8):
    q = torch.randn(t, heads, dim, generator=gen)
    weights = torch.randn(t, heads, generator=gen)
    keys, gate = torch.randn(t, dim, generator=gen), torch.randn(t, dim, generator=gen) * 0.3
    return q, weights, keys, gate, torch.randn(KPOOL, dim, generator=gen)


@pytest.mark.parametrize("heads, topk, query_block, pool_block", [
    (8, 8, 5, 3), (8, 16, 50, 100), (8, 24, 7, 1), (1, 16, 6, 2)])  # one head: exact-zero ties
def test_blocked_indexer_equals_select_pools(heads, topk, query_block, pool_block):
    cu, pos, doc = _packed_positions(INDEXER_LENGTHS)
    q, weights, keys, gate, ape = _indexer_inputs(torch.Generator().manual_seed(7), pos.numel(), heads)
    full = select_pools(q[:, None], weights[:, None], keys[:, None], gate[:, None], ape, pos, doc,
                        cu, KPOOL, topk)[0]

    starts = pool_starts(cu, KPOOL)
    ids = blocked_pool_topk(q, weights, pooled_keys(keys, gate, ape, starts, KPOOL), starts, pos,
                            doc, KPOOL, topk // KPOOL, query_block, pool_block)
    ours = pool_token_indices(ids, starts, pos, doc, KPOOL)
    # The same pools chosen from select_pools' own indices (a pool's first token -> its id).
    firsts = full[:, :topk].reshape(pos.numel(), -1, KPOOL)[..., 0]
    full_ids = torch.where(firsts >= 0, torch.searchsorted(starts, firsts.clamp(min=0)), -1)
    print(heads, topk, "pools kept per query", float((ids >= 0).sum(-1).float().mean()))
    if heads == 1:  # the tie-break is exercised: equal scores straddle the top-k boundary
        scores = torch.einsum("nhd,pd->np", q, pooled_keys(keys, gate, ape, starts, KPOOL)).relu()
        scores = (scores * weights).masked_fill(
            (starts[None] < doc[:, None]) | (starts[None] + KPOOL - 1 > pos[:, None]), float("-inf"))
        ranked = scores.sort(-1, descending=True).values
        last, after = ranked[:, topk // KPOOL - 1], ranked[:, topk // KPOOL]
        assert int(((last == after) & last.isfinite()).sum()) > 10
    assert torch.equal(ours, full)
    assert torch.equal(pool_token_indices(full_ids, starts, pos, doc, KPOOL), full)
    assert index_violations(ours, pos, doc) == 0


# ---------------------------------------------------------------------------------------------
# Memory census: bytes saved for backward per query.

def _census(reference, t, topk, heads=4, rank=32):
    gen = torch.Generator().manual_seed(8)
    q, latent = _inputs(gen, tq=t, tk=t, heads=heads, rank=rank)
    idx = torch.randint(0, t, (t, topk), generator=gen)
    _, nbytes = saved_bytes(lambda: reference(q, latent, idx, rank**-0.5))
    return nbytes / t


def test_kept_bytes_per_query_do_not_grow_with_t_or_dims_times_topk():
    core = lambda q, l, i, s: sparse_latent_attention(q, l, i, s, 64)  # noqa: E731
    paths = {"core": core, "gather": _gather_reference, "masked_dense": _masked_dense_reference}
    per_query = {name: {(t, k): _census(fn, t, k) for t, k in ((256, 32), (1024, 32), (256, 128))}
                 for name, fn in paths.items()}
    print(per_query)
    core_q, gather_q, dense_q = per_query["core"], per_query["gather"], per_query["masked_dense"]
    assert core_q[(1024, 32)] == core_q[(256, 32)]
    assert dense_q[(1024, 32)] > 3 * dense_q[(256, 32)]  # [H, T, T] scores: grows with T
    # Growing top-k by 96 adds the indices only (8 bytes each) to the core; the gather path keeps
    # the gathered rows too (rank * 4 bytes each, and more).
    assert core_q[(256, 128)] - core_q[(256, 32)] == 96 * 8
    assert gather_q[(256, 128)] - gather_q[(256, 32)] >= 96 * 32 * 4


_POOL_TOKENS = """
import json
import torch
from skyrl_megatron_kda.dsa.pools import (document_starts, pool_starts, pool_token_indices,
                                          pool_tokens_kernel)
g = torch.Generator().manual_seed(3)
got = {}
for kpool in (4, 3, 1):
    cu = torch.tensor([0, 23, 24, 150, 161])  # tails of every length; a one-token document
    starts = pool_starts(cu, kpool)
    pos = torch.arange(int(cu[-1]))
    doc = document_starts(cu, pos)
    # 200 picks a query (two of the program's 128-pool steps, the second partial): any pool id,
    # so many are past the query or in another document, and -1s
    ids = torch.randint(-1, starts.numel(), (pos.numel(), 200), generator=g)
    ref = pool_token_indices(ids, starts, pos, doc, kpool).to(torch.int32)
    out = torch.full(ref.shape, 7, dtype=torch.int32)
    pool_tokens_kernel(out, ids, starts, pos, doc, kpool)
    strided = torch.full((pos.numel(), ref.shape[1] + 5), 7, dtype=torch.int32)
    pool_tokens_kernel(strided[:, :ref.shape[1]], ids, starts, pos, doc, kpool)
    other = pool_token_indices(ids.roll(1, 1), starts, pos, doc, kpool).to(torch.int32)
    got[kpool] = {"equal": torch.equal(out, ref),
                  "strided": torch.equal(strided[:, :ref.shape[1]], ref)
                             and bool((strided[:, ref.shape[1]:] == 7).all()),
                  "other_ids_differ": not torch.equal(out, other),
                  "visible_share": float((ref[:, :200 * kpool] >= 0).float().mean())}
print(json.dumps(got))
"""


def test_the_pool_token_kernel_equals_pool_token_indices_interpreted():
    """``write_pool_tokens``'s Triton program under Triton's CPU interpreter equals
    ``pool_token_indices`` for every query of five packed documents (tails of every length, a
    one-token document), at pools of 4, 3 (a non-power-of-two) and 1 token, on random pool ids
    and -1s (many invisible: past the query or another document's), into a contiguous and a
    row-strided output (the columns past the row untouched); control: the same ids in another
    order give other tokens."""
    got = run_interpreted(_POOL_TOKENS)
    assert set(got) == {"4", "3", "1"}, got
    for kpool, case in got.items():
        assert case["equal"] and case["strided"] and case["other_ids_differ"], (kpool, case)
        assert 0.05 < case["visible_share"] < 0.95, (kpool, case)


def test_the_pool_token_kernel_refuses_an_output_it_cannot_fill():
    """One ValueError line naming the output it needs, before any launch."""
    from skyrl_megatron_kda.dsa.pools import pool_tokens_kernel

    ids, pos = torch.zeros(3, 2, dtype=torch.long), torch.arange(3)
    for out in (torch.empty(3, 11, dtype=torch.long), torch.empty(3, 10, dtype=torch.int32),
                torch.empty(11, 3, dtype=torch.int32).t()):
        with pytest.raises(ValueError, match=r"out must be int32 \[3, 11\] with contiguous rows"):
            pool_tokens_kernel(out, ids, torch.arange(0, 12, 4), pos, pos * 0, 4)
