"""The step-time model (``skyrl_megatron_kda/steptime``) against the stored runs it comes from.

Every calibration constant is derived again here from the files under ``bench/results/`` that
its comment names; the model's slice predictions are compared with the slice steps measured in
the same runs (whole steps, which no constant reads), and its 1M-share compute with the sum of
the parts measured at that share. A negative control doubles one measured part and checks that
the prediction moves by the expected amount, and that the comparison then fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_megatron_kda import cli
from skyrl_megatron_kda.kda.cost import estimate as kda_estimate
from skyrl_megatron_kda.kda.exchanges import ExchangeShape
from skyrl_megatron_kda.memory.offload import offloaded_tensor_bytes
from skyrl_megatron_kda.recipes import load_recipe
from skyrl_megatron_kda.steptime import calibration as cal
from skyrl_megatron_kda.steptime import estimate_step_time
from skyrl_megatron_kda.steptime import model as stm

RESULTS = Path(__file__).parents[1] / "bench" / "results"
STEP_RUNS = RESULTS / "h200_step_time"
SLICE_LENGTHS = (32768, 65536, 131072)
SLICE_LEVERS = ["train.offload_activations=true", "train.loss_chunk_tokens=8192",
                "train.grad_reduce_in_fp32=false", "kda.kernel_head_group=16",
                "train.moe_chunk_tokens=8192"]
ONE_GPU = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.etp=1",
           "parallel.sequence_parallel=false", "run.num_workers=1"]
SHARE = ["model.num_layers=2", "kda.num_heads=8", "kda.kernel_head_group=4",
         "model.moe.num_experts=9", "model.moe.ffn_hidden_size=1024",
         "model.dense_ffn_hidden_size=1536", "model.vocab_size=19360", "data.seq_len=524288",
         "train.moe_chunk_tokens=8192", "train.loss_chunk_tokens=8192"]
"""bench/step_time_runs.sh's ``share`` recipe: the 1M recipe's per-rank widths on one GPU."""


def slice_recipe(seq_len: int):
    return load_recipe("glm53_flash_slice", [*ONE_GPU, *SLICE_LEVERS, f"data.seq_len={seq_len}"]).recipe


def slice_run(seq_len: int) -> dict:
    return json.loads((STEP_RUNS / f"slice_{seq_len}.json").read_text())


def _layer(run: dict, attention: str, mlp: str) -> dict:
    return next(x for x in run["layers"] if x["attention"] == attention and x["mlp"] == mlp)


def _kda_terms(recipe) -> tuple[float, float, float]:
    """(cost model forward+backward compute, kernel + elementwise, GEMMs) of one KDA layer with
    the recipe's head groups, as ``model.kda_part`` prices them."""
    part = stm.kda_part(recipe.model_copy(update={"train": recipe.train.model_copy(update={"recompute": "none"})}))
    k = recipe.kda
    est = kda_estimate(k.cp_exchange, ExchangeShape.of(recipe), False, recipe.cluster,
                       gate_ranks=(k.gate_low_rank, k.output_gate_low_rank))
    n = recipe.model.layer_types().count("kda")
    fwd_bwd = part.compute_s / n
    return fwd_bwd, fwd_bwd - est.gemm_s, est.gemm_s


def derive_slice_constants() -> dict[str, float]:
    """Each rate of ``calibration.py``'s last section from the three slice runs' parts."""
    num = {k: 0.0 for k in ("kda", "dsa", "moe", "dense", "mhc", "emb", "opt")}
    den = dict(num)
    for T in SLICE_LENGTHS:
        run, recipe = slice_run(T), slice_recipe(T)
        fwd_bwd, kernel_elem, gemm = _kda_terms(recipe)
        num["kda"] += _layer(run, "kda", "moe")["attention_part"]["s"] - fwd_bwd - gemm / 3
        den["kda"] += kernel_elem
        dsa = _layer(run, "dsa", "moe")["attention_part"]
        n_dsa = recipe.model.layer_types().count("dsa")
        core = sum(stm.dsa_core_s(recipe).values())
        proj = 2 * T * (stm._layer_params(recipe, "dsa", n_dsa) * 4
                        + stm._layer_params(recipe, "dsa_indexer", n_dsa) * 2)
        num["dsa"] += dsa["s"] - core - stm._gemm_s(proj)
        den["dsa"] += dsa["rows"]
        moe = _layer(run, "kda", "moe")["mlp_part"]
        num["moe"] += stm.moe_part(recipe).compute_s * cal.MOE_FLOP_PER_S / recipe.model.mlp_types().count("moe")
        den["moe"] += moe["s"]
        dense = _layer(run, "kda", "dense")["mlp_part"]
        num["dense"] += stm.dense_part(recipe).compute_s * cal.DENSE_FLOP_PER_S
        den["dense"] += dense["s"]
        for layer in run["layers"]:
            num["mhc"] += layer["mhc"]["s"] / 2  # both modules of the layer were timed
            den["mhc"] += layer["mhc"]["rows"]
        num["emb"] += run["embedding"]["s"]
        den["emb"] += run["embedding"]["rows"]
        num["opt"] += run["step"]["optimizer_s"] + run["step"]["finalize_s"]
        den["opt"] += stm.optimizer_part(recipe).compute_s / cal.OPTIMIZER_S_PER_ELEMENT
    return {
        "KDA_FORWARD_SHARE": num["kda"] / den["kda"],
        "DSA_OTHER_S_PER_ROW": num["dsa"] / den["dsa"],
        "MOE_FLOP_PER_S": num["moe"] / den["moe"],
        "DENSE_FLOP_PER_S": num["dense"] / den["dense"],
        "MHC_S_PER_ROW": num["mhc"] / den["mhc"],
        "EMBEDDING_S_PER_ROW": num["emb"] / den["emb"],
        "OPTIMIZER_S_PER_ELEMENT": num["opt"] / den["opt"],
    }


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

    runs = json.loads((RESULTS / "h200_slice_memory_levers_131k" / "slice.json").read_text())
    plain = next(r for r in runs if r["seq_len"] == 32768 and r["levers"] == [])
    offload = next(r for r in runs if r["seq_len"] == 32768 and r["levers"] == ["offload"])
    recipe = load_recipe("glm53_flash_slice", [*ONE_GPU, "data.seq_len=32768",
                                               "train.offload_activations=true"]).recipe
    moved_gib = 2 * sum(offloaded_tensor_bytes(recipe)) / 2**30  # out in forward, back in backward
    assert cal.OFFLOAD_EXPOSED_GIB_S == pytest.approx(moved_gib / (offload["step_time_s"] - plain["step_time_s"]))


