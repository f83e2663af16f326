"""The step-time model (``skyrl_megatron_kda/steptime``) against the stored runs it comes from.

Every calibration constant is derived again here from the files under ``bench/results/`` that
its comment names. The model's predictions of the full-width slice are compared with stored
slice steps (whole steps, which no constant reads) at three lengths of the KDA-only slice and
two of the 4-layer slice; one rank's compute at the 1M share with the sum of the stored
rank-share runs. A negative control doubles one measured part and checks that the prediction
moves by that part, and that the slice comparison then fails.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.memory.census import rank_parameters
from skyrl_megatron_kda.memory.offload import offloaded_tensor_bytes
from skyrl_megatron_kda.recipes import load_recipe
from skyrl_megatron_kda.steptime import calibration as cal
from skyrl_megatron_kda.steptime import estimate_step_time
from skyrl_megatron_kda.steptime import model as stm

RESULTS = Path(__file__).parents[1] / "bench" / "results"
FORWARD_CALL_SHARE = {
    # fla's forward kernels in the CP1 layer's profile, and the share of their calls that are the
    # forward's: the backward runs the state pass (two more calls) and the w/u recompute, the conv
    # and the gate cumsum (one more call) again.
    "chunk_kda_fwd_kernel_inter_solve_fused": 1.0, "chunk_kda_fwd_kernel_intra_sub_chunk": 1.0,
    "chunk_gla_fwd_kernel_o": 1.0, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": 1 / 3,
    "recompute_w_u_fwd_kda_kernel": 1 / 2, "l2norm_fwd_kernel": 1.0, "causal_conv1d_fwd_kernel": 1 / 2,
    "layer_norm_gated_fwd_kernel": 1.0, "kda_gate_chunk_cumsum_vector_kernel": 1 / 2,
    "chunk_local_cumsum_vector_kernel": 1.0, "fused_beta_sigmoid_fwd_kernel": 1.0,
}


def _ms(text: str) -> float:
    value, unit = float(re.match(r"[\d.]+", text).group(0)), re.sub(r"[\d.]", "", text)
    return value * {"ms": 1.0, "us": 1e-3, "s": 1e3}[unit]


def kda_forward_share(path: Path) -> float:
    """Forward kernels' CUDA time over all named kernels that are neither GEMMs nor torch's
    generic kernels, in a torch profiler table (``bench/kda_layer.py --profile``)."""
    kernels = {}
    for line in path.read_text().splitlines():
        cols = line.split()
        if len(cols) < 11 or not cols[-1].isdigit():
            continue
        name = " ".join(cols[:-10])
        if not name.startswith(("nvjet", "sm80_xmma", "void ", "Memcpy", "Memset", "cu", "Activity")):
            kernels[name] = _ms(cols[-5])  # Self CUDA
    return sum(t * FORWARD_CALL_SHARE.get(n, 0.0) for n, t in kernels.items()) / sum(kernels.values())


def test_stored_run_constants_derive_again():
    dsa = json.loads((RESULTS / "h200_dsa_kept_selection" / "dsa_rank_share_sequence.json").read_text())
    best, q = dsa["best"], dsa["queries"]
    visible = (dsa["keys"] - q / 2) / 4
    assert cal.DSA_INDEXER_S_PER_SCORE_DIM == pytest.approx(best["indexer_ms"] * 1e-3 / (q * visible * 32 * 128))
    work = q * dsa["heads"] * dsa["mean_selected"]
    assert cal.DSA_ATTN_FWD_S == pytest.approx(best["attn_fwd_ms"] * 1e-3 / work)
    assert cal.DSA_ATTN_BWD_S == pytest.approx(best["attn_bwd_ms"] * 1e-3 / work)
    assert cal.DSA_SELECTED_PER_TOPK == pytest.approx(dsa["mean_selected"] / 2048)

    rows = [json.loads(line) for line in (RESULTS / "h200_fused_loss" / "fused_loss.txt").read_text().splitlines()]
    for kind, const in (("fused", cal.FUSED_LOSS_S_PER_CELL), ("unfused", cal.UNFUSED_LOSS_S_PER_CELL)):
        pts = [(r["tokens"] * 19360, r["ms"] * 1e-3) for r in rows if r["kind"] == kind]
        assert const == pytest.approx(sum(a * b for a, b in pts) / sum(a * a for a, _ in pts))

    assert cal.KDA_FORWARD_SHARE == pytest.approx(
        kda_forward_share(RESULTS / "h200_kda_own_gemms" / "profile_cp1_T131072.txt"), rel=1e-6)

    parts = json.loads((RESULTS / "h200_step_time_slices" / "slice_131072.json").read_text())
    layer = {part["layer"]: part for part in parts["layers"]}
    recipe = load_recipe(parts["recipe"], parts["overrides"]).recipe
    moe_layer_flop = stm.moe_part(recipe).compute_s * cal.MOE_FLOP_PER_S / recipe.model.mlp_types().count("moe")
    assert cal.MOE_LAYER_FLOP == pytest.approx(moe_layer_flop)  # the model's count, written out
    assert cal.MOE_FLOP_PER_S == pytest.approx(moe_layer_flop / layer[1]["mlp_part"]["s"])
    dense_flop = stm.dense_part(recipe).compute_s * cal.DENSE_FLOP_PER_S
    assert cal.DENSE_FLOP_PER_S == pytest.approx(dense_flop / layer[0]["mlp_part"]["s"])
    assert cal.MHC_S_PER_ROW == pytest.approx(layer[1]["mhc"]["s"] / (2 * layer[1]["mhc"]["rows"]))

    worker = json.loads((RESULTS / "h200_rl_worker" / "rl_worker.json").read_text())
    optim = [c["seconds"] for c in worker["calls"] if c["call"] == "optim_step"][1:]  # after the first
    trainable = sum(g.numel for g in rank_parameters(load_recipe("glm53_flash_slice", []).recipe) if g.trainable)
    assert cal.OPTIMIZER_S_PER_ELEMENT == pytest.approx(statistics.median(optim) / trainable)

    runs = json.loads((RESULTS / "h200_slice_memory_levers_131k" / "slice.json").read_text())
    plain = next(r for r in runs if r["seq_len"] == 32768 and r["levers"] == [])
    offload = next(r for r in runs if r["seq_len"] == 32768 and r["levers"] == ["offload"])
    recipe = load_recipe("glm53_flash_slice", ["data.seq_len=32768",
                                               "train.offload_activations=true"]).recipe
    moved_gib = 2 * sum(offloaded_tensor_bytes(recipe)) / 2**30  # out in forward, back in backward
    assert cal.OFFLOAD_EXPOSED_GIB_S == pytest.approx(moved_gib / (offload["step_time_s"] - plain["step_time_s"]))


SLICE_RUNS = [
    # (layers, tokens, levers, stored file, which row): whole measured steps, which no constant reads
    (3, 16384, (), "slice_cp1_h200.json"),
    (3, 32768, (), "slice_cp1_h200.json"),
    (3, 49152, (), "slice_cp1_h200.json"),
    (4, 32768, (), "h200_slice_memory_levers_131k/slice.json"),
    (4, 131072, ("offload", "loss", "bf16grads", "headgroups", "moechunks"),
     "h200_slice_memory_levers_131k/slice.json"),
]
LEVERS = {"offload": "train.offload_activations=true", "loss": "train.loss_chunk_tokens=8192",
          "bf16grads": "train.grad_reduce_in_fp32=false", "headgroups": "kda.kernel_head_group=16",
          "moechunks": "train.moe_chunk_tokens=8192"}


def stored_slice(layers: int, tokens: int, levers: tuple[str, ...], path: str) -> tuple[object, float]:
    """The slice recipe of a stored run (bench/model_slice.py's spec) and its measured step."""
    rows = json.loads((RESULTS / path).read_text())
    row = next(r for r in rows if r["layers"] == layers and r["seq_len"] == tokens
               and tuple(r.get("levers", ())) == levers)
    recipe = load_recipe("glm53_flash_slice", [f"model.num_layers={layers}", f"data.seq_len={tokens}",
                                               *(LEVERS[name] for name in levers)]).recipe
    return recipe, row["step_time_s"]


@pytest.mark.parametrize("layers, tokens, levers, path", SLICE_RUNS,
                         ids=[f"{r[0]}layers-T{r[1]}{'-levers' if r[2] else ''}" for r in SLICE_RUNS])
def test_slice_step_within_10_percent_of_the_stored_step(layers, tokens, levers, path):
    recipe, measured = stored_slice(layers, tokens, levers, path)
    predicted = estimate_step_time(recipe).step_s
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


@pytest.mark.parametrize("tokens", [65536, 131072])
def test_slice_steps_of_one_device_run_within_10_percent(tokens):
    """The slice with every lever at two lengths, measured in one device run (its 32K step is
    unusable: bench/results/h200_step_time_slices/README.md). The constants read that run's
    parts, never its steps."""
    run = json.loads((RESULTS / "h200_step_time_slices" / f"slice_{tokens}.json").read_text())
    recipe = load_recipe(run["recipe"], run["overrides"]).recipe
    predicted = estimate_step_time(recipe).step_s
    assert predicted == pytest.approx(run["step"]["step_s"], rel=0.10), (predicted, run["step"]["step_s"])


def share_measured() -> dict[str, float]:
    """One rank's work at the 1M recipe's share from the stored rank-share runs: the KDA layer of
    the ``state`` exchange's rank (8 heads over its 524,288 rows, forward+backward, the slower of
    the two CP2 ranks, per-rank emulation), the DSA attention core (65,536 queries x 64 heads over
    1M keys, full recompute, the selection kept), the fused loss over 524,288 rows of the
    19,360-column vocabulary shard."""
    kda = json.loads((RESULTS / "h200_kda_own_gemms" / "emulated_T1048576.json").read_text())
    dsa = json.loads((RESULTS / "h200_dsa_kept_selection" / "dsa_rank_share_sequence.json").read_text())
    loss = [json.loads(line) for line in (RESULTS / "h200_fused_loss" / "fused_loss.txt").read_text().splitlines()]
    return {
        "KDA layer": kda["layer_cp2_state"]["ms"] * 1e-3,
        "DSA core": dsa["best"]["step_ms_full_recompute"] * 1e-3,
        "loss": next(r for r in loss if r["kind"] == "fused" and r["tokens"] == 524288)["ms"] * 1e-3,
    }


def share_predicted() -> dict[str, float]:
    """The model's same three parts for the 1M recipe: the KDA layer as that run ran it (no
    recompute, one kernel call for the rank's 8 heads), the DSA core, the head and loss."""
    recipe = load_recipe("glm53_flash_1m", []).recipe
    as_run = recipe.model_copy(update={
        "train": recipe.train.model_copy(update={"recompute": "none"}),
        "kda": recipe.kda.model_copy(update={"kernel_head_group": None})})
    return {
        "KDA layer": stm.kda_part(as_run).compute_s / 34,
        "DSA core": sum(stm.dsa_core_s(recipe).values()),
        "loss": stm.head_part(recipe).compute_s,
    }


def test_one_rank_compute_at_the_1m_share_within_10_percent_of_its_parts():
    measured, predicted = share_measured(), share_predicted()
    weights = {"KDA layer": 34, "DSA core": 11, "loss": 1}  # the 1M recipe's layers of each
    total_m = sum(weights[k] * v for k, v in measured.items())
    total_p = sum(weights[k] * v for k, v in predicted.items())
    assert total_p == pytest.approx(total_m, rel=0.10), (predicted, measured)
    assert predicted["KDA layer"] == pytest.approx(measured["KDA layer"], rel=0.10)


def test_doubling_one_measured_part_moves_the_prediction_by_that_part(monkeypatch):
    """Negative control: the MoE rate halved (its measured time doubled) adds exactly the MoE
    compute once more to the step, and the slice comparison then fails."""
    recipe, measured = stored_slice(3, 49152, (), "slice_cp1_h200.json")
    before = estimate_step_time(recipe)
    moe = before.part("MoE").compute_s
    monkeypatch.setattr(cal, "MOE_FLOP_PER_S", cal.MOE_FLOP_PER_S / 2)
    after = estimate_step_time(recipe)
    assert after.step_s - before.step_s == pytest.approx(moe, rel=1e-9)
    assert abs(before.step_s / measured - 1) < 0.10
    assert abs(after.step_s / measured - 1) > 0.10


def test_plan_prints_the_step_time(capsys):
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    step = estimate_step_time(load_recipe("glm53_flash_1m", []).recipe)
    assert f"step: {step.step_s:.2f} s, {step.tokens_per_s_per_gpu:,.0f} tokens/s/GPU" in out
    for part in ("KDA attention", "DSA attention", "MoE", "dense MLP", "optimizer",
                 "host-offload copies"):
        assert any(line.startswith(part) for line in out.splitlines()), part
    assert "dominant: " in out and "lever: " in out and "not priced: the embedding lookup" in out
    assert "64 heads x 128" in out and "per-GPU memory estimate" in out  # the earlier sections stay


DOC = Path(__file__).parents[1] / "docs" / "step_time.md"


def _doc_table(heading: str) -> list[list[str]]:
    section = DOC.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def test_the_docs_tables_are_the_models():
    """docs/step_time.md's 1M split and its CP4/CP8 table, row by row, from the model now."""
    step = estimate_step_time(load_recipe("glm53_flash_1m", []).recipe)
    for cells in _doc_table("## The 1M recipe"):
        name = cells[0].strip("*").split(" (")[0]
        if name == "step":
            assert cells[4].strip("*") == f"{step.step_s:.2f}"
            continue
        part = step.part(name)
        assert cells[2:5] == [f"{part.compute_s:.2f}" if part.compute_s else "",
                              f"{part.comm_s:.2f}", f"{part.total_s:.2f}"], cells
    for cells in _doc_table("## Beyond one machine, on paper"):
        gpus, mesh, T = int(cells[0]), cells[1], cells[2]
        cp = int(mesh.split("CP")[1])
        loaded = load_recipe("glm53_flash_1m", [f"parallel.cp={cp}", f"run.num_workers={gpus}",
                                                f"data.seq_len={2**20 * int(T[:-1])}"])
        got = estimate_step_time(loaded.recipe)
        assert cells[3].startswith(f"`{loaded.recipe.kda.cp_exchange}`"), cells
        assert cells[4:8] == [f"{got.step_s:.1f}", f"{got.tokens_per_s_per_gpu:.0f}",
                              f"{got.compute_s:.1f}", f"{got.comm_s:.1f}"], cells
