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

# --- the rest of the layer types, measured part by part --------------------------------------------
# bench/results/h200_step_time/slice_{32768,65536,131072}.json (``bench/rank_share.py`` on the
# full-width slice with every memory lever: each layer's pieces under full recompute (two
# forwards and one backward) on the recipe's rows; the optimizer timed inside the steps).
# Rates are summed over the three lengths (total work / total time).

KDA_FORWARD_SHARE = 0.35
"""Placeholder until the slice parts are in."""

DSA_OTHER_S_PER_ROW = 0.0
MOE_FLOP_PER_S = 500e12
DENSE_FLOP_PER_S = 600e12
MHC_CALIBRATED_STREAMS = 4
MHC_CALIBRATED_HIDDEN = 4096
MHC_S_PER_ROW = 1e-7
EMBEDDING_S_PER_ROW = 1e-9
OPTIMIZER_S_PER_ELEMENT = 1e-10
