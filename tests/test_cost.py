"""The cost model behind kda.cp_exchange=auto: scenario picks that follow from the model, picks are
the argmin of the model's own estimates, calibration reproduces the measurements it came from,
its resolution by ``auto.resolve``, and the ``plan`` command."""

import itertools
import json
import logging
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from skyrl_megatron_kda import auto, cli
from skyrl_megatron_kda.config import CP_EXCHANGE_ENV, MeshRecipe, merge
from skyrl_megatron_kda.kda import exchanges
from skyrl_megatron_kda.kda.cost import (
    Calibration,
    choose,
    estimate,
    exclusions,
    gathered_gemm_flops,
    head_tokens,
    kda_efficiency,
    kda_kernel_s,
    regather_hidden_s,
)
from skyrl_megatron_kda.kda.exchanges import ExchangeShape
from skyrl_megatron_kda.recipe_rules import load_mesh_recipe

CONCRETE = exchanges.names()
shape_of = ExchangeShape.of

# GLM-5.3-Flash (64 heads x 128, hidden 4096) at TP8 x CP2 with SP and 1M-token sequences, auto.
GLM_1M = {
    "parallel": {"tp": 8, "cp": 2, "sequence_parallel": True},
    "kda": {"cp_exchange": "auto"},
    "data": {"seq_len": 2**20},
}
NO_TP = {"tp": 1, "sequence_parallel": False}
EXACT = {"allow_inexact": False}
FLA_STATE = Calibration(state_prepass=246.3 / 73.5 - 1)  # fla 0.6.0's cp_context instead of ours


def glm(**sections) -> MeshRecipe:
    return load_mesh_recipe(merge(GLM_1M, sections), environ={})


def ms(recipe, calibration=Calibration()) -> dict[str, float]:
    return {e.name: e.total_s * 1e3 for e in choose(recipe, calibration)[2]}


# --- scenarios ---------------------------------------------------------------------------------
# Each row: id, recipe overrides of GLM_1M, calibration, expected pick, and why the model says so
# (numbers: ms per layer forward+backward per rank, from the model).

