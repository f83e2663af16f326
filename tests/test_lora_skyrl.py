"""LoRA through SkyRL's settings and the weight sync to the project's sampler
(integrations/skyrl/settings.py, weight_sync.py; train/peft_adapters.py), on CPU.

Settings: ``trainer.policy.model.lora.*`` become ``train.lora.*`` (``decided_settings``), and what
the adapters do not implement is refused by name (tests/test_skyrl.py has one case per refusal).

Weight sync, on two gloo ranks at TP2 +SP with the tiny recipe (fp32) from a random glm5_next
checkpoint: the policy worker with LoRA rank 4 (SkyRL's ``all-linear``, routed experts excluded,
whose merge is tested on its own below) publishes to the project's sampler (the disk backend) before and after
an optimizer step. SkyRL's ``merge_lora=true``: the published folder holds W + (alpha/r) B A.
Checked: the sampler's log-probs equal the trainer's after each sync (below 1e-5, as full
fine-tuning's in tests/test_skyrl_weight_sync.py; the stale v1 sampler against the stepped
trainer differs by more than 1e-3); the published tensors, and the worker's ``save_hf_model``,
equal bitwise what ``merge_lora`` makes of the model; a tensor no adapter targets (the routed experts, the embedding) is the
checkpoint's bitwise, and an adapted one is not. The PEFT folder of the same adapters names
transformers' glm5_next linears with their shapes, and base + (alpha/r) B A from it is the merged
export (1e-6), whose logits it gives in transformers (peft is not installed here: the folder is
applied by hand as peft's LoRA layer computes it).

Routed experts' adapters (per expert or shared, TP2 +SP x EP2, B drawn): the merged export equals
``merge_lora``'s bitwise, every routed expert tensor moved, and the PEFT folder refuses them; the
adapter-only sync's folder (every expert by global index) added to the base equals the merged
export within 1e-6 (fp32 rounding of the folded scale).

SkyRL's ``merge_lora=false`` (adapter-only sync) on the same two-rank run: a disk publisher of the
adapters alone beside the merged one, the sampler adding them to the base (log-probs equal the
trainer's within 1e-5 at both versions); for vLLM engines, the folder at ``lora_sync_path`` and
one ``load_lora_adapter`` call.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from skyrl_megatron_kda.config import CP_EXCHANGE_ENV
from skyrl_megatron_kda.integrations.skyrl.config import KDASkyRLConfig
from tests.support.ranks import run_ranks

RANK, ALPHA = 4, 8
LORA = [f"trainer.policy.model.lora.rank={RANK}", f"trainer.policy.model.lora.alpha={ALPHA}",
        "trainer.policy.model.lora.exclude_modules=['*.experts.*']"]
TP2 = ["parallel.tp=2", "parallel.cp=1", "parallel.ep=1", "parallel.sequence_parallel=true",
       "run.num_workers=2"]
JOB = ["trainer.kda.recipe=glm53_flash_tiny"]
TEMPERATURE = 0.7
PROMPTS = ([5, 9, 14, 3], [7, 7, 21], [30, 4, 4, 4, 11])


# -- settings ------------------------------------------------------------------------------------

def _decided(args):
    from skyrl_megatron_kda.integrations.skyrl.settings import apply_decided, decided_settings

    cfg = KDASkyRLConfig.from_cli_overrides(["trainer.strategy=megatron", "trainer.kda.recipe=glm53_flash_tiny", *args])
    recipe = cfg.trainer.kda.resolve()
    decided = decided_settings(cfg.trainer, recipe)
    return cfg, decided, apply_decided(recipe, decided)


def test_skyrls_lora_settings_become_train_lora():
    from skyrl_megatron_kda.integrations.skyrl.config import unsupported_settings

    cfg, decided, recipe = _decided([
        "trainer.policy.model.lora.rank=8", "trainer.policy.model.lora.alpha=32",
        "trainer.policy.model.lora.dropout=0.1", "trainer.policy.model.lora.init_method=xavier",
        "trainer.policy.model.lora.target_modules=[linear_qkv,out_proj]",
        "trainer.policy.model.lora.exclude_modules='*.layers.3.*'",
        "trainer.policy.model.lora.share_expert_adapters=false",
        "trainer.policy.megatron_config.lora_config.normalize_moe_lora=true"])
    assert unsupported_settings(cfg) == []  # rank 8 is accepted
    lora = recipe.train.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.init_method) == (8, 32.0, 0.1, "xavier")
    assert lora.target_modules == ["linear_qkv", "out_proj"]
    assert lora.exclude_modules == ["*.layers.3.*"]  # one name: a list of one
    assert lora.normalize_moe_lora and not lora.share_expert_adapters
    sources = {d.key: d.source for d in decided}
    assert sources["train.lora.rank"] == "trainer.policy.model.lora.rank"
    # SkyRL's defaults: LoRA off, "all-linear" (a string), no exclusions (None)
    _, _, recipe = _decided([])
    assert recipe.train.lora.rank == 0 and not recipe.train.lora.enabled
    assert recipe.train.lora.target_modules == ["all-linear"]
    assert recipe.train.lora.exclude_modules == []
    assert recipe.train.lora.share_expert_adapters  # SkyRL's default, and ours


def test_dry_run_says_where_train_lora_came_from():
    from skyrl_megatron_kda.integrations.skyrl.entrypoint import provenance

    cfg, _, _ = _decided(LORA)
    lines = provenance(cfg, cfg.trainer.kda.resolve())
    assert "  train.lora.rank=4 <- trainer.policy.model.lora.rank (recipe: 0)" in lines
    assert ("  train.lora.exclude_modules=['*.experts.*'] <- "
            "trainer.policy.model.lora.exclude_modules (recipe: [])") in lines


def test_train_lora_under_trainer_kda_overrides_is_refused():
    cfg = KDASkyRLConfig.from_cli_overrides(["trainer.strategy=megatron",
                                             "trainer.kda.recipe=glm53_flash_tiny"])
    cfg.trainer.kda.overrides = {"train": {"lora": {"rank": 4}}}
    with pytest.raises(ValueError, match="trainer.kda.overrides.train.lora.rank is decided by "
                                         "SkyRL"):
        cfg.trainer.kda.resolve()


@pytest.mark.parametrize("setting,value,why", [
    ("trainer.policy.model.lora.sync_mode", "memory", "sync_mode=disk writes the adapter folder"),
    ("trainer.policy.megatron_config.lora_config.lora_type", "canonical_lora", "canonical_lora"),
    ("trainer.policy.model.lora.init_method", "normal", "kaiming or xavier"),
])
def test_lora_refusals_name_the_setting_and_why(setting, value, why):
    from skyrl_megatron_kda.integrations.skyrl.config import unsupported_settings

    cfg = KDASkyRLConfig.from_cli_overrides(["trainer.strategy=megatron", *JOB, *LORA,
                                             f"{setting}={value}"])
    (line,) = unsupported_settings(cfg)
    assert line.startswith(f"{setting}={value!r}: not supported") and why in line, line


# -- weight sync on two ranks ----------------------------------------------------------------------

def _worker(hf_dir: str):
    from skyrl_megatron_kda.integrations.skyrl.workers import KDAPolicyWorkerBase

    cfg = KDASkyRLConfig.from_cli_overrides([
        "trainer.strategy=megatron", "trainer.placement.colocate_all=false",
        "trainer.algorithm.use_kl_loss=false", "trainer.placement.policy_num_gpus_per_node=2",
        f"trainer.algorithm.temperature={TEMPERATURE}",
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.micro_forward_batch_size_per_gpu=2",
        "generator.inference_engine.model_dtype=float32",
        "trainer.bf16=false", "trainer.policy.optimizer_config.lr=3e-2", *LORA,
        "trainer.kda.recipe=glm53_flash_tiny",
        f"trainer.kda.overrides.run.init_from_hf={hf_dir}",
        *[f"trainer.kda.overrides.{o}" for o in TP2]])
    worker = object.__new__(KDAPolicyWorkerBase)
    worker.cfg = cfg.trainer
    worker.init_worker_process_group()
    worker.init_model()
    return worker, cfg.generator.inference_engine


def _sample_and_score(worker, client):
    import torch.distributed as dist

    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import sampled_tokens
    from tests.test_skyrl_weight_sync import rollout_batch

    box = [None]
    if dist.get_rank() == 0:
        asyncio.run(client.resume_generation())
        gen = torch.Generator().manual_seed(3)
        box[0] = [sampled_tokens(client.model, p, temperature=TEMPERATURE, max_tokens=6,
                                 min_tokens=6, eos_token_id=None, generator=gen)[:2]
                  for p in PROMPTS]
    dist.broadcast_object_list(box, src=0)
    responses = [tokens for tokens, _ in box[0]]
    out = worker.forward(rollout_batch(PROMPTS, responses)).loss_fn_outputs
    trainer = [o["logprobs"][-len(r):] for o, r in zip(out, responses)]
    return [logps for _, logps in box[0]], trainer, responses


def _read_folder(folder) -> dict:
    from skyrl_megatron_kda.model.hf_io import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(folder)
    return {name: ckpt.get(name) for name in ckpt.keys()}


class _RecordingVllmClient:
    """Stands for SkyRL's HTTP client over vLLM servers: records ``load_lora_adapter`` calls."""

    def __init__(self):
        self.loaded = []

    async def load_lora_adapter(self, lora_name, lora_path=None, *, in_memory=False):
        self.loaded.append((lora_name, lora_path))


