"""Rank placement as a pure function of where Ray put the bundles (workers/placement.py), and the
rank map's mesh coordinates (workers/rank_map.py). No Ray here: tests/test_multinode.py runs the
same code on a local multi-node Ray cluster."""

import random

import pytest
from megatron.core.parallel_state import RankGenerator

from skyrl_megatron_kda.recipes import get_recipe
from skyrl_megatron_kda.workers.placement import (BundleLocation, PlacementError, assign_ranks,
                                                  gpus_per_node_note, node_block, with_cpu_slots)
from skyrl_megatron_kda.workers.rank_map import build_rank_map, mesh_groups, rank_map_lines


def _scattered_cluster(nodes: int, gpus: int, seed: int) -> list[BundleLocation]:
    """``nodes`` x ``gpus`` bundles where bundle indices and GPU ids are shuffled across nodes, as
    Ray is free to return them."""
    rng = random.Random(seed)
    slots = [(f"{n:02d}" + "ab" * 27, f"10.0.0.{n + 1}", g) for n in range(nodes) for g in range(gpus)]
    rng.shuffle(slots)
    return [BundleLocation(b, node, ip, gpu) for b, (node, ip, gpu) in enumerate(slots)]


def _nodes_of_groups(ranks, size):
    return [{loc.node_id for loc in ranks[k:k + size]} for k in range(0, len(ranks), size)]


def test_scattered_bundles_keep_each_tp_group_on_one_node():
    """8 nodes x 8 GPUs with bundle indices scattered: the 8 ranks of each TP group share a node
    and follow its GPU ids, while rank r = bundle r (the old rule) would split them."""
    locations = _scattered_cluster(8, 8, seed=3)
    ranks = assign_ranks(locations, block=8)
    assert sorted(loc.bundle for loc in ranks) == list(range(64))
    assert all(len(nodes) == 1 for nodes in _nodes_of_groups(ranks, 8))
    assert [loc.gpu for loc in ranks] == list(range(8)) * 8
    # Negative control: the same table taken in bundle order spreads TP groups over nodes.
    old = sorted(locations, key=lambda loc: loc.bundle)
    assert any(len(nodes) > 1 for nodes in _nodes_of_groups(old, 8))


def test_shuffled_table_gives_the_same_ranks():
    """The rule reads the table, not the order it arrives in."""
    locations = _scattered_cluster(2, 4, seed=5)
    shuffled = list(locations)
    random.Random(0).shuffle(shuffled)
    assert assign_ranks(shuffled, block=2) == assign_ranks(locations, block=2)


def test_nodes_are_taken_in_the_order_of_their_lowest_bundle():
    locations = [BundleLocation(0, "b" * 56, "10.0.0.2", 1), BundleLocation(1, "a" * 56, "10.0.0.1", 0),
                 BundleLocation(2, "b" * 56, "10.0.0.2", 0), BundleLocation(3, "a" * 56, "10.0.0.1", 1)]
    assert [loc.bundle for loc in assign_ranks(locations, block=2)] == [2, 0, 1, 3]


def test_one_cpu_node_keeps_rank_r_on_bundle_r():
    """A CPU run on one node (every existing run): slots in bundle order, rank r = bundle r."""
    locations = [BundleLocation(b, "n" * 56, "127.0.0.1", None) for b in (2, 0, 3, 1)]
    ranks = assign_ranks(with_cpu_slots(locations), block=2)
    assert [(loc.bundle, loc.gpu) for loc in ranks] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_cpu_slots_count_per_node_in_bundle_order():
    locations = [BundleLocation(b, node * 56, "127.0.0.1", None)
                 for b, node in enumerate("abbab")]
    assert [loc.gpu for loc in with_cpu_slots(locations)] == [0, 0, 1, 1, 2]


def test_uneven_nodes_holding_whole_tp_groups_are_placed():
    """4 ranks on one node and 2 on another (uneven CPU counts) with TP2: every pair on a node."""
    locations = with_cpu_slots([BundleLocation(b, ("h" if b in (0, 2, 3, 5) else "w") * 56,
                                               "127.0.0.1", None) for b in range(6)])
    ranks = assign_ranks(locations, block=2)
    assert [loc.node_id[0] for loc in ranks] == list("hhhhww")
    assert all(len(nodes) == 1 for nodes in _nodes_of_groups(ranks, 2))


def test_nodes_that_cannot_hold_whole_tp_groups_are_refused():
    """6 + 2 GPUs per node with TP8: refused, naming each node and its count."""
    locations = [BundleLocation(b, ("a" if b < 6 else "b") * 56, f"10.0.0.{1 if b < 6 else 2}",
                                b % 6) for b in range(8)]
    with pytest.raises(PlacementError, match=r"10\.0\.0\.1/aaaaaaaa: 6, 10\.0\.0\.2/bbbbbbbb: 2 per "
                                             r"node.*groups of 8 consecutive ranks"):
        assign_ranks(locations, block=8)


