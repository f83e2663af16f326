"""The fine-tune example (``examples/finetune_1m/run_cpu.py``) end to end on CPU, as a user runs
it: HF weights -> ``skyrl-kda run`` (4 Ray ranks, TP2 x CP2 +SP, EP2) stopped by SIGTERM ->
``--resume`` -> ``skyrl-kda export`` -> transformers.

Checks: the resumed run's metrics equal an uninterrupted run's bit for bit; the first step's loss
equals transformers' glm5_next with the initial weights on the same rows (so the weights reached
the DDP-wrapped model on every rank of the mesh); the exported folder loads in transformers and
gives the logits of our model holding the final checkpoint (loaded at TP1 from the sharded
checkpoint, not through HF), while the initial weights give other logits.
"""

from __future__ import annotations

import importlib.util
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cli_runs
from tests.support.ranks import run_ranks
from tests.test_checkpoint import EXACT_KEYS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_1m" / "run_cpu.py"
STEPS, STOP_AFTER = 4, 2  # SIGTERM once 2 steps are logged: it stops after step 2 or 3
TOL = 1e-4
# The tiny recipe's DSA keeps 64 keys (index_topk) chosen by 2 indexer heads: beyond 64 tokens
# exact-zero pool scores tie at the boundary (6 of 96 queries on random tokens) and transformers
# breaks the ties differently from dsa/layer.py, so the parity inputs stay within 64 tokens (the
# example's documents too); test_glm_model checks the top-k selection with 8 indexer heads.
LOGIT_TOKENS = 64
TP1 = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=false",
       "run.num_workers=1"]


def _example_module():
    spec = importlib.util.spec_from_file_location("finetune_run_cpu", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> dict:
    """The example's JSON summary (its last stdout line)."""
    work = tmp_path_factory.mktemp("finetune")
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(work), "--steps", str(STEPS),
                           "--stop-after", str(STOP_AFTER)],
                          capture_output=True, text=True, env=cli_runs.env(), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parity(example) -> dict:
    return run_ranks(1, _parity_rank, example)[0]


def _rel(a, b) -> float:
    from skyrl_megatron_kda.kda.parity import relative_error

    return relative_error(a.detach(), b.detach())


def _hf_model(path: str):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(path, attn_implementation="eager").float()


def _first_step_hf_loss(hf, recipe) -> float:
    """Token-masked mean cross entropy of transformers over the rows of the run's first step,
    each packed document on its own."""
    import torch
    import torch.nn.functional as F

    from skyrl_megatron_kda.train.data import build_loader

    loader = build_loader(recipe.data, seed=recipe.train.seed, parallel=recipe.parallel,
                          layout=recipe.parallel.cp_layout, vocab_size=recipe.model.vocab_size)
    total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for _ in range(recipe.data_parallel_size * recipe.data.micro_batch_size):
        row = loader.next_row()
        starts, real = row.cu_seqlens[:-1].tolist(), row.cu_seqlens_unpadded.diff().tolist()
        for lo, n in zip(starts, real):
            if n == 0:
                continue
            with torch.no_grad():
                logits = hf(input_ids=row.tokens[None, lo:lo + n]).logits[0].float()
            ce = F.cross_entropy(logits, row.labels[lo:lo + n], reduction="none")
            mask = row.loss_mask[lo:lo + n].double()
            total, count = total + (ce.double() * mask).sum(), count + mask.sum()
    return float(total / count)


def _parity_rank(rank, world, example) -> dict:
    import sys

    sys.modules["fla"] = None  # transformers would pick fla's GPU-only kernels otherwise
    import torch
    from megatron.core import parallel_state

    from skyrl_megatron_kda.train.checkpoint import latest_checkpoint
    from skyrl_megatron_kda.train.export import load_run_model, run_recipe

    run_dir = example["run_dir"]
    recipe = run_recipe(run_dir)
    first = json.loads(Path(run_dir, "metrics.jsonl").read_text().splitlines()[0])
    hf_in = _hf_model(example["hf_in"])
    hf_loss = _first_step_hf_loss(hf_in, recipe)

    ckpt = latest_checkpoint(run_dir)
    model = load_run_model(run_recipe(run_dir, TP1), ckpt)
    ids = torch.randint(3, recipe.model.vocab_size, (1, LOGIT_TOKENS),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        exported = _hf_model(example["hf_out"])(input_ids=ids).logits.float()
        initial = hf_in(input_ids=ids).logits.float()
    parallel_state.destroy_model_parallel()
    return dict(first_loss=first["loss"], hf_loss=hf_loss, ckpt=ckpt.name,
                export_vs_ours=_rel(exported, ours), initial_vs_ours=_rel(initial, ours))


def test_example_stops_on_sigterm_and_resumed_run_repeats_the_uninterrupted_one(example):
    assert example["stop_exit_code"] == 128 + signal.SIGTERM
    assert STOP_AFTER <= example["stopped_at"] < STEPS, "stopped too late to test a resume"
    resumed = cli_runs.metrics(Path(example["run_dir"]))
    example_module = _example_module()
    reference_dir = Path(example["run_dir"]).parent / "uninterrupted"
    cmd = example_module.train_command(Path(example["hf_in"]), Path(example["corpus"]),
                                       reference_dir, STEPS)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_runs.env())
    rc, err = cli_runs.finish(proc)
    assert rc == 0, err[-3000:]
    reference = cli_runs.metrics(reference_dir)
    assert len(reference) == STEPS
    # Identical on CPU: same loaded weights, Adam state, LR schedule and data position.
    assert [{k: m[k] for k in EXACT_KEYS} for m in resumed] == \
        [{k: m[k] for k in EXACT_KEYS} for m in reference]


