"""The KDA linear-attention layer's section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import ConfigSection, PositiveInt, refuse_former_keys


_FORMER_KEYS = {
    "cp_layout": ("is now parallel.cp_layout: the CP token layout is the whole model's (KDA, DSA, "
                  "the data's rows)"),
    "exchange_reason": ("is not a setting: the reason auto gave is recorded beside recipe.yaml in "
                        "the run folder's auto_choices.yaml; delete the key"),
}


class KDAConfig(ConfigSection):
    """The KDA linear-attention layer; defaults are GLM-5.3-Flash's."""

    cp_exchange: str = Field(default="a2a", strict=True)
    """How the layer exchanges data across the CP group: a registered exchange (``kda.exchanges``)
    or ``auto``, which the cost model resolves once when the recipe is loaded to run
    (``recipes.load_recipe``); SKYRL_KDA_CP_EXCHANGE overrides it. The name and whether it can
    run on the mesh are checked against the live registry (``recipe_rules``)."""
    kernel: Literal["auto", "fla", "torch"] = "auto"
    """Chunked-KDA implementation: auto = fla on CUDA, our pure-torch KDA on CPU."""
    fla_backward: Literal["triton", "tilelang"] = "triton"
    """Which implementation fla runs for the fused piece of KDA's backward
    (``chunk_kda_bwd_wy_dqkg_fused``): its Triton kernel, or its TileLang one (needs tilelang and
    nvcc). fla would otherwise take TileLang whenever it imports, so a run with DSA's fused kernel
    (which installs TileLang) would run another KDA backward; the run sets fla's switch from this
    (``kda.kernel.use_fla_backward``). Triton by default: the two run about as fast, and TileLang
    compiles for minutes on a fresh machine (docs/benchmarks.md)."""
    num_heads: PositiveInt = 64
    """Number of KDA heads (q, k and v alike; no grouped values)."""
    head_dim: PositiveInt = 128
    """Per-head key and value width (K = V)."""
    conv_size: PositiveInt = 4
    """Kernel width of the depthwise causal short convolution on q, k, v (tokens)."""
    gate_lower_bound: float = -5.0
    """Safe forget-gate multiplier lb: g = lb * sigmoid(...), so each log-decay is in (lb, 0)."""
    gate_low_rank: PositiveInt = 128
    """Rank of the forget-gate projection f_b(f_a(x))."""
    output_gate_low_rank: PositiveInt = 128
    """Rank of the output-gate projection g_b(g_a(x))."""
    l2norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of the q/k L2 normalisation, x / sqrt(sum x^2 + eps)."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """Epsilon of the per-head gated RMSNorm on the output."""
    chunk_size: Literal[32, 64] = 64
    """Tokens per chunk of the chunked KDA (the sizes fla's kernels allow)."""
    kernel_segments: PositiveInt = 16
    """On the fla backend, each sequence (or CP piece) is cut into about this many segments of
    whole chunks whose sequential state passes run side by side, chained exactly through fp32
    state summaries (``kda/state_kernel.py``); 1 runs fla's ``chunk_kda`` on whole sequences.
    fla's state pass gives one thread block per head and value block, so a long sequence with a
    rank's few heads leaves most SMs idle. The torch backend (the CPU reference) runs a2a,
    allgather and CP=1 on whole sequences; the state exchange always chains its pieces."""
    kernel_head_group: PositiveInt | None = None
    """Run the recurrence over groups of at most this many of the heads a rank computes, one
    group after another (the last may be smaller): heads are independent, so the result is the
    same, and the kernel's backward working set is one group's (fla's ``chunk_kda_bwd`` holds
    every allocation until it returns: about 6.5 KiB per head-token at K = 128). None: all the
    rank's heads in one call."""
    allow_inexact: bool = Field(default=True, strict=True)
    """Let auto pick an exchange not bitwise equal to CP=1 (state); false also refuses state."""

    @model_validator(mode="before")
    @classmethod
    def _former_keys(cls, data):
        return refuse_former_keys(data, "kda", _FORMER_KEYS)

    @field_validator("gate_lower_bound")
    @classmethod
    def _gate_lower_bound_in_range(cls, value: float) -> float:
        if not -5.0 <= value < 0.0:
            raise ValueError(
                f"gate_lower_bound={value} must be in [-5, 0): fla's safe gate requires it"
            )
        return value
