"""The step-time model against the seed's measured 64-GPU table (``steptime/seed.py``).

One number per link kind is fitted (the node's bandwidth between nodes) on one row; every other
row is a prediction that must land within 15% of its measurement. Negative controls: the same
rows without the node's share of the link, and the slice read as 16 GPUs, miss by more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_megatron_kda.config import parse_overrides
from skyrl_megatron_kda.config.cluster import EFA_NODE_GIB_S, LINK_PRESETS, TCP_NODE_GIB_S
from skyrl_megatron_kda.recipe_rules import load_recipe_dict
from skyrl_megatron_kda.recipes import load_recipe
from skyrl_megatron_kda.steptime import calibration as cal
from skyrl_megatron_kda.steptime import estimate_step_time, seed
from skyrl_megatron_kda.steptime.hardware import GPU_KINDS, compute_scale
from skyrl_megatron_kda.steptime.moe import moe_dispatch_s, with_dispatcher

HELD_OUT = [r for r in seed.SEED_ROWS if not r.fitted]


def test_the_presets_are_the_fit():
    """Each link kind's node bandwidth, fitted again on its one fitted row, is the preset's
    (rounded to 0.1 GiB/s); the fitted row is then met."""
    for kind, preset in (("efa", EFA_NODE_GIB_S), ("tcp", TCP_NODE_GIB_S)):
        fitted = seed.fit_node_bandwidth(kind)
        assert fitted == pytest.approx(preset, abs=0.05), kind
        assert LINK_PRESETS[kind]["node_bandwidth_gib_s"] == preset
        row = next(r for r in seed.SEED_ROWS if r.link == kind and r.fitted)
        assert seed.predicted_s(row, fitted) == pytest.approx(row.measured_s, rel=1e-6)
    assert sum(r.fitted for r in seed.SEED_ROWS) == 2 and len(HELD_OUT) == 4


@pytest.mark.parametrize("row", HELD_OUT, ids=lambda r: f"{r.name}-{r.exchange}")
def test_every_held_out_row_is_predicted_within_15_percent(row):
    predicted = seed.predicted_s(row)
    assert abs(predicted / row.measured_s - 1) < 0.15, (predicted, row.measured_s)


@pytest.mark.parametrize("exchange", sorted(seed.SEED_PEAK_GIB))
def test_the_memory_model_predicts_the_seed_peak_within_15_percent(exchange):
    predicted = seed.predicted_peak_gib(exchange)
    assert abs(predicted / seed.SEED_PEAK_GIB[exchange] - 1) < 0.15, predicted


def test_without_the_node_share_the_rows_are_missed():
    """Negative control: EFA as 40 GiB/s for every GPU at once (no node limit), the full-model
    rows come out at about a third of their measurements."""
    for row in (r for r in seed.SEED_ROWS if r.link == "efa" and not r.slice):
        predicted = seed.predicted_s(row, node_bandwidth_gib_s=10000.0)
        assert predicted / row.measured_s < 0.5, (row, predicted)


def test_the_slice_on_16_gpus_would_be_missed():
    """Negative control: the 4-layer slice read as TP8 x CP2 on 16 GPUs does an eighth of the
    2-GPU slice's work per rank and misses its measured step by more than half."""
    row = next(r for r in HELD_OUT if r.slice)
    overrides = [*seed.SEED_SETUP, f"kda.cp_exchange={row.exchange}", "model.num_layers=4",
                 "run.num_workers=16", "parallel.ep=8", "cluster.inter_node_kind=efa"]
    step = estimate_step_time(load_recipe_dict(parse_overrides(overrides), environ={}))
    assert step.step_s / row.measured_s < 0.5


def test_a_gpu_kind_scales_compute_by_its_spec_sheet():
    """On a B200 every compute term is the H200's times its spec ratio (GEMM-bound by the bf16
    rate, the rest by HBM): the step's compute lies between the two ratios; communication, the
    host optimizer and the offload copies do not change."""
    h200 = load_recipe("glm53_flash_1m", []).recipe
    b200 = load_recipe("glm53_flash_1m", ["cluster.gpu=b200"]).recipe
    a, b = estimate_step_time(h200), estimate_step_time(b200)
    ratio = compute_scale("b200")
    assert ratio.gemm == GPU_KINDS["h200"].bf16_tflops / GPU_KINDS["b200"].bf16_tflops
    assert ratio.gemm * a.compute_s < b.compute_s < ratio.memory * a.compute_s
    assert b.comm_s == pytest.approx(a.comm_s, rel=1e-12)
    assert compute_scale("h200").gemm == compute_scale("h200").memory == 1.0


def test_the_host_optimizer_is_priced_from_its_measured_rates():
    """train.optimizer_offload_fraction=1 moves the Adam step to the host rate and adds the
    PCIe copies of 8 bytes per element; half of it, half of each."""
    def optimizer(fraction):
        recipe = load_recipe("glm53_flash_1m", [f"train.optimizer_offload_fraction={fraction}"]).recipe
        return estimate_step_time(recipe).part("optimizer")

    gpu, half, host = optimizer(0.0), optimizer(0.5), optimizer(1.0)
    elements = gpu.compute_s / cal.OPTIMIZER_S_PER_ELEMENT
    assert host.compute_s == pytest.approx(elements * cal.HOST_ADAM_S_PER_ELEMENT)
    assert host.comm_s - gpu.comm_s == pytest.approx(elements * 8 * cal.HOST_COPY_S_PER_BYTE)
    assert half.compute_s == pytest.approx((gpu.compute_s + host.compute_s) / 2)


def test_the_dispatchers_move_what_they_route():
    """alltoall moves the routed copies (top-k of the rank's rows), allgather every row of the
    EP x ETP group: at EP32 x ETP2 the gather moves several times more; at EP = ETP = 1 neither
    moves anything; flex is refused in one line naming the priced dispatchers."""
    def recipe(*overrides):
        return load_recipe("glm53_flash_1m", list(overrides)).recipe

    a2a = moe_dispatch_s(recipe("model.moe.dispatcher=alltoall"))
    gather = moe_dispatch_s(recipe("model.moe.dispatcher=allgather"))
    assert gather > 4 * a2a > 0
    single = ["parallel.ep=1", "parallel.etp=1", "run.num_workers=16"]
    assert moe_dispatch_s(recipe(*single)) == 0.0
    flex = with_dispatcher(recipe(), "flex")  # loading refuses flex where DeepEP is missing
    with pytest.raises(ValueError, match=r"^model.moe.dispatcher=flex has no step-time rates"):
        estimate_step_time(flex)


def test_the_docs_seed_table_is_the_models():
    """docs/step_time.md's table against the seed, row by row, from the model now."""
    doc = (Path(__file__).parents[1] / "docs" / "step_time.md").read_text()
    section = doc.split("## Against the seed's measured steps", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    steps = iter(seed.SEED_ROWS)
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        exchange = cells[1].strip("`")
        if cells[0].startswith("peak memory"):
            measured, predicted = seed.SEED_PEAK_GIB[exchange], seed.predicted_peak_gib(exchange)
        else:
            row = next(steps)
            assert row.exchange == exchange and cells[5] == ("fitted" if row.fitted else "predicted")
            measured, predicted = row.measured_s, seed.predicted_s(row)
        assert [c.replace(",", "") for c in cells[2:5]] == [
            f"{measured:.1f}", f"{predicted:.1f}", f"{predicted / measured:.2f}"], cells
    assert next(steps, None) is None
