"""Our latent sparse-MLA programs as the layer calls them (``model.dsa.kernel=latent``).

``latent_forward`` and ``latent_backward`` take ``q [S, H, D]``, ``kv [T, D]`` and ``indices [S,
K]`` int32 (natural positions, -1 = not selected), pad heads and the top-k width as the programs
take them (``common``), pick a program's keywords for the head count when the caller names none
(``default_forward_config``, ``default_backward_config``) and compile each shape once. The
forward returns the latent-space output and the natural log-sum-exp of ``scale * q . k`` (0 for a
query with no key, whose output is 0), the backward ``dq`` and the fp32 latent gradient, added
into a buffer it is given so the layer's calls over query blocks share one; ``ordered`` runs the
ordered backward ``ORDERED_QUERY_BLOCK`` queries at a time and adds their rows with
``ordered_row_sums``.

``latent_sparse_mla_ops`` fills the ``SparseMLAOps`` contract with them (``width`` 512), the
Triton ``delta`` (``row_dots``) and indexer scores (``index_scores``), so the layer's wrapper
(``fused_sparse_mla.FusedAbsorbedSparseMLA``: absorption, query blocks) is the one the ``fused``
kernel uses; ``attention_forward=flashmla`` takes FlashMLA's sparse forward instead of ours.
"""

from __future__ import annotations

from functools import lru_cache, partial

import torch

from ..contract import SparseMLAOps
from ..flashmla_forward import flashmla_forward, sparse_prefill
from ..index_scores import INDEXER_SCORES
from ..ordered_row_sums import add_rows_in_index_order
from ..row_dots import row_dots
from .backward import BACKWARD_KEY_BLOCK, backward_program
from .common import HEAD_BLOCK, LATENT_WIDTH, load_tilelang, pad_heads, pad_keys, padded_heads
from .forward import FORWARD_KEY_BLOCK, FORWARD_PASS_CONFIGS, forward_program

BACKWARD_ADDS_DKV = True
"""The backward takes ``dkv=``, an fp32 accumulator it adds the latent gradient to
(``SparseMLAOps.backward_adds_dkv``; ``kernels/latent.py`` models the memory by it)."""
ORDERED_QUERY_BLOCK = 1024
"""Queries per ordered backward call: its per-query latent gradient rows, ORDERED_QUERY_BLOCK x
top-k x 512 fp32, live until ``ordered_row_sums`` has added them; a smaller block lowers that
peak for more, smaller calls."""


@lru_cache(maxsize=None)
def forward_kernel(heads: int, dim: int, topk: int, scale: float, **config):
    tilelang, _ = load_tilelang()
    passes = {getattr(tilelang.PassConfigKey, key): True for key in FORWARD_PASS_CONFIGS}
    return tilelang.compile(forward_program(heads, dim, topk, scale, **config), out_idx=[-2, -1],
                            pass_configs=passes)


@lru_cache(maxsize=None)
def backward_kernel(heads: int, dim: int, topk: int, scale: float, ordered: bool = False,
                    **config):
    """Compiled once per shape; ``ordered`` also returns its per-query latent gradient rows."""
    tilelang, _ = load_tilelang()
    return tilelang.compile(backward_program(heads, dim, topk, scale, ordered=ordered, **config),
                            out_idx=[-2, -1] if ordered else [-2])


def default_forward_config(heads: int) -> dict:
    """``forward_program``'s keywords for ``heads`` (as ``padded_heads`` gives) when the caller
    names none: whole 64-head groups take the warp-specialised forward (the faster at GLM's
    shape, docs/benchmarks.md), fewer heads the pipelined one, whose smaller MMA tiles they
    fit."""
    return {"warp_specialized": True} if heads % HEAD_BLOCK == 0 else {}


def default_backward_config(heads: int) -> dict:
    """``backward_program``'s keywords for ``heads`` (as ``padded_heads`` gives) when the caller
    names none: whole 64-head groups take the stacked backward (its latent gradient in four
    channel parts, each added at once), with atomic adds and ordered alike (the faster at
    GLM's shape, docs/benchmarks.md); fewer heads the backward of ``key_block`` rows, whose
    smaller MMA tiles they fit."""
    if heads % HEAD_BLOCK:
        return {}
    return {"stacked": True, "channel_split": 4, "store_split": 1}


def forward_index_multiple(heads: int, config: dict | None = None) -> int:
    """What ``latent_forward`` pads the top-k width to (with -1) for ``heads`` under
    ``config`` (``default_forward_config`` when None): its key block, or a pair of them for the
    warp-specialised forward, whose two stages take a pair per loop step."""
    config = default_forward_config(heads) if config is None else config
    block = config.get("key_block", FORWARD_KEY_BLOCK)
    return 2 * block if config.get("warp_specialized") else block


def backward_index_multiple(config: dict) -> int:
    """What ``latent_backward`` pads the top-k width to (with -1) under ``config``: its key
    block."""
    return config.get("key_block", BACKWARD_KEY_BLOCK)


