"""``bench/dsa_rank_share.py``'s arithmetic on CPU: the module loads without CUDA or tilelang, its
projection GEMMs are the layer's at the 1M share, and its FLOP, byte and step counts agree with
counts made here by hand; the projection stage runs on tiny shapes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from skyrl_megatron_kda.dsa.sparse_mla import split_kv_up_weight
from skyrl_megatron_kda.recipes import load_recipe
from tests.support.sparse_mla_ops import torch_sparse_mla_ops

BENCH = Path(__file__).resolve().parents[1] / "bench" / "dsa_rank_share.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dsa_rank_share", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# Distinct widths, so a GEMM that reads the wrong one shows.
TINY = dict(hidden=8, q_lora=6, kv_lora=4, heads=4, qk=3, v=5, idx_heads=2, idx_dim=3, tp=2)


def test_sizes_are_the_recipes(bench):
    recipe = load_recipe("glm53_flash_1m", []).recipe
    m, d, p = recipe.model, recipe.model.dsa, recipe.parallel
    assert bench.MLASizes() == bench.MLASizes(
        hidden=m.hidden_size, q_lora=d.q_lora_rank, kv_lora=d.kv_lora_rank, heads=d.num_heads,
        qk=d.qk_nope_head_dim + d.qk_rope_head_dim, v=d.v_head_dim, idx_heads=d.index_num_heads,
        idx_dim=d.index_head_dim, tp=p.tp)


def test_projection_gemms_at_the_share(bench):
    """The heads split's rank: its CP rank's 524,288 rows with 1/8 of the widths; the sequence
    split's: its own 65,536 rows with the whole weights, the same FLOPs; the indexer on its
    own 65,536 rows either way (the caller passes the CP rank's under heads)."""
    shapes = {split: [(g.name, g.rows, g.fan_in, g.fan_out, g.trainable)
                      for g in bench.projection_gemms(524288, 65536, split=split)]
              for split in ("heads", "sequence")}
    indexer = [
        ("indexer_wq_b", 65536, 1536, 4096, False),
        ("indexer_wk", 65536, 4096, 128, False),
        ("indexer_kpool_gate", 65536, 4096, 128, False),
        ("indexer_weights", 65536, 4096, 32, False),
    ]
    assert shapes["heads"] == [
        ("q_down", 524288, 4096, 192, True),
        ("kv_down", 524288, 4096, 64, True),
        ("q_up", 524288, 1536, 2048, True),
        *indexer,
        ("out", 524288, 2048, 4096, True),
    ]
    assert shapes["sequence"] == [
        ("q_down", 65536, 4096, 1536, True),
        ("kv_down", 65536, 4096, 512, True),
        ("q_up", 65536, 1536, 16384, True),
        *indexer,
        ("out", 65536, 16384, 4096, True),
    ]
    flops = {split: bench.stage_flops((0.0, 0.0), 0.0, bench.projection_gemms(524288, 65536, split=split))
             for split in shapes}
    assert flops["heads"] == flops["sequence"]


def test_projection_shapes_run_on_cpu(bench):
    """``--projection-shapes``: both splits' projection steps, and their ratio."""
    result = bench.projection_shapes(10, 5, torch.device("cpu"), bench.MLASizes(**TINY), repeats=1)
    for split in ("heads", "sequence"):
        t = result[split]
        assert t["projections_step_ms"] == pytest.approx(
            2 * t["proj_fwd_ms"] + t["proj_bwd_ms"] + t["indexer_proj_ms"])
    assert result["sequence_over_heads"] == pytest.approx(
        result["sequence"]["projections_step_ms"] / result["heads"]["projections_step_ms"])


def test_projection_flops_by_hand(bench):
    gemms = bench.projection_gemms(10, 5, bench.MLASizes(**TINY))
    # 2 x rows x in x out: q down 10x8x3, kv down 10x8x2, q up 10x6x(2 heads x 3), out 10x(2 x 5)x8
    trainable = 2 * (10 * 8 * 3 + 10 * 8 * 2 + 10 * 6 * 6 + 10 * 10 * 8)
    # wq_b 5x6x(2 x 3), wk 5x8x3, kpool gate 5x8x3, head weights 5x8x2
    frozen = 2 * (5 * 6 * 6 + 5 * 8 * 3 + 5 * 8 * 3 + 5 * 8 * 2)
    assert (trainable, frozen) == (3120, 1000)
    flops = bench.stage_flops((7.0, 11.0), 13.0, gemms)
    assert flops["proj_fwd_ms"] == trainable
    assert flops["proj_bwd_ms"] == 2 * trainable
    assert flops["indexer_proj_ms"] == frozen
    assert flops["projections_step_ms"] == 4 * trainable + frozen
    assert flops["step_ms_full_recompute"] == 13 + 2 * 7 + 11
    assert flops["layer_step_ms"] == 13 + 2 * 7 + 11 + 4 * trainable + frozen


def test_projection_stage_runs_on_cpu(bench):
    gemms = bench.projection_gemms(10, 5, bench.MLASizes(**TINY))
    times = bench.time_projections(gemms, torch.device("cpu"))
    assert set(times) == {"proj_fwd_ms", "proj_bwd_ms", "indexer_proj_ms"}
    assert all(t > 0 for t in times.values()), times


def test_exchange_bytes_and_model(bench):
    b = bench.exchange_bytes(524288)
    # 7/8 of the share's 65,536 rows: the q latent (1536) in, the output (4096) back, the
    # indexer's 32 head weights; 7/8 of the five whole weights.
    assert b["rows_in"] == 65536 * 1536 * 2 * 7 / 8
    assert b["rows_out"] == 65536 * 4096 * 2 * 7 / 8
    assert b["index_weights"] == 65536 * 32 * 2 * 7 / 8
    weights = 4096 * 1536 + 4096 * 512 + 1536 * 64 * 256 + 512 * 64 * 512 + 64 * 256 * 4096
    assert b["weights"] == weights * 2 * 7 / 8
    # Each exchange costs bytes / its bandwidth + 1 ms; three passes of rows and weights, the
    # indexer's once.
    link = SimpleNamespace(a2a_bandwidth_gib_s=1.75, bandwidth_gib_s=3.5, latency_us=1000.0)
    gib = 2**30
    expected = (3 * ((b["rows_in"] + b["rows_out"]) / (1.75 * gib) + b["weights"] / (3.5 * gib)
                     + 3e-3) + b["index_weights"] / (1.75 * gib) + 1e-3) * 1e3
    model = bench.all_to_all_model(524288, "sequence", link)
    assert model["all_to_all_model_ms"] == pytest.approx(expected)
    assert model["all_to_all_gib"] == pytest.approx(
        (3 * (b["rows_in"] + b["rows_out"] + b["weights"]) + b["index_weights"]) / gib)
    assert bench.all_to_all_model(524288, "heads", link) == dict(all_to_all_model_ms=0.0,
                                                                 all_to_all_gib=0.0)
    # On the recipe's NVLink: under 1 GiB a step, against 10.5 GiB for the queries' and
    # outputs' all-to-alls of every head the layer ran before.
    nvlink = load_recipe("glm53_flash_1m", []).recipe.cluster.intra_node
    assert bench.all_to_all_model(524288, "sequence", nvlink)["all_to_all_gib"] < 2.5


def test_attention_and_indexer_flops(bench):
    # 3 queries x 2 heads x 10 keys: 2 x 60 x (576 + 512) forward, 2 x 60 x (1024 + 1728) backward
    assert bench.attention_flops(3, 2, 10.0) == (120 * 1088, 120 * 2752)
    # Positions 2, 3, 10, 11 see 0, 1, 2 and 3 complete pools of 4: 6 (query, pool) pairs.
    pos = torch.tensor([2, 3, 10, 11])
    assert bench.indexer_score_flops(pos) == 6 * 2 * 32 * 128


def test_layer_step_sums_the_stages(bench):
    core = dict(step_ms_full_recompute=100.0)
    proj = dict(proj_fwd_ms=2.0, proj_bwd_ms=3.0, indexer_proj_ms=1.0)
    step = bench.layer_step(core, proj, dict(all_to_all_model_ms=5.0))
    assert step == dict(projections_step_ms=8.0, layer_step_ms=113.0)


def test_stage_table_compares_kernel_sets(bench):
    keys = [key for _, key in bench.STAGES]
    runs = [dict(label=k, best={key: ms for key in keys},
                 tflop_s={key: 2.0 for key in keys if key != "all_to_all_model_ms"})
            for k, ms in (("latent", 100.0), ("fused", 150.0), ("latent+flashmla", 80.0))]
    lines = bench.stage_table(runs).splitlines()
    assert len(lines) == 1 + len(bench.STAGES) and "fused/latent" in lines[0]
    assert "latent+flashmla/latent" in lines[0]
    assert lines[1].split()[-8:] == ["100.0", "2.0", "150.0", "2.0", "80.0", "2.0", "1.500",
                                     "0.800"]
    a2a = next(line for line in lines if line.startswith("TP exchanges"))
    assert a2a.split()[-8:] == ["100.0", "-", "150.0", "-", "80.0", "-", "1.500", "0.800"]


def _layer_inputs(bench, queries=7, heads=2, keys=40, topk=6):
    """The bench's layer inputs at its widths, in fp32, few rows; distinct causal indices with a
    padded slot (-1) in every row."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(keys - queries, keys)
    idx = torch.stack([torch.randperm(int(p) + 1, generator=g)[:topk] for p in pos])
    idx[:, -1] = -1
    x = dict(pos=pos, heads=heads,
             q_nope=torch.randn(queries, heads, bench.DN, generator=g),
             latent=torch.randn(keys, bench.LATENT, generator=g),
             weight=torch.randn(heads * (bench.DN + bench.DV), bench.LATENT, generator=g) * 0.05)
    return x, idx


def test_kernel_alone_gets_what_the_layer_gives_it(bench):
    """The forward kernel timed alone runs on the layer's own kernel inputs: its outputs, through
    the value projection, are the layer's forward (torch stand-in kernels, megatron's widths);
    an index shifted by one in one block is far off."""
    x, idx = _layer_inputs(bench)
    kernels, block = torch_sparse_mla_ops(), 3
    _, w_uv = split_kv_up_weight(x["weight"], x["heads"], bench.DN, bench.DV)

    def through_kernel(inputs):
        out = torch.cat([kernels.forward(q, kv, i, bench.DN ** -0.5)[0] for q, kv, i in inputs])
        return torch.einsum("bhr,hvr->bhv", out[..., :bench.LATENT], w_uv)

    inputs = bench.kernel_forward_inputs(x, idx, block, kernels)
    assert [q.shape[0] for q, _, _ in inputs] == [3, 3, 1]
    layer = bench.attention(x, idx, "latent", block, kernels)
    assert torch.allclose(through_kernel(inputs), layer, rtol=1e-5, atol=1e-5)
    q, kv, i = inputs[1]
    shifted = inputs[:1] + [(q, kv, torch.where(i >= 0, (i + 1) % kv.shape[0], i))] + inputs[2:]
    assert (through_kernel(shifted) - layer).abs().max() > 0.1 * layer.abs().max()
    assert bench.kernel_forward_ms(x, idx, block, kernels) > 0


def test_stage_table_marks_a_stage_a_set_did_not_time(bench):
    """The torch kernel set has no kernel-alone forward: its cell and ratio print '-'."""
    keys = [key for _, key in bench.STAGES]
    timed_all = dict(label="latent", best={key: 10.0 for key in keys}, tflop_s={})
    torch_set = dict(label="torch", best={k: 20.0 for k in keys if k != "attn_fwd_kernel_ms"},
                     tflop_s={})
    lines = bench.stage_table([timed_all, torch_set]).splitlines()
    row = next(line for line in lines if line.startswith("attention forward, kernel alone"))
    assert row.split()[-5:] == ["10.0", "-", "-", "-", "-"]
    forward = next(line for line in lines if line.startswith("attention forward "))
    assert forward.split()[-5:] == ["10.0", "-", "20.0", "-", "2.000"]


def test_the_sequence_split_rank_holds_the_layers_balanced_rows(bench):
    """``--tp-rows balanced`` (the default) is the last TP rank's share as the layer takes it:
    a piece of each of CP rank 0's quarters, its mean position the CP rank's; ``slice`` is its
    contiguous SP slice, the rows nearest the end."""
    keys = 1 << 14
    cp_rows = bench.rank_positions(keys, "heads")
    balanced = bench.rank_positions(keys, "sequence")
    last = bench.rank_positions(keys, "sequence", "slice")
    assert balanced.numel() == last.numel() == cp_rows.numel() // bench.TP
    assert balanced.unique().numel() == balanced.numel() and bool(torch.isin(balanced, cp_rows).all())
    assert balanced.double().mean() == cp_rows.double().mean() == keys / 2 - 0.5
    assert torch.equal(last, torch.arange(keys - last.numel(), keys))
    assert int(balanced.min()) < keys // 4 <= int(balanced.max()) < keys - last.numel()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_the_bench_says_so_in_one_line():
    import subprocess

    done = subprocess.run([sys.executable, str(BENCH), "--projection-shapes"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("needs a CUDA GPU (the kernels and the "
                                                         "timings are the GPU's)")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, error", [
    (["--kernel", "latent", "--latent-configs", "[{"], "--latent-configs is not JSON"),
    (["--kernel", "latent", "--latent-configs", '[{"fwd": {}}]'],
     '--latent-configs entries are {"forward": {...}, "backward": {...}}, got {"fwd": {}}'),
    (["--kernel", "fused", "--latent-configs", '[{"forward": {"ping_pong": true}}]'],
     "--latent-configs needs --kernel latent"),
    (["--kernel", "latent", "--latent-configs", '[{"backward": {"stack": true}}]'],
     "--latent-configs: backward keywords ['stack'] not among")])
def test_latent_configs_it_cannot_run_are_one_line_before_the_gpu(args, error):
    """Checked before it looks for a GPU, so these refusals show on CPU too."""
    import subprocess

    done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert error in done.stderr.strip().splitlines()[-1]
