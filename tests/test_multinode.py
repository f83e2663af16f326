"""Rank placement on Ray's local multi-node cluster (two raylets on this host with 4 and 2 CPUs,
``two_node_cluster`` in conftest.py): where megatron's groups really are, the placement dry run of
``skyrl-kda plan``, and the tiny recipe trained across the two nodes by a driver that joins the
cluster by address, with the losses of the one-node run."""

import json
import re
import subprocess

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from skyrl_megatron_kda.cli import main
from skyrl_megatron_kda.recipes import get_recipe
from skyrl_megatron_kda.workers.group import ActorGroup
from skyrl_megatron_kda.workers.rank_map import build_rank_map
from tests.conftest import HEAD_CPUS, WORKER_CPUS
from tests.support import cli_runs


def _megatron_view(rank, world, recipe):
    """This rank's node as Ray sees it, and its groups as megatron formed them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from skyrl_megatron_kda.train.setup import init_parallel_state

    init_parallel_state(recipe)
    try:
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "tp": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
                "ep": ps.get_expert_model_parallel_rank(),
                "tp_group": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())}
    finally:
        ps.destroy_model_parallel()


def test_uneven_nodes_keep_each_tp_group_on_one_node(two_node_cluster):
    """6 ranks as TP2 x DP3, EP2 fill both nodes (4 + 2 CPUs): each rank's TP group, read from
    megatron's process groups on the ranks, sits on one node, and the rank map's node and
    coordinates are the ones the ranks report."""
    recipe = get_recipe("glm53_flash_tiny", [f"run.num_workers={HEAD_CPUS + WORKER_CPUS}",
                                             "parallel.cp=1"], environ={})
    group = ActorGroup.for_recipe(recipe)
    try:
        views = group.run(_megatron_view, recipe)
    finally:
        group.shutdown()
    rows = build_rank_map(group.ranks, recipe)["ranks"]
    assert sorted({v["node_id"] for v in views}) == sorted(n["NodeID"] for n in ray.nodes())
    for rank, (view, row) in enumerate(zip(views, rows)):
        assert {views[r]["node_id"] for r in view["tp_group"]} == {view["node_id"]}, views
        assert (row["node_id"], row["tp"], row["dp"], row["ep"]) == (
            view["node_id"], view["tp"], view["dp"], view["ep"]), (rank, row, view)


@pytest.fixture
def two_free_cpus_per_node(two_node_cluster):
    """Two of the head's CPUs held, so that 4 ranks need both nodes (2 + 2)."""
    held = placement_group([{"CPU": HEAD_CPUS - WORKER_CPUS, "head": 1}])
    ray.get(held.ready(), timeout=120)
    yield two_node_cluster
    remove_placement_group(held)


def test_plan_dry_run_shows_ranks_on_both_nodes(two_free_cpus_per_node, capsys):
    address = two_free_cpus_per_node.address
    assert main(["plan", "glm53_flash_tiny", f"--set=run.ray_address={address}"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("placement dry run"):].splitlines()
    assert plan[0] == f"placement dry run on {address}: 4 CPU ranks"
    assert plan[1].split()[:3] == ["rank", "node", "CPU"]
    assert len({line.split()[1] for line in plan[2:6]}) == 2, plan
    assert plan[6] == ("2 node(s); groups that cross nodes: TP 0 of 2, CP 2 of 2, DP 0 of 4, "
                       "EP 0 of 2, ETP 0 of 4")
    assert plan[7].startswith("note: cluster.gpus_per_node=8, but Ray placed 2 + 2 ranks")


def test_tiny_recipe_on_two_nodes_trains_as_on_one(two_free_cpus_per_node, tmp_path):
    """`skyrl-kda run --set run.ray_address=...` from another working directory, with a relative
    run.output_dir: 2 steps over 2 + 2 ranks give the one-node run's losses, the rank map is
    printed once and written, and the ranks' checkpoint lands in the driver's folder."""
    reference, rc, err = cli_runs.reference_run()
    assert rc == 0, err[-3000:]
    command = cli_runs.command("run", f"--set=run.ray_address={two_free_cpus_per_node.address}",
                               "--set=train.steps=2")
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                          env=cli_runs.env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    lines, one_node = cli_runs.metrics(out), cli_runs.metrics(reference)[:2]
    # lr of step 1 is train.lr for any train.steps, so the first two losses do not depend on it.
    assert [m["lr"] for m in lines][:1] == [m["lr"] for m in one_node][:1]
    assert [m["loss"] for m in lines] == [m["loss"] for m in one_node]
    assert one_node[0]["loss"] != one_node[1]["loss"]  # the second step did train
    rank_map = json.loads((out / "rank_map.json").read_text())
    nodes = [row["node_id"] for row in rank_map["ranks"]]
    assert len(set(nodes)) == 2 and nodes[0] == nodes[1] and nodes[2] == nodes[3], nodes
    assert rank_map["groups_across_nodes"]["tp"] == [0, 2]
    assert len(re.findall(r"^rank +node +CPU slot", proc.stderr, re.M)) == 1, proc.stderr[-3000:]
    assert "cluster.gpus_per_node=8, but Ray placed 2 + 2 ranks" in proc.stderr
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
