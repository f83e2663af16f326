"""KDA kernel entry points: fla's Triton kernels on CUDA, a pure-torch chunked path elsewhere.

The KDA layer calls :func:`kda` (and :func:`causal_conv_silu`) with a backend picked by
:func:`resolve_backend`. The torch path is our own chunked implementation of the delta rule with a
per-channel decay: per head, with the state ``S`` [K, V],
``S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T`` and
``o_t = scale * S_t^T q_t`` (notation: ``kda/README.md``, "Notation and layout"). It is
differentiable by autograd, computes in fp32 and is the CPU path and oracle for fla's
``chunk_kda``; it is sized for tests and CPU runs, not for production shapes (it materialises
per-chunk ``[C, C/16, K]`` decay tensors for autograd).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F

Backend = Literal["fla", "torch"]
FlaBackward = Literal["triton", "tilelang"]

# fla's chunk_kda normalises q/k with l2norm_fwd's default eps; it has no argument to change it.
FLA_L2NORM_EPS = 1e-6


def resolve_backend(requested: Literal["auto", "fla", "torch"], device: torch.device) -> Backend:
    """Pick the kernel backend: fla's Triton kernels need CUDA, the torch path runs anywhere.

    auto -> 'fla' on CUDA, 'torch' otherwise. Explicit 'fla' on a non-CUDA device raises ValueError.
    """
    device_type = torch.device(device).type
    if requested == "auto":
        return "fla" if device_type == "cuda" else "torch"
    if requested == "fla":
        if device_type != "cuda":
            raise ValueError(
                f"kernel backend 'fla' needs a CUDA device (fla's KDA/conv kernels are Triton GPU kernels), "
                f"got device {device_type!r}; use backend 'torch' (or 'auto') on this device."
            )
        return "fla"
    if requested == "torch":
        return "torch"
    raise ValueError(f"unknown kernel backend {requested!r}; expected 'auto', 'fla' or 'torch'")


def use_fla_backward(choice: FlaBackward) -> None:
    """Make fla run KDA's fused backward piece (``chunk_kda_bwd_wy_dqkg_fused``) in ``choice``.

    fla 0.6.0 registers a TileLang implementation of it and takes it whenever ``tilelang`` imports
    and nvcc works, unless ``FLA_TILELANG=0`` (read at every call); setting the variable here lets
    the recipe decide instead of what happens to be installed (TileLang comes with DSA's fused
    kernel). ``tilelang`` where fla cannot use it is refused."""
    if choice == "tilelang":
        from fla.backends import TileLangBackend

        if not TileLangBackend.is_available():
            raise RuntimeError("kda.fla_backward=tilelang: fla's TileLang backend is unavailable here "
                               "(it needs the tilelang package and nvcc); use kda.fla_backward=triton")
    os.environ["FLA_TILELANG"] = "1" if choice == "tilelang" else "0"


def kda_gate(f_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """GLM-5.3-Flash lower-bound forget gate in log space, fp32.

    g = lower_bound * sigmoid(exp(A_log)[h] * (f_raw + dt_bias)), so g lies in (lower_bound, 0):
    ``lower_bound`` is a multiplier, not a clamp. f_raw [..., H, K], A_log [H], dt_bias [H*K].
    """
    H, K = f_raw.shape[-2:]
    x_HK = f_raw.float() + dt_bias.float().view(H, K)
    rate_H1 = A_log.float().exp().view(H, 1)
    return lower_bound * torch.sigmoid(rate_H1 * x_HK)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2, -1) + eps) in fp32 (returns fp32).

    Matches fla's l2norm kernel (eps added inside the sqrt, unlike F.normalize's max(norm, eps)).
    """
    x32 = x.float()
    return x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + eps)


