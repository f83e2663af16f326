"""Parity tests for skyrl_megatron_kda.kda.kernel.

CPU: the pure-torch chunked KDA against fla's naive references and against an independent fp64
step recurrence (outputs, final states, gradients, varlen, state hand-off), plus gate, l2norm, conv
and backend selection. Negative controls show the tolerances would catch real bugs.
GPU (``-m gpu``): fla's Triton kernels in bf16 against the torch path in fp32.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from skyrl_megatron_kda.kda.kernel import (
    gated_rms_norm,
    causal_conv_silu,
    causal_conv_silu_backward,
    chunk_kda_torch,
    kda,
    kda_gate,
    l2_normalize,
    resolve_backend,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that Triton has no CPU driver; the naive ops are pure torch
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

# Distinct sizes per dim so a transposed axis cannot pass by accident.
B, H, K, V = 2, 3, 16, 24
LOWER_BOUND = -5.0


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: scale-free, and 0/0-safe for all-zero references."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


def make_inputs(T: int, *, batch: int = B, dtype=torch.float32, seed: int = 0, decay: str = "mixed"):
    """q, k (L2-normalised), v, log-decay g in (-5, 0), beta in (0, 1), initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(batch, T, H, K), dim=-1)
    k = F.normalize(randn(batch, T, H, K), dim=-1)
    v = randn(batch, T, H, V)
    if decay == "strong":  # ~ -5 per step: cumulative decay reaches ~ -320 inside a 64-token chunk
        g = LOWER_BOUND * torch.sigmoid(6.0 + randn(batch, T, H, K))
    else:
        g = LOWER_BOUND * torch.sigmoid(randn(batch, T, H, K) - 2.0)
    beta = torch.sigmoid(randn(batch, T, H))
    h0 = randn(batch, H, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta, h0)]


def recurrent_reference(q, k, v, g, beta, initial_state=None):
    """Independent token-by-token KDA in the input dtype (fp64 oracle; fla's naive ops compute in fp32).

    S <- diag(e^g) S; S <- S + beta k (v - S^T k)^T; o = S^T q / sqrt(K).
    """
    batch, T, nh, dk = q.shape
    S = q.new_zeros(batch, nh, dk, v.shape[-1]) if initial_state is None else initial_state.clone()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, beta[:, t, :, None] * (v[:, t] - pred))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * dk**-0.5, S))
    return torch.stack(outs, dim=1), S


# ----------------------------------------------------------------------------- chunk_kda_torch


@pytest.mark.parametrize("T", [1, 7, 65, 130, 200])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_matches_fla_naive_recurrent_fp32(T, with_h0):
    q, k, v, g, beta, h0 = make_inputs(T, seed=T)
    h0 = h0 if with_h0 else None
    o, S = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("T", [128])
def test_chunk_matches_fla_naive_chunk_fp32(T):
    q, k, v, g, beta, h0 = make_inputs(T, seed=1)
    o, S = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, S_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("T,chunk_size", [(7, 64), (130, 64), (130, 16), (100, 32), (50, 24)])
def test_chunk_matches_recurrence_fp64(T, chunk_size):
    q, k, v, g, beta, h0 = make_inputs(T, dtype=torch.float64, seed=2)
    o, S = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_ref, S_ref = recurrent_reference(q, k, v, g, beta, h0)
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(S, S_ref) < 1e-10