def _ranks(rank, world, hf_dir, publish_dir, peft_dir):
    import torch.distributed as dist
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )

    from skyrl_megatron_kda.integrations.skyrl import weight_sync
    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import Glm5NextInferenceClient
    from skyrl_megatron_kda.model.hf_io import export_hf_tensors
    from skyrl_megatron_kda.model.lora import lora_parameters, merge_lora
    from skyrl_megatron_kda.train.peft_adapters import save_peft_adapter
    from tests.test_skyrl_weight_sync import rollout_batch

    worker, ie_cfg = _worker(hf_dir)
    model = worker.trainer.model.module
    out = {"adapters": len(lora_parameters(model))}
    client = Glm5NextInferenceClient(publish_dir, tokenizer=None, model_name="tiny")
    asyncio.run(worker.init_weight_sync_state(client, ie_cfg))
    # merge_lora=false: the adapters alone, published beside (the same worker, the same steps)
    adapter_dir = publish_dir + "_adapters"
    adapter_client = Glm5NextInferenceClient(adapter_dir, tokenizer=None, model_name="tiny")
    adapters = weight_sync.DiskPublisher(
        model, adapter_dir, weight_sync.inference_dtype(ie_cfg), train_step=lambda: 0,
        source=hf_dir, adapters_only=True)

    def sync():
        asyncio.run(worker.broadcast_to_inference_engines(None, ie_cfg))
        adapters.send_weights()
        return _sample_and_score(worker, client), _sample_and_score(worker, adapter_client)

    v1, a1 = sync()
    stale = client.model if rank == 0 else None

    batch = rollout_batch(PROMPTS, [[1, 2, 3]] * 3, advantages=torch.tensor([1.0, -1.0, 0.5]))
    batch["action_log_probs"] = torch.tensor(
        [o["logprobs"] for o in worker.forward(batch).loss_fn_outputs])
    worker.forward_backward(batch)
    worker.optim_step()
    v2, a2 = sync()
    out["adapter_only"] = {"v1": a1, "v2": a2}
    # merge_lora=false to vLLM engines: SkyRL's client is told to load lora_sync_path
    vllm = type("RecordingClient", (_RecordingVllmClient, RemoteInferenceClient), {})()
    worker.cfg.policy.megatron_config.lora_config.merge_lora = False
    worker.cfg.policy.model.lora.lora_sync_path = publish_dir + "_lora_sync"
    worker._weight_sync_engine = None  # not the disk publisher: SkyRL's vLLM path
    asyncio.run(worker.broadcast_to_inference_engines(vllm, ie_cfg))
    out["vllm_loaded"] = vllm.loaded
    save_peft_adapter(model, peft_dir, base_model=hf_dir)
    hf_export = os.path.join(peft_dir + "_hf")
    worker.save_hf_model(hf_export)  # SkyRL's HF export of the policy: the merged weights
    if rank == 0:
        out["save_hf_model"] = _read_folder(hf_export)
        from tests.test_skyrl_weight_sync import _score

        out["v1"], out["v2"] = v1, v2
        out["stale"] = [_score(stale, p, r) for p, r in zip(PROMPTS, v2[2])]
        out["published"] = _read_folder(weight_sync.latest_version(publish_dir)[1])
        out["adapter_folder"] = sorted(p.name for p in weight_sync.latest_version(adapter_dir)[1].iterdir())
        out["lora_sync_path"] = _read_peft(publish_dir + "_lora_sync")
        out["lora_sync_path_dir"] = publish_dir + "_lora_sync"
        out["hf_dir"] = os.path.abspath(hf_dir)
        out["adapter_sync"] = _read_peft(str(weight_sync.latest_version(adapter_dir)[1]))
    # what merge_lora makes of the model (the training model, merged in place at the end)
    merge_lora(model)
    merged = {name: t.clone() for name, t in export_hf_tensors(model)}
    if rank == 0:
        out["merged"] = merged
    worker.trainer.close()
    return out


