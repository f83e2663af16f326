"""``model.dsa.kernel=latent``: our TileLang sparse-MLA programs (``dsa/ops/latent/``).

On CPU: the head padding rule, the refusals, and (in ``tests/test_fused_sparse_mla.py`` and
``tests/test_dsa.py``) the wrapper and the layer on a torch stand-in with the kernels' contract
(the latent's own width, nothing padded). On a GPU: the kernels themselves in bf16 against the
fp32 torch attention (``sparse_mla.sparse_latent_attention``) with -1 holes, a query with no
key, 8 heads (padded to 16) and 64; each tuning of the forward and the backward; and controls
(every index shifted by one; each head given the next head's query) that the tolerance
catches. The ping-pong forward, an experiment outside the package, is
``tests/test_ping_pong_forward.py``. The layer's wrapper on these kernels against the fp32 torch
kernel at GLM's widths is ``tests/test_fused_sparse_mla.py::test_fused_dsa_kernels_match_torch``
(both kernel sets)."""

from __future__ import annotations


import pytest
import torch

from skyrl_megatron_kda.dsa import kernels as dsa_kernels
from skyrl_megatron_kda.dsa.ops.latent.backward import backward_program
from skyrl_megatron_kda.dsa.ops.latent.common import padded_heads
from skyrl_megatron_kda.dsa.ops.latent.forward import forward_program
from skyrl_megatron_kda.dsa.ops.latent.interface import (
    latent_backward,
    latent_forward,
    latent_sparse_mla_ops,
)
from skyrl_megatron_kda.dsa.sparse_mla import sparse_latent_attention
from tests.support.flashmla import needs_flashmla
from tests.support.interpreted import run_interpreted

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="TileLang kernels need CUDA")
SCALE = 256 ** -0.5
TOL = 1e-2


def test_heads_are_padded_as_the_kernels_take_them():
    assert [padded_heads(h) for h in (1, 8, 16, 17, 33, 64, 65, 128)] == [16, 16, 16, 32, 64, 64,
                                                                          128, 128]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_latent_kernels_need_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        latent_sparse_mla_ops()
    assert "run.device=gpu" in dsa_kernels.get("latent").refusal("cpu")
    assert dsa_kernels.resolve("auto", "cpu") == "torch"


def test_a_forward_tuning_names_our_forward():
    """FlashMLA's forward has no tunings of ours: refused in one line before anything runs."""
    with pytest.raises(ValueError, match="forward_config tunes our forward, not 'flashmla'"):
        latent_sparse_mla_ops(attention_forward="flashmla", forward_config={"key_block": 32})


def test_the_backward_refuses_key_blocks_that_do_not_tile_its_keys():
    """Checked before TileLang is needed: a key block that does not divide the top-k width (or
    that its store parts do not divide) would read past a query's indices."""
    for bad in (dict(key_block=48), dict(key_block=16, store_split=3)):
        with pytest.raises(ValueError, match="multiple of the key block"):
            backward_program(64, 512, 2080, SCALE, **bad)


def test_the_stacked_backward_refuses_shapes_it_does_not_cover():
    """Checked before TileLang is needed: 64-head groups, channel parts of whole 64-channel
    tiles, its own threads; channel_split only with stacked."""
    for heads, config in ((32, {}), (64, {"channel_split": 3}), (64, {"threads": 128})):
        with pytest.raises(ValueError, match="stacked backward"):
            backward_program(heads, 512, 2080, SCALE, stacked=True, **config)
    with pytest.raises(ValueError, match="name stacked"):
        backward_program(64, 512, 2080, SCALE, channel_split=2)


