"""The measured numbers behind the cost model of ``kda.cp_exchange=auto`` (``kda/cost.py``): the
kernel / GEMM / state-exchange constants, measured on H200 (docs/benchmarks.md). The link presets
are the ``cluster`` section's defaults (``config.cluster.LINK_PRESETS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The kernel terms describe the kernel every fla path runs: chunk_kda on segments of the sequence
# chained by our state-passing kernel (``kda.kernel_segments=16``, state_kernel.py). Measured on
# one H200, GLM dims, bf16, forward+backward (bench/results/h200_per_rank/kernels_T*.json):
#   T         128K   256K   512K    1M
#   8 heads   24.2   38.0   72.9  145.6 ms
#   4 heads   14.2   20.9   39.5   75.6 ms

KDA_CALL_OVERHEAD_S = 2.1e-3
"""Fixed cost of one kernel forward+backward (launches, per-segment passes): the intercept of the
8-head line through T = 256K and 1M (38.0 and 145.6 ms)."""

KDA_HEAD_TOKENS_PER_S = 8 * 2**20 / (145.6e-3 - KDA_CALL_OVERHEAD_S)
"""The segmented kernel at 8 heads: T = 1M in 145.6 ms, 58.5 M head-tokens/s. T = 512K ran 72.9
ms (the model: 73.8). Below 256K each of the 16 segments is short and the model is optimistic:
T = 128K ran 24.2 ms against 20.1."""

KDA_SATURATED_HEADS = 8
"""Heads per GPU at and above which the kernel runs at ``KDA_HEAD_TOKENS_PER_S``."""

KDA_EFFICIENCY_AT_4_HEADS = 0.96
"""Per-head-token throughput at 4 heads (the head-parallel CP2 share of TP8) relative to 8: 0.95,
0.96 and 0.98 at T = 256K, 512K and 1M (20.9, 39.5, 75.6 ms against the 8-head line). The
segments give the kernel parallelism along the sequence, which fla's single pass over the
sequence lacks with few heads (its chunk_kda at 4 heads ran at 0.74 of its 8-head rate)."""

GEMM_FLOP_PER_S = 790e12
"""Dense bf16 GEMM on one H200 with random data; the profiled CP1
layer's projections ran at this floor (8.8 ms measured vs 9.0 ms predicted at T = 64K)."""

# The state exchange's recurrence per rank (``bench/kda_layer.py --emulate-cp2``, the recurrence
# alone: its pieces, summaries, chain and correction; the few-MiB all-gathers not run), against
# the segmented kernel on the same T/2 shard in the same run (bench/results/h200_kda_own_gemms/
# emulated_T*.json, ``state_recurrence_cp2`` and ``segmented_kernel_8h_T*``; the slower rank):
#   T         256K    1M
#   state     19.0   71.8 ms
#   shard     19.6   72.3 ms
# Through them a line from the origin gives the first term below, and the second is zero: the
# free line meets T = 0 at -0.7 ms (at 256K the recurrence ran 0.6 ms faster than its shard's
# kernel alone, its segments cut from two pieces instead of one sequence), and a fixed cost is
# not negative. (An earlier run, before each chain step became one in-place GEMM, measured 20.5
# and 72.2 against 20.3 and 72.7, and 0.5 ms per call; one before the chain selected its pieces
# by index instead of by a mask, four device syncs per call, 24.2 and 76.2 ms.)

STATE_PREPASS = (18.982 + 71.814) / (19.593 + 72.259) - 1.0
"""Extra kernel time of ``state`` per unit of its shard's kernel time: -0.011, i.e. the summaries
and the correction for the incoming state cost nothing that grows with T beyond the shard's own
kernel (the table above). On two H200s with NCCL at 1M the recurrence took 82.7 ms against 73.5
in a run whose chain still synchronised with the host four times per call: this model gives 73.0
there. fla 0.6.0's own state passing
(``cp_context``) took 246.3 ms, +2.35x over the shard's kernel; ``skyrl-kda plan
--state-prepass 2.35`` prices it."""

STATE_CALL_OVERHEAD_S = 0.0
"""Fixed cost of one ``state`` recurrence beyond its kernel (the summary and chain launches): none
measurable (the table above)."""

