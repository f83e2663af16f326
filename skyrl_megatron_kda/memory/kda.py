"""The KDA layer's memory terms: what it keeps (modelled on fla's GPU kernels, which the CPU
census cannot see), the kernel backward's working set, and the CP exchange's transient buffers
(the exchange's own ``extra_memory_bytes``)."""

from __future__ import annotations

from ..config import Recipe
from ..kda import exchanges
from ..kda.exchanges import ExchangeShape
from .rows import act_bytes, rows_of


def kda_activation_bytes(recipe: Recipe) -> int:
    """One KDA layer (kda/layer.py with fla's kernels), per rank, without the exchange's extra.

    Kept for backward: the projection's input, this rank's SP shard [s, D] (the rows gathered
    from it are gathered again in backward, kda/rows.py), and the low-rank gate outputs
    [S, rf + rg]; the concatenated low-rank and beta weights (q, k and v project with views of
    their parameters); per head-token (S * H / tp of them, for every exchange): the projections
    q, k, v, f, g and beta (5K + 1, alive as the conv's saved input; beta shares the low-rank
    GEMM's output), fla's L2-normalised q and k (2K) with fp32 rstds, the
    contiguous copies fla's ``input_guard`` makes of v, the raw gate and beta (K + K + 1) and
    fp32 beta, the intra-chunk matrices Aqk and Akk (chunk_size each), the kernel output and
    the copied output gate the gated norm keeps (2K) with its rstd, and the normalised output
    o_proj reads (K)."""
    m, k, p, w = recipe.model, recipe.kda, recipe.parallel, act_bytes(recipe)
    r = rows_of(recipe)
    D, K, h = m.hidden_size, k.head_dim, k.num_heads // p.tp
    low = k.gate_low_rank + k.output_gate_low_rank
    head_tokens = r.cp * h
    per_head_token = w * (5 * K + 1 + 2 * K + 2 * K + 1 + 2 * k.chunk_size + 3 * K) + 4 * 4
    weights = w * (h + low) * D
    return (r.sp * D + r.cp * low) * w + weights + head_tokens * per_head_token


def kda_backward_bytes(recipe: Recipe) -> int:
    """Working set of fla 0.6.0's ``chunk_kda_bwd`` for one KDA layer, per rank: every tensor it
    allocates stays referenced until it returns, so at its last step (``chunk_kda_bwd_intra``)
    all of these are alive at once, per head-token (S * H / tp): the recomputed fp32 gate
    cumsum (K) and bf16 w, u, qg, kg (4K) and states h (K*V per chunk of C tokens); v_new and
    dv (2V, bf16); fp32 dAqk and dAkk (2C); the bf16 state gradients dh (K*V per chunk); fp32
    dq, dk, dg (3K), their copies in the intra-chunk pass (3K) and db (two of them).

    With ``kda.kernel_head_group`` the kernel runs on groups of heads one after another: the
    working set is that of the largest group, out of the heads the rank computes (the TP-local
    heads on the rank's rows, or a 1/cp slice of them on whole sequences, the same head-tokens)."""
    k, p, w = recipe.kda, recipe.parallel, act_bytes(recipe)
    K, C, h = k.head_dim, k.chunk_size, k.num_heads // p.tp
    per_head_token = 4 * K + w * 4 * K + 2 * w * K * K // C + 2 * w * K + 4 * 2 * C + 4 * 6 * K + 8
    all_heads = rows_of(recipe).cp * h * per_head_token
    if k.kernel_head_group is None:
        return all_heads
    exchange, _ = exchange_extra_bytes(recipe)  # which heads the rank computes depends on it
    computed = h // p.cp if exchanges.get(exchange).splits_heads else h
    return all_heads * min(k.kernel_head_group, computed) // computed


def exchange_extra_bytes(recipe: Recipe) -> tuple[str, int]:
    """The KDA exchange this recipe runs (resolved: ``auto`` is refused) and the transient
    buffers one KDA layer allocates for it (the exchange's own ``extra_memory_bytes``), for one
    packed row."""
    exchange = exchanges.get(recipe.kda.cp_exchange)
    shape = ExchangeShape.of(recipe, batch=1, element_size=act_bytes(recipe))
    return exchange.name, exchange.extra_memory_bytes(shape)
