"""GLM-5.3-Flash manifold-constrained hyper-connections (mHC), as a small torch module.

Why our own: megatron-core 0.19.2 ships no hyper-connection module (its only Sinkhorn is the MoE
router's tolerance-driven balancing, a different algorithm), so this mirrors transformers'
``Glm5NextTextHyperConnection`` / ``Glm5NextTextHyperHead`` math, checked equal on CPU by
``tests/test_hyper_connections.py``.

The residual stream is widened to N streams: ``streams`` [..., N, D] (any leading dims, so both
megatron's [S, B] and transformers' [B, S] layouts work). Per sub-block (attention, MLP), from the
streams of each token:

    z          = rms(flatten(streams))                    # [..., N*D], no weight, eps = rms_norm_eps
    pre, post, comb_logits = split(z @ fn.T)              # N, N, N*N; then  * scale[k] + base
    pre        = sigmoid(.) + hc_eps                      # [..., N]   collapse weights
    post       = 2 * sigmoid(.)                           # [..., N]   expand weights
    comb       = sinkhorn(softmax_rows(.) + hc_eps)       # [..., N, N] ~doubly stochastic
    block_in   = sum_i pre_i * streams_i                  # [..., D]
    streams'_j = post_j * block(block_in) + sum_i comb_ij * streams_i

The model expands the embedding by copying it into all N streams and, after the last layer,
collapses with an unweighted mean over the streams (then the final RMSNorm).

Tensor / sequence parallelism: everything is per token and the parameters are tiny, so they are
duplicated on every TP rank and nothing is communicated in forward. Gradients: without SP each TP
rank sees all tokens and the gradients reaching the streams are already complete (megatron's
column-parallel input all-reduces them), so the parameter gradients agree across TP. With SP each
rank holds only S/TP rows, so its parameter gradients are partial sums over tokens and must be
summed over TP. We tag every parameter ``sequence_parallel=True`` (as megatron does for norm
weights): ``finalize_model_grads`` then all-reduces (SUM) them over TP exactly when
``config.sequence_parallel`` is on, and leaves them alone otherwise. The initial values must be
equal on all TP ranks (draw them from the default generator, not a TP-rank-offset RNG tracker).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sinkhorn_knopp(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic mixing matrix [..., N, N] from ``logits`` (fp32 in, fp32 out).

    Row softmax (+eps) is the first row normalisation, so iteration 1 only adds a column pass; each
    later iteration normalises rows then columns. ``eps`` in every denominator keeps it finite;
    the columns end exactly normalised, rows nearly so.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def expand_to_streams(hidden: torch.Tensor, num_streams: int) -> torch.Tensor:
    """Embedding [..., D] -> streams [..., N, D]: every stream starts as a copy."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], num_streams, hidden.shape[-1]).contiguous()


def reduce_streams(streams: torch.Tensor) -> torch.Tensor:
    """Final collapse [..., N, D] -> [..., D]: GLM-5.3-Flash uses an unweighted mean (not learned)."""
    return streams.mean(dim=-2)


