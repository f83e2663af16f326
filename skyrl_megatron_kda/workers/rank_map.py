"""The rank map: each rank's node, GPU and mesh coordinates (TP, CP, DP, EP, ETP), and how many
groups of each axis cross nodes. ``skyrl-kda run`` prints it once and writes it to the run folder
(``rank_map.json``); ``skyrl-kda plan`` with ``run.ray_address`` prints it from a placement dry
run. The coordinates come from megatron's own ``RankGenerator`` in its default order, the one
``train.setup.init_parallel_state`` gets, before any process group exists."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from megatron.core.parallel_state import RankGenerator

from ..config import ParallelConfig, Recipe
from ..tables import format_table
from .placement import BundleLocation, gpus_per_node_note

MEGATRON_ORDER = "tp-cp-ep-dp-pp"
"""megatron-core's default rank order (``initialize_model_parallel(order=...)``)."""

AXES = ("tp", "cp", "dp", "ep", "etp")
"""Dense axes (tp, cp, dp) of the attention mesh, then the expert mesh's (ep, etp)."""


def mesh_groups(parallel: ParallelConfig, world: int) -> dict[str, list[list[int]]]:
    """The rank groups of each axis of ``AXES``, as megatron forms them on ``world`` ranks."""
    p = parallel
    dense = RankGenerator(tp=p.tp, ep=1, dp=world // (p.tp * p.cp * p.pp), pp=p.pp, cp=p.cp,
                          order=MEGATRON_ORDER)
    expert = RankGenerator(tp=p.etp, ep=p.ep, dp=world // (p.etp * p.ep * p.pp), pp=p.pp, cp=1,
                           order=MEGATRON_ORDER)
    return {"tp": dense.get_ranks("tp"), "cp": dense.get_ranks("cp"), "dp": dense.get_ranks("dp"),
            "ep": expert.get_ranks("ep"), "etp": expert.get_ranks("tp")}


def build_rank_map(ranks: Sequence[BundleLocation], recipe: Recipe) -> dict:
    """The map of ``ranks`` (rank order, as ``placement.assign_ranks`` returns them): one row per
    rank, per axis ``[groups that cross nodes, groups]``, and notes (``cluster.gpus_per_node``
    other than what Ray placed)."""
    groups = mesh_groups(recipe.parallel, len(ranks))
    coords: list[dict[str, int]] = [{} for _ in ranks]
    for axis, axis_groups in groups.items():
        for group in axis_groups:
            for index, rank in enumerate(group):
                coords[rank][axis] = index
    rows = [{"rank": rank, "node_ip": loc.node_ip, "node_id": loc.node_id, "gpu": loc.gpu,
             "bundle": loc.bundle, **coords[rank]} for rank, loc in enumerate(ranks)]
    across = {axis: [sum(len({ranks[r].node_id for r in group}) > 1 for group in axis_groups),
                     len(axis_groups)] for axis, axis_groups in groups.items()}
    note = gpus_per_node_note(ranks, recipe.cluster.gpus_per_node)
    return {"device": recipe.run.device, "ranks": rows, "groups_across_nodes": across,
            "notes": [] if note is None else [note]}


def rank_map_lines(rank_map: dict) -> list[str]:
    """The map as a table, then one line: how many groups of each axis cross nodes."""
    slot = "GPU" if rank_map["device"] == "gpu" else "CPU slot"
    table = format_table(
        ("rank", "node", slot, "bundle", *(axis.upper() for axis in AXES)),
        [(row["rank"], f"{row['node_ip']}/{row['node_id'][:8]}", row["gpu"], row["bundle"],
          *(row[axis] for axis in AXES)) for row in rank_map["ranks"]],
        align="><>>" + ">" * len(AXES))
    across = rank_map["groups_across_nodes"]
    nodes = len({row["node_id"] for row in rank_map["ranks"]})
    summary = ", ".join(f"{axis.upper()} {across[axis][0]} of {across[axis][1]}" for axis in AXES)
    return [*table, f"{nodes} node(s); groups that cross nodes: {summary}",
            *(f"note: {note}" for note in rank_map["notes"])]


def write_rank_map(path: Path, rank_map: dict) -> None:
    path.write_text(json.dumps(rank_map, indent=1) + "\n")
