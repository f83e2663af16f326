"""``model.dsa.kernel=fused``: our wrapper around megatron-core's TileLang sparse-MLA kernels.

On CPU the kernels are replaced by a torch stand-in with their contract (576-wide queries and
latent, 512-wide output, int32 [S, 1, k] indices; ``tests/support/sparse_mla_ops.py``), so what is
checked here is ours: the zero padding of the absorbed queries and the latent, the value
projection, the query blocks, the recomputed forward in backward and the summed latent gradient.
The fused path equals the torch kernel (``absorbed_sparse_mla``) in fp64 to 1e-10; controls show
the comparison catches an index shifted by one, a head attending with another head's query and
a value read from the padded channels. On a
GPU, ``test_fused_dsa_kernels_match_torch`` runs the real kernels (bf16) against the fp32 torch
kernel."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from skyrl_megatron_kda.config.model import DSAConfig
from skyrl_megatron_kda.dsa.fused_sparse_mla import _per_head_product, fused_absorbed_sparse_mla
from skyrl_megatron_kda.dsa.kernels import DSAShape
from skyrl_megatron_kda.dsa.kernels.fused import FusedKernel
from skyrl_megatron_kda.dsa.ops.contract import KERNEL_VALUE_WIDTH
from skyrl_megatron_kda.dsa.ops.fused import fused_sparse_mla_ops
from skyrl_megatron_kda.dsa.ops.latent.interface import latent_sparse_mla_ops
from skyrl_megatron_kda.dsa.sparse_mla import absorbed_sparse_mla
from tests.support.flashmla import needs_flashmla
from tests.support.interpreted import run_interpreted
from tests.support.sparse_mla_ops import torch_sparse_mla_ops

TQ, TK, HEADS, DN, DV, RANK, TOPK = 37, 45, 3, 8, 6, 16, 12
SCALE = 0.3


def _inputs(dtype, gen, tq=TQ, tk=TK, heads=HEADS, rank=RANK, topk=TOPK, device="cpu"):
    q = torch.randn(tq, heads, DN, generator=gen, dtype=torch.float64)
    latent = torch.randn(tk, rank, generator=gen, dtype=torch.float64)
    weight = torch.randn(heads * (DN + DV), rank, generator=gen, dtype=torch.float64) * 0.3
    idx = torch.stack([torch.randperm(tk, generator=gen)[:topk] for _ in range(tq)])
    idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.25, -1)
    idx[3] = -1  # a query with nothing selected: output 0, no NaN
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, latent, weight)] + [
        idx.to(device=device, dtype=torch.int32)]


def _run(attend, q, latent, weight, idx, grad):
    q, latent, weight = (t.detach().clone().requires_grad_() for t in (q, latent, weight))
    out = attend(q, latent, weight, idx)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dlatent": latent.grad, "dweight": weight.grad}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _fused(kernels, block):
    return lambda q, c, w, i: fused_absorbed_sparse_mla(q, c, w, i, SCALE, DV, block, kernels)


def _torch(q, c, w, i):
    return absorbed_sparse_mla(q, c, w, i, SCALE, DV, block_size=5)


WIDTHS = {"megatron": {}, "latent": {"width": RANK, "value_width": RANK}}
"""The stand-in's widths: megatron-core's (576 in, 512 out: the latent padded) and ours
(``latent_sparse_mla``: the latent's own width, nothing padded)."""


@pytest.mark.parametrize("widths", list(WIDTHS))
@pytest.mark.parametrize("block", [1, 8, TQ, 64])  # single rows, partial last block, one, larger
def test_fused_wrapper_equals_torch_kernel(block, widths):
    gen = torch.Generator().manual_seed(0)
    q, latent, weight, idx = _inputs(torch.float64, gen)
    grad = torch.randn(TQ, HEADS, DV, generator=gen, dtype=torch.float64)
    ref = _run(_torch, q, latent, weight, idx, grad)
    got = _run(_fused(torch_sparse_mla_ops(**WIDTHS[widths]), block), q, latent, weight, idx, grad)
    errors = {k: _rel(got[k], ref[k]) for k in ref}
    print(block, errors)
    assert max(errors.values()) < 1e-10, errors
    assert torch.equal(got["out"][3], torch.zeros_like(got["out"][3]))
    assert all(torch.isfinite(v).all() for v in got.values())


def _shifted(kernels):
    """Control: the kernel reads each selected row one position later."""
    return replace(
        kernels,
        forward=lambda q, kv, i, s: kernels.forward(q, kv, torch.where(i >= 0, (i + 1) % kv.shape[0], i), s),
        backward=lambda q, kv, o, do, i, lse, sm_scale, delta: kernels.backward(
            q, kv, o, do, torch.where(i >= 0, (i + 1) % kv.shape[0], i), lse, sm_scale, delta))


def _wrong_head(kernels):
    """Control: each head attends with the next head's query (the heads off by one)."""
    return replace(kernels, forward=lambda q, kv, i, s: kernels.forward(
        q.roll(1, dims=1).contiguous(), kv, i, s))


def _value_from_padding(kernels):
    """Control: the output read from channels 64..575 (as if the value sat after a RoPE part)."""
    def forward(q, kv, i, s):
        out, lse = kernels.forward(q, kv.roll(-64, dims=-1).contiguous(), i, s)
        return out, lse
    return replace(kernels, forward=forward)


@pytest.mark.parametrize("block", [1, 8, 64])
def test_a_backward_that_adds_into_the_latent_gradient_changes_nothing(block):
    """Our kernels' backward adds each call's latent gradient into the layer's fp32 buffer
    (``backward_adds_dkv``) instead of returning one to be added: the same gradients in fp32
    to rounding of the summation order (fp64: the buffer is not fp32, so it is not used and
    every bit is equal). Control: a backward that adds into the buffer but returns it as its
    own gradient too counts the calls before it twice."""
    gen = torch.Generator().manual_seed(2)
    widths = WIDTHS["latent"]
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 0.0)):
        q, latent, weight, idx = _inputs(dtype, gen)
        grad = torch.randn(TQ, HEADS, DV, generator=gen, dtype=dtype)
        ref = _run(_fused(torch_sparse_mla_ops(**widths), block), q, latent, weight, idx, grad)
        got = _run(_fused(torch_sparse_mla_ops(**widths, backward_adds_dkv=True), block), q,
                   latent, weight, idx, grad)
        errors = {k: _rel(got[k], ref[k]) for k in ref}
        assert max(errors.values()) <= tol, (dtype, errors)
    kernels = torch_sparse_mla_ops(**widths, backward_adds_dkv=True)
    q, latent, weight, idx = _inputs(torch.float32, gen)
    shared = torch.zeros(TK, 1, RANK)  # one buffer across the calls, returned by each
    doubled = replace(kernels, backward_adds_dkv=False,
                      backward=lambda *a, **k: kernels.backward(*a, **k, dkv=shared))
    grad = torch.randn(TQ, HEADS, DV, generator=gen)
    ref = _run(_fused(kernels, 8), q, latent, weight, idx, grad)
    got = _run(_fused(doubled, 8), q, latent, weight, idx, grad)
    assert _rel(got["dlatent"], ref["dlatent"]) > 1e-2


