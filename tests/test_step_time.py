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
from skyrl_megatron_kda.memory.rows import rows_of
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
    dsa = json.loads((RESULTS / "h200_threshold_topk" / "dsa_latent_keep.json").read_text())
    assert cal.DSA_SELECTED_PER_TOPK == pytest.approx(dsa["mean_selected"] / 2048)
    syncs = RESULTS / "h200_indexer_syncs"
    bf16 = json.loads((RESULTS / "h200_dsa_balanced_rows" / "layer_rows.json").read_text())["runs"][0]
    assert (bf16["kernel"], bf16["indexer_scores"], bf16["tp_rows"]) == ("latent", "bf16", "balanced")
    assert cal.DSA_INDEXER_S_PER_SCORE_DIM == pytest.approx(
        bf16["best"]["indexer_ms"] * 1e-3 / (bf16["visible_pools"] * 32 * 128))
    profile = (syncs / "indexer_profile_fp8_keys.txt").read_text()
    wall = {m[1]: float(m[2]) for m in re.finditer(r"^(bf16|fp8): kernels .*? wall ([\d.]+) ms",
                                                    profile, re.M)}
    assert cal.DSA_FP8_INDEXER_SHARE == pytest.approx(wall["fp8"] / wall["bf16"])
    for rates, kernel, path in (
            (cal.DSA_ATTENTION_S, "fused", "h200_dsa_kept_selection/dsa_rank_share_sequence.json"),
            (cal.DSA_ATTENTION_S, "latent", "h200_dsa_latent/dsa_rank_share_latent.json"),
            (cal.DSA_KEPT_OUTPUT_S, "latent", "h200_dsa_balanced_rows/layer_rows.json"),
            (cal.DSA_KEPT_OUTPUT_S, "fused", "h200_index_scores/dsa_layer_latent_fused.json")):
        run = json.loads((RESULTS / path).read_text())
        run = next((r for r in run["runs"] if r["kernel"] == kernel), None) if "runs" in run else run
        kept = rates is cal.DSA_KEPT_OUTPUT_S
        assert (run["kernel"], run.get("keep_output", False)) == (kernel, kept)
        work = run["queries"] * run["heads"] * run["mean_selected"]
        assert rates[kernel] == pytest.approx(
            (run["best"]["attn_fwd_ms"] * 1e-3 / work, run["best"]["attn_bwd_ms"] * 1e-3 / work))
    plain, both = (json.loads((RESULTS / "h200_dsa_ordered_fp8" / f"dsa_{name}.json").read_text())
                   for name in ("latent", "latent_fp8_det"))
    assert (plain["indexer_scores"], plain["deterministic"]) == ("bf16", False)
    assert (both["indexer_scores"], both["deterministic"]) == ("fp8", True)
    runs = json.loads((RESULTS / "h200_dsa_wrapper" / "layer.json").read_text())
    forward = {r["attention_forward"]: r["best"]["attn_fwd_ms"] for r in runs["runs"]}
    assert cal.DSA_FLASHMLA_FORWARD_SHARE == pytest.approx(forward["flashmla"] / forward["tilelang"])
    assert cal.DSA_ORDERED_BACKWARD_SHARE == pytest.approx(
        both["best"]["attn_bwd_ms"] / plain["best"]["attn_bwd_ms"])

    rows = [json.loads(line) for line in (RESULTS / "h200_fused_loss" / "fused_loss.txt").read_text().splitlines()]
    for kind, const in (("fused", cal.FUSED_LOSS_S_PER_CELL), ("unfused", cal.UNFUSED_LOSS_S_PER_CELL)):
        pts = [(r["tokens"] * 19360, r["ms"] * 1e-3) for r in rows if r["kind"] == kind]
        assert const == pytest.approx(sum(a * b for a, b in pts) / sum(a * a for a, _ in pts))

    assert cal.KDA_FORWARD_SHARE == pytest.approx(
        kda_forward_share(RESULTS / "h200_kda_own_gemms" / "profile_cp1_T131072.txt"), rel=1e-6)

    mhc = json.loads((RESULTS / "h200_step_time_slices" / "slice_131072.json").read_text())
    layer = {part["layer"]: part for part in mhc["layers"]}
    assert cal.MHC_S_PER_ROW == pytest.approx(layer[1]["mhc"]["s"] / (2 * layer[1]["mhc"]["rows"]))
    check_two_width_fits()

    dispatch = json.loads((RESULTS / "h100_moe_dispatch" / "moe_dispatch.json").read_text())
    assert cal.MOE_ALLTOALL_SHARE == pytest.approx(
        dispatch["alltoall"]["step_s"] / dispatch["allgather"]["step_s"])

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