def test_the_stacked_backward_refuses_buffers_beyond_shared_memory():
    """Checked before TileLang is needed: half the channels added at once (a 32 KiB fp32 store
    part) would need 240 KiB, beyond sm_90's 227 (on the GPU it compiled and failed at its
    launch); the default's parts, and half the channels in four store parts, fit."""
    from skyrl_megatron_kda.dsa.ops.latent.backward import _stacked_shared_bytes
    from skyrl_megatron_kda.dsa.ops.latent.common import SHARED_BYTES
    from skyrl_megatron_kda.dsa.ops.latent.interface import default_backward_config

    with pytest.raises(ValueError, match="KiB of shared memory"):
        backward_program(64, 512, 2080, SCALE, stacked=True, channel_split=2, store_split=1)
    fits = [_stacked_shared_bytes(512, 32, 2, 32 // c["store_split"], 512 // c["channel_split"])
            for c in (default_backward_config(64), {"channel_split": 2, "store_split": 4})]
    assert max(fits) <= SHARED_BYTES < _stacked_shared_bytes(512, 32, 2, 32, 256), fits


def test_whole_head_groups_take_the_stacked_backward_by_default():
    """64-head groups (atomic and ordered alike): the stacked backward; fewer heads the
    backward of key-block rows."""
    from skyrl_megatron_kda.dsa.ops.latent.interface import default_backward_config

    stacked = {"stacked": True, "channel_split": 4, "store_split": 1}
    assert default_backward_config(64) == default_backward_config(128) == stacked
    assert default_backward_config(8) == {}


def test_the_forward_refuses_key_blocks_that_do_not_tile_its_keys():
    with pytest.raises(ValueError, match="multiple of the key block"):
        forward_program(64, 512, 2080, SCALE, key_block=64)


def test_the_warp_specialised_forward_refuses_shapes_it_does_not_cover():
    """Checked before TileLang is needed: 64-head groups, pairs of key blocks, two stages."""
    for heads, topk, config in ((32, 2176, {}), (64, 2112, {}), (64, 2176, {"num_stages": 3}),
                                (64, 2176, {"deferred_sum": True})):
        with pytest.raises(ValueError, match="warp-specialised"):
            forward_program(heads, 512, topk, SCALE, warp_specialized=True, **config)


def test_whole_head_groups_take_the_warp_specialised_forward_by_default():
    """64-head groups: the warp-specialised forward, its indices padded to a pair of key blocks
    (2,051 -> 2,176); fewer heads: the pipelined forward (-> 2,112); a named tuning replaces
    the default."""
    from skyrl_megatron_kda.dsa.ops.latent.interface import (default_forward_config,
                                                             forward_index_multiple)

    assert default_forward_config(64) == default_forward_config(128) == {"warp_specialized": True}
    assert default_forward_config(16) == default_forward_config(32) == {}
    assert [forward_index_multiple(h) for h in (16, 64, 128)] == [64, 128, 128]
    assert forward_index_multiple(64, {"key_block": 32}) == 32
    assert forward_index_multiple(64, {"warp_specialized": True, "key_block": 32}) == 64


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _case(heads, gen, dev, tq=300, tk=2000, topk=130):
    q = torch.randn(tq, heads, 512, generator=gen, device=dev) * 0.05
    kv = torch.randn(tk, 512, generator=gen, device=dev)
    pos = torch.arange(tk - tq, tk, device=dev)[:, None]
    idx = (torch.rand(tq, topk, generator=gen, device=dev) * (pos + 1)).long()
    idx = idx.masked_fill(torch.rand(idx.shape, generator=gen, device=dev) < 0.2, -1)
    idx[7] = -1  # a query with no key: output, dq and log-sum-exp 0
    grad = torch.randn(tq, heads, 512, generator=gen, device=dev)
    return q.bfloat16(), kv.bfloat16(), idx.to(torch.int32), grad.bfloat16()


def _kernel_errors(q, kv, idx, grad, kernel_idx=None, kernel_q=None, forward_config=None,
                   **config):
    """The kernels' out, dq and d latent against the fp32 attention; ``kernel_idx`` and
    ``kernel_q`` (controls) replace what the kernels alone are given."""
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ref = sparse_latent_attention(qr, kvr, idx, SCALE)
    ref.backward(grad.float())
    kidx = idx if kernel_idx is None else kernel_idx
    kq = q if kernel_q is None else kernel_q
    out, lse = latent_forward(kq, kv, kidx, SCALE, **(forward_config or {}))
    delta = (out.float() * grad.float()).sum(-1)
    dq, dkv = latent_backward(kq, kv, grad, kidx, lse, delta, SCALE, **config)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    assert not out[7].any() and not dq[7].any() and not lse[7].any()
    return {"out": _rel(out, ref), "dq": _rel(dq, qr.grad), "dkv": _rel(dkv, kvr.grad)}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", [{}, {"num_stages": 2, "store_split": 4}, {"ordered": True}])
@pytest.mark.parametrize("heads", [8, 64])
def test_kernels_match_the_fp32_attention(heads, config):
    gen = torch.Generator(device="cuda").manual_seed(heads)
    errors = _kernel_errors(*_case(heads, gen, torch.device("cuda")), **config)
    print(heads, config, errors)
    assert max(errors.values()) < TOL, errors


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("forward_config", [{"num_stages": 1}, {"key_block": 32, "num_stages": 3},
                                            {"key_block": 48, "num_stages": 3},
                                            {"key_block": 128, "num_stages": 1},
                                            {"deferred_sum": True},
                                            {"deferred_sum": True, "key_block": 32,
                                             "num_stages": 4},
                                            {"warp_specialized": True},
                                            {"warp_specialized": True, "key_block": 32}])
def test_forward_tunings_match_the_fp32_attention(forward_config):
    """The forward's other key blocks and pipeline depths (``bench/latent_sparse_mla.py
    --forward-configs`` times them) compute the same attention."""
    gen = torch.Generator(device="cuda").manual_seed(64)
    errors = _kernel_errors(*_case(64, gen, torch.device("cuda")), forward_config=forward_config)
    print(forward_config, errors)
    assert max(errors.values()) < TOL, errors


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", [{"stacked": True}, {"stacked": True, "channel_split": 2},
                                    {"stacked": True, "channel_split": 4, "store_split": 1},
                                    {"stacked": True, "channel_split": 2, "ordered": True}])