def _pad_to_chunks(
    x: torch.Tensor, cu_seqlens: torch.LongTensor | None, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T, ...] (or packed [1, total, ...]) -> zero-padded [N, NT*C, ...] plus the validity mask for varlen.

    Zero padding at each sequence's end is exact for KDA: k = v = beta = 0 adds nothing to the state,
    and g = 0 leaves it undecayed.
    """
    if cu_seqlens is None:
        T = x.shape[1]
        pad = (-T) % chunk_size
        if pad:
            x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
        return x, None
    starts_N = cu_seqlens[:-1].to(device=x.device, dtype=torch.long)
    lens_N = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=x.device, dtype=torch.long)
    max_len = int(lens_N.max().item()) if lens_N.numel() else 0
    Tp = -(-max_len // chunk_size) * chunk_size
    t_P = torch.arange(Tp, device=x.device)
    valid_NP = t_P[None, :] < lens_N[:, None]
    idx_NP = (starts_N[:, None] + t_P[None, :]).clamp(max=max(x.shape[1] - 1, 0))
    gathered = x[0][idx_NP]  # [N, Tp, ...]
    mask = valid_NP.view(*valid_NP.shape, *([1] * (x.dim() - 2)))
    return torch.where(mask, gathered, torch.zeros((), dtype=x.dtype, device=x.device)), valid_NP


def _unpad(o_NPHV: torch.Tensor, T: int, valid_NP: torch.Tensor | None) -> torch.Tensor:
    """Inverse of _pad_to_chunks for the output: [N, Tp, H, V] -> [B, T, H, V] or packed [1, total, H, V]."""
    if valid_NP is None:
        return o_NPHV[:, :T]
    return o_NPHV[valid_NP].unsqueeze(0)  # boolean indexing keeps sequence-major order = packed order


def _causal_decay_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int = 16) -> torch.Tensor:
    """A[t, j] = sum_d x[t,d] exp(G[t,d] - G[j,d]) k[j,d] for j <= t, else 0; x, k, G [..., C, D].

    e^{G_t} e^{-G_j} would overflow (G reaches ~ -320 over a 64-token chunk at lower_bound = -5), so
    the exponent is only ever a difference with t after the subtracted point. Within sub-blocks of
    ``sub`` tokens the masked pairwise difference is exponentiated directly; across sub-blocks the
    decay factors through r = the last token of j's sub-block (j <= r < t):
    e^{G_t - G_j} = e^{G_t - G_r} e^{G_r - G_j}, both <= 1, turning that part into matmuls and
    avoiding a [C, C, D] tensor.
    """
    C, D = G.shape[-2:]
    if C % sub:
        sub = C
    nb = C // sub
    t_C = torch.arange(C, device=G.device)

    # Diagonal sub-blocks: exp of the masked pairwise difference, [.., nb, sub(t), sub(j), D].
    Gb = G.unflatten(-2, (nb, sub))
    causal = torch.ones(sub, sub, dtype=torch.bool, device=G.device).tril().unsqueeze(-1)
    decay_in = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~causal, float("-inf")).exp()
    xb, kb = x.unflatten(-2, (nb, sub)), k.unflatten(-2, (nb, sub))
    A_in = torch.einsum("...btjd,...bjd->...btj", xb.unsqueeze(-2) * decay_in, kb)
    eye = torch.eye(nb, dtype=A_in.dtype, device=G.device)
    A = (A_in.unsqueeze(-2) * eye[:, None, :, None]).reshape(*A_in.shape[:-3], C, C)
    if nb == 1:
        return A

    # Earlier sub-blocks: left factor e^{G_t - G_r(b)} (only where t's block is after b), right e^{G_r - G_j}.
    G_ref = G[..., sub - 1 :: sub, :]  # [.., nb, D]
    after_Cb1 = ((t_C // sub)[:, None] > torch.arange(nb, device=G.device)[None, :]).unsqueeze(-1)
    left = (G.unsqueeze(-2) - G_ref.unsqueeze(-3)).masked_fill(~after_Cb1, float("-inf")).exp()  # [.., C, nb, D]
    right = (G_ref.repeat_interleave(sub, dim=-2) - G).exp()  # [.., C, D]
    k_right = (k * right).unflatten(-2, (nb, sub))  # [.., nb, sub, D]
    A_off = torch.einsum("...tbd,...bjd->...tbj", x.unsqueeze(-2) * left, k_right)
    return A + A_off.reshape(*A_off.shape[:-3], C, C)


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch chunked KDA (autograd-friendly); the CPU path and oracle for fla's chunk_kda.

    q, k [B,T,H,K] (already L2-normalised), v [B,T,H,V], g [B,T,H,K] log-space decay, beta [B,T,H]
    in (0,1). Math in fp32 (fp64 if any input is fp64), output cast to v.dtype.
    initial_state / final state [N,H,K,V] fp32 (fp64 in fp64 mode) with
    N = B, or the number of sequences when cu_seqlens (B == 1, packed) is given; packed sequences
    never exchange state.

    Per chunk of C tokens with G = cumsum(g): (I + A_kk) [w | u] = beta * [k e^G | v] by a
    unit-lower-triangular solve (WY/UT form), then serially v_new = u - w S,
    o = (q e^G) S + A_qk v_new, S <- e^{G_last} S + (k e^{G_last - G})^T v_new.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"q, k, g must share shape [B,T,H,K]; got q={tuple(q.shape)} k={tuple(k.shape)} g={tuple(g.shape)}"
        )
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(
            f"v must be [B,T,H,V] and beta [B,T,H] with B,T,H={B, T, H}; "
            f"got v={tuple(v.shape)} beta={tuple(beta.shape)}"
        )
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs packed input with batch size 1, got B={B}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N,H,K,V]={[N, H, K, V]}, got {list(initial_state.shape)}")
    if scale is None:
        scale = K**-0.5
    out_dtype = v.dtype
    C = chunk_size

    # fp32 math; fp64 only when handed fp64 (lets tests check the algebra to ~1e-12).
    is_f64 = any(x.dtype == torch.float64 for x in (q, k, v, g, beta))
    cdt = torch.float64 if is_f64 else torch.float32
    q_p, valid_NP = _pad_to_chunks(q.to(cdt) * scale, cu_seqlens, C)
    k_p, _ = _pad_to_chunks(k.to(cdt), cu_seqlens, C)
    v_p, _ = _pad_to_chunks(v.to(cdt), cu_seqlens, C)
    g_p, _ = _pad_to_chunks(g.to(cdt), cu_seqlens, C)
    b_p, _ = _pad_to_chunks(beta.to(cdt), cu_seqlens, C)
    Tp = q_p.shape[1]
    NT = Tp // C

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [N, NT*C, H, D] -> [N, H, NT, C, D]
        return x.reshape(N, NT, C, H, -1).permute(0, 3, 1, 2, 4)

    q_c, k_c, v_c, g_c = map(chunked, (q_p, k_p, v_p, g_p))
    beta_c = chunked(b_p.unsqueeze(-1))  # [N, H, NT, C, 1]
    G_c = g_c.cumsum(-2)  # cumulative log decay inside each chunk, <= 0

    # Decay-weighted scores <x_t e^{G_t - G_j}, k_j> (j <= t) for x = q and x = k in one pass.
    A = _causal_decay_scores(torch.stack([q_c, k_c]), k_c, G_c)
    A_qk = A[0]  # causal incl. diagonal
    strict_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A_kk = (beta_c * A[1]).masked_fill(~strict_CC, 0.0)

    # (I + A_kk)^{-1} applied to both right-hand sides at once; the unit diagonal is implicit.
    rhs = beta_c * torch.cat([k_c * G_c.exp(), v_c], dim=-1)
    wu = torch.linalg.solve_triangular(A_kk, rhs, upper=False, unitriangular=True)
    w_c, u_c = wu[..., :K], wu[..., K:]

    q_decay = q_c * G_c.exp()
    G_last = G_c[..., -1:, :]  # [N, H, NT, 1, K]
    k_to_end = k_c * (G_last - G_c).exp()
    state_decay = G_last.squeeze(-2).exp().unsqueeze(-1)  # [N, H, NT, K, 1]

    if initial_state is None:
        S = q_p.new_zeros(N, H, K, V)
    else:
        S = initial_state.to(cdt)
    outs = []
    for i in range(NT):  # the only serial part: state hand-off between chunks
        v_new = u_c[:, :, i] - w_c[:, :, i] @ S
        outs.append(q_decay[:, :, i] @ S + A_qk[:, :, i] @ v_new)
        S = state_decay[:, :, i] * S + k_to_end[:, :, i].transpose(-1, -2) @ v_new

    if NT:
        o_NHTV = torch.stack(outs, dim=2)  # [N, H, NT, C, V]
        o_NPHV = o_NHTV.permute(0, 2, 3, 1, 4).reshape(N, Tp, H, V)
    else:
        o_NPHV = v_p.new_zeros(N, 0, H, V)
    o = _unpad(o_NPHV, T, valid_NP).to(out_dtype)
    return o, (S if output_final_state else None)


def taps_by_lag(weight: torch.Tensor) -> torch.Tensor:
    """The conv weight [C, W] with column ``s`` the tap of the token ``s`` steps back (fla's
    ``causal_conv1d`` stores the current token's tap last)."""
    return weight.flip(-1)


def causal_conv_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    cu_seqlens: torch.LongTensor | None = None,
    backend: Backend,
) -> torch.Tensor:
    """Depthwise causal conv over time, then SiLU. x [B,T,C], weight [C,W], no bias.

    weight[:, W-1] multiplies the current token and weight[:, W-1-s] the token s steps back (fla's
    causal_conv1d convention, ``taps_by_lag``; nn.Conv1d(padding=W-1) truncated to T as in
    transformers' glm5_next).
    With cu_seqlens (B == 1) no tap reaches across a sequence start.
    """
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs packed input with batch size 1, got B={x.shape[0]}")
    if backend == "fla":
        from fla.modules.causal_conv1d import causal_conv1d

        y, _ = causal_conv1d(x, weight, activation="silu", cu_seqlens=cu_seqlens)
        return y
    if backend != "torch":
        raise ValueError(f"unknown kernel backend {backend!r}")

    _, T, _ = x.shape
    W = weight.shape[-1]
    x32, taps = x.float(), taps_by_lag(weight.float())
    t_T = torch.arange(T, device=x.device)
    if cu_seqlens is None:
        pos_T = t_T
    else:
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        start_T = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T)
        pos_T = t_T - start_T  # position inside the own sequence
    y = x32 * taps[:, 0]
    for s in range(1, W):
        shifted = F.pad(x32, (0, 0, s, 0))[:, :T]  # x[t - s], zeros before t = 0
        reaches_T1 = (pos_T >= s).unsqueeze(-1)
        y = y + torch.where(reaches_T1, shifted, 0.0) * taps[:, s]
    return F.silu(y).to(x.dtype)


