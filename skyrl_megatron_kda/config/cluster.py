"""The machines and links of the mesh, as the cost model of ``kda.cp_exchange=auto`` sees them, and
the link presets they default to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import field_validator, model_validator

from .base import ConfigSection, PositiveInt

EFA_NODE_GIB_S = 38.8
TCP_NODE_GIB_S = 7.6
"""What one node's GPUs together move to other nodes (GiB/s): the numbers ``steptime.seed``
fits to the measured steps it holds (``tests/test_step_time_seed.py`` fits them again)."""

# Defaults, to override with measurements of the target cluster.
LINK_PRESETS: dict[str, dict[str, float]] = {
    # NVLink 4 (H200 NV18), from NCCL on two H200s (docs/step_time.md): the all-to-all value is
    # what a rank receives from its peer, half of the algorithm bandwidth at 2 ranks (the other
    # half stays on the rank).
    "nvlink": {"bandwidth_gib_s": 250.0, "all_to_all_bandwidth_gib_s": 268.0, "latency_us": 10.0},
    # One NDR NIC per GPU (8x ConnectX-7), a little under its line rate.
    "infiniband": {"bandwidth_gib_s": 45.0, "latency_us": 20.0},
    # AWS EFA: a GPU's own path, and what a node's GPUs share when all of them cross nodes at
    # once (fitted: steptime/seed.py, docs/step_time.md).
    "efa": {"bandwidth_gib_s": 40.0, "latency_us": 40.0, "node_bandwidth_gib_s": EFA_NODE_GIB_S},
    # Plain TCP sockets (NCCL's socket transport): a few GiB/s per GPU, the node's share fitted
    # like EFA's.
    "tcp": {"bandwidth_gib_s": 3.0, "latency_us": 100.0, "node_bandwidth_gib_s": TCP_NODE_GIB_S},
}
"""Link defaults by kind (GiB/s, microseconds); ``nvlink`` is also the intra-node default."""

InterNodeKind = Literal["nvlink", "infiniband", "efa", "tcp"]
"""Named link presets for the hop between nodes (``nvlink``: a multi-node NVLink domain)."""

GPUKindName = Literal["h200", "h100", "b200"]
"""GPU kinds the step-time model prices compute on (``steptime/hardware.py``)."""


class LinkConfig(ConfigSection):
    """One kind of link as the cost model of ``auto`` sees it; the presets are defaults to override
    with the numbers of your own cluster (nccl-tests on it)."""

    bandwidth_gib_s: float
    """Per-GPU all-gather bandwidth: bytes each rank receives from the others per second (GiB/s)."""
    all_to_all_bandwidth_gib_s: float | None = None
    """Per-GPU all-to-all bandwidth, bytes received from other ranks per second (GiB/s); None: same."""
    latency_us: float
    """Fixed cost per collective (microseconds)."""
    node_bandwidth_gib_s: float | None = None
    """What all GPUs of one node together move over this link (GiB/s; None: each GPU has its
    own path, no limit beyond the per-GPU numbers)."""

    @field_validator("bandwidth_gib_s", "all_to_all_bandwidth_gib_s", "node_bandwidth_gib_s")
    @classmethod
    def _bandwidth_positive(cls, value: float | None, info) -> float | None:
        if value is not None and not value > 0:
            raise ValueError(f"{info.field_name}={value} must be > 0 (GiB/s per GPU)")
        return value

    @field_validator("latency_us")
    @classmethod
    def _latency_not_negative(cls, value: float) -> float:
        if not value >= 0:
            raise ValueError(f"latency_us={value} must be >= 0 (microseconds per collective)")
        return value

    def shared_by(self, gpus: int) -> LinkConfig:
        """The link as one of ``gpus`` GPUs of a node sees it while all of them use it at once
        (every rank of a mesh runs the same collectives together): each gets the per-GPU
        numbers or its share of the node's, whichever is smaller."""
        if self.node_bandwidth_gib_s is None:
            return self
        share = self.node_bandwidth_gib_s / gpus
        return self.model_copy(update={
            "bandwidth_gib_s": min(self.bandwidth_gib_s, share),
            "all_to_all_bandwidth_gib_s": min(self.a2a_bandwidth_gib_s, share)})

    @property
    def a2a_bandwidth_gib_s(self) -> float:
        """The all-to-all bandwidth, falling back to the all-gather one."""
        if self.all_to_all_bandwidth_gib_s is None:
            return self.bandwidth_gib_s
        return self.all_to_all_bandwidth_gib_s


class ClusterConfig(ConfigSection):
    """The machines the mesh runs on, as the cost model of ``auto`` and ``plan``'s step time see
    them (nothing that runs reads it).

    Megatron orders ranks tp-cp-ep-dp with TP fastest, so a CP group spans ``tp * cp``
    consecutive ranks and crosses nodes iff ``tp * cp > gpus_per_node``.
    A partial ``intra_node`` / ``inter_node`` mapping overrides only the keys it names on top of
    the preset (``nvlink`` inside a node, ``inter_node_kind`` between nodes).
    """

    gpus_per_node: PositiveInt = 8
    """GPUs per node connected by NVLink (ranks per node)."""
    gpu: GPUKindName = "h200"
    """The GPU kind ``plan``'s step time prices compute on (rates measured on an H200, others
    derived by spec ratios)."""
    inter_node_kind: InterNodeKind = "infiniband"
    """Preset for the link between nodes; inter_node overrides its numbers."""
    intra_node: LinkConfig
    """Link between GPUs of one node (default: the NVLink preset)."""
    inter_node: LinkConfig
    """Link between nodes, per GPU (default: the inter_node_kind preset)."""

    @model_validator(mode="before")
    @classmethod
    def _fill_link_presets(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        kind = out.get("inter_node_kind", cls.model_fields["inter_node_kind"].default)
        if not isinstance(kind, str) or kind not in LINK_PRESETS:
            raise ValueError(
                f"cluster.inter_node_kind={kind!r} is not a link preset; expected one of "
                f"{', '.join(LINK_PRESETS)} (and override cluster.inter_node for other numbers)"
            )
        for field, preset in (("intra_node", "nvlink"), ("inter_node", kind)):
            value = out.get(field)
            if isinstance(value, LinkConfig):
                continue
            if value is None:
                out[field] = dict(LINK_PRESETS[preset])
            elif isinstance(value, Mapping):
                out[field] = {**LINK_PRESETS[preset], **value}
        return out

    @property
    def inter_node_per_gpu(self) -> LinkConfig:
        """The link between nodes as each GPU sees it while every GPU of its node uses it."""
        return self.inter_node.shared_by(self.gpus_per_node)

    def cp_spans_nodes(self, tp: int, cp: int) -> bool:
        """Whether a CP group (stride tp, size cp) holds ranks of more than one node."""
        return cp > 1 and tp * cp > self.gpus_per_node

    def tp_spans_nodes(self, tp: int) -> bool:
        """Whether a TP group (tp consecutive ranks) holds ranks of more than one node."""
        return tp > self.gpus_per_node