def test_backward_tunings_match_the_fp32_attention(config):
    """The stacked backward (``bench/latent_sparse_mla.py --backward-configs`` times it)
    computes the same gradients, atomically and in the fixed order."""
    gen = torch.Generator(device="cuda").manual_seed(64)
    errors = _kernel_errors(*_case(64, gen, torch.device("cuda")), **config)
    print(config, errors)
    assert max(errors.values()) < TOL, errors


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config", [{}, {"ordered": True}, {"stacked": True, "channel_split": 2}],
                         ids=["atomic", "ordered", "stacked"])
def test_a_shifted_index_is_caught(config):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, kv, idx, grad = _case(64, gen, torch.device("cuda"))
    shifted = torch.where(idx > 0, idx - 1, idx)
    errors = _kernel_errors(q, kv, idx, grad, kernel_idx=shifted, **config)
    print(errors)
    assert min(errors.values()) > 10 * TOL, errors


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("forward_config, config", [({}, {}), ({"warp_specialized": False}, {})],
                         ids=["defaults", "pipelined"])
def test_a_wrong_head_is_caught(forward_config, config):
    """Control: each head given the next head's query; the comparison with the fp32 attention
    is far off for the output, dq and the latent gradient (queries 4x the other tests', so each
    head's attention depends on its query: on CPU, in fp32, the errors are 0.36-0.54)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, kv, idx, grad = _case(64, gen, torch.device("cuda"))
    q = (q.float() * 4).bfloat16()
    errors = _kernel_errors(q, kv, idx, grad, kernel_q=q.roll(1, dims=1),
                            forward_config=forward_config, **config)
    print(errors)
    assert min(errors.values()) > 10 * TOL, errors


@pytest.mark.gpu
@cuda
def test_the_ordered_backward_repeats_bitwise():
    """model.dsa.latent.deterministic_backward: 2,500 queries (three ordered calls, the last
    partial) whose selections crowd onto 3,000 keys, so every key gathers many queries' rows: two
    runs give the same dq and latent gradient bit for bit, and they equal the atomic backward's to
    fp32 summation order (dkv 1e-5; dq is summed alike in both, 1e-6). The atomic backward's own repeatability is printed, not
    asserted: its order is the scheduler's."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, kv, idx, grad = _case(64, gen, torch.device("cuda"), tq=2500, tk=3000, topk=512)
    out, lse = latent_forward(q, kv, idx, SCALE)
    delta = (out.float() * grad.float()).sum(-1)
    runs = {mode: [latent_backward(q, kv, grad, idx, lse, delta, SCALE, ordered=mode == "ordered")
                   for _ in range(2)] for mode in ("ordered", "atomic")}
    (dq1, dkv1), (dq2, dkv2) = runs["ordered"]
    assert torch.equal(dq1, dq2) and torch.equal(dkv1, dkv2)
    (dq_a, dkv_a), (_, dkv_a2) = runs["atomic"]
    print({"atomic runs equal": torch.equal(dkv_a, dkv_a2), "dkv": _rel(dkv1, dkv_a)})
    assert _rel(dq1, dq_a) < 1e-6 and _rel(dkv1, dkv_a) < 1e-5