def test_strong_decay_no_overflow():
    """g ~ -5 per step: e^{G} underflows to 0 and e^{-G} would overflow; the pairwise form must stay finite."""
    T = 130
    q, k, v, g, beta, h0 = make_inputs(T, seed=3, decay="strong")
    G_chunk = g[:, :64].sum(1)
    assert G_chunk.min() < -300  # the regime where e^{-G_j} overflows fp32
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, S = chunk_kda_torch(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    o_ref, S_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(S, S_ref) < 1e-5
    (o.square().sum() + S.sum()).backward()
    for x in leaves:
        assert torch.isfinite(x.grad).all()


def _grads(fn, inputs, seed):
    """Gradients of a random linear functional of (o, final state) w.r.t. all inputs."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, S = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    ((o * do).sum() + (S * dS).sum()).backward()
    return [x.grad for x in leaves]


GRAD_NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


@pytest.mark.parametrize("decay", ["mixed", "strong"])
def test_grads_match_recurrence(decay):
    """Autograd through the chunked form == autograd through the token recurrence (fp64 oracle)."""
    T = 70  # two chunks, the second ragged
    inputs = make_inputs(T, dtype=torch.float64, seed=4, decay=decay)
    got = _grads(
        lambda q, k, v, g, b, h0: chunk_kda_torch(q, k, v, g, b, initial_state=h0, output_final_state=True),
        inputs,
        seed=5,
    )
    ref = _grads(recurrent_reference, inputs, seed=5)
    for name, a, b in zip(GRAD_NAMES, got, ref):
        assert rel_err(a, b) < 1e-10, f"d{name}: rel err {rel_err(a, b):.3e}"


def test_grads_match_fla_naive_fp32():
    T = 65
    inputs = make_inputs(T, seed=6)
    got = _grads(
        lambda q, k, v, g, b, h0: chunk_kda_torch(q, k, v, g, b, initial_state=h0, output_final_state=True),
        inputs,
        seed=7,
    )
    ref = _grads(
        lambda q, k, v, g, b, h0: naive_recurrent_kda(q, k, v, g, b, initial_state=h0, output_final_state=True),
        inputs,
        seed=7,
    )
    for name, a, b in zip(GRAD_NAMES, got, ref):
        assert rel_err(a, b) < 1e-4, f"d{name}: rel err {rel_err(a, b):.3e}"


SEQ_LENS = [1, 7, 64, 65, 30, 130]


def _pack(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Row i of a [N, Tmax, ...] batch holds sequence i; pack the first lens[i] tokens of each into [1, sum, ...]."""
    return torch.cat([x[i, :n] for i, n in enumerate(lens)]).unsqueeze(0)


def test_varlen_equals_separate_runs():
    lens = SEQ_LENS
    N, Tmax = len(lens), max(lens)
    q, k, v, g, beta, h0 = make_inputs(Tmax, batch=N, seed=8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, S = chunk_kda_torch(
        *(_pack(x, lens) for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True, cu_seqlens=cu
    )
    assert o.shape == (1, sum(lens), H, V) and S.shape == (N, H, K, V)
    for i, n in enumerate(lens):
        one = [x[i : i + 1, :n] for x in (q, k, v, g, beta)]
        o_i, S_i = chunk_kda_torch(*one, initial_state=h0[i : i + 1], output_final_state=True)
        o_ref, S_ref = naive_recurrent_kda(*one, initial_state=h0[i : i + 1], output_final_state=True)
        o_packed = o[:, cu[i] : cu[i + 1]]
        assert rel_err(o_packed, o_i) < 1e-6, f"seq {i} (len {n})"
        assert rel_err(S[i : i + 1], S_i) < 1e-6, f"seq {i} (len {n})"
        assert rel_err(o_packed, o_ref) < 1e-5 and rel_err(S[i : i + 1], S_ref) < 1e-5


def test_low_precision_inputs():
    """bf16 in -> bf16 out, fp32 state, and the same result as fp32 inputs holding the same values."""
    q, k, v, g, beta, h0 = make_inputs(70, seed=18)
    lowp = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    o, S = chunk_kda_torch(*lowp, initial_state=h0, output_final_state=True)
    o32, S32 = chunk_kda_torch(*(x.float() for x in lowp), initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert torch.equal(o, o32.to(torch.bfloat16)) and torch.equal(S, S32)


def test_varlen_requires_batch_one():
    q, k, v, g, beta, _ = make_inputs(8, seed=9)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 8]))


@pytest.mark.parametrize("T1", [64, 77])
def test_split_with_state_passing(T1):
    T = 200
    q, k, v, g, beta, h0 = make_inputs(T, seed=10)
    full = (q, k, v, g, beta)
    o, S = chunk_kda_torch(*full, initial_state=h0, output_final_state=True)
    o1, S1 = chunk_kda_torch(*(x[:, :T1] for x in full), initial_state=h0, output_final_state=True)
    o2, S2 = chunk_kda_torch(*(x[:, T1:] for x in full), initial_state=S1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], dim=1), o) < 1e-6
    assert rel_err(S2, S) < 1e-6


