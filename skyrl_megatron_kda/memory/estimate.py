"""The per-GPU estimate of a recipe, from its owners: the parameter census, the states
(gradients, optimizer, megatron's gather buffer), the activations each layer keeps and the
phases of the step (``phases.py``); the total is the states plus the largest phase."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Recipe
from .census import PARAM_GROUPS, rank_buffers_bytes, rank_parameters
from .kda import exchange_extra_bytes
from .phases import dsa_layer_bytes, kept_activations, step_phases
from .states import gather_buffer_bytes, grad_bytes, optimizer_split


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of one recipe; ``rows`` are (label, bytes) in table order."""

    params: dict[str, int]  # by component group (PARAM_GROUPS labels)
    buffers: int
    grads: int
    optimizer: int
    activations: dict[str, int]  # kept for backward at the end of the forward, all layers
    exchange: str
    exchange_buffers: int  # the KDA exchange's transient buffers (one layer at a time)
    phases: dict[str, int]  # activations + working set alive at each candidate peak
    recompute: str
    offloaded: bool  # the kept activations live in host memory (train.offload_activations)
    dsa_layer: int = 0  # the largest DSA layer's own tensors + working set (its phase without
    # what the layers before it keep)
    host_optimizer: int = 0  # optimizer state in host memory (train.optimizer_offload_fraction)
    gather_buffer: int = 0  # megatron's global all-gather buffer at its largest

    @property
    def states(self) -> int:
        return (sum(self.params.values()) + self.buffers + self.grads + self.optimizer
                + self.gather_buffer)

    @property
    def peak_phase(self) -> tuple[str, int]:
        """The phase of the step with the most activation memory, and that memory."""
        return max(self.phases.items(), key=lambda item: item[1])

    @property
    def total(self) -> int:
        return self.states + self.peak_phase[1]


def estimate_memory(recipe: Recipe) -> MemoryEstimate:
    """The per-GPU memory of ``recipe`` (see the package docstring for what is counted)."""
    groups = rank_parameters(recipe)
    params = {label: sum(g.bytes for g in groups if g.component in kinds)
              for label, kinds in PARAM_GROUPS.items()
              if "lora" not in kinds or recipe.train.lora.enabled}
    grads = sum(g.numel * grad_bytes(recipe, g) for g in groups if g.trainable)
    split = optimizer_split(recipe)
    exchange, exchange_buffers = exchange_extra_bytes(recipe)
    activations, kept_below = kept_activations(recipe)
    phases = step_phases(recipe, activations, kept_below, split.step_casts)
    return MemoryEstimate(params=params, buffers=rank_buffers_bytes(recipe), grads=grads,
                          optimizer=split.gpu, activations=activations, exchange=exchange,
                          exchange_buffers=exchange_buffers, phases=phases,
                          recompute=recipe.train.recompute, offloaded=recipe.train.offload_activations,
                          dsa_layer=dsa_layer_bytes(recipe), host_optimizer=split.host,
                          gather_buffer=gather_buffer_bytes(recipe))
