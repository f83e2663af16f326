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
# bench/results/h200_dsa_balanced_rows/layer_rows.json (the first run's ``best``, ``tp_rows``
# balanced): one rank's share of the 1M recipe, 65,536 query rows x 64 heads, the last TP rank's
# balanced share of zigzag CP rank 0's rows (as the layer takes them: mean position 524,288),
# over 262,144 pools of 4 keys, 32 indexer heads of 128, top-2,048; mean tokens selected per
# query 2,049.5; the queries see 8,589,918,208 (query, pool) pairs.
DSA_SHARE_QUERIES = 65536

DSA_INDEXER_S_PER_SCORE_DIM = 196.34421800000013e-3 / (8589918208 * 32 * 128)
"""The indexer (pool scores, the floor's exact top-k, token indices) per query x visible pool x
indexer head x head dim: 196 ms at that share in the same run (about 358 TFLOP/s counting the
score GEMM's multiply-adds); the same for ``latent`` and ``fused``, which share it."""

DSA_SELECTED_PER_TOPK = 2049.5 / 2048
"""Tokens selected per query against min(top-k, the query's prefix): the kernel's pools round
the selection up (2,049.5 of 2,048 there)."""

DSA_ATTENTION_S = {
    # bench/results/h200_dsa_latent/dsa_rank_share_latent.json (``best``), the same share: our
    # TileLang kernels, forward 77.7 ms, backward 462.3 ms (5.9x the forward).
    "latent": (77.71837600000708e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5),
               462.2557320000169e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5)),
    # bench/results/h200_dsa_kept_selection/dsa_rank_share_sequence.json (``best``):
    # megatron-core's TileLang kernels, forward 84.5 ms, backward 857.7 ms (10.2x).
    "fused": (84.50683399999548e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5),
              857.7401830000042e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5)),
}
"""The sparse MLA's forward and backward per query x head x selected token, by
``model.dsa.kernel`` (the GPU kernels that have a stored run at the share); the backward runs
the kernel forward again."""

DSA_KEPT_OUTPUT_S = {
    # bench/results/h200_dsa_balanced_rows/layer_rows.json (the first run's ``best``, the rows
    # above): ``latent`` forward 64.3 ms, backward 279.6 ms.
    # bench/results/h200_index_scores/dsa_layer_latent_fused.json (the ``fused`` run's
    # ``best``): 84.9 and 724.3 ms.
    "latent": (64.27011400000282e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5),
               279.56312700000296e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5)),
    "fused": (84.92471200000296e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5),
              724.3288930000062e-3 / (DSA_SHARE_QUERIES * 64 * 2049.5)),
}
"""``DSA_ATTENTION_S`` under the kernel's ``keep_attention_output`` (``model.dsa.latent`` or
``fused``): the forward keeps its output and log-sum-exp, and the backward reads them instead of
running the kernel forward again."""

# bench/results/h200_indexer_syncs/indexer_profile_fp8_keys.txt (one call, the same share): the
# indexer pass's wall time, best of three, FP8 scores (the keys quantised once per pass) and
# bf16 scores.
DSA_FP8_INDEXER_SHARE = 254.9 / 344.5
"""The indexer's time under ``model.dsa.latent.indexer_scores=fp8`` (or ``fused``) against bf16
(0.74)."""
# bench/results/h200_dsa_ordered_fp8/ (``best`` of each, one device call, the same share, output
# kept, our kernels): dsa_latent.json (the latent gradient added with atomics) and
# dsa_latent_fp8_det.json (the ordered latent gradient; FP8 scores, which move only the indexer).
DSA_ORDERED_BACKWARD_SHARE = 787.5820029999971 / 301.2266100000005
"""The sparse-MLA backward's time under ``model.dsa.latent.deterministic_backward`` against the
atomic one (2.61)."""
# bench/results/h200_dsa_wrapper/layer.json (each run's ``best``, one process, the same share,
# output kept): ``latent`` with our forward and with FlashMLA's.
DSA_FLASHMLA_FORWARD_SHARE = 42.58402899998259 / 65.10329600001796
"""The sparse-MLA forward's time under ``model.dsa.latent.attention_forward=flashmla`` against
ours (0.65; the layer's forward: the kernel and the absorption around it)."""

# --- the head: output layer + loss -----------------------------------------------------------------
# bench/results/h200_fused_loss/fused_loss.txt: forward+backward of the loss over 65,536 to
# 524,288 rows x a 19,360-column vocabulary shard (154,880 / TP8), hidden 4,096. A line through
# the origin fits each kind's four rows within 4% (fused) and 7% (unfused).
HEAD_CALIBRATED_HIDDEN = 4096

