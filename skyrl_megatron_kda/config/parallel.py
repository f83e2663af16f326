"""The Megatron parallel sizes of one model replica."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import ConfigSection, PositiveInt


class ParallelConfig(ConfigSection):
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
    cp_layout: Literal["zigzag", "contiguous"] = "zigzag"
    """How the model lays tokens over CP ranks (every layer and the data's rows): Megatron's
    load-balanced zigzag (what softmax attention layers need), or contiguous slices of the packed
    row."""

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