SCENARIOS = [
    # TP8 x CP2 spans two 8-GPU nodes, CP hop over EFA (40 GiB/s): state moves 2 MiB per layer
    # instead of 1-3 GiB and its kernel costs about what the head-parallel 4-head share does
    # (both from kernel measurements): state 200 < allgather 323 < a2a 386.
    ("tp8-cp2-1M-efa", {"cluster": {"inter_node_kind": "efa"}}, None, "state"),
    # Exact only: allgather moves 1 GiB over CP per forward against a2a's 3 GiB (its input side is
    # hidden rows, 1/5 of the projected width at CP2; backward gathers them again), and the slow
    # link decides: 323 vs 386.
    ("tp8-cp2-1M-efa-exact", {"cluster": {"inter_node_kind": "efa"}, "kda": EXACT}, None, "allgather"),
    # With fla's own state passing (+2.35x over the shard's kernel, measured) state's kernel alone
    # takes 248 ms, and still state 375 < allgather 776: each GPU's share of the node's EFA.
    ("tp8-cp2-1M-efa-fla-state", {"cluster": {"inter_node_kind": "efa"}}, FLA_STATE, "state"),
    # Over TCP (under 1 GiB/s per GPU when a node's 8 share it) any token exchange costs
    # seconds: state 203 vs allgather 2892, a2a 6568.
    ("tp8-cp2-1M-tcp", {"cluster": {"inter_node_kind": "tcp"}}, None, "state"),
    # CP over a multi-node NVLink domain: CP bytes are cheap, but not free: state 200 < a2a 258
    # < allgather 270.
    ("tp8-cp2-1M-nvlink-domain", {"cluster": {"inter_node_kind": "nvlink"}}, None, "state"),
    # ... exact only: allgather's doubled TP gathers (forward, and again in backward: 84 vs 42 ms,
    # of which only the last collective can hide behind the GEMMs) outweigh its CP saving:
    # a2a 258 < allgather 270.
    ("tp8-cp2-1M-nvlink-domain-exact", {"cluster": {"inter_node_kind": "nvlink"}, "kda": EXACT},
     None, "a2a"),
    # CP4 across nodes: head-parallel leaves 2 heads per rank and sends tokens over IB; state runs
    # 8 heads on a 256K shard and moves no tokens: state 101 vs a2a 223, allgather 246.
    ("tp8-cp4-1M-ib", {"parallel": {"cp": 4}}, None, "state"),
    # CP8 inside one node (TP1, NVLink): state 335 < allgather 444 < a2a 478 (its kernel runs
    # 64 heads on a 128K shard, about what 8 heads on 1M tokens take, but it moves nothing while
    # the head-parallel exchanges move 9-10 GiB).
    ("tp1-cp8-1M-node", {"parallel": {**NO_TP, "cp": 8}}, None, "state"),
    # ... exact only: allgather by 7%. Both head-parallel exchanges run 8 heads per rank on 1M
    # tokens and their comm is NVLink-cheap; allgather moves 17% fewer CP bytes forward (8.75 vs
    # 10.5 GiB, crossover near CP10), gathers its 1M rows again in backward behind its
    # input-gradient GEMMs and projects f_a/g_a on all of them, and a2a's profiled copies cost
    # more per head-token: allgather 444 < a2a 478 (the re-gather's overlap is what tips it; see the test below).
    ("tp1-cp8-1M-node-exact", {"parallel": {**NO_TP, "cp": 8}, "kda": EXACT}, None, "allgather"),
    # Short sequences, 8K tokens at TP8 x CP2 over IB: all comm is sub-millisecond; state has no
    # fixed cost per call beyond its kernel's (fitted at 256K and 1M, not measured at 8K) and it
    # copies the least: state 3.8 < allgather 4.7 < a2a 5.1.
    ("tp8-cp2-8K-ib", {"data": {"seq_len": 8192}}, None, "state"),
    # Few heads: 8 heads, hidden 4096, TP1 x CP2 on NVLink, T = 256K, the shape of
    # docs/benchmarks-log.md (measured per rank: state and a2a within 1.5% in one run, state 12%
    # ahead in another; 1.36x ahead of a2a once q, k, v had GEMMs of their own; see the test
    # below): state 44.5 < a2a 59.1 < allgather 59.5. The projected width is 0.63x two hidden
    # rows, so a2a moves fewer bytes than allgather (0.75 vs 1.13 GiB), and that outweighs its
    # dearer copies.
    ("8heads-tp1-cp2-256K-node", {"parallel": {**NO_TP}, "kda": {"num_heads": 8},
                                  "data": {"seq_len": 2**18}}, None, "state"),
    # ... and at 1M clearly: state 172 < a2a 230 < allgather 231.
    ("8heads-tp1-cp2-1M-node", {"parallel": {**NO_TP}, "kda": {"num_heads": 8}}, None, "state"),
    # Few heads with CP across nodes (one GPU per node), exact only: a2a's fewer bytes on the slow
    # link decide it, 341 vs allgather 465.
    ("8heads-tp1-cp2-1M-ib-exact", {"parallel": {**NO_TP}, "kda": {"num_heads": 8, **EXACT},
                                    "cluster": {"gpus_per_node": 1}}, None, "a2a"),
    # 8 local heads at CP3 cannot be split over CP: only state is possible.
    ("tp8-cp3-heads-not-divisible", {"parallel": {"cp": 3}, "data": {"seq_len": 6 * 2**17}},
     None, "state"),
    # TP2 without SP across 2-GPU nodes over TCP with fla's state passing: allgather has no SP
    # shards to gather (excluded), and state's kernel (3.35x) still beats a2a's 8 GB over TCP.
    ("tp2-cp2-no-sp-tcp-fla-state", {"parallel": {"tp": 2, "sequence_parallel": False},
                                     "cluster": {"inter_node_kind": "tcp", "gpus_per_node": 2}},
     FLA_STATE, "state"),
    # CP=1: nothing crosses a CP group, every exchange runs the same code: a2a.
    ("cp1", {"parallel": {"cp": 1}}, None, "a2a"),
]