def normalized_projection(flat: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms(flat) @ weight.T`` in fp32: the maps' projection, computed as the reference does."""
    x = flat.float()
    x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return F.linear(x, weight.float())


class NormalizedProjection(torch.autograd.Function):
    """``normalized_projection`` in chunks of rows that keeps only its input and weight for
    backward.

    Autograd would keep the fp32 upcast of the flattened streams and its normalised copy, two
    fp32 tensors of N*D per row (4x the bf16 streams it reads), while the streams themselves are
    kept anyway by ``collapse`` and ``expand``; and its backward would hold that upcast's
    gradients for every row at once (six fp32 copies of the input's width). Here forward and
    backward run ``chunk_rows`` rows at a time: backward rebuilds each chunk's ops from the input
    and differentiates them, and the weight gradient is the sum over chunks. In one chunk that
    is bitwise the plain autograd graph; over several, each chunk's GEMMs have fewer rows and
    round differently (within 1e-6 in fp32). The input goes through ``save_for_backward``, so
    host offload moves it like any saved tensor.
    """

    @staticmethod
    def forward(ctx, flat: torch.Tensor, weight: torch.Tensor, eps: float, chunk_rows: int) -> torch.Tensor:
        ctx.save_for_backward(flat, weight)
        ctx.eps, ctx.chunk_rows = eps, chunk_rows
        rows = flat.reshape(-1, flat.shape[-1])
        out = torch.cat([normalized_projection(part, weight, eps) for part in rows.split(chunk_rows)])
        return out.view(*flat.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, weight = ctx.saved_tensors
        want_flat, want_weight = ctx.needs_input_grad[:2]
        rows, grads = flat.reshape(-1, flat.shape[-1]), grad.reshape(-1, grad.shape[-1])
        d_rows = torch.empty_like(rows) if want_flat else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, rows.shape[0], ctx.chunk_rows):
            part = slice(start, start + ctx.chunk_rows)
            x = rows[part].detach().requires_grad_(want_flat)
            w = weight.detach().requires_grad_(want_weight)
            wanted = [t for t in (x, w) if t.requires_grad]
            with torch.enable_grad():
                proj = normalized_projection(x, w, ctx.eps)
            got = iter(torch.autograd.grad(proj, wanted, grads[part]))
            if want_flat:
                d_rows[part] = next(got)
            if want_weight:
                d_weight += next(got)
        return (d_rows.view_as(flat) if want_flat else None,
                d_weight.to(weight.dtype) if want_weight else None, None, None)


class HyperConnection(nn.Module):
    """mHC around one sub-block (attention or MLP) of a decoder layer; a layer owns two.

    Parameters (names match transformers' ``attn_hc`` / ``ffn_hc`` so checkpoints map 1:1):
    ``fn`` [(2+N)*N, N*D], ``base`` [(2+N)*N], ``scale`` [3] (pre, post, comb). Kept fp32, and
    the maps are computed in fp32 whatever the stream dtype (the reference does ``fn.float()``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_streams: int = 4,
        sinkhorn_iters: int = 20,
        hc_eps: float = 1e-6,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        map_chunk_rows: int = 4096,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_streams = num_streams
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.init_std = init_std
        self.map_chunk_rows = map_chunk_rows  # rows per chunk of NormalizedProjection
        n = num_streams
        kw = dict(device=device, dtype=torch.float32)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, **kw))
        self.base = nn.Parameter(torch.empty((2 + n) * n, **kw))
        self.scale = nn.Parameter(torch.empty(3, **kw))
        for p in self.parameters():
            p.sequence_parallel = True  # partial grads under SP: finalize_model_grads sums over TP
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Reference init: fn ~ N(0, init_std), base 0, scale 1 (maps start near uniform)."""
        nn.init.normal_(self.fn, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def mixing_maps(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [..., N], post [..., N], comb [..., N, N]), fp32, from ``streams`` [..., N, D]."""
        n = self.num_streams
        # [..., N*D] stream-major like the reference's view -> [..., (2+N)*N]
        proj = NormalizedProjection.apply(streams.flatten(-2), self.fn, self.norm_eps, self.map_chunk_rows)
        pre_w, post_w, comb_w = proj.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre_n = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post_n = 2.0 * torch.sigmoid(post_w * s_post + post_b)
        comb_logits_nn = (comb_w * s_comb + comb_b).unflatten(-1, (n, n))
        comb_nn = sinkhorn_knopp(comb_logits_nn, self.sinkhorn_iters, self.hc_eps)
        return pre_n, post_n, comb_nn

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Block input [..., D] = sum_i pre_i * streams_i, accumulated in fp32, in streams' dtype."""
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)

    @staticmethod
    def expand(block_out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor) -> torch.Tensor:
        """New streams [..., N, D]: out_j = post_j * block_out + sum_i comb[i, j] * residual_i.

        Done in the streams' dtype (maps cast down first), as the reference does.
        """
        dtype = residual.dtype
        return (post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2)
                + torch.matmul(comb.to(dtype).transpose(-1, -2), residual))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_input [..., D], post, comb); pass post/comb and ``streams`` to ``expand`` after
        the block (its norm included) has run on block_input."""
        pre, post, comb = self.mixing_maps(streams)
        return self.collapse(streams, pre), post, comb

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_streams={self.num_streams}, "
                f"sinkhorn_iters={self.sinkhorn_iters}, hc_eps={self.hc_eps}, norm_eps={self.norm_eps}")