@pytest.fixture(scope="module")
def runs():
    from examples.rl_tiny import make_inputs

    mp = pytest.MonkeyPatch()
    mp.delenv(CP_EXCHANGE_ENV, raising=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = os.path.join(tmp, "hf")
            make_inputs.make_hf_checkpoint(Path(hf_dir))
            results = run_ranks(2, _ranks, hf_dir, os.path.join(tmp, "published"),
                                os.path.join(tmp, "peft"))
            base = _read_folder(hf_dir)
            peft = _read_peft(os.path.join(tmp, "peft"))
            logits = run_ranks(1, _hf_logits, hf_dir, os.path.join(tmp, "peft"),
                               _write_merged(results[0]["published"], hf_dir, tmp))[0]
    finally:
        mp.undo()
    return results[0], base, peft, logits


def _read_peft(folder) -> dict:
    from safetensors.torch import load_file

    return {"tensors": load_file(os.path.join(folder, "adapter_model.safetensors")),
            "config": json.loads(Path(folder, "adapter_config.json").read_text())}


def _write_merged(published: dict, hf_dir: str, tmp: str) -> str:
    """The published merged weights as a folder transformers loads (the checkpoint's config)."""
    import shutil

    from safetensors.torch import save_file

    out = os.path.join(tmp, "merged")
    os.makedirs(out)
    save_file({k: v.contiguous() for k, v in published.items()},
              os.path.join(out, "model.safetensors"))
    shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(out, "config.json"))
    return out