FUSED_LOSS_S_PER_CELL = (
    (87.64821000000467 * 65536 + 176.8873740000032 * 131072 + 357.10796899999764 * 262144
     + 728.7358250000011 * 524288) * 1e-3 * 19360
    / ((65536**2 + 131072**2 + 262144**2 + 524288**2) * 19360**2))
"""The loss alone (``train.loss_chunk_tokens``): 71.4 ps per row x vocabulary column (the output
GEMM forward, its two backward GEMMs and the rebuilt chunk logits)."""

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

# --- KDA block, MoE, dense MLP, head: two widths ------------------------------------------------
# Each block is timed at two widths on one H200 (bench/rank_share.py: the part called on its own,
# forward without grad, forward with grad, backward, as a full-recompute step runs it): the
# full-width slice at 131,072 tokens (bench/results/h200_step_time_latent/slice_131072.json,
# layers 0 and 1) and one rank's widths of the 1M recipe fed that rank's rows
# (bench/results/h200_step_time_share/share_1m.json: 8 KDA heads, 9 experts of 1,024 columns,
# a 1,536-column dense FFN, a 19,360-row vocabulary shard). At one width the GEMM work and the
# rows grow together; the two widths separate a GEMM rate from a cost per row and hidden
# element (norms, casts, the copies around the GEMMs), which the narrow rank pays relatively
# more of. The slice at 32,768 and 65,536 tokens (same run) checks each fit
# (tests/test_step_time.py; docs/step_time.md).
SLICE_PART_ROWS = 131072
SHARE_ROWS = 524288
"""Rows of the share's KDA, dense and head parts (the CP rank's rows, gathered over TP)."""
SHARE_MOE_ROWS = 131072
"""Rows fed to the share's MoE block: top-8 of its 9 experts, 1,048,576 routed pairs, the
rank's pairs in the 1M recipe."""
HIDDEN = 4096

MOE_SLICE_S, MOE_SHARE_S = 0.835285209999995, 0.5107687660000124
MOE_SLICE_FLOP = 5 * (2 * 8 * SLICE_PART_ROWS * 3 * HIDDEN * 2048) \
    + 4 * (2 * SLICE_PART_ROWS * 3 * HIDDEN * 2048 + 2 * SLICE_PART_ROWS * HIDDEN * 16)
MOE_SHARE_FLOP = 5 * (2 * 8 * SHARE_MOE_ROWS * 3 * HIDDEN * 1024) \
    + 4 * (2 * SHARE_MOE_ROWS * 3 * HIDDEN * 1024 + 2 * SHARE_MOE_ROWS * HIDDEN * 9)
"""The MoE blocks' GEMM work as ``model.moe_part`` counts it, in forward-equivalents (a backward
is two): the routed experts' three GEMMs over the 1,048,576 (row, expert) pairs five times (two
forwards under full recompute, the chunks' extra forward, the backward), the shared expert's
and the router's four times. Both blocks route the same number of pairs."""

MOE_FLOP_PER_S = (MOE_SLICE_FLOP - MOE_SHARE_FLOP) / (MOE_SLICE_S - MOE_SHARE_S)
"""The MoE GEMM rate (about 447 TFLOP/s): the two blocks differ in GEMM work only."""

MOE_S_PER_PAIR_ELEMENT = (MOE_SLICE_S - MOE_SLICE_FLOP / MOE_FLOP_PER_S) / (8 * SLICE_PART_ROWS * HIDDEN)
"""The rest per routed pair and hidden element under full recompute (permutation, SwiGLU and
its clamp, probabilities, the experts run one after another): 43.4 ps, 0.19 s of each block."""

# bench/results/h100_moe_dispatch/moe_dispatch.json (``bash bench/step_time_runs.sh moe``): the
# share's MoE block (131,072 rows, 9 experts of 1,024 columns, chunks of 8,192, EP1) under each
# dispatcher in one device call on one H100, median of five: forward without grad, forward and
# backward, as a full-recompute step runs them.
MOE_ALLTOALL_SHARE = 0.5673527870000044 / 0.5445683559999992
"""The MoE block's compute under ``model.moe.dispatcher=alltoall`` against ``allgather``, the
dispatcher every MoE rate above was measured under (1.042): its local permutation carries the
fp32 routing weights with the rows and sorts each chunk's rows by local expert."""

