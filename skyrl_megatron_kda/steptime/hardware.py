"""The GPU kinds the step-time model prices compute on (``cluster.gpu``).

Every compute rate in ``calibration.py`` was measured on one H200. Another kind's seconds are
the H200's scaled by published spec ratios: GEMM-bound work (the projection, expert, FFN and
output GEMMs and the attention kernels, whose time is their multiply-adds) by the dense bf16
rate, the rest (recurrences, norms, casts, copies, routing, the optimizer on the GPU) by the
HBM bandwidth. Host work and PCIe copies do not change with the GPU.

What a ratio cannot know: a kernel tuned for one architecture may not reach the other's spec
(the TileLang and Triton kernels here are tuned on Hopper), so a derived kind's compute is an
estimate that assumes each kernel reaches the same fraction of its card's peak.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUKind:
    """A GPU's published dense bf16 tensor rate and HBM bandwidth (per GPU, SXM parts)."""

    name: str
    bf16_tflops: float
    hbm_tb_s: float


GPU_KINDS: dict[str, GPUKind] = {
    kind.name: kind for kind in (
        GPUKind("h200", bf16_tflops=989.0, hbm_tb_s=4.8),
        GPUKind("h100", bf16_tflops=989.0, hbm_tb_s=3.35),
        GPUKind("b200", bf16_tflops=2250.0, hbm_tb_s=8.0),
    )
}
"""NVIDIA's data sheets (dense, without sparsity): H100 SXM, H200 SXM, HGX B200."""

MEASURED_ON = GPU_KINDS["h200"]
"""The card every rate in ``calibration.py`` was measured on."""


@dataclass(frozen=True)
class ComputeScale:
    """Multipliers on H200 seconds: ``gemm`` for multiply-add-bound work, ``memory`` for the
    rest."""

    gemm: float
    memory: float


def compute_scale(gpu: str) -> ComputeScale:
    """How a ``gpu`` kind's compute seconds relate to the measured H200's (1.0 on an H200)."""
    kind = GPU_KINDS[gpu]
    return ComputeScale(gemm=MEASURED_ON.bf16_tflops / kind.bf16_tflops,
                        memory=MEASURED_ON.hbm_tb_s / kind.hbm_tb_s)