@pytest.mark.parametrize("control, widths", [(_shifted, "megatron"), (_shifted, "latent"),
                                             (_wrong_head, "megatron"), (_wrong_head, "latent"),
                                             (_value_from_padding, "megatron")])
def test_controls_are_caught(control, widths):
    gen = torch.Generator().manual_seed(1)
    q, latent, weight, idx = _inputs(torch.float64, gen)
    grad = torch.randn(TQ, HEADS, DV, generator=gen, dtype=torch.float64)
    ref = _run(_torch, q, latent, weight, idx, grad)
    got = _run(_fused(control(torch_sparse_mla_ops(**WIDTHS[widths])), 8), q, latent, weight, idx, grad)
    assert _rel(got["out"], ref["out"]) > 1e-2


def _counting(kernels, calls):
    """The stand-in with every forward call counted in ``calls``."""
    def forward(*args):
        calls.append(1)
        return kernels.forward(*args)
    return replace(kernels, forward=forward)


def _saved_bytes(attend, q, latent, weight, idx):
    """Bytes autograd saves for backward in ``attend``'s forward (each storage once; all alive
    until the graph goes)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    q, latent, weight = (t.detach().clone().requires_grad_() for t in (q, latent, weight))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attend(q, latent, weight, idx)
    return sum(seen.values())


@pytest.mark.parametrize("widths", list(WIDTHS))
@pytest.mark.parametrize("block", [8, TQ])
def test_keeping_the_output_skips_the_backwards_forward_and_changes_no_bit(block, widths):
    """``keep_output`` (model.dsa.fused.keep_attention_output): the backward reads the forward's
    kernel output and log-sum-exp instead of calling the kernel forward again per block; every
    gradient is bitwise the recomputing path's, and autograd keeps exactly the output [S, H,
    value_width] and log-sum-exp [S, H] more (what FusedKernel.kept_bytes adds)."""
    gen = torch.Generator().manual_seed(3)
    q, latent, weight, idx = _inputs(torch.float64, gen)
    grad = torch.randn(TQ, HEADS, DV, generator=gen, dtype=torch.float64)
    runs, saved = {}, {}
    blocks = -(-TQ // block)
    for keep in (False, True):
        calls = []
        kernels = _counting(torch_sparse_mla_ops(**WIDTHS[widths]), calls)
        attend = lambda q, c, w, i: fused_absorbed_sparse_mla(  # noqa: E731
            q, c, w, i, SCALE, DV, block, kernels, keep_output=keep)
        runs[keep] = _run(attend, q, latent, weight, idx, grad)
        assert len(calls) == (blocks if keep else 2 * blocks), (keep, len(calls))
        saved[keep] = _saved_bytes(attend, q, latent, weight, idx)
    for name, value in runs[False].items():
        assert torch.equal(runs[True][name], value), name
    # plan's term (FusedKernel.kept_bytes) on this call's shape, at the stand-in's output width
    model = type("StandIn", (FusedKernel,), {
        "value_width": torch_sparse_mla_ops(**WIDTHS[widths]).value_width})
    shape = {keep: DSAShape(dsa=DSAConfig(fused={"keep_attention_output": keep}), whole=TK, cp_rows=TQ,
                            sp_rows=TQ, tp=1, cp=1, act_bytes=8, rows=TQ, heads=HEADS,
                            index_rows=TQ, by_rows=False) for keep in (False, True)}
    lse_in_fp64 = TQ * HEADS * 4  # the stand-in's log-sum-exp is fp64, the kernels' fp32
    assert (saved[True] - saved[False]
            == model.kept_bytes(shape[True]) - model.kept_bytes(shape[False]) + lse_in_fp64)


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-14), (torch.bfloat16, 1e-2)])
def test_per_head_products_are_the_einsums_written_where_they_lie(dtype, bound):
    """The absorption, the value projection and dq's projection write [b, H, n] in place
    (``_per_head_product``): the einsum they replace up to its summation order, into the given
    rows and first channels only (the rest untouched); heads taken in another order (the
    control) are far off."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(TQ, HEADS, DN, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(HEADS, DN, RANK, generator=gen, dtype=torch.float64).to(dtype)
    out = torch.full((TQ + 9, HEADS, RANK + 5), 7.0, dtype=dtype)
    _per_head_product(x, w, out[4:4 + TQ])
    assert _rel(out[4:4 + TQ, :, :RANK], torch.einsum("qhd,hdr->qhr", x, w)) < bound
    assert bool((out[:4] == 7).all() and (out[4 + TQ:] == 7).all() and (out[..., RANK:] == 7).all())
    assert _rel(out[4:4 + TQ, :, :RANK], torch.einsum("qhd,hdr->qhr", x, w.flip(0))) > 0.5