def _hf_logits(rank, world, hf_dir, peft_dir, merged_dir):
    """transformers' glm5_next: the base with the PEFT folder applied as peft's LoRA layer does
    (each named linear's output plus (lora_alpha/r) B A x), and the merged folder; their logits,
    and every adapted module's (path, is a Linear, weight shape)."""
    from safetensors.torch import load_file

    from skyrl_megatron_kda.integrations.skyrl.glm5_next_client import load_glm5_next

    config = json.loads(Path(peft_dir, "adapter_config.json").read_text())
    tensors = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    base = load_glm5_next(hf_dir)
    modules = dict(base.named_modules())
    scale = config["lora_alpha"] / config["r"]
    found = {}
    for path in config["target_modules"]:
        linear = modules.get(path)
        found[path] = (type(linear).__name__, None if linear is None else tuple(linear.weight.shape))
        if linear is None:
            continue
        a = tensors[f"base_model.model.{path}.lora_A.weight"]
        b = tensors[f"base_model.model.{path}.lora_B.weight"]
        linear.register_forward_hook(
            lambda m, args, y, a=a, b=b: y + scale * (args[0] @ a.T @ b.T))
    ids = torch.tensor([[5, 9, 14, 3, 7, 7, 21, 30, 4, 4, 4, 11, 2, 8]])
    with torch.no_grad():
        adapted = base(input_ids=ids).logits
        merged = load_glm5_next(merged_dir)(input_ids=ids).logits
        plain = load_glm5_next(hf_dir)(input_ids=ids).logits
    return {"adapted": adapted, "merged": merged, "plain": plain, "modules": found}


def test_sampler_logprobs_equal_the_trainers_after_each_sync(runs):
    out, *_ = runs
    assert out["adapters"] > 0
    for version in ("v1", "v2"):
        sampler, trainer, _ = out[version]
        diff = max(abs(a - b) for s, t in zip(sampler, trainer) for a, b in zip(s, t))
        assert diff < 1e-5, f"{version}: sampler vs trainer log-probs differ by {diff:.1e}"
    # Negative control: the sampler on v1 (the base: B = 0) against the stepped trainer.
    stale = max(abs(a - b) for s, t in zip(out["stale"], out["v2"][1]) for a, b in zip(s, t))
    assert stale > 1e-3, f"the step changed the log-probs by only {stale:.1e}"


