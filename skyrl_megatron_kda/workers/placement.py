"""Which Ray bundle each rank gets, from where the bundles landed: a pure function, no Ray.

Megatron orders ranks tp-cp-ep-dp with TP fastest, so a TP group is ``tp`` consecutive ranks
and an expert-TP group ``etp`` consecutive ranks. Ray does not promise that placement-group
bundle indices follow nodes (bundle 3 can sit on node B while bundle 4 is on node A), so rank
``r`` does not simply take bundle ``r``: the nodes are taken in the order of their lowest bundle
index, the bundles inside a node in the order of their GPU id, and ranks are dealt out in that
order. Ranks ``[k*g, (k+1)*g)`` then share a node when each node holds ``g`` ranks, and every
block of ``block = lcm(tp, etp)`` consecutive ranks stays inside one node as long as every node
holds a multiple of ``block`` ranks; a cluster where one does not is refused, naming the nodes.

"GPU id" is the id Ray gave the bundle's GPU on its node (``ray.get_gpu_ids()``). A CPU run has
none: there it is the bundle's slot on its node, its position among that node's bundles in
bundle-index order (``with_cpu_slots``), so CPU runs use the same rule.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class BundleLocation:
    """Where one placement-group bundle landed."""

    bundle: int
    """Index of the bundle in the placement group."""
    node_id: str
    """Ray's node id (hex); nodes of one host share an IP but not an id."""
    node_ip: str
    """IP address of the node."""
    gpu: int | None
    """GPU id on the node (GPU run), or the bundle's slot on its node (CPU run); None: not yet
    known (a CPU bundle before ``with_cpu_slots``)."""

    @property
    def node(self) -> str:
        """The node as people read it: IP and the first 8 hex digits of its id."""
        return f"{self.node_ip}/{self.node_id[:8]}"


class PlacementError(ValueError):
    """The cluster's nodes cannot hold the mesh's groups of consecutive ranks."""


def node_block(tp: int, etp: int) -> int:
    """Consecutive ranks that must share a node: every TP group and every expert-TP group."""
    return math.lcm(tp, etp)


def with_cpu_slots(locations: Sequence[BundleLocation]) -> list[BundleLocation]:
    """CPU bundles with ``gpu`` set to their slot on their node (position in bundle order)."""
    taken: dict[str, int] = {}
    slotted = []
    for loc in sorted(locations, key=lambda loc: loc.bundle):
        slotted.append(replace(loc, gpu=taken.get(loc.node_id, 0)))
        taken[loc.node_id] = taken.get(loc.node_id, 0) + 1
    return slotted


def by_node(locations: Sequence[BundleLocation]) -> list[list[BundleLocation]]:
    """The bundles of each node, nodes in the order of their lowest bundle index, bundles in GPU
    id order."""
    nodes: dict[str, list[BundleLocation]] = {}
    for loc in sorted(locations, key=lambda loc: loc.bundle):
        nodes.setdefault(loc.node_id, []).append(loc)
    return [sorted(held, key=lambda loc: (loc.gpu, loc.bundle)) for held in nodes.values()]


def assign_ranks(locations: Sequence[BundleLocation], block: int) -> list[BundleLocation]:
    """The bundle of each rank, in rank order: node after node (``by_node``), so that every
    ``block`` consecutive ranks share a node. Refused when a node's bundle count is not a
    multiple of ``block`` (``PlacementError`` naming every node and its count)."""
    _check_locations(locations)
    nodes = by_node(locations)
    if any(len(held) % block for held in nodes):
        counts = ", ".join(f"{held[0].node}: {len(held)}" for held in nodes)
        raise PlacementError(
            f"Ray placed the {len(locations)} ranks as {counts} per node, but groups of {block} "
            f"consecutive ranks (TP and expert-TP groups, lcm(tp, etp) = {block}) must each sit "
            f"on one node: every node must hold a multiple of {block} ranks (use nodes with a "
            f"multiple of {block} free GPUs, or a smaller parallel.tp / parallel.etp)")
    return [loc for held in nodes for loc in held]


def _check_locations(locations: Sequence[BundleLocation]) -> None:
    bundles = sorted(loc.bundle for loc in locations)
    if bundles != list(range(len(locations))):
        raise ValueError(f"bundle indices {bundles} are not 0..{len(locations) - 1}, each once")
    if any(loc.gpu is None for loc in locations):
        raise ValueError("a bundle has no GPU id (give CPU bundles their slots: with_cpu_slots)")
    seen = {(loc.node_id, loc.gpu) for loc in locations}
    if len(seen) != len(locations):
        raise ValueError("two bundles report the same GPU id on one node")


def gpus_per_node_note(ranks: Sequence[BundleLocation], gpus_per_node: int) -> str | None:
    """None when the ranks per node (in rank order) are what ``cluster.gpus_per_node`` makes
    the cost model of ``kda.cp_exchange=auto`` assume (nodes filled with that many ranks, the
    last with the rest); else one line saying how they differ."""
    counts = list(Counter(loc.node_id for loc in ranks).values())  # nodes in rank order
    world = len(ranks)
    full, rest = divmod(world, gpus_per_node)
    expected = [gpus_per_node] * full + ([rest] if rest else [])
    if counts == expected:
        return None
    return (f"cluster.gpus_per_node={gpus_per_node}, but Ray placed {' + '.join(map(str, counts))}"
            f" ranks on {len(counts)} node(s): the cost model of kda.cp_exchange=auto assumed "
            f"{' + '.join(map(str, expected))}; set cluster.gpus_per_node to the GPUs per node")

