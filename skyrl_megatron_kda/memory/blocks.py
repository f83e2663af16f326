"""The blocks every layer has, whatever its attention and FFN: the two hyper-connections, the
RMSNorms, and the dense SwiGLU MLP (the FFN of the dense layers). These run the same
torch/megatron code on CPU and GPU, and a CPU test checks them against autograd's saved tensors."""

from __future__ import annotations

from ..config import Recipe
from .rows import act_bytes, rows_of


def mhc_activation_bytes(recipe: Recipe) -> int:
    """One layer's two hyper-connections (model/hyper_connections.py, glm.py's expand), per rank.

    Per row and sub-block: the input streams [N, D] (the normalised map projection keeps only
    them, ``NormalizedProjection``); the map projection [(2+N)N], sigmoids, softmax and every
    Sinkhorn division (numerator [N, N] and denominator [N], 2 * iterations - 1 of them); pre
    weights; then in expand the block output [D] and the post [N] and comb [N, N] maps in the
    stream dtype."""
    m, w = recipe.model, act_bytes(recipe)
    D, N = m.hidden_size, m.hyper_connections.num_streams
    divs = 2 * m.hyper_connections.sinkhorn_iterations - 1
    sub = 4 * (2 + N) * N + 4 * 2 * N + 4 * N * N
    sub += divs * 4 * (N * N + N) + 4 * N
    sub += w * (N * D + N + D + N * N)
    return 2 * rows_of(recipe).sp * sub


def mhc_map_backward_bytes(recipe: Recipe) -> int:
    """Working set of one map projection's backward (``NormalizedProjection``), per rank: the
    gradient of its input, the rank's rows [s, N*D] in the stream dtype; per chunk of
    ``model.hyper_connections.map_chunk_rows`` rows six fp32 tensors of that width (the rebuilt
    upcast and its normalised copy, and autograd's gradients through the normalisation); four
    fp32 copies of the projection weight [(2+N)N, N*D] (its gradient per chunk and their sum)
    and of the chunk's projected rows. An upper bound, held to the CPU census for bf16 streams
    by tests/test_hyper_connections.py. An FFN's map runs it after the FFN's backward
    and before the attention block's, so it adds to what the layer holds then."""
    m, w = recipe.model, act_bytes(recipe)
    N, rows = m.hyper_connections.num_streams, rows_of(recipe).sp
    width, maps = N * m.hidden_size, (2 + N) * N
    chunk = min(rows, m.hyper_connections.map_chunk_rows)
    return rows * width * w + 6 * 4 * chunk * width + 4 * 4 * maps * (width + chunk)


def norm_activation_bytes(recipe: Recipe, width: int, rows: int) -> int:
    """GLM's RMSNorm (glm.py): fp32 input copy, rsqrt, and the normalised tensor in the
    activation dtype (``width`` channels, ``rows`` rows)."""
    return rows * (4 * width + 4 + act_bytes(recipe) * width)


def dense_mlp_activation_bytes(recipe: Recipe) -> int:
    """One dense SwiGLU MLP (megatron MLP with GLM's clamp): the input [s, D] and, per row of
    the CP rank, 6 intermediates of width F/tp (fc1 output 2F, both clamps and SiLU, fc2 input)."""
    m, p, w, r = recipe.model, recipe.parallel, act_bytes(recipe), rows_of(recipe)
    return r.sp * m.hidden_size * w + r.cp * m.dense_ffn_hidden_size // p.tp * 6 * w


def dense_mlp_backward_bytes(recipe: Recipe) -> int:
    """Working set of a dense MLP's backward (megatron's MLP with GLM's clamped SwiGLU), per
    rank: four gradients of width F/tp on the rows it runs (the fc2 input's, the two halves of
    the fc1 output's and their concatenation) and fc2's weight gradient before DDP's hook adds it
    to the buffer. The CPU census of megatron's module equals it (tests/test_memory_terms.py)."""
    m, p, w, r = recipe.model, recipe.parallel, act_bytes(recipe), rows_of(recipe)
    width = m.dense_ffn_hidden_size // p.tp
    return r.cp * 4 * width * w + m.hidden_size * width * w
