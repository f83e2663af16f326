"""The latent kernel's sparse-attention forward on FlashMLA's sparse prefill kernel
(``model.dsa.latent.attention_forward=flashmla``).

FlashMLA (DeepSeek's MLA kernels) has a Hopper forward for exactly this attention: queries [S, H,
D] over one shared latent [T, 1, D] at int32 indices [S, 1, K] (-1 = not selected), D = 512 for
both the scores and the values, returning the output, the row maxima and the natural
log-sum-exp, equal to our TileLang forward within bf16 rounding (docs/benchmarks.md times
both). It has no backward; ours takes its log-sum-exp (the same natural log-sum-exp of
``scale * q . k``).

We load the build vLLM ships (``vllm/_flashmla_C``, an op library on torch's stable ABI, so
one build serves several torch versions): SkyRL's generation already installs vLLM, and
FlashMLA has no release of its own on the package index (the ``flash-mla`` there predates its
sparse kernels). Only that library is loaded (``torch.ops.load_library``), not the ``vllm``
package, so importing vLLM's engine costs nothing here.

The kernel's contract differs from ours in three places, which ``flashmla_forward`` adapts:
the top-k width must be a multiple of 128 (padded with -1, and ``topk_length`` tells it to stop
at ours), the heads must be 8, 16, 32, 64 or 128 (padded with zero queries, more in groups of
128), and a query with no selected key gets log-sum-exp +inf where our backward expects 0.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

KEY_BLOCK = 128
"""The kernel's top-k width is a multiple of this (two of its 64-key steps)."""
HEAD_COUNTS = (8, 16, 32, 64, 128)
"""Heads per call the kernel runs on Hopper."""
VALUE_WIDTH = 512
"""The only value width the kernel has (GLM's and DeepSeek's latent)."""
LIBRARY = "_flashmla_C.abi3.so"


@lru_cache(maxsize=None)
def sparse_prefill():
    """FlashMLA's sparse prefill op from vLLM's install, or a one-line error naming the fix."""
    spec = importlib.util.find_spec("vllm")
    folders = list(spec.submodule_search_locations or []) if spec else []
    library = next((Path(f) / LIBRARY for f in folders if (Path(f) / LIBRARY).is_file()), None)
    if library is None:
        raise RuntimeError("model.dsa.latent.attention_forward=flashmla needs vLLM's FlashMLA "
                           f"build (vllm/{LIBRARY}; pip install vllm), or use "
                           "model.dsa.latent.attention_forward=tilelang")
    try:
        torch.ops.load_library(str(library))
    except OSError as e:  # built for another CUDA or torch, or no driver here
        raise RuntimeError(f"model.dsa.latent.attention_forward=flashmla could not load {library}: "
                           f"{str(e).splitlines()[0]}; use "
                           "model.dsa.latent.attention_forward=tilelang") from e
    return torch.ops._flashmla_C.sparse_prefill_fwd


def _pad_heads(q: torch.Tensor) -> torch.Tensor:
    """q with zero queries added up to a head count the kernel runs (a multiple of the largest
    above it); q itself, not a copy, where it has one."""
    heads = q.shape[1]
    if heads > HEAD_COUNTS[-1]:
        missing = -heads % HEAD_COUNTS[-1]
    else:
        missing = next(h for h in HEAD_COUNTS if h >= heads) - heads
    return F.pad(q, (0, 0, 0, missing)) if missing else q


def flashmla_forward(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                     op=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``latent.interface.latent_forward``'s contract on FlashMLA: q [S, H, D] bf16, kv [T, D]
    bf16, indices [S, K] (natural positions, -1 = none) -> the latent-space output [S, H, D]
    and the natural log-sum-exp of ``scale * q . k`` [S, H] fp32 (0 for a query with no key,
    whose output is 0). ``op``: the kernel (``sparse_prefill()``; the CPU tests pass a torch
    stand-in with its contract)."""
    S, H, D = q.shape
    if D != VALUE_WIDTH or kv.shape[-1] != D:
        raise ValueError(f"FlashMLA's sparse forward needs {VALUE_WIDTH}-wide queries and latent, "
                         f"got {D} and {kv.shape[-1]}")
    op = op or sparse_prefill()
    K = indices.shape[1]
    idx = F.pad(indices.to(torch.int32), (0, -K % KEY_BLOCK), value=-1)[:, None].contiguous()
    lengths = torch.full((S,), K, dtype=torch.int32, device=q.device)
    kv = kv[:, None].contiguous()
    padded = _pad_heads(q)
    group = min(padded.shape[1], HEAD_COUNTS[-1])
    outs, lses = [], []
    for h0 in range(0, padded.shape[1], group):
        out, _, lse = op(padded[:, h0:h0 + group].contiguous(), kv, idx, float(scale), D, None,
                         lengths, None)
        outs.append(out)
        lses.append(lse)
    out, lse = (torch.cat(t, 1) if len(t) > 1 else t[0] for t in (outs, lses))
    return out[:, :H], lse[:, :H].masked_fill(torch.isinf(lse[:, :H]), 0.0)