def test_adapter_only_sync_serves_the_trainers_policy(runs):
    """merge_lora=false: each version folder holds only the adapter folder (SkyRL's disk layout:
    alpha/r folded into B, lora_alpha == r) naming the base; the sampler adds it to the base and
    its log-probs equal the trainer's after each sync, as the merged sync's do."""
    out, _, peft, _ = runs
    for version in ("v1", "v2"):
        sampler, trainer, _ = out["adapter_only"][version]
        diff = max(abs(a - b) for s, t in zip(sampler, trainer) for a, b in zip(s, t))
        assert diff < 1e-5, f"{version}: adapter-only sampler vs trainer differ by {diff:.1e}"
    assert out["adapter_folder"] == ["TRAIN_STEP", "adapter_config.json",
                                     "adapter_model.safetensors"]
    config = out["adapter_sync"]["config"]
    assert config["lora_alpha"] == config["r"] == RANK
    assert config["base_model_name_or_path"] == out["hf_dir"]
    # the scale is in B: the sync's B is the export's times alpha/r
    export, peft = out["lora_sync_path"]["tensors"], peft["tensors"]
    key = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.allclose(export[key], peft[key] * ALPHA / RANK, rtol=1e-6, atol=0)
    assert not torch.allclose(export[key], peft[key])  # negative control: the fold is seen
    # to vLLM: the same folder at lora_sync_path, loaded once under SkyRL's adapter name
    assert out["vllm_loaded"] == [("skyrl-lora", out["lora_sync_path_dir"])]


def test_published_weights_are_merge_loras_and_only_adapted_ones_moved(runs):
    out, base, _, _ = runs
    published, merged = out["published"], out["merged"]
    assert set(merged) <= set(published)
    differ = [n for n in merged if not torch.equal(published[n], merged[n])]
    assert differ == [], differ[:5]
    saved = out["save_hf_model"]  # the worker's save_hf_model: the same merged tensors
    assert [n for n in merged if not torch.equal(saved[n], merged[n])] == []
    moved = {n for n in merged if not torch.equal(merged[n], base[n])}
    # only weights of adapted linears moved: attention projections, dense MLP, shared experts
    assert moved and all(n.endswith("proj.weight") or "kv_a_proj_with_mqa" in n for n in moved)
    assert not any(".experts." in n for n in moved)  # excluded: routed experts
    assert "model.language_model.embed_tokens.weight" not in moved
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in moved


def test_peft_folder_names_glm5_next_linears_and_merges_to_the_export(runs):
    out, base, peft, logits = runs
    config, tensors = peft["config"], peft["tensors"]
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    for path, (kind, shape) in logits["modules"].items():
        assert kind == "Linear", f"{path} is not a linear of transformers' glm5_next"
        a = tensors[f"base_model.model.{path}.lora_A.weight"]
        b = tensors[f"base_model.model.{path}.lora_B.weight"]
        assert a.shape == (RANK, shape[1]) and b.shape == (shape[0], RANK), path
    assert "model.language_model.layers.0.self_attn.forget_gate.f_a_proj" in logits["modules"]
    assert "model.language_model.layers.0.mlp.gate_proj" in logits["modules"]
    assert len(tensors) == 2 * len(config["target_modules"])
    # base + (alpha/r) B A from the folder is the merged export, per HF tensor
    disk = {p.replace("forget_gate.", ""): p for p in config["target_modules"]}
    worst = 0.0
    for name, merged in out["merged"].items():
        path = name.removesuffix(".weight")
        if path not in disk:
            assert torch.equal(merged, base[name]), name
            continue
        prefix = f"base_model.model.{disk[path]}"
        want = base[name] + ALPHA / RANK * (tensors[f"{prefix}.lora_B.weight"]
                                            @ tensors[f"{prefix}.lora_A.weight"])
        worst = max(worst, (want - merged).abs().max().item())
    assert worst < 1e-6, worst
    # in transformers: the base with the folder applied gives the merged folder's logits
    diff = (logits["adapted"] - logits["merged"]).abs().max().item()
    moved = (logits["plain"] - logits["merged"]).abs().max().item()
    assert diff < 1e-4 and moved > 1e-3, (diff, moved)