# The stored runs ran megatron's allgather dispatcher (every recipe's then), which the MoE rates
# are measured under.
AS_STORED = "model.moe.dispatcher=allgather"


def _run(path: str, *overrides: str):
    run = json.loads((RESULTS / path).read_text())
    return run, load_recipe(run["recipe"], [*run["overrides"], AS_STORED, *overrides]).recipe


def check_two_width_fits():
    """The KDA, MoE, dense and head constants from the slice's and the share's parts: each run's
    part times, the model's own work counts of those recipes, and each fit solved again."""
    slice_run, slice_recipe = _run("h200_step_time_latent/slice_131072.json")
    share_run, share_recipe = _run("h200_step_time_share/share_1m.json")
    sl = {p["layer"]: p for p in slice_run["layers"]}
    sh = {p["layer"]: p for p in share_run["layers"]}
    assert (cal.KDA_SLICE_S, cal.DENSE_SLICE_S, cal.MOE_SLICE_S) == (
        sl[0]["attention_part"]["s"], sl[0]["mlp_part"]["s"], sl[1]["mlp_part"]["s"])
    assert (cal.KDA_SHARE_S, cal.DENSE_SHARE_S, cal.MOE_SHARE_S, cal.HEAD_SHARE_S) == (
        sh[0]["attention_part"]["s"], sh[0]["mlp_part"]["s"], sh[1]["mlp_part"]["s"], share_run["head"]["s"])
    assert (sh[1]["mlp_part"]["rows"], sh[0]["mlp_part"]["rows"], share_run["head"]["rows"]) == (
        cal.SHARE_MOE_ROWS, cal.SHARE_ROWS, cal.SHARE_ROWS)
    # The KDA cost model's layer of each recipe, as each run printed it.
    assert stm.kda_layer_s(slice_recipe)[0] == pytest.approx(cal.KDA_SLICE_LAYER_S)
    assert stm.kda_layer_s(share_recipe)[0] == pytest.approx(cal.KDA_SHARE_LAYER_S)
    assert sl[0]["attention_part"]["model_s"] == pytest.approx(cal.KDA_SLICE_LAYER_S)
    assert sh[0]["attention_part"]["model_s"] == pytest.approx(cal.KDA_SHARE_LAYER_S)
    # The model's GEMM counts of both recipes (the share's MoE at the rows it was fed).
    moe_share = share_recipe.model_copy(update={"data": share_recipe.data.model_copy(
        update={"seq_len": cal.SHARE_MOE_ROWS})})
    for recipe, flop in ((slice_recipe, cal.MOE_SLICE_FLOP), (moe_share, cal.MOE_SHARE_FLOP)):
        part = stm.moe_part(recipe)
        pair_s = stm.moe_pairs(recipe) * recipe.model.hidden_size * cal.MOE_S_PER_PAIR_ELEMENT
        assert (part.compute_s / part.layers - pair_s) * cal.MOE_FLOP_PER_S == pytest.approx(flop)
    for recipe, flop in ((slice_recipe, cal.DENSE_SLICE_FLOP), (share_recipe, cal.DENSE_SHARE_FLOP)):
        part = stm.dense_part(recipe)
        rows = rows_of(recipe).cp * recipe.model.hidden_size * cal.DENSE_S_PER_ROW_ELEMENT
        assert (part.compute_s / part.layers - rows) * cal.DENSE_FLOP_PER_S == pytest.approx(flop)
    # Each fit passes through both of its points.
    for recipe, kda_s, dense_s, moe_s in ((slice_recipe, cal.KDA_SLICE_S, cal.DENSE_SLICE_S, cal.MOE_SLICE_S),
                                          (share_recipe, cal.KDA_SHARE_S, cal.DENSE_SHARE_S, None)):
        kda, dense = stm.kda_part(recipe), stm.dense_part(recipe)
        assert kda.compute_s / kda.layers == pytest.approx(kda_s)
        assert dense.compute_s / dense.layers == pytest.approx(dense_s)
        if moe_s is not None:
            moe = stm.moe_part(recipe)
            assert moe.compute_s / moe.layers == pytest.approx(moe_s)
    moe = stm.moe_part(moe_share)
    assert moe.compute_s / moe.layers == pytest.approx(cal.MOE_SHARE_S)
    assert stm.head_part(share_recipe).compute_s == pytest.approx(cal.HEAD_SHARE_S)


