"""``train.lora``: low-rank adapters on the model's linears, the base weights frozen."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from .base import ConfigSection, NonNegativeInt


class LoRAConfig(ConfigSection):
    """LoRA (docs/lora.md): each targeted linear computes ``W x + (alpha/rank) B A x`` with W
    frozen; only A and B train, get gradients and Adam state. The names and defaults are SkyRL's
    (``trainer.policy.model.lora``), which map onto this section."""

    rank: NonNegativeInt = 0
    """Rank r of the adapters; 0: no LoRA, every weight trains."""
    alpha: float = Field(default=16.0, gt=0)
    """The adapters' output is scaled by ``alpha / rank``."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input (the base linear sees the input unchanged)."""
    target_modules: list[str] = ["all-linear"]
    """Linears to adapt: SkyRL's (megatron's) names (``linear_qkv``, ``linear_proj``,
    ``linear_fc1``, ``linear_fc2``, ``in_proj``, ``out_proj``, ``all-linear``), ours (a module
    name's last component, e.g. ``q_proj``) or wildcard patterns on the dotted name
    (``*.layers.3.*``). docs/lora.md lists which linears each name selects."""
    exclude_modules: list[str] = []
    """Linears left out of ``target_modules``' selection, named the same ways."""
    init_method: Literal["kaiming", "xavier"] = "kaiming"
    """A's initial values (B starts at zero): peft's kaiming-uniform (bound 1/sqrt(in)) or
    xavier-uniform (bound sqrt(6/(in + rank)))."""
    share_expert_adapters: bool = True
    """Routed experts' ``linear_fc1``/``linear_fc2``: one adapter per MoE layer and linear kind,
    used by every expert of the layer on every EP rank (a dense parameter, its gradient summed
    over every rank), as SkyRL's default; false: each expert its own adapter (an expert
    parameter, split under ETP as the expert's weight and reduced over the expert-DP group)."""
    normalize_moe_lora: bool = False
    """Routed experts' adapters take rank ``max(1, rank // moe top_k)`` and scale
    ``alpha / that rank`` (SkyRL's ``normalize_moe_lora``); the other adapters keep ``rank``."""

    @field_validator("target_modules", "exclude_modules", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value

    @property
    def enabled(self) -> bool:
        return self.rank > 0