def test_slice_constants_derive_again():
    for name, value in derive_slice_constants().items():
        assert getattr(cal, name) == pytest.approx(value, rel=1e-3), name


@pytest.mark.parametrize("seq_len", SLICE_LENGTHS)
def test_slice_step_within_10_percent_of_the_measured_step(seq_len):
    measured = slice_run(seq_len)["step"]["step_s"]
    predicted = estimate_step_time(slice_recipe(seq_len)).step_s
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


def share_measured() -> dict[str, float]:
    """One rank's compute at the 1M recipe's share, per layer type, from the measured parts:
    the share run (KDA at 8 heads on the CP rank's 524,288 rows, MoE with the rank's 9 experts
    fed 131,072 rows (their 1,048,576 routed pairs), the dense FFN's 1,536 columns over 524,288
    rows, mHC over 65,536 rows), the DSA core of the stored rank-share run, the fused loss at
    524,288 rows of the vocabulary shard."""
    share = json.loads((STEP_RUNS / "share_1m.json").read_text())
    dsa = json.loads((RESULTS / "h200_dsa_kept_selection" / "dsa_rank_share_sequence.json").read_text())
    kda = _layer(share, "kda", "moe")
    dense = _layer(share, "kda", "dense")
    return {
        "KDA attention": 34 * kda["attention_part"]["s"],
        "DSA attention core": 11 * dsa["best"]["step_ms_full_recompute"] * 1e-3,
        "MoE": 42 * kda["mlp_part"]["s"],
        "dense MLP": 3 * dense["mlp_part"]["s"],
        "mHC": 45 * kda["mhc"]["s"],
        "head + loss": share["head"]["s"],
    }


def share_predicted() -> dict[str, float]:
    recipe = load_recipe("glm53_flash_1m", []).recipe
    step = estimate_step_time(recipe)
    core = 11 * sum(stm.dsa_core_s(recipe).values())
    return {
        "KDA attention": step.part("KDA attention").compute_s,
        "DSA attention core": core,
        "MoE": step.part("MoE").compute_s,
        "dense MLP": step.part("dense MLP").compute_s,
        "mHC": step.part("mHC").compute_s,
        "head + loss": step.part("embedding + head + loss").compute_s,
    }


def test_one_rank_compute_at_the_1m_share_within_10_percent_of_its_parts():
    measured, predicted = share_measured(), share_predicted()
    assert sum(predicted.values()) == pytest.approx(sum(measured.values()), rel=0.10), (predicted, measured)


def test_doubling_one_measured_part_moves_the_prediction_by_that_part(monkeypatch):
    """Negative control: the MoE rate halved (its measured time doubled) adds exactly the MoE
    compute once more to the step, and the slice comparison then fails."""
    recipe = slice_recipe(65536)
    before = estimate_step_time(recipe)
    moe = before.part("MoE").compute_s
    monkeypatch.setattr(cal, "MOE_FLOP_PER_S", cal.MOE_FLOP_PER_S / 2)
    after = estimate_step_time(recipe)
    assert after.step_s - before.step_s == pytest.approx(moe, rel=1e-9)
    measured = slice_run(65536)["step"]["step_s"]
    assert abs(after.step_s / measured - 1) > 0.10


def test_plan_prints_the_step_time(capsys):
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    step = estimate_step_time(load_recipe("glm53_flash_1m", []).recipe)
    assert f"step: {step.step_s:.2f} s, {step.tokens_per_s_per_gpu:,.0f} tokens/s/GPU" in out
    for part in ("KDA attention", "DSA attention", "MoE", "dense MLP", "mHC", "optimizer",
                 "host-offload copies"):
        assert any(line.startswith(part) for line in out.splitlines()), part
    assert "dominant: " in out and "lever: " in out
    assert "64 heads x 128" in out and "per-GPU memory estimate" in out  # the earlier sections stay