@pytest.mark.parametrize("tokens", [32768, 65536])
def test_the_two_width_fits_predict_the_slice_parts_they_did_not_read(tokens):
    """The same run's slice at 32K and 64K tokens: each fitted part within 10% of its
    measured time (the fits read only the 131K parts and the share's)."""
    run, recipe = _run(f"h200_step_time_latent/slice_{tokens}.json")
    layer = {p["layer"]: p for p in run["layers"]}
    predicted = {"KDA": stm.kda_part(recipe), "dense": stm.dense_part(recipe),
                 "MoE": stm.moe_part(recipe), "DSA": stm.dsa_part(recipe)}
    measured = {"KDA": layer[0]["attention_part"]["s"], "dense": layer[0]["mlp_part"]["s"],
                "MoE": layer[1]["mlp_part"]["s"], "DSA": layer[3]["attention_part"]["s"]}
    got = {k: p.compute_s / p.layers for k, p in predicted.items()}
    got["head"], measured["head"] = stm.head_part(recipe).compute_s, run["head"]["s"]
    ratios = {k: got[k] / measured[k] for k in got}
    print(tokens, ratios)
    assert all(abs(r - 1) < 0.10 for r in ratios.values()), ratios


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
    # These runs attended with megatron-core's sparse-MLA kernels (the GPU default then).
    recipe = load_recipe("glm53_flash_slice", [f"model.num_layers={layers}", f"data.seq_len={tokens}",
                                               "model.dsa.kernel=fused", AS_STORED,
                                               *(LEVERS[name] for name in levers)]).recipe
    return recipe, row["step_time_s"]


@pytest.mark.parametrize("layers, tokens, levers, path", SLICE_RUNS,
                         ids=[f"{r[0]}layers-T{r[1]}{'-levers' if r[2] else ''}" for r in SLICE_RUNS])
def test_slice_step_within_10_percent_of_the_stored_step(layers, tokens, levers, path):
    recipe, measured = stored_slice(layers, tokens, levers, path)
    predicted = estimate_step_time(recipe).step_s
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


ONE_RUN = [("h200_step_time_latent/slice_32768.json", ()),
           ("h200_step_time_latent/slice_65536.json", ()),
           ("h200_step_time_latent/slice_131072.json", ()),
           ("h200_step_time_slices/slice_65536.json", ("model.dsa.kernel=fused",)),
           ("h200_step_time_slices/slice_131072.json", ("model.dsa.kernel=fused",)),
           *((f"h200_slice_kernels/slice_{kernel}_{tokens}.json", ())
             for kernel in ("latent", "fused") for tokens in (32768, 131072))]


@pytest.mark.parametrize("path, overrides", ONE_RUN, ids=[r[0] for r in ONE_RUN])
def test_slice_steps_of_one_device_run_within_10_percent(path, overrides):
    """The slice with every lever at 32K, 64K and 131K tokens, measured in one device run on our
    DSA kernels (the step: the median of three timed steps); an earlier run on megatron-core's
    at 64K and 131K (its 32K step is unusable: bench/results/h200_step_time_slices/README.md);
    and both kernel sets at 32K and 131K on one machine (bench/results/h200_slice_kernels/,
    the median of two timed steps). The constants read the 131K parts of the first run, never
    its steps."""
    run, recipe = _run(path, *overrides)
    auto_pick = run["choices"].get("model.dsa.kernel")  # where the run left the kernel to auto
    set_here = [o.split("=")[1] for o in run["overrides"] if o.startswith("model.dsa.kernel=")]
    assert recipe.model.dsa.kernel == (auto_pick.split(":")[0] if auto_pick else set_here[0])
    predicted = estimate_step_time(recipe).step_s
    assert predicted == pytest.approx(run["step"]["step_s"], rel=0.10), (predicted, run["step"]["step_s"])