def test_nothing_is_kept_without_a_backward():
    """Under no_grad (a recomputed layer's first forward) keep_output keeps nothing: the same
    one kernel call per block and no [S, H, value_width] copy."""
    gen = torch.Generator().manual_seed(4)
    q, latent, weight, idx = _inputs(torch.float64, gen)
    calls = []
    kernels = _counting(torch_sparse_mla_ops(), calls)
    with torch.no_grad():
        kept = fused_absorbed_sparse_mla(q, latent, weight, idx, SCALE, DV, 8, kernels,
                                         keep_output=True)
        plain = fused_absorbed_sparse_mla(q, latent, weight, idx, SCALE, DV, 8, kernels)
    assert torch.equal(kept, plain) and len(calls) == 2 * -(-TQ // 8)
    assert kept.grad_fn is None


def test_latent_wider_than_the_kernel_is_refused():
    gen = torch.Generator().manual_seed(2)
    q, latent, weight, idx = _inputs(torch.float64, gen, rank=KERNEL_VALUE_WIDTH + 1)
    with pytest.raises(ValueError, match="latent"):
        _fused(torch_sparse_mla_ops(), 8)(q, latent, weight, idx)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_fused_kernel_needs_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        fused_sparse_mla_ops()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TileLang kernels need CUDA")
@pytest.mark.parametrize("load", [
    fused_sparse_mla_ops, latent_sparse_mla_ops, lambda: latent_sparse_mla_ops(ordered=True),
    pytest.param(lambda: latent_sparse_mla_ops(attention_forward="flashmla"), marks=needs_flashmla)],
    ids=["megatron", "latent", "latent_ordered", "latent_flashmla"])
@pytest.mark.parametrize("heads", [8, 64])  # 8: TP8's heads-split share (padded to 16 inside)
@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep_output"])
def test_fused_dsa_kernels_match_torch(heads, load, keep):
    """The wrapper on bf16 TileLang kernels (megatron-core's, and ours: dsa/ops/latent/) vs
    the fp32 torch kernel at GLM's widths (latent 512, head 256): out, dq, d latent and d
    weight within 1e-2 relative, with -1 padded indices; the backward recomputing the kernel
    output or reading the kept one."""
    gen = torch.Generator().manual_seed(3)
    tq, tk, topk = 300, 700, 130  # rows and top-k that are not multiples of the kernels' 64/256
    q = torch.randn(tq, heads, 256, generator=gen) * 0.5
    latent = torch.randn(tk, 512, generator=gen)
    weight = torch.randn(heads * 512, 512, generator=gen) * 512 ** -0.5
    pos = torch.arange(tk - tq, tk)[:, None]
    idx = (torch.rand(tq, topk, generator=gen) * (pos + 1)).long()
    idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.2, -1).to(torch.int32)
    grad = torch.randn(tq, heads, 256, generator=gen)
    dev = torch.device("cuda")
    args = [t.to(dev) for t in (q, latent, weight, idx)]
    ref = _run(lambda q, c, w, i: absorbed_sparse_mla(q, c, w, i, 1 / 16, 256, 64), *args,
               grad.to(dev))
    bf16 = [t.bfloat16() for t in args[:3]] + [args[3]]
    kernels = load()
    got = _run(lambda q, c, w, i: fused_absorbed_sparse_mla(q, c, w, i, 1 / 16, 256, 128, kernels,
                                                             keep_output=keep),
               *bf16, grad.to(dev).bfloat16())
    errors = {k: _rel(got[k], ref[k]) for k in ref}
    print(heads, errors)
    assert max(errors.values()) < 1e-2, errors