# The layer's work that is neither the KDA kernel nor a projection GEMM (the causal conv forward
# and backward, the gated norm, casts, concatenations, reorders, the exchanges' own copies), per
# head-token on the rank, from per-kernel profiles on one H200 (8 heads, T = 131,072, 3 steps
# after the warm-up; bench/results/h200_kda_own_gemms/profile_*.txt, ``bench/kda_layer.py
# --profile`` and ``--emulate-cp2 --profile-cp2``): every CUDA kernel that is not fla's KDA
# kernels (chunk_*, recompute_w_u, kda_*, l2norm) nor a cuBLAS GEMM (nvjet*), summed.
# ``tests/test_cost.py`` derives each term from the stored tables again.

ELEMENTWISE_S_PER_HEAD_TOKEN = 16.313e-3 / 3 / (8 * 131072)
"""The CP1 layer: 5.2 ns per head-token (16.3 ms over 3 steps of 8 x 131,072 head-tokens)."""

CP_ELEMENTWISE_S_PER_HEAD_TOKEN = {
    "a2a": 21.963e-3 / 3 / (8 * 65536),
    "allgather": 15.934e-3 / 3 / (8 * 65536),
    "state": 9.960e-3 / 3 / (8 * 65536),
}
"""Each CP2 exchange's rank (the slower of its two ranks), per head-token it computes: ``a2a``
14.0 ns, ``allgather`` 10.1, ``state`` 6.3, all above CP1's 5.2. ``a2a`` pays the most: its
input and output all-to-alls need the rows reordered and the head slices of every projection
(q, k, v, the gates, beta) made contiguous on both sides, forward and backward; ``allgather``
reorders the gathered rows of each projection (and its emulation copies the shard into every
slot of its all-gather, about 2 ns of its term). ``state`` moves no rows: its term is CP1's
plus the halo rows' recomputation and its summaries' small GEMMs."""

REGATHER_OVERLAP = 1.0
"""Fraction of the backward row re-gather's last collective that hides behind the input-gradient
GEMMs issued after it (``rows.py``): up to the GEMMs' own time. 1.0 takes the overlap as
megatron's SP linears intend it; it has not been measured on its own."""


@dataclass(frozen=True)
class Calibration:
    """The measured constants above, bundled so a caller (``plan``, a benchmark) can swap one."""

    kda_head_tokens_per_s: float = KDA_HEAD_TOKENS_PER_S
    kda_efficiency_at_4_heads: float = KDA_EFFICIENCY_AT_4_HEADS
    kda_call_overhead_s: float = KDA_CALL_OVERHEAD_S
    gemm_flop_per_s: float = GEMM_FLOP_PER_S
    state_prepass: float = STATE_PREPASS
    state_call_overhead_s: float = STATE_CALL_OVERHEAD_S
    elementwise_s_per_head_token: float = ELEMENTWISE_S_PER_HEAD_TOKEN
    cp_elementwise_s_per_head_token: Mapping[str, float] = field(
        default_factory=lambda: dict(CP_ELEMENTWISE_S_PER_HEAD_TOKEN))
    regather_overlap: float = REGATHER_OVERLAP

    def __post_init__(self) -> None:
        if not 0.5 < self.kda_efficiency_at_4_heads <= 1.0:
            raise ValueError(
                f"kda_efficiency_at_4_heads={self.kda_efficiency_at_4_heads} must be in (0.5, 1]: "
                "4 heads cannot take longer than 8 heads")
        for name in ("kda_head_tokens_per_s", "gemm_flop_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0.0 <= self.regather_overlap <= 1.0:
            raise ValueError(f"regather_overlap={self.regather_overlap} must be in [0, 1]")
        for name in ("kda_call_overhead_s", "state_call_overhead_s", "elementwise_s_per_head_token"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name, value in self.cp_elementwise_s_per_head_token.items():
            if not value >= 0:
                raise ValueError(f"cp_elementwise_s_per_head_token[{name!r}]={value} must be >= 0")
        if not self.state_prepass > -1:
            raise ValueError(f"state_prepass={self.state_prepass} must be > -1 (a positive kernel time)")


DEFAULT_CALIBRATION = Calibration()