def test_negative_controls():
    """Plausible bugs (lost carry-in state, reversed time) are far outside the tolerances used above."""
    T = 130
    q, k, v, g, beta, h0 = make_inputs(T, seed=11)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    o_no_h0, _ = chunk_kda_torch(q, k, v, g, beta)
    assert rel_err(o_no_h0, o_ref) > 1e-2
    rev = [x.flip(1) for x in (q, k, v, g, beta)]
    o_rev, _ = chunk_kda_torch(*rev, initial_state=h0)
    assert rel_err(o_rev.flip(1), o_ref) > 1e-2
    o_wrong_beta, _ = chunk_kda_torch(q, k, v, g, beta.flip(2), initial_state=h0)  # heads' beta swapped
    assert rel_err(o_wrong_beta, o_ref) > 1e-2


# ----------------------------------------------------------------------------- gate, l2norm, kda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gate_matches_fla(dtype):
    gen = torch.Generator().manual_seed(12)
    f_raw = torch.randn(B, 9, H, K, generator=gen).to(dtype)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(f_raw, A_log, dt_bias, LOWER_BOUND)
    ref = naive_kda_lowerbound_gate(f_raw, A_log, dt_bias, lower_bound=LOWER_BOUND)
    assert g.dtype == torch.float32 and g.shape == f_raw.shape
    torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-6)
    assert (g < 0).all() and (g > LOWER_BOUND).all()
    # lower_bound scales the sigmoid rather than clamping: halving it halves g.
    torch.testing.assert_close(kda_gate(f_raw, A_log, dt_bias, LOWER_BOUND / 2), g / 2)


def test_l2_normalize_eps_inside_sqrt():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 5, K, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    y = l2_normalize(x, 1e-6)
    x64 = x.double()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x64 * torch.rsqrt(x64.square().sum(-1, keepdim=True) + 1e-6))
    # eps is added inside the sqrt (fla), not a floor on the norm (F.normalize): visible on tiny vectors.
    tiny = torch.full((K,), 1e-4)
    expected_norm = (K * 1e-8 / (K * 1e-8 + 1e-6)) ** 0.5
    assert abs(l2_normalize(tiny, 1e-6).norm().item() - expected_norm) < 1e-6
    assert abs(F.normalize(tiny, dim=-1, eps=1e-6).norm().item() - 1.0) < 1e-6


def _kda_inputs(T: int, batch: int, seed: int):
    """Raw (pre-norm, pre-gate) kda() inputs; V == K as in the model."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, f_raw = (torch.randn(batch, T, H, K, generator=gen) for _ in range(4))
    b_raw = torch.randn(batch, T, H, generator=gen)
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(H * K, generator=gen)
    h0 = torch.randn(batch, H, K, K, generator=gen)
    return q, k, v, f_raw, b_raw, A_log, dt_bias, h0


def _kda_reference(q, k, v, f_raw, b_raw, A_log, dt_bias, h0):
    """kda() composed from fla's naive pieces."""
    def norm(x):
        return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)

    g = naive_kda_lowerbound_gate(f_raw, A_log, dt_bias, lower_bound=LOWER_BOUND)
    return naive_recurrent_kda(norm(q), norm(k), v, g, b_raw.sigmoid(), initial_state=h0, output_final_state=True)


