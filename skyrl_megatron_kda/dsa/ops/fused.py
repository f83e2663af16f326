"""megatron-core's TileLang sparse-MLA programs as ``SparseMLAOps`` (``model.dsa.kernel=fused``).

megatron-core 0.19.2 ships DeepSeek-V3.2's sparse-MLA kernels (forward, backward and the
backward's ``delta`` pre-pass) under ``experimental_attention_variant/ops``. They attend with
queries [S, H, 576] over one shared latent [T, 1, 576] at int32 indices [S, 1, topk] (-1 = not
selected) and return the latent-space output [S, H, 512] (the first 512 channels of the selected
rows) and a log-sum-exp. They are specialised for DeepSeek's 512 latent + 64 RoPE channels;
GLM's NoPE latent is 512 wide, so the wrapper zero-pads the absorbed queries and the latent to
576 (zero channels add nothing to q . k, and the value is the first 512 channels: exact). They
pad heads (to a power of two >= 16), rows and the top-k width (to 64) themselves. The indexer
scores beside them are ours in Triton (``index_scores``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.experimental_attention_variant.ops import (
    tilelang_sparse_mla_bwd,
    tilelang_sparse_mla_fwd,
)

from .contract import SparseMLAOps
from .index_scores import INDEXER_SCORES


def fused_sparse_mla_ops(indexer_scores: str = "bf16") -> SparseMLAOps:
    """megatron-core's TileLang sparse-MLA kernels and our Triton indexer scores
    (``index_scores.pool_scores``, which replaces megatron's slower TileLang indexer kernel of
    the same scores), on the products ``indexer_scores`` names (``index_scores.INDEXER_SCORES``);
    a clear error where they cannot run."""
    if not torch.cuda.is_available():
        raise RuntimeError("model.dsa.kernel=fused needs CUDA (TileLang kernels); "
                           "use model.dsa.kernel=torch on CPU")
    if not tilelang_sparse_mla_fwd.HAVE_TILELANG:
        raise RuntimeError("model.dsa.kernel=fused needs the tilelang package "
                           "(pip install 'skyrl-megatron-kda[gpu]'), or use model.dsa.kernel=torch")
    return SparseMLAOps(forward=tilelang_sparse_mla_fwd.sparse_mla_fwd_interface,
                        delta=tilelang_sparse_mla_bwd.sparse_mla_delta,
                        backward=tilelang_sparse_mla_bwd.sparse_mla_bwd,
                        index_keys=INDEXER_SCORES[indexer_scores].keys,
                        index_scores=INDEXER_SCORES[indexer_scores].scores)