@pytest.mark.parametrize("table, match", [
    ([(0, "a", 0), (0, "a", 1)], "bundle indices"),       # one bundle twice
    ([(0, "a", 0), (1, "a", None)], "no GPU id"),         # CPU bundle without its slot
    ([(0, "a", 0), (1, "a", 0)], "same GPU id"),          # two bundles on one GPU
])
def test_inconsistent_tables_are_refused(table, match):
    with pytest.raises(ValueError, match=match):
        assign_ranks([BundleLocation(b, node * 56, "127.0.0.1", gpu) for b, node, gpu in table], 1)


def test_node_block_holds_tp_and_expert_tp_groups():
    assert node_block(8, 1) == 8 and node_block(2, 4) == 4 and node_block(4, 6) == 12


def _on_nodes(counts):
    return [BundleLocation(b, f"{n}" * 56, "127.0.0.1", b) for b, n in
            enumerate(n for n, count in enumerate(counts) for _ in range(count))]


def test_gpus_per_node_agreeing_with_ray_says_nothing():
    assert gpus_per_node_note(_on_nodes([8] * 8), 8) is None
    assert gpus_per_node_note(_on_nodes([4]), 8) is None  # a run smaller than one node


def test_gpus_per_node_other_than_ray_placed_is_said():
    note = gpus_per_node_note(_on_nodes([2, 2]), 8)
    assert note == ("cluster.gpus_per_node=8, but Ray placed 2 + 2 ranks on 2 node(s): the cost "
                    "model of kda.cp_exchange=auto assumed 4; set cluster.gpus_per_node to the "
                    "GPUs per node")
    assert "assumed 4 + 4" in gpus_per_node_note(_on_nodes([8]), 4)


def test_coordinates_follow_megatron_rank_order():
    """TP2 x CP2 x DP2 and EP4 on 8 ranks, written out by hand from megatron's tp-cp-ep-dp
    order (TP fastest; the expert mesh folds EP over the same ranks, ETP fastest)."""
    recipe = get_recipe("glm53_flash_tiny", ["run.num_workers=8", "parallel.ep=4"], environ={})
    rows = build_rank_map(_on_nodes([8]), recipe)["ranks"]
    assert [(r["tp"], r["cp"], r["dp"], r["ep"], r["etp"]) for r in rows] == [
        (0, 0, 0, 0, 0), (1, 0, 0, 1, 0), (0, 1, 0, 2, 0), (1, 1, 0, 3, 0),
        (0, 0, 1, 0, 0), (1, 0, 1, 1, 0), (0, 1, 1, 2, 0), (1, 1, 1, 3, 0)]


def test_groups_match_megatrons_rank_generator():
    """The 1M recipe's mesh (TP8 x CP2 x DP4, EP32 x ETP2 on 64 GPUs): the TP group of each rank
    is the one megatron's own generator forms, and none crosses a node of 8."""
    recipe = get_recipe("glm53_flash_1m", [], environ={})
    p, world = recipe.parallel, recipe.run.num_workers
    groups = mesh_groups(p, world)
    expected = RankGenerator(tp=p.tp, ep=1, dp=world // (p.tp * p.cp), pp=1, cp=p.cp,
                             order="tp-cp-ep-dp-pp").get_ranks("tp")
    assert groups["tp"] == expected == [list(range(k, k + 8)) for k in range(0, 64, 8)]
    rank_map = build_rank_map(assign_ranks(_scattered_cluster(8, 8, seed=1), block=8), recipe)
    across = rank_map["groups_across_nodes"]
    assert across["tp"] == [0, 8] and across["etp"] == [0, 32]
    assert across["cp"] == [32, 32]  # TP8 x CP2 = 16 consecutive ranks: every CP pair crosses
    assert rank_map["notes"] == []


def test_rank_map_table_names_node_gpu_and_coordinates():
    recipe = get_recipe("glm53_flash_tiny", [], environ={})
    lines = rank_map_lines(build_rank_map(with_cpu_slots(
        [BundleLocation(b, ("a" if b < 2 else "b") * 56, "127.0.0.1", None) for b in range(4)]),
        recipe))
    assert lines[0].split() == ["rank", "node", "CPU", "slot", "bundle", "TP", "CP", "DP", "EP",
                                "ETP"]
    assert lines[3].split() == ["2", "127.0.0.1/bbbbbbbb", "0", "2", "0", "1", "0", "0", "0"]
    assert lines[5] == ("2 node(s); groups that cross nodes: TP 0 of 2, CP 2 of 2, DP 0 of 4, "
                        "EP 0 of 2, ETP 0 of 4")
    assert lines[6].startswith("note: cluster.gpus_per_node=8, but Ray placed 2 + 2 ranks")