def causal_conv_silu_backward(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, *,
                              backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of :func:`causal_conv_silu` without cu_seqlens, for an autograd Function that
    calls it in its forward: fla's backward kernel directly (it recomputes the activation as fla's
    own autograd does), autograd over the torch path on CPU."""
    if backend == "fla":
        from fla.modules.causal_conv1d import causal_conv1d_bwd

        dx, dweight, _, _, _ = causal_conv1d_bwd(x=x, dy=dy, dht=None, weight=weight, activation="silu")
        return dx, dweight
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
        return torch.autograd.grad(causal_conv_silu(*leaves, backend=backend), leaves, dy)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   backend: Backend) -> torch.Tensor:
    """Per-head RMSNorm of ``x`` [..., K], times ``weight`` [K], times sigmoid(``gate``); fp32 inside,
    output in x's dtype (GLM's ``o_norm``). 'fla': fla's fused Triton kernel (one pass instead of
    about ten elementwise torch kernels forward and backward); 'torch': the same in torch."""
    if backend == "fla":
        from fla.modules.fused_norm_gate import rms_norm_gated

        return rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=eps)
    if backend != "torch":
        raise ValueError(f"unknown kernel backend {backend!r}")
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f_raw: torch.Tensor,
    b_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    lower_bound: float,
    l2norm_eps: float = 1e-6,
    cu_seqlens: torch.LongTensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA core as the layer uses it: L2-norm q/k, lower-bound gate, sigmoid beta, chunked delta rule.

    q, k, v [B,T,H,K] (post conv, pre-normalisation), f_raw [B,T,H,K] raw f_b output, b_raw [B,T,H]
    raw b_proj output, A_log [H] fp32, dt_bias [H*K] fp32. Varlen: B == 1 with cu_seqlens [N+1].
    'fla' fuses normalisation, gate and beta into fla's chunk_kda (bf16 in, fp32 state);
    'torch' computes the same in fp32 with chunk_kda_torch. Output has v's dtype; final state fp32.
    """
    if backend == "fla":
        from fla.ops.kda import chunk_kda

        # fla's in-kernel l2norm has a fixed eps; for any other eps normalise here instead.
        qk_norm_in_kernel = l2norm_eps == FLA_L2NORM_EPS
        if not qk_norm_in_kernel:
            q = l2_normalize(q, l2norm_eps).to(q.dtype)
            k = l2_normalize(k, l2norm_eps).to(k.dtype)
        return chunk_kda(
            q,
            k,
            v,
            f_raw,
            b_raw,
            A_log=A_log,
            dt_bias=dt_bias,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=qk_norm_in_kernel,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            lower_bound=lower_bound,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size,
        )
    if backend != "torch":
        raise ValueError(f"unknown kernel backend {backend!r}")
    g = kda_gate(f_raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b_raw.float())
    return chunk_kda_torch(
        l2_normalize(q, l2norm_eps),
        l2_normalize(k, l2norm_eps),
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