def _gpu_indexer_case(cu_seqlens: list[int], first_query: int, seed: int):
    """Indexer inputs on CUDA at GLM's widths (32 heads x 128, pools of 4) for the queries from
    ``first_query`` to the last token: pool starts, positions, document starts, q, weights,
    pool keys."""
    from skyrl_megatron_kda.dsa.pools import document_starts, pool_starts

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(seed)
    cu = torch.tensor(cu_seqlens, device=dev)
    starts = pool_starts(cu, 4)
    pos = torch.arange(first_query, cu_seqlens[-1], device=dev)
    q = (torch.randn(pos.numel(), 32, 128, generator=gen) * 0.3).to(dev).bfloat16()
    w = torch.rand(pos.numel(), 32, generator=gen).to(dev)
    keys = torch.randn(starts.numel(), 128, generator=gen).to(dev).bfloat16()
    return starts, pos, document_starts(cu, pos), q, w, keys


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TileLang kernels need CUDA")
def test_fused_indexer_selects_the_torch_pools():
    """The fused indexer's scores (bf16 products, fp32 sums) pick the same pools as the torch
    indexer (fp32) for nearly every query, and never a pool the query may not see."""
    from skyrl_megatron_kda.dsa.pool_topk import blocked_pool_topk, fused_pool_topk

    # (a 3-token document: no pool at all)
    starts, pos, first, q, w, keys = _gpu_indexer_case([0, 1500, 1503, 4000], 1000, seed=4)
    ref = blocked_pool_topk(q, w, keys, starts, pos, first, 4, 64, query_block=256)
    kernels = fused_sparse_mla_ops()
    got = fused_pool_topk(q, w, keys, starts, pos, first, 4, 64, 700, kernels.index_scores,
                          kernels.index_group)
    same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(got.cpu(), ref.cpu())]
    ends = starts[got.clamp(min=0)] + 3
    bad = (got >= 0) & ((ends > pos[:, None]) | (starts[got.clamp(min=0)] < first[:, None]))
    print(sum(same) / len(same))
    assert int(bad.sum()) == 0
    assert sum(same) / len(same) > 0.98


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TileLang kernels need CUDA")
def test_fp8_keys_quantised_once_select_what_per_block_quantisation_selects():
    """``model.dsa.fused.indexer_scores=fp8``: the pool keys quantised once for the pass
    (``index_keys``) and sliced per block give the fused indexer exactly the selection that
    quantising each block's range gives, over several blocks and a document boundary; and the
    FP8 selection is close to the bf16 one (most pools the same)."""
    from skyrl_megatron_kda.dsa.pool_topk import fused_pool_topk

    starts, pos, first, q, w, keys = _gpu_indexer_case([0, 1500, 6000], 1000, seed=11)
    fp8, bf16 = fused_sparse_mla_ops(indexer_scores="fp8"), fused_sparse_mla_ops()
    select = lambda k, pool_keys: fused_pool_topk(  # noqa: E731
        q, w, pool_keys, starts, pos, first, 4, 64, 700, k.index_scores, k.index_group)
    once, per_block = select(fp8, fp8.index_keys(keys)), select(fp8, keys)
    assert torch.equal(once, per_block)
    reference = select(bf16, keys)
    picked = lambda row: set(row.tolist()) - {-1}  # noqa: E731
    same = sum(len(picked(a) & picked(b)) for a, b in zip(once.cpu(), reference.cpu()))
    share = same / sum(len(picked(b)) for b in reference.cpu())
    print({"same pools as bf16": share})
    assert share > 0.9, share


@pytest.mark.parametrize("block", [1, 7, 192, 4000])
def test_pool_candidates_ranges_are_each_blocks_window(block):
    """``PoolCandidates.ranges``, computed once for the pass, equals each block's ranges
    relative to its window (``window``'s first pool) as five torch kernels per block computed
    them, at blocks of 1 query, 7 (the last one short), the whole pass and more; a slice that
    is not one of the pass's blocks is refused. Control: relative to the pass's first pool
    instead, the ranges differ."""
    from skyrl_megatron_kda.dsa.pool_topk import PoolCandidates
    from skyrl_megatron_kda.dsa.pools import document_starts, pool_starts

    cu = torch.tensor([0, 61, 66, 156, 192])
    starts, pos = pool_starts(cu, 4), torch.arange(0, 192)
    candidates = PoolCandidates(starts, pos, document_starts(cu, pos), 4, block)
    shifted = 0
    for q0 in range(0, 192, block):
        rows = slice(q0, min(q0 + block, 192))
        lo = candidates.window(rows)[0]
        ks, ke = candidates.ranges(rows)
        assert ks.dtype == ke.dtype == torch.int32
        assert torch.equal(ks, (candidates.first[rows] - lo).int())
        assert torch.equal(ke, (candidates.end[rows] - lo).clamp(min=0).int())
        shifted += not torch.equal(ks, candidates.first[rows].int())
    assert shifted or block >= 192  # one block: its window starts at the pass's first pool
    with pytest.raises(ValueError, match="not one block"):
        candidates.ranges(slice(1, 1 + block) if block > 1 else slice(0, 2))
    with pytest.raises(ValueError, match="query block must be >= 1"):
        PoolCandidates(starts, pos, document_starts(cu, pos), 4, 0)