def test_kda_torch_entry_point():
    T = 100
    q, k, v, f_raw, b_raw, A_log, dt_bias, h0 = _kda_inputs(T, B, seed=14)
    o, S = kda(q, k, v, f_raw, b_raw, A_log, dt_bias, lower_bound=LOWER_BOUND, initial_state=h0,
               output_final_state=True, backend="torch")
    o_ref, S_ref = _kda_reference(q, k, v, f_raw, b_raw, A_log, dt_bias, h0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    o_none, S_none = kda(q, k, v, f_raw, b_raw, A_log, dt_bias, lower_bound=LOWER_BOUND, backend="torch")
    assert S_none is None and o_none.shape == (B, T, H, K)


def test_kda_entry_point_chunk_size_is_used_and_does_not_change_the_math():
    q, k, v, f_raw, b_raw, A_log, dt_bias, h0 = _kda_inputs(100, B, seed=16)
    args = (q, k, v, f_raw, b_raw, A_log, dt_bias)
    o64, _ = kda(*args, lower_bound=LOWER_BOUND, chunk_size=64, backend="torch")
    o32, _ = kda(*args, lower_bound=LOWER_BOUND, chunk_size=32, backend="torch")
    assert rel_err(o32, o64) < 1e-5
    with pytest.raises(ValueError, match="chunk_size"):
        kda(*args, lower_bound=LOWER_BOUND, chunk_size=0, backend="torch")


def test_kda_torch_entry_point_varlen():
    lens = [1, 40, 70]
    N, Tmax = len(lens), max(lens)
    q, k, v, f_raw, b_raw, A_log, dt_bias, h0 = _kda_inputs(Tmax, N, seed=15)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, S = kda(*(_pack(x, lens) for x in (q, k, v, f_raw, b_raw)), A_log, dt_bias, lower_bound=LOWER_BOUND,
               cu_seqlens=cu, initial_state=h0, output_final_state=True, backend="torch")
    for i, n in enumerate(lens):
        o_ref, S_ref = _kda_reference(*(x[i : i + 1, :n] for x in (q, k, v, f_raw, b_raw)), A_log, dt_bias,
                                      h0[i : i + 1])
        assert rel_err(o[:, cu[i] : cu[i + 1]], o_ref) < 1e-5 and rel_err(S[i : i + 1], S_ref) < 1e-5


# ----------------------------------------------------------------------------- conv, backend


def conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.Conv1d(padding=W-1) truncated to T, then SiLU: transformers glm5_next's causal_conv1d_fn."""
    T, W = x.shape[1], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=W - 1, groups=x.shape[-1])[..., :T]
    return F.silu(y).transpose(1, 2)


CONV_C, CONV_W = 10, 4


def test_causal_conv_matches_conv1d():
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(B, 33, CONV_C, generator=gen)
    w = torch.randn(CONV_C, CONV_W, generator=gen)
    y = causal_conv_silu(x, w, backend="torch")
    torch.testing.assert_close(y, conv_reference(x, w), rtol=1e-5, atol=1e-6)
    # Tap convention: weight[:, -1] multiplies the current token. A flipped kernel is a different conv.
    assert rel_err(causal_conv_silu(x, w.flip(-1), backend="torch"), y) > 1e-2


def test_causal_conv_varlen_no_leak():
    gen = torch.Generator().manual_seed(17)
    lens = [1, 2, 5, 9]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = torch.randn(1, sum(lens), CONV_C, generator=gen)
    w = torch.randn(CONV_C, CONV_W, generator=gen)
    y = causal_conv_silu(x, w, cu_seqlens=cu, backend="torch")
    for i in range(len(lens)):
        seg = slice(cu[i].item(), cu[i + 1].item())
        torch.testing.assert_close(y[:, seg], conv_reference(x[:, seg], w), rtol=1e-5, atol=1e-6)
    # Changing a sequence changes nothing outside it.
    x2 = x.clone()
    x2[:, cu[2] : cu[3]] += 100.0
    y2 = causal_conv_silu(x2, w, cu_seqlens=cu, backend="torch")
    outside = torch.ones(sum(lens), dtype=torch.bool)
    outside[cu[2] : cu[3]] = False
    assert torch.equal(y2[:, outside], y[:, outside])
    assert not torch.equal(y2[:, ~outside], y[:, ~outside])