SHARE_LAYERS = {"KDA block": 34, "DSA core": 11, "MoE block": 42, "dense block": 3, "mHC": 45,
                "head": 1}
"""The 1M recipe's layers of each part."""


def share_measured() -> dict[str, float]:
    """One rank's parts at the 1M recipe's share, per layer, from the stored rank-share runs: the
    blocks at the rank's widths fed its rows (bench/results/h200_step_time_share/), the DSA
    attention core on our kernels (65,536 queries x 64 heads over 1M keys, full recompute, the
    selection and the attention output kept, as the recipe runs it)."""
    share = json.loads((RESULTS / "h200_step_time_share" / "share_1m.json").read_text())
    layer = {p["layer"]: p for p in share["layers"]}
    dsa = json.loads((RESULTS / "h200_dsa_balanced_rows" / "layer_rows.json").read_text())["runs"][0]
    assert (dsa["kernel"], dsa["attention_forward"], dsa["keep_output"], dsa["tp_rows"]) == (
        "latent", "tilelang", True, "balanced")
    return {"KDA block": layer[0]["attention_part"]["s"],
            "DSA core": dsa["best"]["step_ms_full_recompute"] * 1e-3,
            "MoE block": layer[1]["mlp_part"]["s"], "dense block": layer[0]["mlp_part"]["s"],
            "mHC": layer[0]["mhc"]["s"], "head": share["head"]["s"]}


def share_predicted() -> dict[str, float]:
    """The model's same parts for the 1M recipe, per layer."""
    recipe = load_recipe("glm53_flash_1m", [AS_STORED]).recipe
    per_layer = lambda part: part.compute_s / part.layers
    return {"KDA block": per_layer(stm.kda_part(recipe)),
            "DSA core": sum(stm.dsa_core_s(recipe).values()),
            "MoE block": per_layer(stm.moe_part(recipe)), "dense block": per_layer(stm.dense_part(recipe)),
            "mHC": per_layer(stm.mhc_part(recipe)), "head": stm.head_part(recipe).compute_s}


def test_one_rank_compute_at_the_1m_share_within_10_percent_of_its_parts():
    """The sum over the recipe's layers, and the parts no constant reads from these runs: mHC
    (calibrated on the slice) and the KDA layer without its block against the emulated CP2
    layer at the share (bench/results/h200_kda_own_gemms/, no recompute, 8 heads in one
    call). The KDA, MoE, dense and head blocks are the fits' share points
    (``check_two_width_fits``), the DSA core is its rates' run: those agree by construction."""
    measured, predicted = share_measured(), share_predicted()
    total_m = sum(SHARE_LAYERS[k] * v for k, v in measured.items())
    total_p = sum(SHARE_LAYERS[k] * v for k, v in predicted.items())
    print(total_p, total_m, predicted, measured)
    assert total_p == pytest.approx(total_m, rel=0.10), (predicted, measured)
    assert predicted["mHC"] == pytest.approx(measured["mHC"], rel=0.10)
    kda = json.loads((RESULTS / "h200_kda_own_gemms" / "emulated_T1048576.json").read_text())
    recipe = load_recipe("glm53_flash_1m", []).recipe
    as_run = recipe.model_copy(update={
        "train": recipe.train.model_copy(update={"recompute": "none"}),
        "kda": recipe.kda.model_copy(update={"kernel_head_group": None})})
    assert stm.kda_layer_s(as_run)[0] == pytest.approx(kda["layer_cp2_state"]["ms"] * 1e-3, rel=0.10)


def test_doubling_one_measured_part_moves_the_prediction_by_that_part(monkeypatch):
    """Negative control: the MoE block's measured time doubled (its GEMM rate halved, its
    per-pair cost doubled) adds exactly the MoE compute once more to the step, and the slice
    comparison then fails."""
    recipe, measured = stored_slice(3, 49152, (), "slice_cp1_h200.json")
    before = estimate_step_time(recipe)
    moe = before.part("MoE").compute_s
    monkeypatch.setattr(cal, "MOE_FLOP_PER_S", cal.MOE_FLOP_PER_S / 2)
    monkeypatch.setattr(cal, "MOE_S_PER_PAIR_ELEMENT", cal.MOE_S_PER_PAIR_ELEMENT * 2)
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