def _flashmla_stand_in(calls: list):
    """FlashMLA's sparse prefill contract in fp32 torch, with the rules the kernel enforces
    (heads per call, a top-k width of a multiple of 128, kv [T, 1, D], indices [S, 1, K], d_v
    512): the output, the rows' maxima and the natural log-sum-exp, +inf for a query with no
    key; ``calls`` gets each call's heads."""
    def op(q, kv, idx, scale, d_v, sink, lengths, out):
        assert q.shape[1] in (8, 16, 32, 64, 128) and idx.shape[-1] % 128 == 0, (q.shape, idx.shape)
        assert kv.shape[1] == idx.shape[1] == 1 and d_v == 512 and sink is None and out is None
        calls.append(q.shape[1])
        sel = idx[:, 0].long()
        live = torch.arange(sel.shape[1])[None] < lengths[:, None].long()
        valid = (sel >= 0) & (sel < kv.shape[0]) & live
        keys = kv[:, 0].float()[sel.clamp(min=0)]
        logits = torch.einsum("shd,skd->shk", q.float(), keys) * scale
        logits = logits.masked_fill(~valid[:, None], float("-inf"))
        lse = torch.logsumexp(logits, -1)
        lse = torch.where(valid.any(-1)[:, None], lse, float("inf"))
        p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
        return torch.einsum("shk,skd->shd", p, keys).to(q.dtype), logits.amax(-1), lse
    return op


@pytest.mark.parametrize("heads, calls", [(3, [8]), (64, [64]), (192, [128, 128])])
def test_flashmla_forward_adapts_the_contract(heads, calls):
    """model.dsa.latent.attention_forward=flashmla on a torch stand-in of FlashMLA's kernel: heads
    padded to the counts it runs (more than 128 in groups of 128), the top-k width padded to a
    multiple of 128 and cut back by the lengths, and +inf log-sum-exps (a query with no key)
    made 0, so it equals the fp32 attention (1e-5) and the natural log-sum-exp our backward
    takes; control: every index shifted by one is far off."""
    from skyrl_megatron_kda.dsa.ops.flashmla_forward import flashmla_forward

    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(40, heads, 512, generator=gen) * 0.05
    kv = torch.randn(100, 512, generator=gen)
    idx = torch.randint(0, 100, (40, 130), generator=gen)
    idx = idx.masked_fill(torch.rand(idx.shape, generator=gen) < 0.2, -1).to(torch.int32)
    idx[7] = -1
    seen = []
    out, lse = flashmla_forward(q, kv, idx, SCALE, op=_flashmla_stand_in(seen))
    assert seen == calls
    ref = sparse_latent_attention(q, kv, idx, SCALE)
    logits = torch.einsum("shd,skd->shk", q, kv[idx.long().clamp(min=0)]) * SCALE
    ref_lse = torch.logsumexp(logits.masked_fill((idx < 0)[:, None], float("-inf")), -1)
    assert out.shape == ref.shape and lse.shape == (40, heads)
    assert _rel(out, ref) < 1e-5
    keyed = torch.arange(40) != 7
    assert _rel(lse[keyed], ref_lse[keyed]) < 1e-6
    assert not out[7].any() and not lse[7].any()
    shifted = torch.where(idx >= 0, (idx + 1) % 100, idx)
    assert _rel(flashmla_forward(q, kv, shifted, SCALE, op=_flashmla_stand_in([]))[0], ref) > 0.1


def test_flashmla_needs_vllm(monkeypatch, tmp_path):
    """Without vLLM's FlashMLA build, or with one that does not load here, the setting fails in
    one line naming the fix."""
    import importlib.machinery
    import importlib.util

    from skyrl_megatron_kda.dsa.ops import flashmla_forward as fm

    fm.sparse_prefill.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"needs vLLM's FlashMLA build .*pip install vllm.*"
                                           r"attention_forward=tilelang"):
        fm.sparse_prefill()
    (tmp_path / fm.LIBRARY).write_bytes(b"not a shared library")
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(RuntimeError, match=r"could not load .*_flashmla_C.*; use "
                                           r"model.dsa.latent.attention_forward=tilelang"):
        fm.sparse_prefill()
    fm.sparse_prefill.cache_clear()


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("heads", [8, 64])
def test_flashmla_forward_with_our_backward_matches_the_fp32_attention(heads):
    """FlashMLA's forward (bf16) against the fp32 torch attention with -1 holes, a query with no
    key and one whose selection is only its 3-token tail; our backward on its log-sum-exp gives
    dq and the latent gradient within the bound; control: every index shifted by one."""
    from skyrl_megatron_kda.dsa.ops.flashmla_forward import flashmla_forward

    gen = torch.Generator(device="cuda").manual_seed(heads + 1)
    q, kv, idx, grad = _case(heads, gen, torch.device("cuda"))
    idx[9] = -1
    idx[9, -3:] = torch.arange(1997, 2000, device="cuda", dtype=torch.int32) - (300 - 1 - 9)
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ref = sparse_latent_attention(qr, kvr, idx, SCALE)
    ref.backward(grad.float())
    out, lse = flashmla_forward(q, kv, idx, SCALE)
    ours_out, ours_lse = latent_forward(q, kv, idx, SCALE)
    delta = (out.float() * grad.float()).sum(-1)
    dq, dkv = latent_backward(q, kv, grad, idx, lse, delta, SCALE)
    errors = {"out": _rel(out, ref), "dq": _rel(dq, qr.grad), "dkv": _rel(dkv, kvr.grad),
              "lse_vs_ours": _rel(lse, ours_lse), "tail_row": _rel(out[9], ref[9])}
    shifted = torch.where(idx > 0, idx - 1, idx)
    errors["shifted"] = _rel(flashmla_forward(q, kv, shifted, SCALE)[0], ref)
    print(heads, errors)
    assert max(errors["out"], errors["dq"], errors["dkv"], errors["tail_row"]) < TOL, errors
    assert errors["lse_vs_ours"] < 1e-5 and errors["shifted"] > 10 * TOL, errors
    assert not out[7].any() and not lse[7].any() and torch.isfinite(lse).all()