def test_first_step_loss_equals_transformers_with_the_initial_weights(parity):
    rel = abs(parity["first_loss"] - parity["hf_loss"]) / parity["hf_loss"]
    assert rel < TOL, f"step 1 loss {parity['first_loss']} vs transformers {parity['hf_loss']}"


def test_export_loads_in_transformers_with_the_final_logits(example, parity):
    assert parity["ckpt"] == f"step_{STEPS:08d}"
    assert parity["export_vs_ours"] < TOL, parity
    # Control: the fine-tune moved the weights far beyond the tolerance.
    assert parity["initial_vs_ours"] > 100 * TOL, parity
    assert math.isfinite(example["transformers_loss"])


def test_export_folder_is_complete(example):
    from safetensors import safe_open

    out, source = Path(example["hf_out"]), Path(example["hf_in"])
    assert (out / "config.json").read_text() == (source / "config.json").read_text()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        assert set(index) == set(f.keys())  # every tensor, the vision tower's included


def _main_params_rank(rank, world, hf_in) -> dict:
    """One step at a learning rate too small to move any weight, bf16 model: megatron's optimizer
    then writes its fp32 main parameters back into the model, so the model still holds the loaded
    weights only if those main parameters were made from them."""
    from safetensors import safe_open

    from skyrl_megatron_kda.model.hf_io import export_hf_tensors
    from skyrl_megatron_kda.recipes import load_recipe
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = load_recipe("glm53_flash_tiny", [
        "parallel.tp=1", "parallel.cp=1", "parallel.ep=2", "parallel.sequence_parallel=false",
        f"run.num_workers={world}",
        "model.params_dtype=bfloat16", f"run.init_from_hf={hf_in}", "train.lr=1e-30",
        "train.weight_decay=0.0", "data.seq_len=64"], environ={}).recipe
    trainer = RankTrainer(recipe)
    metrics = trainer.train_step()
    worst, moved = 0.0, []
    with safe_open(f"{hf_in}/model.safetensors", "pt") as f:
        for name, tensor in export_hf_tensors(trainer.model.module):
            diff = float((tensor.float() - f.get_tensor(name).to(tensor.dtype).float()).abs().max())
            if name.endswith("e_score_correction_bias"):
                # Updated outside the optimizer by design: megatron's aux-loss-free balancing
                # moves it by its update rate (1e-3) per step.
                moved.append(diff)
                continue
            worst = max(worst, diff)
    trainer.close()
    return dict(worst=worst, bias_moved=moved, loss=metrics["loss"], dtype=str(tensor.dtype))


def test_loaded_weights_reach_the_optimizer_main_params(example):
    # 2 ranks: DP2 over the dense parameters (the distributed optimizer shards them), EP2.
    results = run_ranks(2, _main_params_rank, example["hf_in"])
    for r in results:
        assert r["dtype"] == "torch.bfloat16" and math.isfinite(r["loss"])
        assert r["worst"] == 0.0, r


def _missing_init_rank(rank, world, path) -> str:
    from skyrl_megatron_kda.recipes import load_recipe
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = load_recipe("glm53_flash_tiny", [*TP1, f"run.init_from_hf={path}"], environ={}).recipe
    try:
        RankTrainer(recipe)
    except FileNotFoundError as err:
        return str(err)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return "no error"


def test_missing_init_checkpoint_is_refused_naming_host_and_rank(tmp_path):
    message = run_ranks(1, _missing_init_rank, str(tmp_path / "nowhere"))[0]
    assert "run.init_from_hf=" in message and "nowhere" in message and "(rank 0)" in message


def test_export_refuses_a_non_run_folder_and_a_non_empty_target(example, tmp_path):
    from skyrl_megatron_kda.train.export import export

    with pytest.raises(FileNotFoundError, match="recipe.yaml does not exist"):
        export(tmp_path, tmp_path / "out")
    with pytest.raises(FileExistsError, match="not empty"):
        export(example["run_dir"], example["hf_out"])


def test_ray_up_config_fits_rays_schema_and_the_recipe():
    """examples/finetune_1m/cluster.yaml is a valid `ray up` config, and its nodes x GPUs are the
    1M recipe's ranks and cluster.gpus_per_node."""
    import yaml
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    from skyrl_megatron_kda.recipes import get_recipe

    config = yaml.safe_load((EXAMPLE.parent / "cluster.yaml").read_text())
    validate_config(prepare_config(config))  # as `ray up` does before it starts anything
    recipe = get_recipe("glm53_flash_1m", [], environ={})
    nodes = 1 + len(config["provider"]["worker_ips"])
    assert config["max_workers"] == nodes - 1
    gpus = recipe.cluster.gpus_per_node
    for start in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert f"--num-gpus={gpus}" in config[start][-1]
    assert nodes * gpus == recipe.run.num_workers