def _doc_table(heading: str, index: int = 0) -> list[list[str]]:
    """The body rows of the section's ``index``-th table, cell by cell."""
    section = DOC.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    tables = [block for block in section.split("\n\n") if block.lstrip().startswith("|")]
    rows = [line for line in tables[index].strip().splitlines() if line.startswith("|")]
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
    for cells in _doc_table("## The 1M recipe", index=1):
        gpu, dispatcher = cells[0].lower(), cells[1].strip("`")
        got = estimate_step_time(load_recipe("glm53_flash_1m", [
            f"cluster.gpu={gpu}", f"model.moe.dispatcher={dispatcher}"]).recipe)
        assert [c.replace(",", "") for c in cells[2:7]] == [
            f"{got.step_s:.1f}", f"{got.tokens_per_s_per_gpu:.0f}", f"{got.compute_s:.1f}",
            f"{got.comm_s:.1f}", f"{got.part('MoE').comm_s:.1f}"], cells
    for cells in _doc_table("## Beyond one machine, on paper"):
        gpus, mesh, T = int(cells[0]), cells[1], cells[2]
        cp = int(mesh.split("CP")[1])
        loaded = load_recipe("glm53_flash_1m", [f"parallel.cp={cp}", f"run.num_workers={gpus}",
                                                f"data.seq_len={2**20 * int(T[:-1])}"])
        got = estimate_step_time(loaded.recipe)
        assert cells[3].startswith(f"`{loaded.recipe.kda.cp_exchange}`"), cells
        assert cells[4:8] == [f"{got.step_s:.1f}", f"{got.tokens_per_s_per_gpu:.0f}",
                              f"{got.compute_s:.1f}", f"{got.comm_s:.1f}"], cells


def test_each_dsa_kernel_setting_moves_its_own_stage():
    """model.dsa.latent.indexer_scores=fp8 scales the DSA core's indexer and nothing else;
    model.dsa.latent.deterministic_backward its attention backward and attention_forward=flashmla
    its attention forward, each nothing else, by the measured ratios."""
    def core(*overrides):
        return stm.dsa_core_s(load_recipe("glm53_flash_1m", list(overrides)).recipe)

    base = core()
    fp8 = core("model.dsa.latent.indexer_scores=fp8")
    ordered = core("model.dsa.latent.deterministic_backward=true")
    flashmla = core("model.dsa.latent.attention_forward=flashmla")
    assert flashmla["attention_fwd"] == pytest.approx(
        base["attention_fwd"] * cal.DSA_FLASHMLA_FORWARD_SHARE)
    assert fp8["indexer"] == pytest.approx(base["indexer"] * cal.DSA_FP8_INDEXER_SHARE)
    assert ordered["attention_bwd"] == pytest.approx(
        base["attention_bwd"] * cal.DSA_ORDERED_BACKWARD_SHARE)
    for name in base:
        if name != "indexer":
            assert fp8[name] == base[name], name
        if name != "attention_bwd":
            assert ordered[name] == base[name], name
        if name != "attention_fwd":
            assert flashmla[name] == base[name], name


# --- LoRA (train.lora; steptime/lora.py) -----------------------------------------------------

LORA_1M = ["train.lora.rank=64", 'train.lora.exclude_modules=["*.experts.*"]']


def test_lora_rank_zero_changes_no_number():
    """Rank 0 is LoRA off whatever the rest of the section says: every part bitwise equal."""
    plain = estimate_step_time(load_recipe("glm53_flash_1m").recipe)
    off = estimate_step_time(load_recipe("glm53_flash_1m", [
        "train.lora.rank=0", "train.lora.alpha=3", 'train.lora.target_modules=["linear_fc1"]']).recipe)
    assert plain == off


