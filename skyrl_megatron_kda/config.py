"""Pydantic configuration for the KDA layer and its parallel layout.

Every invalid combination is refused here, at config time, with a message that names the values
and the fix; nothing downstream falls back. This is the only module of the package that reads
environment variables (``SKYRL_KDA_CP_EXCHANGE``), and it does so only inside
``apply_env_overrides``, never at import. It imports no torch so that configs load anywhere.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

# Strict so that YAML `true` or "2" is not silently read as an int.
PositiveInt = Annotated[int, Field(strict=True, gt=0)]

CPExchange = Literal["a2a", "allgather", "state"]
"""How KDA layers exchange data across the CP group (DESIGN.md section 2); add new ones here."""

CP_EXCHANGE_ENV = "SKYRL_KDA_CP_EXCHANGE"
"""Environment variable (the seed pull request's) that overrides ``kda.cp_exchange``."""


class _Config(BaseModel):
    """Base for every config: unknown keys are errors, values never change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ParallelConfig(_Config):
    """Megatron parallel sizes for one model replica (data parallelism is what is left over)."""

    tp: PositiveInt = 1
    """Tensor-parallel size (ranks splitting heads and hidden columns)."""
    cp: PositiveInt = 1
    """Context-parallel size (ranks splitting each sequence, zigzag layout)."""
    ep: PositiveInt = 1
    """Expert-parallel size for the MoE layers."""
    etp: PositiveInt = 1
    """Expert tensor-parallel size (TP inside each expert)."""
    pp: PositiveInt = 1
    """Pipeline-parallel size; only 1 is supported."""
    sequence_parallel: bool = Field(default=False, strict=True)
    """Shard activations outside TP regions along the sequence over the TP group; needs tp > 1."""

    @model_validator(mode="after")
    def _sequence_parallel_needs_tp(self) -> ParallelConfig:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel needs tp > 1 (got tp=1): it shards over the TP group; "
                "set parallel.sequence_parallel=false or raise parallel.tp"
            )
        return self

    @model_validator(mode="after")
    def _no_pipeline_parallel(self) -> ParallelConfig:
        if self.pp != 1:
            raise ValueError(
                f"pp={self.pp}: pipeline parallelism is not supported yet; set parallel.pp=1"
            )
        return self


class KDAConfig(_Config):
    """The KDA linear-attention layer; defaults are GLM-5.3-Flash's."""

    cp_exchange: CPExchange = "a2a"
    """How the layer exchanges data across the CP group; SKYRL_KDA_CP_EXCHANGE overrides it."""
    kernel: Literal["auto", "fla", "torch"] = "auto"
    """Chunked-KDA implementation: auto = fla on CUDA, our pure-torch KDA on CPU."""
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

    @field_validator("gate_lower_bound")
    @classmethod
    def _gate_lower_bound_in_range(cls, value: float) -> float:
        if not -5.0 <= value < 0.0:
            raise ValueError(
                f"gate_lower_bound={value} must be in [-5, 0): fla's safe gate requires it"
            )
        return value


class ModelConfig(_Config):
    """Model-wide sizes the KDA layer depends on."""

    hidden_size: PositiveInt = 4096
    """Width of the residual stream (the layer's input and output)."""
    params_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter dtype as a torch dtype name; the model builder resolves it (no torch here)."""


class DataConfig(_Config):
    """Shape of the training batches."""

    seq_len: PositiveInt = 8192
    """Tokens per sequence (for packed batches, per packed row)."""
    micro_batch_size: PositiveInt = 1
    """Sequences per micro-batch on each data-parallel rank."""


class LayerRecipe(_Config):
    """Everything needed to build and run one KDA layer on a mesh, with the cross-section checks."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model sizes."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel layout."""
    kda: KDAConfig = Field(default_factory=KDAConfig)
    """The KDA layer and its CP exchange."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Batch shape."""

    @model_validator(mode="after")
    def _heads_divisible_by_tp(self) -> LayerRecipe:
        heads, tp = self.kda.num_heads, self.parallel.tp
        if heads % tp:
            raise ValueError(
                f"kda.num_heads={heads} must be divisible by tp={tp}: each TP rank owns whole heads"
            )
        return self

    @model_validator(mode="after")
    def _local_heads_divisible_by_cp(self) -> LayerRecipe:
        heads, tp, cp = self.kda.num_heads, self.parallel.tp, self.parallel.cp
        local_heads = heads // tp
        if self.kda.cp_exchange != "state" and local_heads % cp:
            raise ValueError(
                f"local heads kda.num_heads/tp = {heads}/{tp} = {local_heads} must be divisible "
                f"by cp={cp}: kda.cp_exchange={self.kda.cp_exchange} splits each TP rank's heads "
                "over the CP group (kda.cp_exchange=state keeps all heads on every rank)"
            )
        return self

    @model_validator(mode="after")
    def _allgather_needs_sequence_parallel(self) -> LayerRecipe:
        p = self.parallel
        if self.kda.cp_exchange == "allgather" and p.tp > 1 and not p.sequence_parallel:
            raise ValueError(
                f"kda.cp_exchange=allgather with tp={p.tp} needs sequence parallelism: it gathers "
                "the sequence-parallel shards of the hidden state over CP then TP, and without "
                "sequence parallelism there are none; set parallel.sequence_parallel=true, "
                "or use kda.cp_exchange=a2a"
            )
        return self

    @model_validator(mode="after")
    def _seq_len_fits_cp_layout(self) -> LayerRecipe:
        seq_len, cp = self.data.seq_len, self.parallel.cp
        # At cp=1 nothing is split, so any length works (tiny CPU tests use odd ones).
        if cp > 1 and seq_len % (2 * cp):
            raise ValueError(
                f"data.seq_len={seq_len} must be divisible by 2*cp={2 * cp}: Megatron's "
                "load-balanced (zigzag) CP layout cuts each sequence into 2*cp chunks"
            )
        return self

    @model_validator(mode="after")
    def _cp_shard_fits_sequence_parallel(self) -> LayerRecipe:
        seq_len, p = self.data.seq_len, self.parallel
        if p.sequence_parallel and (seq_len // p.cp) % p.tp:
            raise ValueError(
                f"data.seq_len/cp = {seq_len}/{p.cp} = {seq_len // p.cp} tokens per CP rank must "
                f"be divisible by tp={p.tp} under sequence parallelism: each TP rank holds 1/tp "
                "of its CP rank's tokens"
            )
        return self


def apply_env_overrides(raw: dict, environ: Mapping[str, str] | None = None) -> dict:
    """Return a copy of ``raw`` with ``SKYRL_KDA_CP_EXCHANGE`` applied to ``kda.cp_exchange``.

    The seed pull request selected the exchange with this variable; it keeps working, but it is
    read here only, explicitly, and logged, so the config stays the single source of truth.
    An empty value counts as unset. ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    out = copy.deepcopy(raw)
    value = env.get(CP_EXCHANGE_ENV)
    if not value:
        return out
    allowed = get_args(CPExchange)
    if value not in allowed:
        raise ValueError(
            f"{CP_EXCHANGE_ENV}={value!r} is not a KDA CP exchange; "
            f"allowed values: {', '.join(allowed)}"
        )
    kda = out.get("kda")
    if kda is None:
        kda = out["kda"] = {}
    if not isinstance(kda, dict):
        raise ValueError(f"kda must be a mapping to apply {CP_EXCHANGE_ENV}, got {kda!r}")
    default = KDAConfig.model_fields["cp_exchange"].default
    configured = kda.get("cp_exchange", f"{default} (default)")
    logger.warning(
        "%s=%s overrides kda.cp_exchange (config value: %s)", CP_EXCHANGE_ENV, value, configured
    )
    kda["cp_exchange"] = value
    return out


def load_layer_recipe(raw: dict, environ: Mapping[str, str] | None = None) -> LayerRecipe:
    """Validate ``raw`` after environment overrides, so an override is checked like any value."""
    return LayerRecipe.model_validate(apply_env_overrides(raw, environ))


def parse_overrides(pairs: list[str]) -> dict:
    """Turn ``["kda.cp_exchange=allgather", "parallel.tp=2"]`` into a nested dict.

    Values go through ``yaml.safe_load`` so ints, bools and lists keep their types; later pairs
    win over earlier ones for the same key. Unknown keys are left for the models to refuse.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"override {pair!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"override {pair!r}: value is not valid YAML ({err})") from err
        node = out
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                prefix = ".".join(parts[: i + 1])
                raise ValueError(f"override {pair!r}: {prefix} was already set to a value")
        node[parts[-1]] = value
    return out


def merge(base: dict, overrides: dict) -> dict:
    """Deep-merge ``overrides`` into a copy of ``base``: mappings merge, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
