"""What every part of the step-time model shares: the ``Part`` it returns, the seconds a
collective takes on a link, the link a group crosses, forward passes under recompute, and the
GPU kind's scale on the measured H200 rates."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import LinkConfig, Recipe
from . import calibration as cal
from .hardware import ComputeScale, compute_scale

GiB = 2**30


@dataclass(frozen=True)
class Part:
    """One layer type (all its layers) or step phase of one rank: seconds per step."""

    name: str
    layers: int  # how many layers of this type (0: not a layer: head, optimizer, copies)
    compute_s: float
    comm_s: float
    what: str = ""  # what the communication is and over which link

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def seconds(nbytes: float, link: LinkConfig, a2a: bool = False) -> float:
    """One collective that brings ``nbytes`` to a rank over ``link``: its all-gather (or, with
    ``a2a``, all-to-all) bandwidth and its fixed cost per call."""
    bw = link.a2a_bandwidth_gib_s if a2a else link.bandwidth_gib_s
    return nbytes / (bw * GiB) + link.latency_us * 1e-6


def group_link(recipe: Recipe, stride: int, size: int) -> LinkConfig:
    """The link a group of ``size`` ranks ``stride`` apart runs at: between nodes as soon as it
    holds ranks of two nodes (a ring runs at its slowest hop)."""
    c = recipe.cluster
    return c.inter_node_per_gpu if crosses_nodes(recipe, stride, size) else c.intra_node


def crosses_nodes(recipe: Recipe, stride: int, size: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart holds ranks of two nodes."""
    return size > 1 and stride * size > recipe.cluster.gpus_per_node


def forward_passes(recipe: Recipe, kind: str) -> int:
    """Forward passes of a layer's block per step: 2 when it is rebuilt in backward."""
    return 2 if recipe.train.recompute_of(kind) == "full" else 1


def recompute_share(recipe: Recipe, kind: str) -> float:
    """A per-row cost measured under full recompute (two forwards and a backward, four
    forward-equivalents), scaled to the recipe's passes."""
    return (forward_passes(recipe, kind) + 2) / 4


def scale(recipe: Recipe) -> ComputeScale:
    """The recipe's GPU kind (``cluster.gpu``) against the H200 the rates were measured on."""
    return compute_scale(recipe.cluster.gpu)


def gemm_s(recipe: Recipe, flops: float) -> float:
    """Seconds of ``flops`` GEMM work on the recipe's GPU kind."""
    return flops / cal.GEMM_FLOP_PER_S * scale(recipe).gemm
