"""The measured rates behind the step-time model (``model.py``): one H200, bf16. Each constant is
computed from the stored run it names (under ``bench/results/``); ``tests/test_step_time.py``
reads those files and derives every one again.

KDA's own terms (kernel, projection GEMMs, elementwise work, exchanges) are the KDA cost
model's (``kda/calibration.py``); this module adds what the step needs around them.
"""

from __future__ import annotations

from ..kda.calibration import GEMM_FLOP_PER_S

__all__ = ["GEMM_FLOP_PER_S"]

# --- DSA attention core ------------------------------------------------------------------------
# bench/results/h200_dsa_kept_selection/dsa_rank_share_sequence.json (``best``): one rank's share
# of the 1M recipe, 65,536 query rows x 64 heads, the last TP slice of zigzag CP rank 0 (query
# positions 1,048,576 - 65,536 ... 1,048,575), over 262,144 pools of 4 keys, 32 indexer heads of
# 128, top-2,048; mean tokens selected per query 2,049.5.
DSA_SHARE_QUERIES = 65536
DSA_SHARE_VISIBLE_POOLS = (1048576 - 65536 / 2) / 4
"""Pools a query of that share sees on average: its position / 4."""

DSA_INDEXER_S_PER_SCORE_DIM = 597.7241270000206e-3 / (DSA_SHARE_QUERIES * DSA_SHARE_VISIBLE_POOLS * 32 * 128)
"""The indexer (pool scores, top-k, token indices) per query x visible pool x indexer head x
head dim: 598 ms there (about 233 TFLOP/s counting the score GEMM's multiply-adds)."""

DSA_SELECTED_PER_TOPK = 2049.5 / 2048
"""Tokens selected per query against min(top-k, the query's prefix): the kernel's pools round
the selection up (2,049.5 of 2,048 there)."""

DSA_ATTN_FWD_S = 84.50683399999548e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5)
"""Sparse MLA forward (megatron's TileLang kernel over the absorbed latent) per query x head x
selected token: 84.5 ms there."""

DSA_ATTN_BWD_S = 857.7401830000042e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5)
"""Its backward per query x head x selected token: 857.7 ms there, 10.2x the forward."""

# --- the head: output layer + loss -----------------------------------------------------------------
# bench/results/h200_fused_loss/fused_loss.txt: forward+backward of the loss over 65,536 to
# 524,288 rows x a 19,360-column vocabulary shard (154,880 / TP8), hidden 4,096. A line through
# the origin fits each kind's four rows within 4% (fused) and 7% (unfused).
HEAD_CALIBRATED_HIDDEN = 4096

FUSED_LOSS_S_PER_CELL = (
    (87.64821000000467 * 65536 + 176.8873740000032 * 131072 + 357.10796899999764 * 262144
     + 728.7358250000011 * 524288) * 1e-3 * 19360
    / ((65536**2 + 131072**2 + 262144**2 + 524288**2) * 19360**2))
"""``train.loss_chunk_tokens``: seconds per row x vocabulary column (at hidden 4,096), 71.4 ps
(the output GEMM forward, its two backward GEMMs and the rebuilt chunk logits: 4 GEMMs, about
450 TFLOP/s)."""

UNFUSED_LOSS_S_PER_CELL = (
    (63.432135999995864 * 65536 + 140.3884099999999 * 131072 + 276.88655400000073 * 262144
     + 537.3732050000015 * 524288) * 1e-3 * 19360
    / ((65536**2 + 131072**2 + 262144**2 + 524288**2) * 19360**2))
"""The whole logits and megatron's loss: 53.3 ps per row x column."""

# --- host-offload copies ------------------------------------------------------------------------
# bench/results/h200_slice_memory_levers_131k/slice.json: the full-width slice at 32,768 tokens,
# full recompute, 2.4902 s per step; with train.offload_activations 2.6496 s. The offloaded
# tensors then: the token ids and four layer inputs of 32,768 x 4 streams x 4,096 (bf16),
# 4.0002 GiB (memory/offload.py), copied out in forward and back in backward.
OFFLOAD_EXPOSED_GIB_S = 2 * 4.000244140625 / (2.6496047874999817 - 2.4901763824999534)
"""Bytes copied (both ways) per second of step time they add: 50.2 GiB/s. The copies are
ordered on the compute stream (model/host_offload.py), so none of it is hidden."""

