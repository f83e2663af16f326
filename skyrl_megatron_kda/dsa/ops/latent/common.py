"""What the latent sparse-MLA programs share: GLM's latent width and the head block, the
padding the interfaces apply (heads to a power of two >= 16 or whole 64-head groups, the top-k
width to a program's key block with -1), TileLang's import, the programs' tensor signatures,
and the TileLang macros both phases use (a key block's gather, the natural log-sum-exp).

The programs are built for GLM's shape: one width ``D`` (the latent, 512) for the scores and the
values, so nothing is padded to DeepSeek's 576 channels and no tail products run, and every
head of a query in one thread block (up to 64; more in groups of 64), so each selected latent
row is gathered once per query and its gradient added once.
"""

import math

import torch
import torch.nn.functional as F

LOG2E = math.log2(math.e)
LATENT_WIDTH = 512
"""GLM-5.3-Flash's kv_lora_rank: the width the kernels are built for (scores and values)."""
HEAD_BLOCK = 64
"""Heads per thread block: the wider MMA tile; more heads run in groups of 64."""
SHARED_BYTES = 227 * 1024
"""Shared memory one Hopper thread block may hold (sm_90's opt-in limit)."""


def padded_heads(heads: int) -> int:
    """Heads as the kernels take them: a power of two >= 16 up to 64, else a multiple of 64."""
    if heads > HEAD_BLOCK:
        return -(-heads // HEAD_BLOCK) * HEAD_BLOCK
    return max(16, 1 << (heads - 1).bit_length())


def threads_for(head_block: int) -> int:
    """Threads per block: 8 warps for 64 heads; fewer heads leave 8 warps too few MMA tiles
    (each warp needs 16 rows and 8 columns of every GEMM), so 4."""
    return 256 if head_block >= HEAD_BLOCK else 128


def pad_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, heads - t.shape[1])) if t.shape[1] != heads else t


def padded_width(width: int, multiple: int) -> int:
    """A top-k width rounded up to the multiple a kernel takes (``forward_index_multiple``,
    ``backward_index_multiple``)."""
    return -(-width // multiple) * multiple


def pad_keys(indices: torch.Tensor, multiple: int) -> torch.Tensor:
    width = padded_width(indices.shape[1], multiple)
    return F.pad(indices, (0, width - indices.shape[1]), value=-1)



def load_tilelang():
    try:
        import tilelang
        import tilelang.language as T
    except ImportError as e:
        raise RuntimeError("model.dsa.kernel=latent needs the tilelang package "
                           "(pip install 'skyrl-megatron-kda[gpu]'), or use model.dsa.kernel=torch") from e
    return tilelang, T


def forward_signature(T, heads: int, dim: int, topk: int):
    """Both forward programs' query count S and tensors: q [S, heads, dim], the latent [Tk,
    dim], the indices [S, topk], the output and the log-sum-exp [S, heads]."""
    S, Tk = T.dynamic("S"), T.dynamic("Tk")
    return S, dict(Q=T.Tensor([S, heads, dim], "bfloat16"), KV=T.Tensor([Tk, dim], "bfloat16"),
                   Indices=T.Tensor([S, topk], "int32"), Out=T.Tensor([S, heads, dim], "bfloat16"),
                   Lse=T.Tensor([S, heads], "float32"))


def natural_lse_macro(T, log2_scale: float):
    """A TileLang macro: each head's row sum made the natural log-sum-exp of its scaled scores
    (from the sum and the running maximum, in place; 0 for a head with no key)."""
    ln2 = math.log(2.0)

    @T.macro
    def natural_lse(row_sum, row_max, heads):
        for h in T.Parallel(heads):
            row_sum[h] = T.if_then_else(
                row_sum[h] > 0, (T.log2(row_sum[h]) + row_max[h] * log2_scale) * ln2, 0)

    return natural_lse


def block_gather_macro(T, key_block: int, dim: int):
    """A TileLang macro: one key block's latent rows into ``kv_s`` [key_block, dim] and their
    flags (index >= 0) into ``valid``; a -1 index gathers row 0, masked by its flag. Inside
    ``T.Pipelined`` these become the stage's asynchronous copies."""

    @T.macro
    def gather_block(KV, Indices, s, key0, kv_s, valid):
        for k in T.Parallel(key_block):
            valid[k] = Indices[s, key0 + k] >= 0
        for k, d in T.Parallel(key_block, dim):
            kv_s[k, d] = KV[T.max(Indices[s, key0 + k], 0), d]

    return gather_block


def backward_signature(T, heads: int, dim: int, topk: int, ordered: bool):
    """Both backward programs' query count S and tensors: q, dO and dq [S, heads, dim], the
    latent [Tk, dim], the indices [S, topk], the log-sum-exp and delta [S, heads], and the fp32
    latent gradient: [Tk, dim], or each slot's row [S, topk, dim] when ``ordered``."""
    S, Tk = T.dynamic("S"), T.dynamic("Tk")
    bf16, f32 = "bfloat16", "float32"
    return S, dict(Q=T.Tensor([S, heads, dim], bf16), KV=T.Tensor([Tk, dim], bf16),
                   dO=T.Tensor([S, heads, dim], bf16), Indices=T.Tensor([S, topk], "int32"),
                   Lse=T.Tensor([S, heads], f32), Delta=T.Tensor([S, heads], f32),
                   dQ=T.Tensor([S, heads, dim], bf16),
                   dKV=T.Tensor([S, topk, dim] if ordered else [Tk, dim], f32))