@pytest.mark.parametrize("overrides, calibration, expected",
                         [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_scenario_picks(overrides, calibration, expected):
    recipe = glm(**overrides)
    choice, reason, table = choose(recipe, calibration or Calibration())
    assert choice == expected, reason
    assert reason.startswith(f"{expected}: ")
    assert [e.name for e in table] == list(CONCRETE)


def test_cp8_inside_a_node_allgathers_row_regather_hides():
    recipe = glm(parallel={**NO_TP, "cp": 8})
    t = ms(recipe)
    serial = ms(recipe, Calibration(regather_overlap=0.0))
    # Its 1M rows gathered again in backward cost 28 ms on NVLink; behind the input-gradient
    # GEMMs (longer than that here) all of it hides, and allgather beats a2a, whose reorders
    # and copies cost more per head-token (calibration.py); state is faster than both.
    again = exchanges.get("allgather")._row_gather_bytes(shape_of(recipe))["cp"]
    again_ms = again / (recipe.cluster.intra_node.bandwidth_gib_s * 2**30) * 1e3
    assert again_ms > 20
    assert serial["allgather"] - t["allgather"] == pytest.approx(again_ms)
    assert serial["a2a"] == pytest.approx(t["a2a"])  # a2a has no row re-gather over CP
    assert t["allgather"] < serial["allgather"] < t["a2a"]
    assert t["state"] < 0.9 * t["allgather"]


def test_regather_hides_only_up_to_the_gemms_beside_it():
    # 8K tokens over TCP: the re-gathered rows take far longer than the GEMMs that run beside them.
    recipe = glm(parallel={**NO_TP}, data={"seq_len": 8192}, cluster={"gpus_per_node": 1, "inter_node_kind": "tcp"})
    shape, cluster = shape_of(recipe), recipe.cluster
    group, hidden = regather_hidden_s("allgather", shape, cluster.inter_node, cluster.intra_node, (128, 128),
                                      Calibration())
    assert group == "cp"
    assert hidden == pytest.approx(gathered_gemm_flops("allgather", shape) / Calibration().gemm_flop_per_s)
    # Under SP the TP gather is the last collective, so that is the one that hides.
    assert regather_hidden_s("a2a", shape_of(glm()), cluster.inter_node, cluster.intra_node, (128, 128),
                             Calibration())[0] == "tp"
    with pytest.raises(ValueError, match=r"regather_overlap=1.5 must be in \[0, 1\]"):
        Calibration(regather_overlap=1.5)


RESULTS = Path(__file__).parents[1] / "bench/results"
CALIBRATION_RUN = RESULTS / "h200_kda_own_gemms"
STORED_LAYER_RUNS = sorted(CALIBRATION_RUN.glob("emulated_T*.json"))
"""Layer runs per rank, both ranks, of the code as it is: 128K, 256K and 1M in the run whose
per-kernel profiles (at 128K) and state recurrence rows (256K, 1M) give the calibration its
terms (its layer rows are timed separately from the profiled steps and read by no constant).
(The runs in h200_kda_layer_profiles_one_qkv_gemm/, h200_kda_layer_256k_1m/, h200_kda_floor/ and
h200_kda_profiles/ measured the code before q, k and v had GEMMs of their own.)"""


def _against_stored_run(path: Path, calibration: Calibration):
    """(measured ms, model estimates) of one stored per-rank layer run: 8 heads, TP1 x CP2,
    ``bench/kda_layer.py --emulate-cp2`` (each CP2 rank's work on one H200, no data crossing GPUs),
    with the model's NVLink comm time added to the measured rows as the benchmark does."""
    run = json.loads(path.read_text())
    tokens = run["args"]["tokens"]
    _, _, table = choose(glm(parallel=NO_TP, kda={"num_heads": 8}, data={"seq_len": tokens}), calibration)
    model = {e.name: e for e in table}
    measured = {n: run[f"layer_cp2_{n}"]["ms"] + model[n].cp_comm_s * 1e3 for n in CONCRETE}
    return run, measured, model


def _pick_is_within(path: Path, calibration: Calibration, margin: float) -> bool:
    _, measured, model = _against_stored_run(path, calibration)
    pick = min(model.values(), key=lambda e: e.total_s).name
    return measured[pick] <= (1 + margin) * min(measured.values())


@pytest.mark.parametrize("path", STORED_LAYER_RUNS, ids=lambda p: p.stem)
def test_auto_against_stored_layer_runs_the_calibration_did_not_use(path):
    """The calibration (``calibration.py``) reads kernel rows, the state recurrence rows and
    per-kernel profiles, never these layer rows. Against them: ``auto``'s pick is within 3% of
    the measured fastest exchange (the issue's target; it is the fastest in each of them), every
    pair measured more than 10% apart is in the model's order, and every estimate is within 20%
    of its layer's measured time, CP1 included. (10%: the two ranks of one exchange, doing the
    same work in the same run, differ by up to 18% at 128K, where the host's launches set the
    pace: state 23.0 vs 27.1 ms in one run; the model has a2a and allgather within 1% there,
    measured 31.1 and 33.1 with the comm time.)"""
    assert len(STORED_LAYER_RUNS) == 3
    run, measured, model = _against_stored_run(path, Calibration())
    assert _pick_is_within(path, Calibration(), 0.03), (measured, model)
    for a, b in itertools.permutations(CONCRETE, 2):
        if measured[a] < 0.90 * measured[b]:
            assert model[a].total_s < model[b].total_s, (a, b, measured, model)
    for name in CONCRETE:
        assert 0.8 < model[name].total_s * 1e3 / measured[name] < 1.2, (name, measured, model)
    cp1 = choose(glm(parallel={**NO_TP, "cp": 1}, kda={"num_heads": 8}, data={"seq_len": run["args"]["tokens"]}))
    assert 0.8 < cp1[2][0].total_s * 1e3 / run["layer_cp1"]["ms"] < 1.2


def test_stored_layer_runs_can_fail_the_pick_check():
    # Negative control: a state call overhead of 30 ms (the old fla-style path's order) makes the
    # model pick a head-parallel exchange where state is measured clearly fastest.
    slow_state = Calibration(state_call_overhead_s=0.030)
    assert not all(_pick_is_within(p, slow_state, 0.03) for p in STORED_LAYER_RUNS)


def test_efa_break_even_state_prepass():
    # Over EFA, with each GPU's share of its node's link, state wins while its kernel costs less
    # than about 8.8x the shard's kernel alone: ours (-0.01x) and fla's cp_context (+2.35x).
    over = {"cluster": {"inter_node_kind": "efa"}}
    t = ms(glm(**over))
    assert t["state"] < 0.3 * t["allgather"] < t["a2a"]
    assert choose(glm(**over), Calibration(state_prepass=7.7))[0] == "state"
    assert choose(glm(**over), Calibration(state_prepass=7.9))[0] == "allgather"
    assert choose(glm(**over), FLA_STATE)[0] == "state"


def test_reason_names_all_and_the_link():
    _, reason, _ = choose(glm(cluster={"inter_node_kind": "efa"}))
    assert reason.startswith("state: ")
    assert "a2a " in reason and "allgather " in reason
    assert reason.endswith("(CP spans nodes over efa, T=1048576)")
    _, reason, _ = choose(glm(cluster={"inter_node_kind": "efa"}, kda=EXACT))
    assert reason.startswith("allgather: ")
    assert "state excluded (not exact, kda.allow_inexact=false)" in reason
    _, reason, _ = choose(glm(parallel={"tp": 4}))
    assert reason.endswith("(CP inside one node over NVLink, T=1048576)")


# --- every pick is the argmin of the model's own estimates -----------------------------------------


def _grid():
    for tp, cp, seq_len, kind, inexact, heads in itertools.product(
            (1, 2, 8), (1, 2, 4, 8), (8192, 2**17, 2**20), ("nvlink", "infiniband", "efa", "tcp"),
            (True, False), (64, 8)):
        raw = {"parallel": {"tp": tp, "cp": cp, "sequence_parallel": tp > 1},
               "kda": {"cp_exchange": "auto", "allow_inexact": inexact, "num_heads": heads},
               "data": {"seq_len": seq_len}, "cluster": {"inter_node_kind": kind}}
        try:
            yield load_mesh_recipe(raw, environ={})
        except ValueError:
            # Only auto with heads that CP cannot split and state forbidden is refused.
            assert not inexact and (heads // tp) % cp
    # Exchanges that SP excludes, and CP groups that straddle nodes at 4 GPUs per node.
    for tp, cp in ((2, 2), (4, 2), (2, 4)):
        yield load_mesh_recipe({"parallel": {"tp": tp, "cp": cp}, "kda": {"cp_exchange": "auto"},
                                 "data": {"seq_len": 2**20}, "cluster": {"gpus_per_node": 4}},
                                environ={})


def test_every_pick_is_the_argmin_of_the_models_estimates():
    picks = set()
    recipes = list(_grid())
    assert len(recipes) > 500
    for recipe in recipes:
        choice, _, table = choose(recipe)
        p, cluster = recipe.parallel, recipe.cluster
        spans = cluster.cp_spans_nodes(p.tp, p.cp)
        ranks = (recipe.kda.gate_low_rank, recipe.kda.output_gate_low_rank)
        own = {n: estimate(n, shape_of(recipe), spans, cluster, gate_ranks=ranks) for n in CONCRETE}
        assert {e.name: e for e in table} == own
        if p.cp == 1:
            assert choice == "a2a"
            continue
        allowed = [n for n in CONCRETE if n not in exclusions(recipe)]
        assert choice == min(allowed, key=lambda n: own[n].total_s)
        assert recipe.kda.allow_inexact or choice != "state"
        picks.add(choice)
    assert picks == set(CONCRETE), "the grid should exercise every pick"


def test_spans_nodes_follows_the_mesh():
    # Ranks are ordered tp-cp-ep-dp, TP fastest: a CP group covers tp*cp consecutive ranks.
    c = MeshRecipe().cluster
    assert c.cp_spans_nodes(8, 2) and c.cp_spans_nodes(2, 8)
    assert not c.cp_spans_nodes(4, 2) and not c.cp_spans_nodes(1, 8) and not c.cp_spans_nodes(16, 1)
    assert c.tp_spans_nodes(16) and not c.tp_spans_nodes(8)


# --- the model's parts ---------------------------------------------------------------------------


def test_efficiency_formula():
    assert kda_efficiency(8) == pytest.approx(1.0)
    assert kda_efficiency(4) == pytest.approx(0.96)
    assert kda_efficiency(64) == 1.0
    values = [kda_efficiency(h) for h in (1, 2, 4, 8, 16)]
    assert values == sorted(values)
    assert kda_efficiency(4, at_4_heads=1.0) == 1.0
    with pytest.raises(ValueError, match=r"kda_efficiency_at_4_heads=0.4 must be in \(0.5, 1\]"):
        Calibration(kda_efficiency_at_4_heads=0.4)


def test_calibration_reproduces_its_measurements():
    # bench/results/h200_per_rank/kernels_T*.json: one H200, the segmented kernel fwd+bwd, GLM dims.
    assert kda_kernel_s(8, 2**20) * 1e3 == pytest.approx(145.6)
    assert kda_kernel_s(8, 2**18) * 1e3 == pytest.approx(38.0, rel=0.005)
    assert kda_kernel_s(8, 2**19) * 1e3 == pytest.approx(72.9, rel=0.02)
    for tokens, measured in ((2**18, 20.9), (2**19, 39.5), (2**20, 75.6)):  # 4 heads
        assert kda_kernel_s(4, tokens) * 1e3 == pytest.approx(measured, rel=0.025)
    # Below 256K the 16 segments are short: the model is optimistic (24.2 ms measured).
    assert 0.8 < kda_kernel_s(8, 2**17) * 1e3 / 24.2 < 0.85
    # Our state exchange's recurrence per rank, CP2, 8 heads (emulated_T*.json of the calibration
    # run): 19.0 and 71.8 ms at 256K and 1M; fla's cp_context on two H200s with NCCL at 1M
    # 246.3 ms (its pre-pass priced as +2.35x, no fixed cost of ours).
    cluster, calibration = glm().cluster, Calibration()
    for tokens, path in ((2**18, CALIBRATION_RUN / "emulated_T262144.json"),
                         (2**20, CALIBRATION_RUN / "emulated_T1048576.json")):
        run = json.loads(path.read_text())
        measured = run["state_recurrence_cp2"]["ms"]
        shard = run[f"segmented_kernel_8h_T{tokens // 2}"]["ms"]
        # The state terms on the shard's kernel as this run measured it...
        relative = (1 + calibration.state_prepass) * shard + calibration.state_call_overhead_s * 1e3
        assert relative == pytest.approx(measured, rel=0.025)
        # ... and the model's whole estimate, whose shard kernel is the kernel line above: 2% high
        # at T/2 = 128K against this run's 19.6 ms.
        shape = shape_of(glm(parallel=NO_TP, kda={"num_heads": 8}, data={"seq_len": tokens}))
        state = estimate("state", shape, False, cluster, calibration=calibration)
        assert state.kernel_s * 1e3 == pytest.approx(measured, rel=0.05)
    shape = shape_of(glm(parallel=NO_TP, kda={"num_heads": 8}))
    fla = estimate("state", shape, False, cluster, calibration=FLA_STATE)
    assert (fla.kernel_s - FLA_STATE.state_call_overhead_s) * 1e3 == pytest.approx(246.3, rel=0.02)


def _profile_rows(path: Path) -> tuple[list[tuple[str, float]], float]:
    """(kernel name, self CUDA ms) rows and the total of a stored torch.profiler table."""
    rows, total = [], None
    for line in path.read_text().splitlines():
        row = re.match(r"\s*(.+?)\s{2,}\S+%\s+\S+\s+\S+%\s+\S+\s+\S+\s+([\d.]+)(us|ms)\s+\S+%", line)
        if row:
            rows.append((row.group(1), float(row.group(2)) * (1e-3 if row.group(3) == "us" else 1)))
        found = re.search(r"Self CUDA time total: ([\d.]+)ms", line)
        total = float(found.group(1)) if found else total
    return rows, total


def _elementwise_ms(path: Path) -> float:
    """CUDA ms of a stored profile outside fla's KDA kernels and the cuBLAS GEMMs."""
    rows, total = _profile_rows(path)
    gemm = sum(ms for name, ms in rows if name.startswith("nvjet"))
    kda = sum(ms for name, ms in rows if re.match(r"(chunk_|recompute_w_u|kda_|l2norm|solve_tril)", name))
    assert sum(ms for _, ms in rows) == pytest.approx(total, rel=1e-3)  # the whole table is read
    return total - gemm - kda


def test_elementwise_terms_are_the_profiled_ones():
    """Each per-head-token term is what the stored per-kernel profile (8 heads, T = 131,072, over
    the steps its header counts) spends outside the KDA kernels and the GEMMs, derived again here:
    CP1's over 8 x T head-tokens, each CP2 exchange's (the slower rank) over the 8 x T/2 its ranks
    compute."""
    profiles = CALIBRATION_RUN
    tokens = 131072
    header = (profiles / f"profile_cp1_T{tokens}.txt").read_text().splitlines()[0]
    steps = int(re.search(r"(\d+) profiled steps", header).group(1))
    assert steps == 3
    cp1 = _elementwise_ms(profiles / f"profile_cp1_T{tokens}.txt")
    assert cp1 * 1e-3 / steps / (8 * tokens) == pytest.approx(Calibration().elementwise_s_per_head_token, rel=1e-3)
    for name in CONCRETE:
        rank = max(_elementwise_ms(profiles / f"profile_cp2_{name}_rank_{r}_T{tokens}.txt") for r in (0, 1))
        assert rank * 1e-3 / steps / (8 * tokens // 2) == pytest.approx(
            Calibration().cp_elementwise_s_per_head_token[name], rel=1e-3), name
    # What the exchanges' own copies cost beyond CP1's elementwise work, per head-token.
    terms = Calibration().cp_elementwise_s_per_head_token
    assert terms["a2a"] > terms["allgather"] > terms["state"] > Calibration().elementwise_s_per_head_token


def test_an_exchange_without_a_profile_gets_cp1s_elementwise_term_and_the_reason_says_so():
    recipe = glm(parallel=NO_TP, kda={"num_heads": 8}, data={"seq_len": 131072})
    calibration = Calibration(cp_elementwise_s_per_head_token={"a2a": 1e-8})
    _, reason, table = choose(recipe, calibration)
    by_name = {e.name: e for e in table}
    assert by_name["a2a"].elementwise_profiled and not by_name["state"].elementwise_profiled
    per_head_token = by_name["state"].elementwise_s / head_tokens("state", shape_of(recipe))
    assert per_head_token == pytest.approx(calibration.elementwise_s_per_head_token)
    assert reason.endswith("; elementwise term of CP1 for allgather, state (not profiled))"), reason
    assert "not profiled" not in choose(recipe)[1]
    with pytest.raises(ValueError, match=r"cp_elementwise_s_per_head_token\['a2a'\]=-1"):
        Calibration(cp_elementwise_s_per_head_token={"a2a": -1.0})


def test_bytes_come_from_the_exchanges_byte_model():
    recipe = glm()
    shape = shape_of(recipe)
    for e in choose(recipe)[2]:
        moved = exchanges.get(e.name).bytes_moved(shape)
        assert e.cp_in_bytes + e.cp_out_bytes == moved["cp"]
        assert e.tp_bytes == moved["tp"]
    a2a, allgather, state = choose(recipe)[2]
    # The design's byte model: a2a 2.5 + 0.5 GiB, allgather 0.5 + 0.5 GiB; state about 2 MiB here
    # (its 1 MiB is one summary; zigzag gives each rank two pieces, plus 3-row conv halos). a2a
    # sends its 2,564-column blocks padded to 2,568 (whole 16-byte vectors).
    assert (a2a.cp_in_bytes * 2564 / 2568 / 2**30, a2a.cp_out_bytes / 2**30) == pytest.approx((2.504, 0.5), abs=1e-3)
    assert (allgather.cp_in_bytes, allgather.cp_out_bytes) == (2**29, 2**29)
    assert state.cp_out_bytes == 0 and 2**21 < state.cp_in_bytes < 2**21 + 2**18
    assert allgather.tp_bytes == 2 * a2a.tp_bytes == 2 * state.tp_bytes
    assert allgather.extra_memory_bytes == 2**20 * 4096 * 2  # the [T, D] hidden buffer, 8 GiB
    assert not state.exact and a2a.exact and allgather.exact


def test_contiguous_layout_halves_state_summaries():
    # Zigzag gives each rank two pieces of the sequence to summarise, contiguous one.
    zigzag, contiguous = (choose(glm(parallel={"cp_layout": layout}))[2][2]
                          for layout in ("zigzag", "contiguous"))
    assert contiguous.cp_in_bytes * 2 == zigzag.cp_in_bytes


def test_state_cost_does_not_grow_with_sequence_length_in_comm():
    short, long = (choose(glm(data={"seq_len": t}))[2][2] for t in (2**17, 2**20))
    assert short.cp_in_bytes == long.cp_in_bytes
    assert short.cp_comm_s == pytest.approx(long.cp_comm_s)


def test_slower_link_never_helps_token_exchanges():
    for name in ("a2a", "allgather"):
        kinds = ("nvlink", "infiniband", "efa", "tcp")
        times = [ms(glm(cluster={"inter_node_kind": k}))[name] for k in kinds]
        assert times == sorted(times)


def test_estimate_unknown_exchange():
    with pytest.raises(ValueError, match="no cost model for cp_exchange 'auto'"):
        estimate("auto", shape_of(glm()), False, glm().cluster)


# --- auto.resolve on kda.cp_exchange ------------------------------------------------------------


@pytest.mark.parametrize("exchange", ["a2a", "allgather", "state"])
def test_resolve_leaves_configured_exchanges_alone(exchange, caplog):
    recipe = glm(kda={"cp_exchange": exchange})
    with caplog.at_level(logging.INFO, logger="skyrl_megatron_kda.auto"):
        resolved, choices = auto.resolve(recipe)
    assert resolved is recipe
    assert choices == {}
    assert not caplog.records


def test_resolve_auto_logs_the_reason(caplog):
    recipe = glm(cluster={"inter_node_kind": "tcp"})
    with caplog.at_level(logging.INFO, logger="skyrl_megatron_kda.auto"):
        resolved, choices = auto.resolve(recipe)
    reason = choices["kda.cp_exchange"]
    assert resolved.kda.cp_exchange == "state"
    assert resolved.model_copy(update={"kda": recipe.kda}) == recipe, "only cp_exchange changes"
    assert reason.startswith("state: ")
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == f"kda.cp_exchange=auto -> {reason}"


def test_resolve_auto_from_the_environment(monkeypatch):
    monkeypatch.setenv(CP_EXCHANGE_ENV, "auto")
    recipe = load_mesh_recipe({"parallel": {"tp": 8, "cp": 2, "sequence_parallel": True},
                                "data": {"seq_len": 2**20}})
    assert recipe.kda.cp_exchange == "auto"
    resolved, _ = auto.resolve(recipe)
    assert resolved.kda.cp_exchange == "state", "the env is not re-applied to the choice"


# --- the plan command ---------------------------------------------------------------------------


def _rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in CONCRETE}


def test_plan_prints_three_rows_and_the_choice(capsys):
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "64 heads x 128, hidden 4096, TP8 x CP2 +SP, T=1048576" in out
    rows = _rows(out)
    assert list(rows) == list(CONCRETE)
    assert rows["a2a"][1:4] == ["2.508", "0.500", "3.500"]  # CP in (2,564-column blocks padded to 2,568), CP out, TP GiB
    assert rows["state"][-1] == "no" and rows["a2a"][-1] == "yes"
    [choice] = [line for line in out.splitlines() if line.startswith("choice: ")]
    assert choice.startswith("choice: state: ")
    assert choice.endswith("(CP spans nodes over efa, T=1048576)")  # glm53_flash_1m's cluster


def test_plan_overrides_and_state_prepass(capsys):
    assert cli.main(["plan", "--set", "cluster.inter_node_kind=efa", "--state-prepass", "7.9"]) == 0
    out = capsys.readouterr().out
    assert "state pre-pass +7.90x" in out
    assert "choice: allgather: " in out
    assert cli.main(["plan", "--set", "kda.allow_inexact=false", "--set", "cluster.inter_node_kind=tcp"]) == 0
    assert "choice: allgather: " in capsys.readouterr().out


def test_plan_configured_exchange(capsys):
    assert cli.main(["plan", "--set", "kda.cp_exchange=a2a"]) == 0
    out = capsys.readouterr().out
    assert "choice: a2a (configured); auto would pick state: " in out


def test_plan_refuses_bad_values():
    with pytest.raises(ValidationError, match=r"bandwidth_gib_s=0.0 must be > 0"):
        cli.main(["--debug", "plan", "--set", "cluster.inter_node.bandwidth_gib_s=0"])


def test_exactness_is_declared_once_per_exchange():
    """The registry's exact set (what config and the cost model read) agrees with the classes."""
    EXACT_EXCHANGES = exchanges.exact_names()
    EXCHANGES = {name: exchanges.get(name) for name in exchanges.names()}

    assert set(EXACT_EXCHANGES) == {name for name, cls in EXCHANGES.items() if cls.exact}


def test_state_prepass_may_be_negative_but_not_erase_the_kernel():
    """A state path faster than the kernel on its shard alone would be a negative value, which is
    valid; -1 or below would make the kernel free or negative."""
    recipe = glm()
    shape = shape_of(recipe)
    faster = estimate("state", shape, False, recipe.cluster,
                      calibration=Calibration(state_prepass=-0.10, state_call_overhead_s=0.0))
    alone = estimate("state", shape, False, recipe.cluster,
                     calibration=Calibration(state_prepass=0.0, state_call_overhead_s=0.0))
    assert faster.kernel_s == pytest.approx(alone.kernel_s * 0.90)
    with pytest.raises(ValueError, match=r"state_prepass=-1.0 must be > -1"):
        Calibration(state_prepass=-1.0)