def latent_forward(q, kv, indices, scale, **config):
    """The forward kernel on the contract's tensors (padding heads and the top-k width);
    ``config``: ``forward_program``'s tuning keywords (``default_forward_config`` when none
    are given)."""
    S, H, D = q.shape
    heads = padded_heads(H)
    config = config or default_forward_config(heads)
    idx = pad_keys(indices.to(torch.int32), forward_index_multiple(heads, config)).contiguous()
    kernel = forward_kernel(heads, D, idx.shape[1], float(scale), **config)
    out, lse = kernel(pad_heads(q, heads).contiguous(), kv.contiguous(), idx)
    return out[:, :H], lse[:, :H]


def latent_backward(q, kv, grad_out, indices, lse, delta, scale, dkv=None, ordered=False,
                    **config):
    """The backward kernel on the contract's tensors -> (dq, dkv fp32); ``dkv``: an fp32
    accumulator of kv's shape that the kernel adds the latent gradient to (and returns), so that
    calls over query blocks share one buffer; ``ordered``: add it in a fixed order (bitwise
    reproducible; ORDERED_QUERY_BLOCK queries per kernel call, then ``ordered_row_sums``)
    instead of with atomics; ``config``: ``backward_program``'s tuning keywords
    (``default_backward_config`` when none are given)."""
    S, H, D = q.shape
    heads = padded_heads(H)
    config = config or default_backward_config(heads)
    idx = pad_keys(indices.to(torch.int32), backward_index_multiple(config)).contiguous()
    kernel = backward_kernel(heads, D, idx.shape[1], float(scale), ordered=ordered, **config)
    if dkv is None:
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    elif dkv.shape != kv.shape or dkv.dtype != torch.float32 or not dkv.is_contiguous():
        raise ValueError(f"dkv must be a contiguous fp32 {list(kv.shape)}, got "
                         f"{dkv.dtype} {list(dkv.shape)}")
    q, kv, grad_out = (pad_heads(q, heads).contiguous(), kv.contiguous(),
                       pad_heads(grad_out, heads).contiguous())
    lse, delta = (pad_heads(t[..., None], heads)[..., 0].contiguous() for t in (lse, delta))
    if not ordered:
        return kernel(q, kv, grad_out, idx, lse, delta, dkv)[:, :H], dkv
    dq = q.new_empty(S, H, D)
    for b0 in range(0, S, ORDERED_QUERY_BLOCK):
        b = slice(b0, b0 + ORDERED_QUERY_BLOCK)
        dq_block, rows = kernel(q[b], kv, grad_out[b], idx[b], lse[b], delta[b])
        add_rows_in_index_order(dkv, rows.view(-1, D), idx[b].view(-1))
        dq[b] = dq_block[:, :H]
        del rows  # before the next call allocates its own: one call's rows alive at a time
    return dq, dkv


def latent_sparse_mla_ops(ordered: bool = False, indexer_scores: str = "bf16",
                       attention_forward: str = "tilelang", forward_config: dict | None = None,
                       backward_config: dict | None = None) -> SparseMLAOps:
    """Our sparse-MLA kernels and the Triton indexer scores in the ``SparseMLAOps`` contract
    (``kv [T, 1, 512]``, ``indices [S, 1, K]``); ``ordered``: the backward's latent gradient
    summed in a fixed order (``latent_backward``); ``indexer_scores``: the score products'
    precision (``index_scores.INDEXER_SCORES``); ``attention_forward``: ``tilelang`` (ours) or
    ``flashmla`` (``flashmla_forward``); a clear error where they cannot run.
    ``forward_config`` / ``backward_config``: tuning keywords of our forward and backward
    programs (``forward_program``, ``backward_program``) for benchmarks; the layer takes the
    defaults."""
    if forward_config and attention_forward != "tilelang":
        raise ValueError(f"forward_config tunes our forward, not {attention_forward!r}'s")
    if not torch.cuda.is_available():
        raise RuntimeError("model.dsa.kernel=latent needs CUDA (TileLang kernels); "
                           "use model.dsa.kernel=torch on CPU")
    load_tilelang()
    attend = {"tilelang": partial(latent_forward, **(forward_config or {})),
              "flashmla": flashmla_forward}[attention_forward]
    if attention_forward == "flashmla":
        sparse_prefill()  # its one-line error now, not at the first layer

    def forward(q, kv, indices, sm_scale):
        return attend(q, kv[:, 0], indices[:, 0], sm_scale)

    def backward(q, kv, out, grad_out, indices, lse, sm_scale, delta, dkv=None):
        dq, dkv = latent_backward(q, kv[:, 0], grad_out, indices[:, 0], lse, delta, sm_scale,
                                  None if dkv is None else dkv[:, 0], ordered=ordered,
                                  **(backward_config or {}))
        return dq, dkv[:, None]

    return SparseMLAOps(forward=forward, delta=row_dots, backward=backward,
                      index_keys=INDEXER_SCORES[indexer_scores].keys,
                      index_scores=INDEXER_SCORES[indexer_scores].scores, width=LATENT_WIDTH,
                      value_width=LATENT_WIDTH,
                      backward_adds_dkv=BACKWARD_ADDS_DKV, zero_without_keys=True)