def _base_dw_flops(recipe) -> dict[str, float]:
    """One weight-gradient GEMM of every base linear of each part per step (= one forward GEMM),
    from the parameter census and the rows each linear runs on; the linears whose adapted weight
    the model reads keep theirs (``memory.lora.Linear.reads_weight``)."""
    from skyrl_megatron_kda.memory.lora import local_factors, lora_linears
    from skyrl_megatron_kda.steptime.moe import moe_pairs

    m, p, k, e = recipe.model, recipe.parallel, recipe.kda, recipe.model.moe
    rows, D = rows_of(recipe), m.hidden_size
    per = {g.component: g.numel for g in rank_parameters(recipe) if g.dtype_bytes == 2}
    kept = {"kda": 0.0, "dsa": 0.0}
    for lin in lora_linears(recipe):
        if lin.reads_weight:
            (_, a_in), (b_out, _) = local_factors(recipe, lin)
            kept[m.layer_types()[lin.layer]] += 2 * rows.cp * a_in * b_out
    h, K, n_kda = k.num_heads // p.tp, k.head_dim, m.layer_types().count("kda")
    kda = 2 * rows.cp * (3 * h * K * D + h * D + (k.gate_low_rank + k.output_gate_low_rank)
                         * (D + h * K) + h * K * D) * n_kda
    n_moe = m.mlp_types().count("moe")
    moe = n_moe * (2 * moe_pairs(recipe) * 3 * D * (e.ffn_hidden_size // p.etp)
                   + 2 * rows.cp * 3 * D * e.ffn_hidden_size * e.num_shared_experts // p.tp
                   + 2 * rows.sp * D * e.num_experts)
    return {"KDA attention": kda - kept["kda"], "DSA attention": 2 * rows.cp * per["dsa"] - kept["dsa"],
            "MoE": moe, "dense MLP": 2 * rows.cp * per["dense_mlp"]}


def test_lora_skips_the_base_weight_gradients_at_1m():
    """Under LoRA each part's compute drops by its frozen linears' weight-gradient GEMMs (derived
    from the census and the rows, at the part's GEMM rate) and rises by its adapters; the
    optimizer steps the adapters only, and its gradient reduction carries their bytes. The 1M
    step is faster by about the weight-gradient share."""
    from skyrl_megatron_kda.steptime.lora import adapter_comm_s, adapter_compute_s, part_linears

    recipe = load_recipe("glm53_flash_1m", LORA_1M).recipe
    base, lora = estimate_step_time(load_recipe("glm53_flash_1m").recipe), estimate_step_time(recipe)
    assert recipe.model.moe.dispatcher == "alltoall"  # its measured share scales the MoE's GEMMs
    rates = {"KDA attention": (cal.GEMM_FLOP_PER_S, "kda"),
             "DSA attention": (cal.GEMM_FLOP_PER_S, "dsa"),
             "MoE": (cal.MOE_FLOP_PER_S / cal.MOE_ALLTOALL_SHARE, "moe"),
             "dense MLP": (cal.DENSE_FLOP_PER_S, "dense")}
    saved = added = exchanged = 0.0
    for name, flops in _base_dw_flops(recipe).items():
        rate, part = rates[name]
        adapters = sum(adapter_compute_s(recipe, lin) for lin in part_linears(recipe, part))
        got = base.part(name).compute_s - lora.part(name).compute_s
        assert got == pytest.approx(flops / rate - adapters, rel=1e-9), (name, got, flops / rate)
        saved += flops / rate
        added += adapters
        exchanged += sum(adapter_comm_s(recipe, lin) for lin in part_linears(recipe, part))
    assert added < 0.2 * saved, (added, saved)  # r-wide GEMMs: small beside the base's
    assert lora.part("optimizer").compute_s < base.part("optimizer").compute_s / 100
    assert lora.part("optimizer").comm_s < base.part("optimizer").comm_s / 5
    optimizer = base.part("optimizer").total_s - lora.part("optimizer").total_s
    # the step: the weight gradients and the optimizer saved, the adapters and their exchanges added
    assert base.step_s - lora.step_s == pytest.approx(saved + optimizer - added - exchanged, rel=1e-9)
    assert base.step_s - lora.step_s > 0.75 * saved
    for name in ("mHC", "embedding + head + loss", "host-offload copies"):
        assert base.part(name) == lora.part(name)