_POOL_IDS = """
import json
import torch
from skyrl_megatron_kda.dsa.pool_topk import pool_ids_kernel, write_pool_ids
g = torch.Generator().manual_seed(4)
got = {}
for k in (5, 512, 1500):  # one program step, a whole one, two steps with the last partial
    ids = torch.randint(0, 4000, (9, k), generator=g)
    scores = torch.randn(9, k, generator=g).masked_fill(torch.rand(9, k, generator=g) < 0.3,
                                                        float("-inf"))
    ref = torch.empty(9, k, dtype=torch.long)
    write_pool_ids(ref, ids, scores, 1234)  # the torch path (CPU tensors)
    out = torch.full((9, k + 3), 7, dtype=torch.long)  # rows strided, 3 columns past them
    pool_ids_kernel(out[:, :k], ids, scores, 1234)
    other = torch.empty(9, k, dtype=torch.long)
    pool_ids_kernel(other, ids, scores, 1235)
    got[k] = {"equal": torch.equal(out[:, :k], ref), "untouched": bool((out[:, k:] == 7).all()),
              "minus_one": bool((ref == -1).eq(scores == float("-inf")).all()),
              "other_offset_differs": not torch.equal(other, ref)}
print(json.dumps(got))
"""


def test_the_pool_id_kernel_equals_torch_interpreted():
    """``write_pool_ids``'s Triton program (a top-k's ids plus the window's first pool, -1 for
    a -inf score) under Triton's CPU interpreter equals the torch path, at top-k widths within
    one step and over two, into row-strided output (the columns past each row untouched);
    control: another offset gives other ids."""
    got = run_interpreted(_POOL_IDS)
    assert set(got) == {"5", "512", "1500"}, got
    for k, case in got.items():
        assert all(case.values()), (k, case)


def test_the_pool_id_kernel_refuses_an_output_it_cannot_fill():
    from skyrl_megatron_kda.dsa.pool_topk import pool_ids_kernel

    ids, scores = torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4)
    for out in (torch.empty(3, 4, dtype=torch.int32), torch.empty(3, 5, dtype=torch.long),
                torch.empty(4, 3, dtype=torch.long).t()):
        with pytest.raises(ValueError, match=r"out must be int64 \[3, 4\] with contiguous rows"):
            pool_ids_kernel(out, ids, scores, 0)


@pytest.mark.parametrize("block", [1, 7, 4000])
def test_fused_indexer_selects_the_blocked_pools(block):
    """``fused_pool_topk`` with the stand-in scores equals ``blocked_pool_topk`` (fp32, no ties):
    the per-query pool ranges [ks, ke) and the block's pool window are right; a query whose
    document has no complete pool yet selects nothing. Control: ranges one pool too far."""
    from skyrl_megatron_kda.dsa.pools import document_starts, pool_starts
    from skyrl_megatron_kda.dsa.pool_topk import blocked_pool_topk, fused_pool_topk

    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 61, 66, 156, 192])
    starts = pool_starts(cu, 4)
    pos = torch.arange(0, 192)
    first = document_starts(cu, pos)
    q, w = torch.randn(192, 4, 8, generator=gen), torch.rand(192, 4, generator=gen)
    keys = torch.randn(starts.numel(), 8, generator=gen)
    ref = blocked_pool_topk(q, w, keys, starts, pos, first, 4, 5, query_block=9, pool_block=3)
    scores, group = torch_sparse_mla_ops().index_scores, torch_sparse_mla_ops().index_group
    got = fused_pool_topk(q, w, keys, starts, pos, first, 4, 5, block, scores, group)
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)
    assert (got[:3] == -1).all()  # tokens 0..2: no complete pool
    # (one block: a single query's window ends at its own range, so the control needs several)
    late = fused_pool_topk(q, w, keys, starts, pos, first, 4, 5, 4000,
                           lambda q, k, w, ks, ke: scores(q, k, w, ks, ke + 1), group)
    assert not torch.equal(late.sort(-1).values, ref.sort(-1).values)