def test_causal_conv_backward_equals_autograd():
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(1, 11, 2 * CONV_C, generator=gen, dtype=torch.float64)[..., :CONV_C]  # strided
    w = torch.randn(CONV_C, CONV_W, generator=gen, dtype=torch.float64)
    dy = torch.randn(1, 11, CONV_C, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    causal_conv_silu(*leaves, backend="torch").backward(dy)
    ours = causal_conv_silu_backward(x, w, dy, backend="torch")
    for got, leaf in zip(ours, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=0)
    assert rel_err(causal_conv_silu_backward(x, w.flip(-1), dy, backend="torch")[0], ours[0]) > 1e-2


def test_resolve_backend():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("fla", cpu)
    assert resolve_backend("auto", torch.device("cuda")) == "fla"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"


# ----------------------------------------------------------------------------- GPU: fla vs torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for fla's Triton kernels")
GPU_H, GPU_K = 4, 64
BF16_RATIO = 2e-2  # rms(diff) / rms(ref): bf16 inputs and tensor-core accumulation vs fp32 throughout
BF16_MAX = 6e-2  # max|diff| / max|ref|


def _err_msg(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    diff = a.double() - b.double()
    ratio = (diff.square().mean().sqrt() / b.double().square().mean().sqrt().clamp_min(1e-30)).item()
    mx = rel_err(a, b)
    return ratio < BF16_RATIO and mx < BF16_MAX, f"{name}: rms ratio {ratio:.3e}, max rel err {mx:.3e}"


def _gpu_kda_inputs(batch: int, T: int, n_states: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    q, k, v, f_raw = (randn(batch, T, GPU_H, GPU_K) for _ in range(4))
    b_raw = randn(batch, T, GPU_H)
    A_log = torch.log(torch.empty(GPU_H, device=dev).uniform_(1, 16, generator=gen))
    dt_bias = randn(GPU_H * GPU_K) * 0.5
    h0 = randn(n_states, GPU_H, GPU_K, GPU_K) * 0.1
    return [q, k, v, f_raw, b_raw, A_log, dt_bias, h0]


def _run_kda_both(batch: int, T: int, cu_seqlens, seed: int):
    """Same values through fla (bf16 activations, fp32 params/state) and torch (fp32 everywhere)."""
    n_states = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    base = _gpu_kda_inputs(batch, T, n_states, seed)
    lowp = [x.to(torch.bfloat16) if i < 5 else x.clone() for i, x in enumerate(base)]
    fla_in = [x.detach().requires_grad_() for x in lowp]
    ref_in = [x.detach().float().requires_grad_() for x in lowp]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    results = []
    for inputs, backend in ((fla_in, "fla"), (ref_in, "torch")):
        q, k, v, f_raw, b_raw, A_log, dt_bias, h0 = inputs
        o, S = kda(q, k, v, f_raw, b_raw, A_log, dt_bias, lower_bound=LOWER_BOUND, cu_seqlens=cu_seqlens,
                   initial_state=h0, output_final_state=True, backend=backend)
        results.append((o, S))
    do = torch.randn(results[1][0].shape, generator=gen, device="cuda")
    dS = torch.randn(results[1][1].shape, generator=gen, device="cuda")
    for o, S in results:
        ((o.float() * do).sum() + (S * dS).sum()).backward()
    return results, fla_in, ref_in


KDA_INPUT_NAMES = ["q", "k", "v", "f_raw", "b_raw", "A_log", "dt_bias", "initial_state"]


def _check_kda_parity(results, fla_in, ref_in):
    (o_fla, S_fla), (o_ref, S_ref) = results
    assert o_fla.dtype == torch.bfloat16 and S_fla.dtype == torch.float32
    checks = [_err_msg("o", o_fla, o_ref), _err_msg("final_state", S_fla, S_ref)]
    checks += [_err_msg(f"d{n}", a.grad, b.grad) for n, a, b in zip(KDA_INPUT_NAMES, fla_in, ref_in)]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


@pytest.mark.gpu
@needs_cuda
def test_gpu_kda_fla_vs_torch():
    results, fla_in, ref_in = _run_kda_both(batch=2, T=300, cu_seqlens=None, seed=20)
    _check_kda_parity(results, fla_in, ref_in)


@pytest.mark.gpu
@needs_cuda
def test_gpu_kda_fla_vs_torch_varlen():
    lens = [1, 63, 64, 100, 300, 17]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    results, fla_in, ref_in = _run_kda_both(batch=1, T=sum(lens), cu_seqlens=cu, seed=21)
    assert results[0][1].shape == (len(lens), GPU_H, GPU_K, GPU_K)
    _check_kda_parity(results, fla_in, ref_in)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_causal_conv_fla_vs_torch(varlen):
    gen = torch.Generator(device="cuda").manual_seed(22)
    lens = [1, 3, 64, 100, 32]
    C, W = 96, 4
    if varlen:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
        shape = (1, sum(lens), C)
    else:
        cu, shape = None, (2, 200, C)
    x0 = torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)
    w0 = (torch.randn(C, W, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    dy = torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)
    outs = []
    for backend in ("fla", "torch"):
        x, w = x0.detach().requires_grad_(), w0.detach().requires_grad_()
        y = causal_conv_silu(x, w, cu_seqlens=cu, backend=backend)
        (y.float() * dy.float()).sum().backward()
        outs.append((y, x.grad, w.grad))
    checks = [_err_msg(n, a, b) for n, a, b in zip(["y", "dx", "dweight"], outs[0], outs[1])]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


@pytest.mark.gpu
@needs_cuda
def test_gpu_causal_conv_backward_fla_vs_torch():
    """The conv's backward called directly, as the state exchange's conv does, on a strided view."""
    gen = torch.Generator(device="cuda").manual_seed(24)
    T, C, W = 300, 96, 4
    x = torch.randn(1, T, 2 * C, generator=gen, device="cuda").to(torch.bfloat16)[..., :C]
    w = (torch.randn(C, W, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    dy = torch.randn(1, T, C, generator=gen, device="cuda").to(torch.bfloat16)
    outs = [causal_conv_silu_backward(x, w, dy, backend=backend) for backend in ("fla", "torch")]
    checks = [_err_msg(n, a, b) for n, a, b in zip(["dx", "dweight"], outs[0], outs[1])]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


@pytest.mark.gpu
@needs_cuda
def test_gpu_gated_rms_norm_fla_vs_torch():
    gen = torch.Generator(device="cuda").manual_seed(23)
    shape = (2, 300, GPU_H, GPU_K)
    x0 = torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)
    g0 = torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)
    w0 = 1 + 0.1 * torch.randn(GPU_K, generator=gen, device="cuda")
    dy = torch.randn(*shape, generator=gen, device="cuda")
    outs = []
    for backend in ("fla", "torch"):
        x, g, w = (t.detach().requires_grad_() for t in (x0, g0, w0))
        y = gated_rms_norm(x, g, w, 1e-5, backend=backend)
        (y.float() * dy).sum().backward()
        outs.append((y, x.grad, g.grad, w.grad))
    checks = [_err_msg(n, a, b) for n, a, b in zip(["y", "dx", "dgate", "dweight"], outs[0], outs[1])]
    assert all(ok for ok, _ in checks), "; ".join(msg for _, msg in checks)


def test_heads_are_independent_so_head_groups_give_the_same_result():
    """``kda.kernel_head_group`` runs the heads in groups: the output and every gradient equal
    the all-heads call to fp32 rounding (the batched matmuls round by batch size), and a group
    handed the wrong heads' gate parameters is caught."""
    from skyrl_megatron_kda.kda.kernel import kda

    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 64, 4, 16
    q, k, v, f = (torch.randn(B, T, H, K, generator=gen).requires_grad_() for _ in range(4))
    b = torch.randn(B, T, H, generator=gen).requires_grad_()
    A_log = torch.randn(H, generator=gen).requires_grad_()
    dt_bias = torch.randn(H * K, generator=gen).requires_grad_()
    leaves = (q, k, v, f, b, A_log, dt_bias)

    def grouped(bounds, shift=0):
        outs = []
        for h0, h1 in bounds:
            gate = slice((h0 + shift) % H, (h0 + shift) % H + h1 - h0)
            o, _ = kda(q[:, :, h0:h1], k[:, :, h0:h1], v[:, :, h0:h1], f[:, :, h0:h1], b[..., h0:h1],
                       A_log[gate], dt_bias[gate.start * K:gate.stop * K], lower_bound=-5.0,
                       backend="torch", chunk_size=16)
            outs.append(o)
        o = torch.cat(outs, dim=2)
        return (o, *torch.autograd.grad(o.square().sum(), leaves))

    whole, groups = grouped([(0, 4)]), grouped([(0, 3), (3, 4)])
    for a, c in zip(whole, groups):
        assert ((a - c).abs().max() / a.abs().max()) < 1e-6
    wrong = grouped([(0, 1), (1, 2), (2, 3), (3, 4)], shift=1)
    assert ((wrong[0] - whole[0]).abs().max() / whole[0].abs().max()) > 1e-2
