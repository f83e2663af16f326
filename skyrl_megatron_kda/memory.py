"""Per-GPU memory estimate of a recipe: parameters, gradients, optimizer state, activations.

Why an estimate of our own: the 1M-token recipe cannot run on these machines, and the question
"does it fit, and which term breaks it" must be answered before renting 64 GPUs. Every formula
below follows what the code of this package allocates on one rank (docs/memory.md lists each
tensor); nothing is fitted to a measurement.

- **Parameters** are counted exactly, per rank, as ``model/glm.py`` builds them (tests compare
  them with the megatron model element by element), with each tensor's dtype (the mHC maps and
  KDA's ``A_log``/``dt_bias`` stay fp32 in a bf16 model).
- **Gradients**: megatron DDP's grad buffer holds every trainable parameter once, in fp32
  (``train.grad_reduce_in_fp32``, the default) or else in the parameter's dtype. The frozen DSA
  indexer has none. With a bf16 buffer the optimizer step casts the rank's shard of it to fp32
  (its own phase, below).
- **Optimizer**: megatron's DistributedOptimizer shards Adam's state over the data-parallel
  group of each parameter: dense parameters over DP x CP (``intra_dp_cp``), routed experts over
  the expert data-parallel group (world / (ep * etp)). Per element: fp32 main copy + exp_avg +
  exp_avg_sq = 12 bytes for bf16 parameters; 8 for fp32 ones (the main copy is the parameter).
  ``train.optimizer_offload_fraction`` f moves f of it to host memory (``optimizer_split``;
  modelled only: a run refuses it, see ``train/optimizer.py``).
- **Megatron's all-gather buffer** (``gather_buffer_bytes``): the sequence-parallel linears and
  the MoE dispatcher gather into one global buffer, which keeps its largest size for the run.
- **Activations**: the tensors autograd keeps for backward, per layer type, for one packed row
  of ``data.seq_len`` tokens (the trainer runs forward+backward one row at a time, so
  ``micro_batch_size`` does not multiply them). KDA is modeled on the fla (GPU) kernels;
  every other block runs the same torch/megatron code on CPU and GPU, and a CPU test checks
  those terms against autograd's saved tensors. ``train.recompute`` (for the layer types of
  ``train.recompute_layers``): ``full`` keeps only each layer's input streams and rebuilds one
  layer at a time in backward, ``selective`` keeps the attention block's input instead of its
  tensors. ``train.offload_activations`` moves the kept ones to host memory.
- **Peak phase**: activations are not all alive at once. The estimate takes the largest of a
  few phases of the step, each the activations alive then plus its working set: the loss (the
  head's tensors and the bf16 logits, or under ``train.loss_chunk_tokens`` one chunk's fp32
  logits and the hidden and weight gradients), a KDA layer's kernel backward (fla's ``chunk_kda_bwd``
  allocations; the head, the later layers and that layer's MLP are freed by then; a recomputed
  layer's rebuilt tensors are alive), a DSA layer's working set (model.dsa.kernel: one
  block of the torch kernel, or the unfused path's indexer scores and whole-sequence keys), an
  MoE layer's backward (the whole rebuilt layer, the allgather dispatcher's token-sized
  transients and, under ``train.moe_chunk_tokens``, one chunk's rebuilt experts); with
  a bf16 gradient buffer also the optimizer step, when the distributed optimizer holds fp32 casts
  of the rank's gradient shard and no activation is alive.

Not counted: allocator fragmentation and caching,
NCCL/communication buffers other than the KDA exchange's, CUDA context (about 0.5-1 GiB),
gradients of activations other than fla's kernel backward (for example the MLPs' and the
projections' input gradients).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .config import Recipe
from .dsa import kernels as dsa_kernels
from .dsa.kernels import DSAShape
from .kda import exchanges
from .kda.cost import choose
from .kda.exchanges import ExchangeShape
from .tables import format_table

GiB = 2**30

H200_BYTES = 143_771 * 2**20
"""Memory of one H200 as ``nvidia-smi`` reports it (143,771 MiB, "141 GB")."""

HOST_OPTIMIZER_BYTES = 16
"""Host bytes per offloaded optimizer element (megatron's HybridDeviceOptimizer): the fp32 main
copy, exp_avg, exp_avg_sq, and the pinned fp32 copy of its gradient, for bf16 and fp32
parameters alike."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# --- parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one kind on one rank: all layers together, one dtype."""

    component: str  # see PARAM_COMPONENTS
    numel: int
    dtype_bytes: int
    trainable: bool = True  # has a gradient and Adam state (the DSA indexer is frozen)
    expert: bool = False  # routed-expert weight: optimizer sharded over the expert-DP group

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype_bytes


PARAM_COMPONENTS = ("embedding", "output_layer", "final_norm", "mhc", "layer_norms", "kda", "dsa",
                    "dsa_indexer", "dense_mlp", "moe_router", "moe_shared", "moe_experts")
"""Parameter kinds, in the order of the model."""


def rank_parameters(recipe: Recipe) -> list[ParamGroup]:
    """The parameters of one rank, grouped by kind and dtype (every rank holds the same count:
    TP shards evenly, each EP rank owns num_experts/ep experts)."""
    m, p, k = recipe.model, recipe.parallel, recipe.kda
    w = _DTYPE_BYTES[m.params_dtype]
    D, tp, N = m.hidden_size, p.tp, m.hyper_connections.num_streams
    kinds = m.layer_types()
    mlps = m.mlp_types()
    n_kda, n_dsa = kinds.count("kda"), kinds.count("dsa")
    n_dense, n_moe = mlps.count("dense"), mlps.count("moe")
    out: list[ParamGroup] = []

    def add(component: str, numel: int, dtype_bytes: int = w, **flags) -> None:
        if numel:
            out.append(ParamGroup(component, numel, dtype_bytes, **flags))

    vocab_shard = m.vocab_size // tp * D
    add("embedding", vocab_shard)
    add("output_layer", 0 if m.tie_word_embeddings else vocab_shard)
    add("final_norm", D)
    # Two HyperConnection modules per layer: fn [(2+N)N, N*D], base [(2+N)N], scale [3], fp32.
    add("mhc", m.num_layers * 2 * ((2 + N) * N * N * D + (2 + N) * N + 3), 4)
    add("layer_norms", m.num_layers * 2 * D)

    # KDA (kda/layer.py): column-parallel q/k/v/f_b/g_b/b, row-parallel o_proj, TP-duplicated
    # f_a/g_a/o_norm, head-sharded conv taps; A_log and dt_bias fp32.
    h, K = k.num_heads // tp, k.head_dim
    lw = h * K
    kda_w = 3 * lw * D + lw * (k.gate_low_rank + k.output_gate_low_rank) + h * D + lw * D
    kda_w += (k.gate_low_rank + k.output_gate_low_rank) * D + K + 3 * lw * k.conv_size
    add("kda", n_kda * kda_w)
    add("kda", n_kda * (h + lw), 4)

    # DSA (dsa/layer.py): megatron MLA, every projection TP-sharded (down projections too),
    # latent norms duplicated; the indexer duplicated and frozen.
    a = m.dsa
    n, dq = a.num_heads // tp, a.qk_nope_head_dim + a.qk_rope_head_dim
    dsa_w = a.q_lora_rank // tp * D + n * dq * a.q_lora_rank
    dsa_w += (a.kv_lora_rank + a.qk_rope_head_dim) // tp * D
    dsa_w += n * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank + D * n * a.v_head_dim
    dsa_w += a.q_lora_rank + a.kv_lora_rank
    add("dsa", n_dsa * dsa_w)
    hi, di = a.index_num_heads, a.index_head_dim
    indexer = hi * di * a.q_lora_rank + di * D + 2 * di + hi * D + a.index_kpool * di + di * D
    add("dsa_indexer", n_dsa * indexer, trainable=False)

    # SwiGLU MLPs: fc1 [2F, D] column-parallel (gate and up), fc2 [D, F] row-parallel.
    add("dense_mlp", n_dense * 3 * m.dense_ffn_hidden_size // tp * D)
    e = m.moe
    add("moe_router", n_moe * e.num_experts * D)
    add("moe_shared", n_moe * 3 * e.ffn_hidden_size * e.num_shared_experts // tp * D)
    local_experts = e.num_experts // p.ep
    add("moe_experts", n_moe * local_experts * 3 * (e.ffn_hidden_size // p.etp) * D, expert=True)
    return out


def rank_buffers_bytes(recipe: Recipe) -> int:
    """Non-parameter state of the model: each router's fp32 ``expert_bias`` and token counter."""
    n_moe = recipe.model.mlp_types().count("moe")
    return n_moe * 2 * recipe.model.moe.num_experts * 4 if recipe.model.moe.score_correction_bias else 0


def total_parameters(recipe: Recipe) -> int:
    """Parameters of the whole model (all ranks together, no replicas): the rank count at
    tp = ep = etp = 1."""
    single = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(
        update={"tp": 1, "cp": 1, "ep": 1, "etp": 1, "sequence_parallel": False})})
    return sum(g.numel for g in rank_parameters(single))


def active_parameters(recipe: Recipe) -> int:
    """Parameters one token passes through: everything but the routed experts, plus top_k of
    them (the frozen indexer included; the embedding counted as a lookup of its table)."""
    total = total_parameters(recipe)
    e = recipe.model.moe
    n_moe = recipe.model.mlp_types().count("moe")
    routed = n_moe * e.num_experts * 3 * e.ffn_hidden_size * recipe.model.hidden_size
    return total - routed + routed * e.top_k // e.num_experts


# --- activations --------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """Row counts of one forward on one rank (one packed row of seq_len tokens)."""

    whole: int  # T: tokens of the packed row (all CP ranks)
    cp: int  # S = T / cp: this CP rank's tokens (what TP-sharded layers compute on)
    sp: int  # s = S / tp under sequence parallelism, else S: rows of the residual stream


def rows_of(recipe: Recipe) -> Rows:
    p, T = recipe.parallel, recipe.data.seq_len
    S = T // p.cp
    return Rows(whole=T, cp=S, sp=S // p.tp if p.sequence_parallel else S)


def _act_bytes(recipe: Recipe) -> int:
    return _DTYPE_BYTES[recipe.model.params_dtype]


def mhc_activation_bytes(recipe: Recipe) -> int:
    """One layer's two hyper-connections (model/hyper_connections.py, glm.py's expand), per rank.

    Per row and sub-block: the input streams [N, D] (the normalised map projection keeps only
    them, ``NormalizedProjection``); the map projection [(2+N)N], sigmoids, softmax and every
    Sinkhorn division (numerator [N, N] and denominator [N], 2 * iterations - 1 of them); pre
    weights; then in expand the block output [D] and the post [N] and comb [N, N] maps in the
    stream dtype."""
    m, w = recipe.model, _act_bytes(recipe)
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
    and of the chunk's projected rows. An upper bound, within 7% of the CPU census for bf16
    streams (tests/test_hyper_connections.py). An FFN's map runs it after the FFN's backward
    and before the attention block's, so it adds to what the layer holds then."""
    m, w = recipe.model, _act_bytes(recipe)
    N, rows = m.hyper_connections.num_streams, rows_of(recipe).sp
    width, maps = N * m.hidden_size, (2 + N) * N
    chunk = min(rows, m.hyper_connections.map_chunk_rows)
    return rows * width * w + 6 * 4 * chunk * width + 4 * 4 * maps * (width + chunk)


def norm_activation_bytes(recipe: Recipe, width: int, rows: int) -> int:
    """GLM's RMSNorm (glm.py): fp32 input copy, rsqrt, and the normalised tensor in the
    activation dtype (``width`` channels, ``rows`` rows)."""
    return rows * (4 * width + 4 + _act_bytes(recipe) * width)


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
    m, k, p, w = recipe.model, recipe.kda, recipe.parallel, _act_bytes(recipe)
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
    k, p, w = recipe.kda, recipe.parallel, _act_bytes(recipe)
    K, C, h = k.head_dim, k.chunk_size, k.num_heads // p.tp
    per_head_token = 4 * K + w * 4 * K + 2 * w * K * K // C + 2 * w * K + 4 * 2 * C + 4 * 6 * K + 8
    all_heads = rows_of(recipe).cp * h * per_head_token
    if k.kernel_head_group is None:
        return all_heads
    exchange, _ = exchange_extra_bytes(recipe)  # which heads the rank computes depends on it
    computed = h // p.cp if exchanges.get(exchange).splits_heads else h
    return all_heads * min(k.kernel_head_group, computed) // computed


def dsa_shape(recipe: Recipe) -> DSAShape:
    """One rank's DSA layer for the kernel's memory terms. Its attention share
    (``model.dsa.tp_split``): heads: the CP rank's rows with heads/tp; sequence (TP > 1 under
    SP): the rank's own rows with every head, the kv up-projection weight of every head
    gathered."""
    p, a, r = recipe.parallel, recipe.model.dsa, rows_of(recipe)
    by_rows = a.attends_by_rows(p.tp, p.sequence_parallel)
    rows = r.sp if by_rows else r.cp
    return DSAShape(dsa=a, whole=r.whole, cp_rows=r.cp, sp_rows=r.sp, tp=p.tp, cp=p.cp,
                    act_bytes=_act_bytes(recipe), rows=rows,
                    heads=a.num_heads if by_rows else a.num_heads // p.tp, index_rows=rows,
                    gathers_weight=by_rows)


def dsa_kernel(recipe: Recipe) -> type[dsa_kernels.DSAKernel]:
    """The kernel class of ``model.dsa.kernel`` (resolved: ``auto`` is refused)."""
    return dsa_kernels.get(recipe.model.dsa.kernel)


def dsa_activation_bytes(recipe: Recipe) -> int:
    """One DSA layer (dsa/layer.py on megatron's MLA), per rank.

    Every kernel keeps: the layer input [s, D]; the q and KV latent norms; the q latent
    [s, q_lora]; the normalised KV latent of the whole sequence [T, kv_lora]; the output
    [S, heads/tp * v_head_dim] the output projection reads. The indexer runs without gradient:
    nothing kept but the token indices the attention saves. Then what the kernel keeps
    (``DSAKernel.kept_bytes``)."""
    m, p, w = recipe.model, recipe.parallel, _act_bytes(recipe)
    a, r = m.dsa, rows_of(recipe)
    total = r.sp * m.hidden_size * w
    # torch.nn.RMSNorm (LatentRMSNorm) keeps its fp32 input and fp32 normalised tensor.
    total += r.sp * (8 * a.q_lora_rank + 4) + r.sp * a.q_lora_rank * w
    total += r.sp * (8 * a.kv_lora_rank + 4)
    total += r.whole * a.kv_lora_rank * w
    total += r.cp * (a.num_heads // p.tp) * a.v_head_dim * w
    return total + dsa_kernel(recipe).kept_bytes(dsa_shape(recipe))


def dsa_transient_bytes(recipe: Recipe) -> int:
    """Working set of one DSA layer that is not kept between forward and backward, per rank:
    the largest stage of the kernel's (``DSAKernel.working_sets``)."""
    return max(dsa_kernel(recipe).working_sets(dsa_shape(recipe)).values())


def dense_mlp_activation_bytes(recipe: Recipe) -> int:
    """One dense SwiGLU MLP (megatron MLP with GLM's clamp): the input [s, D] and, per row of
    the CP rank, 6 intermediates of width F/tp (fc1 output 2F, both clamps and SiLU, fc2 input)."""
    m, p, w, r = recipe.model, recipe.parallel, _act_bytes(recipe), rows_of(recipe)
    return r.sp * m.hidden_size * w + r.cp * m.dense_ffn_hidden_size // p.tp * 6 * w


def dense_mlp_backward_bytes(recipe: Recipe) -> int:
    """Working set of a dense MLP's backward (megatron's MLP with GLM's clamped SwiGLU), per
    rank: four gradients of width F/tp on the rows it runs (the fc2 input's, the two halves of
    the fc1 output's and their concatenation) and fc2's weight gradient before DDP's hook adds it
    to the buffer. The CPU census of megatron's module equals it (tests/test_memory.py)."""
    m, p, w, r = recipe.model, recipe.parallel, _act_bytes(recipe), rows_of(recipe)
    width = m.dense_ffn_hidden_size // p.tp
    return r.cp * 4 * width * w + m.hidden_size * width * w


def moe_activation_bytes(recipe: Recipe) -> int:
    """One MoE block (model/moe_layer.py on megatron's MoELayer, allgather dispatcher), per rank.

    Kept: the input [s, D] (router, shared expert and dispatcher read the same tensor); the
    router's fp32 scores [E], top-k indices and weights; the shared expert like a dense MLP of
    width I * n_shared (on the rows gathered over TP under SP). Without
    ``train.moe_chunk_tokens`` also what the routed experts keep for all s rows
    (``moe_routed_bytes``); with it, only what each chunk's checkpoint keeps to rebuild from:
    its views of the input and of the router's dense fp32 probabilities and boolean routing map
    [s, E] (5 E bytes per row)."""
    m, p, w, r = recipe.model, recipe.parallel, _act_bytes(recipe), rows_of(recipe)
    e = m.moe
    total = r.sp * m.hidden_size * w + r.sp * (4 * e.num_experts + 12 * e.top_k + 4)
    total += r.cp * e.ffn_hidden_size * e.num_shared_experts // p.tp * 6 * w
    if recipe.train.moe_chunk_tokens:
        return total + r.sp * 5 * e.num_experts
    return total + moe_routed_bytes(recipe, r.sp)


def moe_call_rows(recipe: Recipe) -> int:
    """Rows of the rank's residual stream one MoE call covers: all of them, or one chunk of
    ``train.moe_chunk_tokens``."""
    sp, chunk = rows_of(recipe).sp, recipe.train.moe_chunk_tokens
    return min(chunk, sp) if chunk else sp


def local_assignments(recipe: Recipe, rows: int) -> int:
    """Token-to-expert assignments of ``rows`` rows that land on this rank's experts, under
    balanced routing: rows * ep * etp gathered rows, top_k each, local / E of them here."""
    p, e = recipe.parallel, recipe.model.moe
    return rows * p.ep * p.etp * e.top_k * (e.num_experts // p.ep) // e.num_experts


def moe_routed_bytes(recipe: Recipe, rows: int) -> int:
    """What the dispatcher and the routed experts keep for ``rows`` rows of the rank's residual
    stream (all of them, or one chunk of ``train.moe_chunk_tokens``): the routing map and
    probabilities of the local experts for every row gathered over EP x ETP, and one int64
    index per assignment; per assignment to a local expert (balanced routing:
    rows * ep * etp * top_k * local / E of them) the permuted input [D], six intermediates of
    width I/etp, the routing weight and the fc2 input cast."""
    m, p, w = recipe.model, recipe.parallel, _act_bytes(recipe)
    e, D = m.moe, m.hidden_size
    gathered = rows * p.ep * p.etp
    assignments = local_assignments(recipe, rows)
    total = gathered * (e.num_experts // p.ep) * 5 + assignments * 8
    return total + assignments * (D * w + 7 * e.ffn_hidden_size // p.etp * w + 4)


def moe_transient_bytes(recipe: Recipe, rows: int) -> int:
    """The allgather dispatcher's token-sized transients for one call on ``rows`` rows, per
    rank (g = rows * ep * etp gathered rows): the expert outputs scattered back to the gathered
    rows [g, D] and, when the dispatch gathers (ep * etp > 1), the fp32 copy the combine
    reduce-scatters [g, D] (a bf16 model; the backward mirrors them: the all-gathered fp32
    output gradient, its cast). The gathered inputs land in megatron's all-gather buffer, a
    state of its own (``gather_buffer_bytes``)."""
    m, p, w = recipe.model, recipe.parallel, _act_bytes(recipe)
    g = rows * p.ep * p.etp
    per_row = w
    if p.ep * p.etp > 1:
        per_row += 4 if w != 4 else 0
    return g * m.hidden_size * per_row


def gather_buffer_bytes(recipe: Recipe) -> int:
    """Megatron's global all-gather buffer ("mpu", ``get_global_memory_buffer``), per rank. The
    sequence-parallel linears gather their input [S, D] into it (TP > 1 with SP) and the MoE
    dispatcher its tokens [g, D] over EP x ETP (g = rows per call * ep * etp, a chunk's rows
    under ``train.moe_chunk_tokens``); it grows to the largest request and stays allocated
    for the rest of the run, so it counts like a state."""
    m, p, w, r = recipe.model, recipe.parallel, _act_bytes(recipe), rows_of(recipe)
    sp_gather = r.cp * m.hidden_size * w if p.sequence_parallel and p.tp > 1 else 0
    moe_gather = 0
    if "moe" in m.mlp_types() and p.ep * p.etp > 1:
        moe_gather = moe_call_rows(recipe) * p.ep * p.etp * m.hidden_size * w
    return max(sp_gather, moe_gather)


def moe_working_bytes(recipe: Recipe) -> int:
    """An MoE layer's working set during its backward on top of what it keeps, for one call on
    r rows (all s, or under ``train.moe_chunk_tokens`` = c, r = min(c, s)): the dispatcher's
    transients (``moe_transient_bytes``); the routed experts' output gradient gathered for
    every assignment and their input gradient concatenated back, [assignments, D] each (the
    unpermute's and the experts' split's backward); under chunks, one chunk's rebuilt tensors
    (``moe_routed_bytes`` of r rows)."""
    m, w, rows = recipe.model, _act_bytes(recipe), moe_call_rows(recipe)
    gradients = 2 * local_assignments(recipe, rows) * m.hidden_size * w
    rebuilt = moe_routed_bytes(recipe, rows) if recipe.train.moe_chunk_tokens else 0
    return moe_transient_bytes(recipe, rows) + gradients + rebuilt


def head_tensor_bytes(recipe: Recipe) -> list[int]:
    """Embedding, final norm, output layer and loss, one entry per tensor kept: the token ids
    (int64), the final norm (fp32 input copy, rsqrt, normalised rows), the output layer's input
    [s, D], and the loss's per-token tensors (``loss_kept_bytes_per_token``)."""
    m, w, r = recipe.model, _act_bytes(recipe), rows_of(recipe)
    D = m.hidden_size
    norm = [r.sp * D * 4, r.sp * 4, r.sp * D * w]
    return [*embedding_tensor_bytes(recipe), *norm, r.sp * D * w,
            *(r.cp * n for n in loss_kept_bytes_per_token(recipe))]


HEAD_LABEL = "embedding + head + loss"
"""The plan's row of what the embedding, final norm, output layer and loss keep."""


def embedding_tensor_bytes(recipe: Recipe) -> list[int]:
    """What the embedding keeps: the rank's token ids (int64)."""
    return [rows_of(recipe).cp * 8]


def head_activation_bytes(recipe: Recipe) -> int:
    """What the embedding, final norm, output layer and loss keep (``head_tensor_bytes``)."""
    return sum(head_tensor_bytes(recipe))


def loss_kept_bytes_per_token(recipe: Recipe) -> list[int]:
    """What the loss keeps per token of the CP rank, one entry per tensor. Unfused (megatron's
    vocab-parallel cross entropy): the fp32 softmax over the vocabulary shard [V/tp], the target
    mask (bool) and the masked target (int64). ``train.loss_chunk_tokens``
    (model/fused_loss.py): the labels (int64) and the all-reduced fp32 row max and sum of exp."""
    if recipe.train.loss_chunk_tokens is not None:
        return [8, 4, 4]
    return [recipe.model.vocab_size // recipe.parallel.tp * 4, 1, 8]


def pinned_block_bytes(nbytes: int) -> int:
    """Host bytes torch's caching host allocator takes for a pinned tensor of ``nbytes``: the
    next power of two (its rounding under the default config)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def offloaded_tensor_bytes(recipe: Recipe) -> list[int] | None:
    """Sizes of the tensors ``train.offload_activations`` copies to the host per forward, one
    entry per tensor (model/host_offload.py copies each once), when every layer is under full
    recompute: the token ids and each layer's input streams. The head's tensors stay on the
    device: saved last and read first, moving them would lower no peak. None otherwise: layers
    that keep their own tensors are modelled in bytes per block, not tensor by tensor."""
    m, t = recipe.model, recipe.train
    if any(t.recompute_of(kind) != "full" for kind in m.layer_types()):
        return None
    return embedding_tensor_bytes(recipe) + [checkpoint_input_bytes(recipe, "full")] * m.num_layers


def host_activation_bytes(recipe: Recipe) -> tuple[int, bool]:
    """(host bytes of the offloaded activations per rank, whether exact). Exact under full
    recompute: each tensor in its own pinned block on a GPU (``pinned_block_bytes``), as it is on
    CPU; otherwise the kept bytes, a lower bound (the pinned blocks round each tensor up)."""
    if not recipe.train.offload_activations:
        return 0, True
    sizes = offloaded_tensor_bytes(recipe)
    if sizes is None:
        kept = sum(sum(layer_kept_bytes(recipe, i).values()) for i in range(recipe.model.num_layers))
        return kept + sum(embedding_tensor_bytes(recipe)), False
    pinned = recipe.run.device == "gpu"
    return sum(pinned_block_bytes(n) if pinned else n for n in sizes), True


def loss_working_bytes(recipe: Recipe) -> tuple[str, int]:
    """The loss phase's working set on top of what is kept, with its label.

    Unfused: the logits [S, V/tp] in the activation dtype (before their fp32 copy in forward,
    their gradient in backward). ``train.loss_chunk_tokens`` = c (model/fused_loss.py's
    backward, its largest point): the gathered hidden rows [S, D] (under SP with tp > 1; else
    the kept input itself) and their gradient [S, D] in the activation dtype, the fp32 weight
    gradient accumulator and one chunk's product [V/tp, D] (in the activation dtype), and one
    chunk's logits [c, V/tp]: fp32, with the matmul's output in the activation dtype (bf16)
    alive at the fp32 copy, or the gradient cast to it after (fp32 needs neither)."""
    m, p, w, r = recipe.model, recipe.parallel, _act_bytes(recipe), rows_of(recipe)
    shard = m.vocab_size // p.tp
    chunk = recipe.train.loss_chunk_tokens
    if chunk is None:
        return "bf16 logits", r.cp * shard * w
    gathered = r.cp * m.hidden_size * w if p.sequence_parallel and p.tp > 1 else 0
    rows = gathered + r.cp * m.hidden_size * w
    weight = shard * m.hidden_size * (4 + w)
    logits = min(chunk, r.cp) * shard * (4 + (w if w != 4 else 0))
    return f"fused loss chunk of {chunk}", rows + weight + logits


def attention_activation_bytes(recipe: Recipe, index: int) -> int:
    """The attention block of layer ``index`` (KDA or DSA; exchange excluded)."""
    if recipe.model.layer_types()[index] == "kda":
        return kda_activation_bytes(recipe)
    return dsa_activation_bytes(recipe)


def mlp_activation_bytes(recipe: Recipe, index: int) -> int:
    """The FFN block of layer ``index`` (dense MLP or MoE)."""
    if recipe.model.mlp_types()[index] == "dense":
        return dense_mlp_activation_bytes(recipe)
    return moe_activation_bytes(recipe)


def layer_parts(recipe: Recipe, index: int) -> dict[str, int]:
    """What layer ``index`` keeps for backward without recompute (exchange excluded), by the
    plan table's labels."""
    m, r = recipe.model, rows_of(recipe)
    return {
        "dense MLP" if m.mlp_types()[index] == "dense" else "MoE": mlp_activation_bytes(recipe, index),
        "mHC + norms": mhc_activation_bytes(recipe) + 2 * norm_activation_bytes(recipe, m.hidden_size, r.sp),
        f"{m.layer_types()[index].upper()} attention": attention_activation_bytes(recipe, index),
    }


def layer_activation_bytes(recipe: Recipe, index: int) -> int:
    """Everything layer ``index`` keeps for backward without recompute (exchange excluded)."""
    return sum(layer_parts(recipe, index).values())


def checkpoint_input_bytes(recipe: Recipe, mode: str) -> int:
    """What a recompute keeps to rebuild from: the layer's input streams [s, N, D] (``full``),
    the attention block's input [s, D] (``selective``), nothing (``none``)."""
    m, r, w = recipe.model, rows_of(recipe), _act_bytes(recipe)
    width = {"full": m.hyper_connections.num_streams * m.hidden_size, "selective": m.hidden_size, "none": 0}
    return r.sp * width[mode] * w


def layer_kept_bytes(recipe: Recipe, index: int) -> dict[str, int]:
    """What layer ``index`` keeps for backward at the end of the forward, under its recompute
    mode (``train.recompute_of``), by the plan table's labels: ``full`` keeps its input streams
    (the checkpoint); ``selective`` keeps the attention block's input [s, D] instead of its
    norm and attention tensors; ``none`` keeps everything."""
    m = recipe.model
    kind = m.layer_types()[index]
    mode = recipe.train.recompute_of(kind)
    if mode == "full":
        return {"layer inputs (checkpoints)": checkpoint_input_bytes(recipe, mode)}
    kept = layer_parts(recipe, index)
    if mode == "selective":
        del kept[f"{kind.upper()} attention"]
        kept["mHC + norms"] -= norm_activation_bytes(recipe, m.hidden_size, rows_of(recipe).sp)
        kept["attention inputs (checkpoints)"] = checkpoint_input_bytes(recipe, mode)
    return kept


def layer_backward_bytes(recipe: Recipe, index: int) -> int:
    """What layer ``index`` holds while its attention block runs backward (its FFN has finished
    backward): its tensors without the FFN's, rebuilt ones included, plus the checkpoint input
    that a recompute keeps."""
    mode = recipe.train.recompute_of(recipe.model.layer_types()[index])
    return (layer_activation_bytes(recipe, index) - mlp_activation_bytes(recipe, index)
            + checkpoint_input_bytes(recipe, mode))


def ffn_backward_bytes(recipe: Recipe, index: int) -> int:
    """What layer ``index`` holds while its FFN block (MoE or dense MLP) runs backward (first in
    the layer): under full recompute the whole rebuilt layer and its checkpoint input; otherwise
    what it kept (its attention block is rebuilt only after, under selective recompute)."""
    mode = recipe.train.recompute_of(recipe.model.layer_types()[index])
    if mode == "full":
        return layer_activation_bytes(recipe, index) + checkpoint_input_bytes(recipe, mode)
    return sum(layer_kept_bytes(recipe, index).values())


def moe_phase_label(recipe: Recipe) -> str:
    chunk = recipe.train.moe_chunk_tokens
    return f"MoE layer backward, chunks of {chunk} (largest)" if chunk else "MoE layer backward (largest)"


def exchange_extra_bytes(recipe: Recipe) -> tuple[str, int]:
    """The KDA exchange this recipe runs (``auto`` resolved by the cost model) and the transient
    buffers one KDA layer allocates for it (the exchange's own ``extra_memory_bytes``), for one
    packed row."""
    name = recipe.kda.cp_exchange
    if name == exchanges.AUTO:  # the plan of an unresolved recipe
        name, _, _ = choose(recipe)
    shape = ExchangeShape.of(recipe, batch=1, element_size=_act_bytes(recipe))
    return name, exchanges.get(name).extra_memory_bytes(shape)


# --- the whole rank -----------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of one recipe; ``rows`` are (label, bytes) in table order."""

    params: dict[str, int]  # by component group (PARAM_GROUPS labels)
    buffers: int
    grads: int
    optimizer: int
    activations: dict[str, int]  # kept for backward at the end of the forward, all layers
    exchange: str
    exchange_buffers: int  # the KDA exchange's transient buffers (one layer at a time)
    phases: dict[str, int]  # activations + working set alive at each candidate peak
    recompute: str
    offloaded: bool  # the kept activations live in host memory (train.offload_activations)
    dsa_layer: int = 0  # the largest DSA layer's own tensors + working set (its phase without
    # what the layers before it keep)
    host_optimizer: int = 0  # optimizer state in host memory (train.optimizer_offload_fraction)
    gather_buffer: int = 0  # megatron's global all-gather buffer at its largest

    @property
    def states(self) -> int:
        return (sum(self.params.values()) + self.buffers + self.grads + self.optimizer
                + self.gather_buffer)

    @property
    def peak_phase(self) -> tuple[str, int]:
        """The phase of the step with the most activation memory, and that memory."""
        return max(self.phases.items(), key=lambda item: item[1])

    @property
    def total(self) -> int:
        return self.states + self.peak_phase[1]


PARAM_GROUPS: dict[str, tuple[str, ...]] = {
    "KDA attention": ("kda",),
    "DSA attention": ("dsa", "dsa_indexer"),
    "dense MLP": ("dense_mlp",),
    "MoE routed experts": ("moe_experts",),
    "MoE shared + router": ("moe_shared", "moe_router"),
    "embedding + output": ("embedding", "output_layer"),
    "mHC + norms": ("mhc", "layer_norms", "final_norm"),
}
"""How the table groups the parameter kinds."""


def optimizer_shards(recipe: Recipe) -> tuple[int, int]:
    """(dense, expert) sizes of the groups the distributed optimizer shards Adam state over:
    DP x CP = world / (tp * pp) and the expert data-parallel group = world / (ep * etp * pp)."""
    p, world = recipe.parallel, recipe.run.num_workers
    return world // (p.tp * p.pp), world // (p.ep * p.etp * p.pp)


def grad_bytes(recipe: Recipe, group: ParamGroup) -> int:
    """Bytes per element of ``group``'s gradients in DDP's buffer: fp32, or the parameter's own
    dtype without ``train.grad_reduce_in_fp32``."""
    return 4 if recipe.train.grad_reduce_in_fp32 else group.dtype_bytes


@dataclass(frozen=True)
class OptimizerSplit:
    """Where one rank's optimizer memory lives (bytes)."""

    gpu: int  # fp32 main copies + Adam moments kept on the GPU
    host: int  # the offloaded share in host memory (HOST_OPTIMIZER_BYTES per element)
    step_casts: int  # on the GPU during the step: fp32 casts of the GPU share's bf16 gradients


def optimizer_split(recipe: Recipe) -> OptimizerSplit:
    """The distributed optimizer's memory on the GPU and on the host, per rank.

    With ``train.optimizer_offload_fraction`` f, megatron's HybridDeviceOptimizer offloads whole
    parameter shards in order until f of the shard elements are on the host; this takes exactly
    f of each term (exact at 0 and 1; in between it differs by less than one parameter shard).
    Offloaded, an element costs the GPU nothing and the host ``HOST_OPTIMIZER_BYTES``; its
    gradient is copied to the host as fp32 without a GPU cast."""
    dense_shard, expert_shard = optimizer_shards(recipe)
    state = host = casts = 0
    for g in rank_parameters(recipe):
        if not g.trainable:
            continue
        shard = expert_shard if g.expert else dense_shard
        state += g.numel * (12 if g.dtype_bytes != 4 else 8) // shard
        host += g.numel * HOST_OPTIMIZER_BYTES // shard
        if grad_bytes(recipe, g) != 4:
            casts += g.numel * 4 // shard
    f = recipe.train.optimizer_offload_fraction
    return OptimizerSplit(gpu=state - round(f * state), host=round(f * host),
                          step_casts=casts - round(f * casts))


def estimate_memory(recipe: Recipe) -> MemoryEstimate:
    """The per-GPU memory of ``recipe`` (see the module docstring for what is counted)."""
    groups = rank_parameters(recipe)
    params = {label: sum(g.bytes for g in groups if g.component in kinds)
              for label, kinds in PARAM_GROUPS.items()}
    grads = sum(g.numel * grad_bytes(recipe, g) for g in groups if g.trainable)
    split = optimizer_split(recipe)

    m = recipe.model
    kinds = m.layer_types()
    exchange, per_layer_extra = exchange_extra_bytes(recipe)
    head = head_activation_bytes(recipe)
    loss_label, loss_working = loss_working_bytes(recipe)
    kda_bwd = kda_backward_bytes(recipe) if "kda" in kinds else 0
    dsa_scratch = dsa_transient_bytes(recipe) if "dsa" in kinds else 0
    offload = recipe.train.offload_activations
    activations: dict[str, int] = {}
    kept_below = [0]  # on the GPU: what the layers before layer i keep, at index i
    for i in range(m.num_layers):
        kept = layer_kept_bytes(recipe, i)
        for label, nbytes in kept.items():
            activations[label] = activations.get(label, 0) + nbytes
        kept_below.append(kept_below[-1] + (0 if offload else sum(kept.values())))
    activations[HEAD_LABEL] = head
    # Backward runs the loss first and then the layers from the last one, a layer's FFN before
    # its attention; each layer's saved tensors are freed after its backward. So at a layer's
    # attention backward the head and the later layers are gone. The exchange's transient
    # buffers live around the projection and the exchange, not during the kernel's backward:
    # the larger of the two counts. Offloaded activations live on the host until their layer's
    # backward copies them back.
    loss = head + loss_working if offload else sum(activations.values()) + loss_working
    phases = {f"loss: kept + head + {loss_label}": loss}
    dsa_layer = 0
    for kind, working, label in (
            ("kda", max(per_layer_extra, kda_bwd), "KDA layer backward (largest)"),
            ("dsa", dsa_scratch, f"DSA layer + {dsa_kernel(recipe).working_set_label} (largest)")):
        own = {i: layer_backward_bytes(recipe, i) + working
               for i in range(m.num_layers) if kinds[i] == kind}
        if own:
            phases[label] = max(kept_below[i] + nbytes for i, nbytes in own.items())
            if kind == "dsa":
                dsa_layer = max(own.values())
    map_backward = mhc_map_backward_bytes(recipe)
    phases["mHC map backward (largest)"] = max(
        kept_below[i] + layer_backward_bytes(recipe, i) + map_backward for i in range(m.num_layers))
    for mlp, working, label in (("moe", moe_working_bytes, moe_phase_label(recipe)),
                                ("dense", dense_mlp_backward_bytes, "dense MLP backward (largest)")):
        layers = [i for i, kind in enumerate(m.mlp_types()) if kind == mlp]
        if layers:
            phases[label] = max(kept_below[i] + ffn_backward_bytes(recipe, i) + working(recipe)
                                for i in layers)
    if split.step_casts:
        # The distributed optimizer casts the bf16 gradient shard to fp32 before Adam runs, when
        # every activation is freed; the casts live until the gradients are zeroed.
        phases["optimizer step: fp32 casts of bf16 grads"] = split.step_casts
    return MemoryEstimate(params=params, buffers=rank_buffers_bytes(recipe), grads=grads,
                          optimizer=split.gpu, activations=activations, exchange=exchange,
                          exchange_buffers=per_layer_extra, phases=phases, recompute=recipe.train.recompute,
                          offloaded=offload, dsa_layer=dsa_layer, host_optimizer=split.host,
                          gather_buffer=gather_buffer_bytes(recipe))


def memory_lines(recipe: Recipe, gpu_bytes: int | None = None) -> list[str]:
    """The ``plan`` table: per-GPU memory of every term, the total, and the share of the GPU.

    ``gpu_bytes`` None: an H200 for ``run.device=gpu`` (the GPU this project targets), unknown
    on CPU. Units: GiB, or MiB when the total is below 1 GiB."""
    est = estimate_memory(recipe)
    dense_shard, expert_shard = optimizer_shards(recipe)
    r = rows_of(recipe)
    unit, scale = ("GiB", GiB) if est.total >= GiB else ("MiB", 2**20)
    t = recipe.train
    grad_dtype = "fp32" if t.grad_reduce_in_fp32 else recipe.model.params_dtype
    on_host = f"; {t.optimizer_offload_fraction:.0%} on the host" if t.optimizer_offload_fraction else ""

    def rows(items: Iterable[tuple[str, int]], indent: int = 0) -> list[tuple[str, str]]:
        return [(" " * indent + label, f"{nbytes / scale:.2f}") for label, nbytes in items]

    title = (
        f"per-GPU memory estimate ({unit}): one packed row of {r.whole} tokens, {r.cp} per CP "
        f"rank, {r.sp} residual-stream rows per rank; train.recompute={est.recompute} "
        f"({', '.join(recipe.train.recompute_layers)} layers), "
        f"offload_activations={str(est.offloaded).lower()}")
    table = rows([("parameters (+ router buffers)", sum(est.params.values()) + est.buffers)])
    table += rows(((label, v) for label, v in est.params.items() if v), 2)
    table += rows([
        (f"gradients ({grad_dtype} DDP buffer)", est.grads),
        (f"optimizer (Adam; dense /{dense_shard}, experts /{expert_shard}{on_host})", est.optimizer),
        ("megatron's all-gather buffer (its largest gather)", est.gather_buffer),
        ("activations kept for backward", sum(est.activations.values())),
    ])
    # Offloaded: the layers' tensors (and the token ids) are in host memory, the head's are not.
    table += rows(((label + (" (host memory)" if est.offloaded and label != HEAD_LABEL else ""), v)
                   for label, v in est.activations.items() if v), 2)
    table += rows([(f"KDA exchange transient ({est.exchange}, one layer)", est.exchange_buffers),
                   ("peak phase (activations + working set)", est.peak_phase[1])])
    for label, nbytes in est.phases.items():
        table += rows([(label, nbytes)], 2)
        if label.startswith("DSA"):
            table += rows([("of which the DSA layer itself", est.dsa_layer)], 4)
    table += rows([("total: states + peak phase", est.total)])
    lines = [title, *format_table(None, table)]
    if gpu_bytes is None and recipe.run.device == "gpu":
        gpu_bytes, gpu_name = H200_BYTES, "H200"
    else:
        gpu_name = "GPU"
    if gpu_bytes is None:
        lines.append("GPU memory: unknown (run.device=cpu; --gpu-memory-gib to compare)")
    else:
        verdict = "fits" if est.total <= gpu_bytes else "does NOT fit"
        lines.append(f"vs. {gpu_name} {gpu_bytes / GiB:.1f} GiB: {est.total / gpu_bytes:.1%} "
                     f"-> {verdict}")
    return lines + host_memory_lines(recipe, est)


def host_memory_lines(recipe: Recipe, est: MemoryEstimate) -> list[str]:
    """What each GPU's rank keeps in host memory, and a node's worth (``cluster.gpus_per_node``)."""
    t = recipe.train
    activations, exact = host_activation_bytes(recipe)
    if not activations and not est.host_optimizer:
        return ["host memory per GPU: none beyond the process (nothing offloaded)"]
    parts = []
    if activations:
        how = "pinned blocks" if recipe.run.device == "gpu" else "as saved"
        parts.append(f"activations {activations / GiB:.2f} GiB (train.offload_activations, {how}"
                     + ("" if exact else "; at least: layers not under full recompute") + ")")
    if est.host_optimizer:
        parts.append(f"optimizer state {est.host_optimizer / GiB:.2f} GiB "
                     f"(train.optimizer_offload_fraction={t.optimizer_offload_fraction:g}; "
                     "modelled only: a run refuses it, megatron-core 0.19.2's "
                     "HybridDeviceOptimizer cannot hold fp32 parameters)")
    per_gpu = activations + est.host_optimizer
    node = recipe.cluster.gpus_per_node
    return [f"host memory per GPU: {' + '.join(parts)}",
            f"host memory per node: {per_gpu * node / GiB:.2f} GiB "
            f"({node} GPUs, cluster.gpus_per_node)"]


def param_counts(groups: Iterable[ParamGroup]) -> dict[tuple[str, int, bool], int]:
    """Elements by (component, dtype bytes, trainable): the key tests compare with a model."""
    out: dict[tuple[str, int, bool], int] = {}
    for g in groups:
        key = (g.component, g.dtype_bytes, g.trainable)
        out[key] = out.get(key, 0) + g.numel
    return out