CUDA_PARAM = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the floor top-k's Triton kernels and pinned copies need CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
@pytest.mark.parametrize("block", [7, 4000])
def test_crowded_rows_are_redone_after_the_blocks(block, device, monkeypatch):
    """With room for one candidate per pick, most rows have more candidates than fit
    (``floor_topk`` flags them); ``fused_pool_topk`` redoes those a few blocks later
    (``DeferredRows``) with a whole-row top-k and still equals ``blocked_pool_topk``. Control:
    without the redo (flags dropped) the selection differs."""
    from skyrl_megatron_kda.dsa import pool_topk
    from skyrl_megatron_kda.dsa.ops import threshold_topk
    from skyrl_megatron_kda.dsa.pools import document_starts, pool_starts

    monkeypatch.setattr(threshold_topk, "CANDIDATES_PER_PICK", 1)
    gen = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 400])
    starts = pool_starts(cu, 4)
    pos = torch.arange(0, 400)
    first = document_starts(cu, pos)
    q, w = torch.randn(400, 4, 8, generator=gen), torch.rand(400, 4, generator=gen)
    keys = torch.randn(starts.numel(), 8, generator=gen)
    ref = pool_topk.blocked_pool_topk(q, w, keys, starts, pos, first, 4, 5, query_block=9,
                                      pool_block=3)
    q, w, keys, starts, pos, first = (t.to(device) for t in (q, w, keys, starts, pos, first))
    scores, group = torch_sparse_mla_ops().index_scores, torch_sparse_mla_ops().index_group
    flagged = []
    floor_topk = pool_topk.floor_topk

    def counting(*args):
        best, ids, crowded = floor_topk(*args)
        flagged.append(int(crowded.sum()))
        return best, ids, crowded

    monkeypatch.setattr(pool_topk, "floor_topk", counting)
    got = pool_topk.fused_pool_topk(q, w, keys, starts, pos, first, 4, 5, block, scores,
                                    group).cpu()
    assert sum(flagged) > 100
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)
    monkeypatch.setattr(pool_topk, "floor_topk",
                        lambda *a: (lambda b, i, c: (b, i, torch.zeros_like(c)))(*floor_topk(*a)))
    skipped = pool_topk.fused_pool_topk(q, w, keys, starts, pos, first, 4, 5, block, scores,
                                        group).cpu()
    assert not torch.equal(skipped.sort(-1).values, ref.sort(-1).values)


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
def test_deferred_rows_run_in_order_lag_blocks_later(device):
    """``DeferredRows``: a block's fix runs once ``lag`` more flagged blocks are queued, with
    exactly its flagged rows (none: not at all), before the actions queued after it, and
    ``finish`` runs the rest in order. Control: a lag of 0 runs each fix at once."""
    from skyrl_megatron_kda.dsa.pool_topk import DeferredRows

    log = []
    later = DeferredRows(lag=2)
    flags = [torch.tensor(f, device=device) for f in
             ([True, False, True], [False, False, False], [False, True, False])]
    for b, f in enumerate(flags):
        later.fix(f, lambda rows, b=b: log.append((b, rows.tolist())))
        later.then(lambda b=b: log.append(("then", b)))
        assert len([e for e in log if e[0] == "then"]) == max(0, b - 1)
    assert log == [(0, [0, 2]), ("then", 0)]
    later.finish()
    assert log == [(0, [0, 2]), ("then", 0), ("then", 1), (2, [1]), ("then", 2)]
    at_once = []
    DeferredRows(lag=0).fix(flags[0], lambda rows: at_once.append(rows.tolist()))
    assert at_once == [[0, 2]]

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
@pytest.mark.parametrize("n, pools", [(1, 5), (100, 300), (257, 1000)])  # partial tiles
def test_triton_pool_scores_equal_the_reference(n, pools):
    """``index_scores.pool_scores`` against the fp32 torch reference of the same contract on
    bf16-rounded inputs: the same -inf pattern (visible ranges, empty ranges) and finite scores
    within 1e-3 relative (bf16 products, fp32 sums in another order); its group maxima are
    exactly its scores' (partial last group included)."""
    from skyrl_megatron_kda.dsa.ops.index_scores import GROUP, pool_scores
    from skyrl_megatron_kda.dsa.ops.threshold_topk import group_maxima

    gen, dev = torch.Generator().manual_seed(6), torch.device("cuda")
    q = torch.randn(n, 32, 128, generator=gen).bfloat16()
    keys = torch.randn(pools, 128, generator=gen).bfloat16()
    w = torch.rand(n, 32, generator=gen)
    ks = torch.randint(0, pools, (n,), generator=gen, dtype=torch.int32)
    ke = (ks + torch.randint(-3, pools, (n,), generator=gen, dtype=torch.int32)).clamp(0, pools)
    ref = torch_sparse_mla_ops().index_scores(q.float(), keys.float(), w, ks, ke)[0]
    got, maxima = (t.cpu() for t in pool_scores(*(t.to(dev) for t in (q, keys, w, ks, ke))))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    err = float((got[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-30))
    print(n, pools, err)
    assert err < 1e-3, err
    assert torch.equal(maxima, group_maxima(got, GROUP))  # the kernel's own scores' maxima


def _fp8_case(gen, n, pools, heads=4, dim=32):
    q = torch.randn(n, heads, dim, generator=gen).bfloat16()
    keys = (torch.randn(pools, dim, generator=gen) * torch.rand(pools, 1, generator=gen) * 4).bfloat16()
    w = torch.randn(n, heads, generator=gen)  # signed, as weights_proj's output
    ks = torch.randint(0, pools // 4, (n,), generator=gen, dtype=torch.int32)
    ke = (ks + torch.randint(1, pools, (n,), generator=gen, dtype=torch.int32)).clamp(max=pools)
    return q, keys, w, ks, ke


def _fp8_errors(q, keys, w, ks, ke, **tiles):
    """fp8_pool_scores against the fp64 scores of its own dequantised inputs, of the exact bf16
    inputs, and (control) of the dequantised inputs with each pool's scale moved one pool on."""
    from skyrl_megatron_kda.dsa.ops.index_scores import GROUP, fp8_keys, fp8_pool_scores, fp8_rows
    from skyrl_megatron_kda.dsa.ops.threshold_topk import group_maxima

    got, maxima = (t.cpu() for t in fp8_pool_scores(q, keys, w, ks, ke, **tiles))
    assert torch.equal(maxima, group_maxima(got, tiles.get("group", GROUP)))
    # The keys quantised once for the pass (the layer's index_keys) score the same.
    assert torch.equal(fp8_pool_scores(q, fp8_keys(keys), w, ks, ke, **tiles)[0].cpu(), got)
    (q8, q_scale), (k8, k_scale) = (tuple(t.cpu() for t in fp8_rows(x)) for x in (q, keys))
    reference = torch_sparse_mla_ops().index_scores
    q_deq = q8.double() * q_scale[..., None]
    scores = lambda k: reference(q_deq, k, w.float().cpu(), ks.cpu(), ke.cpu())[0]  # noqa: E731
    ref = scores(k8.double() * k_scale[:, None])
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    rel = lambda other: float((got.double()[finite] - other[finite]).norm()  # noqa: E731
                              / other[finite].norm())
    exact = reference(q.cpu().double(), keys.cpu().double(), w.float().cpu(), ks.cpu(), ke.cpu())[0]
    return {"dequantised": rel(ref), "bf16": rel(exact),
            "scales_moved": rel(scores(k8.double() * k_scale.roll(1)[:, None]))}


def test_a_range_of_fp8_keys_is_the_range_quantised():
    """``FP8Keys`` quantised once per pass and sliced by a block's pool range hold exactly what
    quantising that range alone gives (each pool's scale is its own row's). Control: scales
    taken one pool off differ."""
    from skyrl_megatron_kda.dsa.ops.index_scores import FP8Keys, fp8_keys

    keys = torch.randn(300, 16, generator=torch.Generator().manual_seed(9)).bfloat16()
    whole, alone = fp8_keys(keys)[50:200], fp8_keys(keys[50:200])
    assert isinstance(whole, FP8Keys)
    assert torch.equal(whole.values.float(), alone.values.float())
    assert torch.equal(whole.scales, alone.scales)
    assert not torch.equal(fp8_keys(keys).scales[51:201], alone.scales)


@pytest.mark.parametrize("heads, tiles", [(4, (32, 64, 4, 1)), (3, (4, 64, 4, 2))])
def test_fp8_pool_scores_equal_their_dequantised_inputs_interpreted(heads, tiles):
    """model.dsa.fused.indexer_scores=fp8 under Triton's CPU interpreter (which runs FP8 products
    but not bf16 ones: the bf16 kernel is checked on the GPU): the kernel's scores with the query
    heads' scales folded into the weights and the pools' applied after the relu equal the
    fp64 scores of the dequantised FP8 inputs (1e-5), differ from the exact bf16 scores by
    FP8's rounding (a few percent), and a pool scale applied to the wrong pool is caught. Also
    with 3 heads (padded to 4 columns per query), 4 queries per program (70 queries: a partial
    last program) and partial visible ranges."""
    code = (
        "import json, torch\n"
        "from tests.test_fused_sparse_mla import _fp8_case, _fp8_errors\n"
        "gen = torch.Generator().manual_seed(7)\n"
        f"print(json.dumps(_fp8_errors(*_fp8_case(gen, 70, 300, heads={heads}), "
        f"tiles={tiles})))\n")
    got = run_interpreted(code)
    assert got["dequantised"] < 1e-5 and 1e-3 < got["bf16"] < 0.1 < got["scales_moved"], got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
def test_fp8_pool_scores_on_the_gpu():
    """The FP8 score kernel at GLM's indexer widths (32 heads x 128) on wgmma FP8: equal to the
    fp64 scores of its dequantised inputs to 1e-3 (Hopper's FP8 tensor cores accumulate each
    product with fewer bits than fp32: 1.3e-4 measured, against 3.6e-2 from FP8's rounding of
    the inputs) and within FP8's rounding of the bf16 ones;
    the maxima are its scores'. Then the selection it makes for 1,024 queries over 20,000 pools
    (top 512) against the bf16 kernel's: the share of the same pools is printed and must be
    most of them (> 0.8); random scores crowd near the k-th, real ones less."""
    from skyrl_megatron_kda.dsa.ops.index_scores import fp8_pool_scores, pool_scores

    gen, dev = torch.Generator().manual_seed(8), torch.device("cuda")
    case = [t.to(dev) for t in _fp8_case(gen, 300, 1000, heads=32, dim=128)]
    errors = _fp8_errors(*case)
    print(errors)
    assert errors["dequantised"] < 1e-3 and errors["bf16"] < 0.1 < errors["scales_moved"], errors
    q, keys, w, _, _ = (t.to(dev) for t in _fp8_case(gen, 1024, 20000, heads=32, dim=128))
    ks = torch.zeros(1024, dtype=torch.int32, device=dev)
    ke = torch.full_like(ks, 20000)
    picks = [scorer(q, keys, w, ks, ke)[0].topk(512, dim=-1).indices
             for scorer in (pool_scores, fp8_pool_scores)]
    same = torch.zeros(1024, 20000, dtype=torch.int32, device=dev)
    for p in picks:
        same.scatter_add_(1, p, torch.ones_like(p, dtype=torch.int32))
    agreement = float((same == 2).sum(-1).float().mean() / 512)
    print({"same pools": agreement})
    assert agreement > 0.8, agreement


def test_pool_scores_refuse_a_tile_the_product_cannot_take():
    """Queries per program that are not a power of two, or too few columns (queries x heads
    below 16), are refused in one line before any kernel is compiled."""
    from skyrl_megatron_kda.dsa.ops.index_scores import pool_scores

    q, keys = torch.zeros(8, 2, 16), torch.zeros(40, 16)
    w, ks, ke = torch.zeros(8, 2), torch.zeros(8, dtype=torch.int32), torch.ones(8, dtype=torch.int32)
    for tiles in ((3, 64, 4, 2), (4, 64, 4, 2)):
        with pytest.raises(ValueError, match="queries per program must be a power of two"):
            pool_scores(q, keys, w, ks, ke, tiles)


_FP8_ROWS = """
import json
import torch
from skyrl_megatron_kda.dsa.ops.index_scores import FP8_MAX, fp8_rows_kernel, fp8_rows_reference
g = torch.Generator().manual_seed(4)
x = (torch.randn(37, 3, 128, generator=g) * torch.logspace(-4, 3, 37)[:, None, None]).bfloat16()
x[5, 1] = 0  # an all-zero row keeps scale 1
x[6, 2, 7] = 1e-30  # a row with one tiny value
x[7, 0] = -x[7, 0].abs()
x[7, 1, :5] = -0.0  # keeps its sign
q, scale = fp8_rows_kernel(x)
ref_q, ref_scale = fp8_rows_reference(x)
bits = lambda t: t.view(torch.uint8)
print(json.dumps({"values": torch.equal(bits(q), bits(ref_q)), "scales": torch.equal(scale, ref_scale),
                  "shapes": [list(q.shape), list(scale.shape)],
                  "reaches_max": float(q.float().abs().amax()) == FP8_MAX,
                  "zero_row_scale": float(scale[5, 1]),
                  "shifted_rows_differ": not torch.equal(bits(q), bits(fp8_rows_reference(x.roll(1, 0))[0]))}))
"""


def test_the_fp8_row_kernel_equals_the_torch_quantisation_interpreted():
    """``fp8_rows_kernel`` (one launch per indexer block's queries instead of about eight) under
    Triton's CPU interpreter: the FP8 values bit for bit and the fp32 scales exactly as
    ``fp8_rows_reference`` on 111 rows of 128 (a partial last program) spread over seven decades,
    with an all-zero row (scale 1), a row holding one tiny value, a negative one and negative
    zeros; control:
    the rows shifted by one give other bits."""
    got = run_interpreted(_FP8_ROWS)
    assert got["values"] and got["scales"] and got["reaches_max"], got
    assert got["shapes"] == [[37, 3, 128], [37, 3]] and got["zero_row_scale"] == 1.0, got
    assert got["shifted_rows_differ"], got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need CUDA")
def test_the_indexer_blocks_small_kernels_equal_torch_on_the_gpu():
    """On CUDA, at an indexer block's shape (1,024 queries x 32 heads x 128; 512 pools a query
    over 262,144): ``fp8_rows_kernel`` gives torch's FP8 bits and scales (the compiled rounding,
    not only the interpreter's), and ``write_pool_tokens`` gives ``pool_token_indices``'s tokens."""
    from skyrl_megatron_kda.dsa.ops.index_scores import fp8_rows_kernel, fp8_rows_reference
    from skyrl_megatron_kda.dsa.pools import pool_token_indices, pool_starts, write_pool_tokens

    gen = torch.Generator(device="cuda").manual_seed(8)
    x = (torch.randn(1024, 32, 128, generator=gen, device="cuda")
         * torch.logspace(-6, 4, 1024, device="cuda")[:, None, None]).bfloat16()
    x[3, 4] = 0
    x[5, 6, :9] = -0.0
    (q, scale), (ref_q, ref_scale) = fp8_rows_kernel(x), fp8_rows_reference(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)

    kpool, keys = 4, 1 << 20
    cu = torch.tensor([0, 5000, keys], device="cuda")
    starts = pool_starts(cu, kpool)
    pos = torch.arange(keys - 1024, keys, device="cuda")
    doc = torch.full_like(pos, 5000)
    ids = torch.randint(-1, starts.numel(), (1024, 512), generator=gen, device="cuda")
    out = torch.empty(1024, 512 * kpool + kpool - 1, dtype=torch.int32, device="cuda")
    write_pool_tokens(out, ids, starts, pos, doc, kpool)
    assert torch.equal(out, pool_token_indices(ids, starts, pos, doc, kpool).int())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need CUDA")
def test_the_pool_id_kernel_equals_torch_on_the_gpu():
    """On CUDA, at an indexer block's shape (1,024 queries, 512 picks into a row of 512 pools
    of a 262,144-pool window): ``write_pool_ids``'s Triton program gives torch's ids, -1 where
    the score is -inf."""
    from skyrl_megatron_kda.dsa.pool_topk import write_pool_ids

    gen = torch.Generator(device="cuda").manual_seed(9)
    ids = torch.randint(0, 1 << 18, (1024, 512), generator=gen, device="cuda")
    scores = torch.randn(1024, 512, generator=gen, device="cuda")
    scores[::7, 100:] = float("-inf")
    pools = torch.empty(1024, 512, dtype=torch.long, device="cuda")
    write_pool_ids(pools, ids, scores, 262144)
    assert torch.equal(pools, torch.where(scores == float("-inf"), -1, ids + 262144))