# --- MoE, dense MLP, mHC: parts of the full-width slice at 131,072 tokens ----------------------
# bench/results/h200_step_time_slices/slice_131072.json (bench/rank_share.py, one H200, every
# memory lever, full recompute): each part of a layer called on its own, forward without grad,
# forward with grad, backward, as the step runs it. Layer 1 (KDA + MoE) and layer 0 (KDA + dense).
SLICE_PART_ROWS = 131072

MOE_LAYER_S = 0.8102356370000052
"""Layer 1's MLP block (norm, router, 16 experts of 2,048 columns with top-8 under
``train.moe_chunk_tokens=8192``, the shared expert): 0.810 s."""

MOE_LAYER_FLOP = 5 * (2 * 8 * SLICE_PART_ROWS * 3 * 4096 * 2048) \
    + 4 * (2 * SLICE_PART_ROWS * 3 * 4096 * 2048 + 2 * SLICE_PART_ROWS * 4096 * 16)
"""Its GEMM work as ``model.moe_part`` counts it, in forward-equivalents (a backward is two): the
routed experts' three GEMMs over 8 x 131,072 (row, expert) pairs five times (two forwards under
full recompute, the chunks' extra forward, the backward), the shared expert's and the router's
four times."""

MOE_FLOP_PER_S = MOE_LAYER_FLOP / MOE_LAYER_S
"""The MoE layer's rate, its GEMM FLOPs per second (about 358 TFLOP/s); the shared expert and the
router get the same rate. megatron's SequentialMLP runs the experts one after another, with the
token permutation and the clamped SwiGLU around them."""

DENSE_LAYER_S = 0.3144743689999814
"""Layer 0's MLP block (norm and the dense FFN, 12,288 columns): 0.314 s."""

DENSE_FLOP_PER_S = 4 * 2 * SLICE_PART_ROWS * 3 * 4096 * 12288 / DENSE_LAYER_S
"""The dense FFN's rate over its three GEMMs in four forward-equivalents (about 503 TFLOP/s)."""

MHC_CALIBRATED_STREAMS = 4
MHC_CALIBRATED_HIDDEN = 4096

MHC_S_PER_ROW = 0.6870871080000143 / (2 * SLICE_PART_ROWS)
"""One hyper-connection module (maps, a 20-step Sinkhorn on 4 x 4 matrices, the chunked
projection, the expand over 4 streams of 4,096) per residual row under full recompute: layer 1's
two modules took 0.687 s, 2.62 us per row each."""

# --- the optimizer, KDA's rebuilt forward ----------------------------------------------------------

OPTIMIZER_S_PER_ELEMENT = (0.07007398899986583 + 0.06406928000001244) / 2 / 3_237_247_768
"""The distributed Adam step (with the gradient finalisation and clipping) per parameter element
of the rank's shard: 20.7 ps. bench/results/h200_rl_worker/rl_worker.txt: SkyRL's optim_step on
the 4-layer slice (3,237,247,768 trainable parameters on its one rank), 0.067 s (the median of
the calls after the first, bench/results/h200_rl_worker/rl_worker.json)."""

KDA_FORWARD_SHARE = 13.912382 / 65.6661
"""The forward's share of the KDA layer's non-GEMM work (fla's kernels, conv, gated norm): what
full recompute adds once more, beside a third of the projection GEMMs. 0.21, from the CP1
layer's per-kernel profile (bench/results/h200_kda_own_gemms/profile_cp1_T131072.txt, 8 heads,
131,072 tokens, 3 steps): 13.9 of 65.7 ms of named kernels are forward kernels (fla's backward
runs the state pass and the w/u recompute again: a third and half of those kernels' calls)."""

DSA_OTHER_S_PER_ROW = 0.0
"""Assumed: a DSA layer is its core plus its MLA projections at the GEMM rate (norms, casts and
the KV latent's copies not priced)."""

EMBEDDING_S_PER_ROW = 0.0
"""Not priced: a table lookup and its scatter-add, well under a millisecond per 32,768 rows."""