_ROW_DOTS = """
import json
import torch
from skyrl_megatron_kda.dsa.ops.row_dots import row_dots
g = torch.Generator().manual_seed(3)
a, b = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
ref = (a.double() * b.double()).sum(-1)
print(json.dumps({"err": float((row_dots(a, b) - ref).abs().max()),
                  "swapped": float((row_dots(a, b.flip(-1)) - ref).abs().max())}))
"""


def test_the_delta_kernel_equals_the_row_sums_interpreted():
    """The latent set's ``delta`` (``row_dots``, Triton) under Triton's CPU interpreter: fp32
    sums of products over 15 rows (two programs, the second partial) to rounding; control: the
    channels of one input reversed."""
    got = run_interpreted(_ROW_DOTS)
    assert got["err"] < 1e-4 < got["swapped"], got


def test_the_delta_kernel_refuses_other_shapes():
    from skyrl_megatron_kda.dsa.ops.row_dots import row_dots

    with pytest.raises(ValueError, match="one shape"):
        row_dots(torch.ones(2, 3, 8), torch.ones(2, 3, 6))


_ORDERED_SUMS = """
import json
import torch
from skyrl_megatron_kda.dsa.ops.ordered_row_sums import add_rows_in_index_order
g = torch.Generator().manual_seed(0)
rows = torch.randn(400, 160, generator=g)
index = torch.randint(-1, 50, (400,), generator=g)
index[:30] = 7  # a run of 30+ rows: several CHUNK steps, the last partial
out = torch.randn(50, 160, generator=g)
ref = out.double().index_add(0, index.clamp(min=0), rows.double() * (index >= 0)[:, None])
def summed(idx):
    got = out.clone()
    add_rows_in_index_order(got, rows, idx)
    return float((got - ref).abs().max())
print(json.dumps({"err": summed(index),
                  "shifted": summed(torch.where(index >= 0, (index + 1) % 50, index))}))
"""


def test_the_ordered_row_sums_equal_index_add_interpreted():
    """model.dsa.latent.deterministic_backward's scatter-add (``ordered_row_sums``, Triton) under
    Triton's CPU interpreter: 400 rows onto 50 keys, 160 columns (two column programs, the
    second partial), -1 rows skipped, one key with 30+ rows: equal to the fp64 ``index_add``
    to fp32 rounding; control: every index shifted by one."""
    got = run_interpreted(_ORDERED_SUMS)
    assert got["err"] < 1e-5 < 1.0 < got["shifted"], got


def test_the_ordered_row_sums_refuse_other_shapes():
    from skyrl_megatron_kda.dsa.ops.ordered_row_sums import add_rows_in_index_order

    with pytest.raises(ValueError, match="fp32"):
        add_rows_in_index_order(torch.zeros(4, 8), torch.zeros(3, 8, dtype=torch.float64),
                                torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"index \[M\]"):
        add_rows_in_index_order(torch.zeros(4, 8), torch.zeros(3, 8), torch.zeros(2))


@pytest.mark.gpu
@cuda
def test_the_delta_kernel_on_the_gpu():
    """bf16 [8192, 64, 512] (one call's shape at GLM's widths): equal to the fp32 sums of the
    bf16 values to fp32 rounding."""
    from skyrl_megatron_kda.dsa.ops.row_dots import row_dots

    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(8192, 64, 512, generator=g, device="cuda").bfloat16() for _ in range(2))
    ref = (a.double() * b.double()).sum(-1)
    err = float(((row_dots(a, b) - ref).norm() / ref.norm()))
    assert err < 1e-6, err
