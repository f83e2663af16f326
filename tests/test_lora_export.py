"""``skyrl-kda export`` of a LoRA run (train/export.py, train/peft_adapters.py), on CPU.

A LoRA run (rank 4, alpha 8, SkyRL's ``all-linear`` without the routed experts, whose adapters
have no PEFT layout) trains 2 steps at TP2 +SP from a random glm5_next checkpoint and saves its
adapters-only checkpoint. The export's rank side (what ``skyrl-kda export`` runs on each Ray
actor) writes, at TP2, the merged HF checkpoint (default) and the PEFT folder (``--adapters``).
Then at TP1 the run's model is rebuilt from the checkpoint (the base from ``run.init_from_hf``,
the adapters loaded across meshes, the base fingerprint checked), and on the same tokens:

- transformers' glm5_next from the merged folder gives our adapted model's logits (relative
  1e-4, tests/test_example.py's budget for a full export; fp32 summation order) while the base
  checkpoint does not (the control: 2 steps of adapters move them by more than that);
- transformers' glm5_next from the base with the PEFT folder applied as peft's LoRA layer
  computes it (each named linear plus (lora_alpha/r) B A x) gives the same logits, and so does
  the ``peft`` library (the dev extra's, SkyRL's pin): ``PeftModel.from_pretrained`` wraps every
  module of the folder;
- a checkpoint whose base differs (another ``run.init_from_hf``) is refused, naming both
  fingerprints.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.ranks import run_ranks

TINY = "glm53_flash_tiny"
LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.exclude_modules=['*.experts.*']",
        "train.warmup_steps=0", "train.steps=2"]
TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=1", "parallel.ep=1",
          "run.num_workers=2", "model.dsa.tp_split=heads"]
TP1 = ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.cp=1", "parallel.ep=1",
       "run.num_workers=1"]
TOL = 1e-4
TOKENS = 48


def _train_and_export(rank, world, hf_dir, run_dir, merged_dir, peft_dir):
    import yaml

    from skyrl_megatron_kda.recipes import load_recipe
    from skyrl_megatron_kda.train.export import _export_rank
    from skyrl_megatron_kda.train.outputs import RECIPE
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = load_recipe(TINY, [*LORA, *TP2_SP, f"run.init_from_hf={hf_dir}"], environ={}).recipe
    trainer = RankTrainer(recipe)
    for _ in range(2):
        trainer.train_step()
    ckpt = trainer.save_checkpoint(run_dir)
    trainer.close()
    if rank == 0:
        Path(run_dir, RECIPE).write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    _export_rank(rank, world, recipe, ckpt, merged_dir, hf_dir)
    _export_rank(rank, world, recipe, ckpt, peft_dir, hf_dir, True)
    return ckpt


def _logits(rank, world, hf_dir, run_dir, ckpt, merged_dir, peft_dir, other_hf):
    import sys

    sys.modules["fla"] = None  # transformers would pick fla's GPU-only kernels otherwise
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from skyrl_megatron_kda.kda.parity import relative_error
    from skyrl_megatron_kda.train.export import load_run_model, run_recipe

    def hf(path):
        return Glm5NextForConditionalGeneration.from_pretrained(
            path, attn_implementation="eager").float().eval()

    recipe = run_recipe(run_dir, TP1)
    model = load_run_model(recipe, ckpt)  # the adapters from the TP2 checkpoint, at TP1
    ids = torch.randint(3, recipe.model.vocab_size, (1, TOKENS),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        merged = hf(merged_dir)(input_ids=ids).logits.float()
        base_model = hf(hf_dir)
        base = base_model(input_ids=ids).logits.float()
        config = json.loads(Path(peft_dir, "adapter_config.json").read_text())
        tensors = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
        modules = dict(base_model.named_modules())
        scale = config["lora_alpha"] / config["r"]
        for path in config["target_modules"]:
            a = tensors[f"base_model.model.{path}.lora_A.weight"]
            b = tensors[f"base_model.model.{path}.lora_B.weight"]
            modules[path].register_forward_hook(
                lambda m, args, y, a=a, b=b: y + scale * (args[0] @ a.T @ b.T))
        adapted = base_model(input_ids=ids).logits.float()
    parallel_state.destroy_model_parallel()
    try:  # the same adapters on another base
        load_run_model(run_recipe(run_dir, [*TP1, f"run.init_from_hf={other_hf}"]), ckpt)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    finally:
        parallel_state.destroy_model_parallel()
    return dict(merged=relative_error(merged, ours), peft=relative_error(adapted, ours),
                base=relative_error(base, ours), refusal=refusal, config=config,
                keys=sorted(tensors))


def _peft_library(rank, world, hf_dir, merged_dir, peft_dir):
    """``peft.PeftModel.from_pretrained`` of the folder on transformers' glm5_next base: its
    logits against the merged folder's, what it loaded and what it left out."""
    import sys

    sys.modules["fla"] = None
    import peft
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    from skyrl_megatron_kda.kda.parity import relative_error

    def hf(path):
        return Glm5NextForConditionalGeneration.from_pretrained(
            path, attn_implementation="eager").float().eval()

    model = peft.PeftModel.from_pretrained(hf(hf_dir), peft_dir).eval()
    wrapped = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A"))
    ids = torch.randint(3, 256, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits.float()
        merged = hf(merged_dir)(input_ids=ids).logits.float()
    return dict(err=relative_error(adapted, merged), wrapped=len(wrapped), version=peft.__version__)


@pytest.fixture(scope="module")
def exported():
    from examples.rl_tiny import make_inputs

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, other = os.path.join(tmp, "hf"), os.path.join(tmp, "other")
        make_inputs.make_hf_checkpoint(Path(hf_dir))
        make_inputs.make_hf_checkpoint(Path(other))
        # another base: the same shapes, one weight changed
        from safetensors.torch import load_file, save_file

        weights = Path(other, "model.safetensors")
        tensors = load_file(weights)
        tensors["model.language_model.norm.weight"] += 0.5
        save_file(tensors, weights)
        run_dir, merged, peft = (os.path.join(tmp, n) for n in ("run", "merged", "peft"))
        ckpt = run_ranks(2, _train_and_export, hf_dir, run_dir, merged, peft)[0]
        files = sorted(os.listdir(merged)), sorted(os.listdir(peft))
        out = run_ranks(1, _logits, hf_dir, run_dir, ckpt, merged, peft, other)[0]
        out["peft_library"] = run_ranks(1, _peft_library, hf_dir, merged, peft)[0]
    return out, files


def test_merged_export_loads_in_transformers_with_the_adapter_models_logits(exported):
    out, (merged_files, _) = exported
    assert "config.json" in merged_files and "model.safetensors.index.json" in merged_files
    assert out["merged"] < TOL, out
    assert out["base"] > 10 * TOL, out  # the adapters moved the logits


def test_peft_folder_applied_to_the_base_gives_the_same_logits(exported):
    out, (_, peft_files) = exported
    assert peft_files == ["adapter_config.json", "adapter_model.safetensors"]
    config = out["config"]
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert len(out["keys"]) == 2 * len(config["target_modules"])
    assert out["peft"] < TOL, out


def test_the_peft_library_loads_the_folder_with_the_merged_logits(exported):
    """``PeftModel.from_pretrained`` wraps every module of the folder and gives the merged
    export's logits."""
    out, _ = exported
    lib = out["peft_library"]
    assert lib["wrapped"] == len(out["config"]["target_modules"]), lib
    assert lib["err"] < TOL, lib


def test_adapters_on_another_base_are_refused(exported):
    out, _ = exported
    assert "trained on another base: base fingerprint" in out["refusal"], out["refusal"]
    assert "export with the base the run started from" in out["refusal"]


def test_adapters_flag_on_a_full_weights_run_is_refused_before_ray(capsys, tmp_path, monkeypatch):
    """``skyrl-kda export --adapters`` of a run without LoRA: one line, before Ray starts."""
    import ray

    from skyrl_megatron_kda import cli
    from tests.test_cli import fake_run

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for an input that could be refused up front")

    monkeypatch.setattr(ray, "init", no_ray)
    fake_run(tmp_path / "run")
    argv = ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--adapters"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --adapters: ") and "holds full weights" in err, err
    assert "\n" not in err and not (tmp_path / "hf").exists()