# -- routed experts' adapters in the merged export -------------------------------------------------

EP2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=1", "parallel.ep=2",
       "parallel.etp=1", "run.num_workers=2"]


def _experts_merged(rank, world, share):
    """On TP2 +SP x EP2: the HF export of the base, of ``hf_view`` with every adapter's B drawn
    (routed experts included, per-expert or shared), and of the model after ``merge_lora``; and
    what ``save_peft_adapter`` says of the routed experts' adapters."""
    from skyrl_megatron_kda.model.hf_io import export_hf_tensors
    from skyrl_megatron_kda.model.lora import apply_lora, lora_parameters, merge_lora
    from skyrl_megatron_kda.model.moe_layer import GLMMoELayer
    from skyrl_megatron_kda.recipes import load_recipe
    from skyrl_megatron_kda.train.peft_adapters import hf_view, save_peft_adapter, save_sync_adapter
    from tests.support.memory_recipes import TINY
    from tests.support.tiny_models import build_on_mesh
    from tests.test_lora_experts import _draw_b, _global_name

    model = build_on_mesh(load_recipe(TINY, EP2).recipe)
    base = {n: t.clone() for n, t in export_hf_tensors(model)}
    apply_lora(model, rank=RANK, alpha=ALPHA, target_modules="all-linear",
               share_expert_adapters=share)
    moe_layers = {n: m for n, m in model.named_modules() if isinstance(m, GLMMoELayer)}
    with torch.no_grad():
        for n, p in lora_parameters(model).items():
            if n.endswith(".B"):
                p.copy_(_draw_b(_global_name(n, moe_layers), p))
    view = {n: t.clone() for n, t in export_hf_tensors(hf_view(model))}
    try:
        save_peft_adapter(model, tempfile.mkdtemp())
        refusal = None
    except ValueError as err:
        refusal = str(err)
    sync_dir = tempfile.mkdtemp() if rank == 0 else None
    save_sync_adapter(model, sync_dir)  # rank 0 writes
    synced = _added_to(base, sync_dir) if rank == 0 else None
    merge_lora(model)
    merged = {n: t.clone() for n, t in export_hf_tensors(model)}
    return ({"base": base, "view": view, "merged": merged, "refusal": refusal, "synced": synced}
            if rank == 0 else {})


def _added_to(base: dict, adapter_dir: str) -> dict:
    """``merge_adapter_folder`` of ``adapter_dir`` on the tensors ``base`` (as a checkpoint)."""
    from safetensors.torch import save_file

    from skyrl_megatron_kda.model.hf_io import SafetensorsCheckpoint
    from skyrl_megatron_kda.train.peft_adapters import merge_adapter_folder

    folder = tempfile.mkdtemp()
    save_file({k: v.contiguous() for k, v in base.items()}, os.path.join(folder, "model.safetensors"))
    return merge_adapter_folder(adapter_dir, SafetensorsCheckpoint(folder))


@pytest.mark.parametrize("share", [True, False], ids=["shared", "per_expert"])
def test_merged_export_of_routed_expert_adapters_is_merge_loras(share):
    out = run_ranks(2, _experts_merged, share)[0]
    view, merged, base = out["view"], out["merged"], out["base"]
    assert list(view) == list(merged) == list(base)  # the same names, in the same order
    differ = [n for n in merged if not torch.equal(view[n], merged[n])]
    assert differ == [], differ[:5]
    experts = [n for n in merged if ".mlp.experts." in n]
    assert experts and all(not torch.equal(merged[n], base[n]) for n in experts)
    assert torch.equal(merged["model.language_model.embed_tokens.weight"],
                       base["model.language_model.embed_tokens.weight"])
    assert "routed experts' adapters have no PEFT layout" in out["refusal"]
    # the adapter-only sync's folder (every expert's adapter by global expert, the scale in B)
    # added to the base is the merged export
    synced = out["synced"]
    assert list(synced) == sorted(base)
    worst = max((synced[n] - merged[n]).abs().max().item() for n in merged)
    assert worst < 1e-6, worst
    assert all(not torch.equal(synced[n], base[n]) for n in experts)
