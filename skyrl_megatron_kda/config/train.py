"""The optimisation loop."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import ConfigSection, NonNegativeInt, PositiveInt
from .lora import LoRAConfig
from .model import LayerType


SCHEDULE_FIELDS = ("steps", "lr", "min_lr", "warmup_steps", "weight_decay")


class TrainConfig(ConfigSection):
    """The optimisation loop."""

    steps: PositiveInt = 10
    """Optimizer steps to run."""
    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate (Adam)."""
    min_lr: float = Field(default=0.0, ge=0)
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled (AdamW) weight decay."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value (None: no clipping)."""
    optimizer_offload_fraction: float = Field(default=0.0, ge=0, le=1)
    """Share of the distributed optimizer's fp32 main parameters and Adam moments kept and updated
    in host memory (megatron's ``HybridDeviceOptimizer``; it offloads whole parameter shards, in
    order, until this share of the elements is on the host). 0: all on the GPU. Needs
    ``run.device=gpu``."""
    grad_reduce_in_fp32: bool = Field(default=True, strict=True)
    """Accumulate and reduce gradients over DP x CP in an fp32 DDP buffer; false: in the
    parameters' dtype (a bf16 buffer is half the size, but the gradients are rounded to bf16)."""
    seed: int = Field(default=1234, strict=True, ge=0, le=2**63 - 1)
    """Seed of parameter init and synthetic data; the same seed gives the same first loss. At
    most 2**63 - 1: the ranks hand it to torch and megatron's RNG streams as a 64-bit integer."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in backward for the layers of ``recompute_layers`` (Megatron's
    recompute granularities): ``full`` reruns the whole layer and keeps only its input streams;
    ``selective`` reruns its attention block (norm + KDA or DSA: the largest activations per
    token) and keeps the FFN's; ``none`` keeps every activation."""
    recompute_layers: list[LayerType] = ["kda", "dsa"]
    """The layer types ``recompute`` applies to; layers of the other type keep their activations."""
    keep_dsa_selection: bool = Field(default=True, strict=True)
    """Under recompute, a DSA layer's checkpointed forward keeps its indexer's selection for the
    recompute (int32, ``index_topk / index_kpool + index_kpool - 1`` per query row, until the
    layer's backward), so the indexer runs once per step instead of twice (dsa/kept_selection.py);
    false: the recompute selects again."""
    offload_activations: bool = Field(default=False, strict=True)
    """Keep the tensors saved for backward in host memory instead of the GPU (pinned,
    model/host_offload.py; parameters stay): under full recompute the token ids and the layer
    inputs, else every activation the layers keep; the head's tensors stay (saved last and read
    first, they would lower no peak). Each is copied to the host in forward and back in
    backward; ``skyrl-kda plan`` shows the host memory per GPU and per node."""
    loss_chunk_tokens: PositiveInt | None = None
    """Compute the output layer and cross entropy in chunks of this many tokens of the CP rank,
    never forming the [tokens, vocab/tp] logits (model/fused_loss.py: kept per token are two fp32
    numbers, the logits of one chunk are rebuilt in backward). None: megatron's unfused loss on
    the whole fp32 logits. Same loss and gradients either way (fp32 summation order)."""
    moe_chunk_tokens: NonNegativeInt = 0
    """Run each MoE layer's shared expert, dispatch, routed experts and combine over chunks of
    this many rows of the rank's residual stream (tokens, at one packed row per micro-batch),
    each chunk rebuilt in its backward (model/moe_layer.py): the experts' [tokens x ffn]
    activations and the dispatcher's gathered tokens scale with the chunk instead of the
    sequence. The router still runs once on every row. 0: no chunks (megatron's MoELayer as it
    is). Same loss and gradients either way (fp32 summation order)."""
    log_every: PositiveInt = 1
    """Log metrics every this many steps."""
    warmup_steps: NonNegativeInt = 0
    """Steps of linear LR warmup from 0 to lr before the cosine decay (0: start at lr)."""
    save_interval: NonNegativeInt = 0
    """Save a checkpoint every this many steps (0: only at the end and on SIGTERM/Ctrl-C)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a step whose loss or gradient norm is not finite (on any rank) does; it is caught
    before the optimizer applies anything (``train.step_guard``). ``stop``: the run ends with one
    error naming the step, the values and the last checkpoint, nothing of that step applied or
    saved. ``skip``: the update is dropped (weights, Adam state and LR schedule stay), the step
    is counted with ``update_skipped`` in its metrics, and the run stops after
    ``max_skipped_steps`` skips in a row."""
    max_skipped_steps: PositiveInt = 3
    """With ``on_nonfinite=skip``: consecutive skipped updates after which the run stops."""
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    """Low-rank adapters on the linears, the base frozen (``train.lora.rank`` 0: off)."""
    save_at_end: bool = Field(default=True, strict=True)
    """Save a checkpoint after the last step (benchmarks turn it off: the slice's optimizer state
    alone is tens of GiB)."""

    @field_validator("recompute_layers")
    @classmethod
    def _layer_types_once(cls, value: list[str]) -> list[str]:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"train.recompute_layers={value} must name 'kda' and/or 'dsa', each once")
        return value

    def schedule(self) -> dict:
        """The settings megatron's LR and weight-decay scheduler is built from
        (``trainer.build_scheduler``), by dotted name: a checkpoint records them, and a resume that
        changes one changes the schedule (refused unless asked for, ``train.run_folder``)."""
        return {f"train.{name}": getattr(self, name) for name in SCHEDULE_FIELDS}

    def recompute_of(self, layer_type: str) -> str:
        """The recompute mode of layers of ``layer_type``."""
        return self.recompute if layer_type in self.recompute_layers else "none"

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must be <= train.lr={self.lr}")
        return self