DENSE_SLICE_S, DENSE_SHARE_S = 0.323069084999986, 0.25058116299999256
DENSE_SLICE_FLOP = 4 * 2 * SLICE_PART_ROWS * 3 * HIDDEN * 12288
DENSE_SHARE_FLOP = 4 * 2 * SHARE_ROWS * 3 * HIDDEN * 1536
DENSE_S_PER_ROW_ELEMENT = ((DENSE_SHARE_S - DENSE_SLICE_S * DENSE_SHARE_FLOP / DENSE_SLICE_FLOP)
                           / (SHARE_ROWS * HIDDEN
                              - SLICE_PART_ROWS * HIDDEN * DENSE_SHARE_FLOP / DENSE_SLICE_FLOP))
"""The dense block (norm and FFN) per row and hidden element under full recompute: 47.4 ps."""
DENSE_FLOP_PER_S = DENSE_SLICE_FLOP / (DENSE_SLICE_S - DENSE_S_PER_ROW_ELEMENT * SLICE_PART_ROWS * HIDDEN)
"""The dense FFN's three GEMMs in four forward-equivalents: about 532 TFLOP/s."""

KDA_SLICE_S, KDA_SHARE_S = 0.5271065869999916, 0.3914068489999636
KDA_SLICE_LAYER_S, KDA_SHARE_LAYER_S = 0.41947216393694364, 0.2182303089571619
"""The KDA attention blocks measured, and ``model.kda_layer_s`` of the same recipes (the KDA
cost model's layer, under full recompute; the runs printed it as ``model_s``, their model
having no block term yet)."""
KDA_SLICE_HEAD_WIDTH, KDA_SHARE_HEAD_WIDTH = 64 * 128, 8 * 128
"""The blocks' head width per row (heads on the rank x head dim)."""
_KDA_A = ((KDA_SLICE_S - KDA_SLICE_LAYER_S, SLICE_PART_ROWS * HIDDEN, SLICE_PART_ROWS * KDA_SLICE_HEAD_WIDTH),
          (KDA_SHARE_S - KDA_SHARE_LAYER_S, SHARE_ROWS * HIDDEN, SHARE_ROWS * KDA_SHARE_HEAD_WIDTH))
_KDA_DET = _KDA_A[0][1] * _KDA_A[1][2] - _KDA_A[0][2] * _KDA_A[1][1]
KDA_S_PER_ROW_ELEMENT = (_KDA_A[0][0] * _KDA_A[1][2] - _KDA_A[0][2] * _KDA_A[1][0]) / _KDA_DET
"""What the KDA block costs beyond the cost model's layer (its norm, the residual streams'
reads, casts and copies around the projections), per row and hidden element under full
recompute: 63.5 ps ..."""
KDA_S_PER_ROW_HEAD_ELEMENT = (_KDA_A[0][1] * _KDA_A[1][0] - _KDA_A[0][0] * _KDA_A[1][1]) / _KDA_DET
"""... and per row and head channel (the rank's heads x head dim): 68.5 ps."""

HEAD_SHARE_S = 0.8209464729999922
HEAD_SHARE_VOCAB = 19360
HEAD_S_PER_ROW_ELEMENT = ((HEAD_SHARE_S - FUSED_LOSS_S_PER_CELL * SHARE_ROWS * HEAD_SHARE_VOCAB)
                          / (SHARE_ROWS * HIDDEN))
"""The head block beyond the loss (the final norm, the hidden rows' copies and casts) per row
and hidden element: 44.8 ps; the share's head took 0.821 s where the loss alone at its shape
takes 0.725 s."""

# bench/results/h200_step_time_slices/slice_131072.json: layer 1's two hyper-connection modules
# at 131,072 rows.
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

# --- the optimizer on the host (train.optimizer_offload_fraction) ------------------------------
# bench/results/h100_host_optimizer/cpu_optimizer_t12.json (bench/cpu_optimizer.py, one H100
# machine of 16 cores, 12 torch threads: a host of eight GPUs and about a hundred cores gives
# each GPU's rank about that many): megatron's hybrid optimizer's phases over 268,435,456 fp32
# elements, one after another.
HOST_ADAM_S_PER_ELEMENT = 0.36615772800000457 / 268435456
"""``torch.optim.AdamW`` on the CPU per parameter element: 1.36 ns."""
HOST_COPY_S_PER_BYTE = (0.019535194000006584 + 0.01935860999999761) / (8 * 268435456)
"""The fp32 gradient to pinned host memory and the fp32 parameter back, per byte: 18.1 ps
(55 GB/s over PCIe)."""
