"""LoRA in the trainer (``train.lora``; train/trainer.py, train/checkpoint.py, docs/lora.md):
megatron's DDP buffers and the distributed optimizer hold the adapters only and a step moves
nothing else; an adapter checkpoint resumes bit-exactly on its mesh (TP2 +SP, whose split
adapters a replicated declaration would get wrong) and loads into another (TP1 x CP2), whose
base has the same fingerprint; a resume with other LoRA settings, another base, or full weights
on one side is refused in one line; ``checkpoint verify`` names an adapter checkpoint and its
base fingerprint. With routed experts adapted (shared, or per expert), a TP1 x EP2 checkpoint
resumes bit-exactly and loads at EP1 by global expert (train/adapter_checkpoint.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tempfile

import pytest
import torch

from skyrl_megatron_kda.recipes import load_recipe
from tests.support.memory_recipes import SINGLE, TINY
from tests.support.ranks import run_ranks

# all-linear but the routed experts (refused by lora_targets); no warmup, so step 1 moves
LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.exclude_modules=['*.experts.*']",
        "train.warmup_steps=0", "train.steps=3"]
# TP2 +SP; DSA by heads (its rows path gathers the MLA linears' weights, refused for adapters)
TP2_SP = ["parallel.cp=1", "parallel.ep=1", "run.num_workers=2", "model.dsa.tp_split=heads"]
TP1_CP2 = ["parallel.tp=1", "parallel.cp=2", "parallel.sequence_parallel=false", "parallel.ep=1",
           "run.num_workers=2", "model.dsa.tp_split=heads"]
SAVE_AFTER, STEPS = 2, 3


def _recipe(overrides):
    return load_recipe(TINY, [*LORA, *overrides], environ={}).recipe


def _base_state(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state outside the adapters (parameters, the routers' expert
    bias), copied."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()
            if ".lora." not in n and isinstance(t, torch.Tensor)}


def _one_rank_steps(rank, world):
    """DDP's and the optimizer's parameters, and what two steps change."""
    from skyrl_megatron_kda.model.lora import lora_parameters
    from skyrl_megatron_kda.train.data import build_loader
    from skyrl_megatron_kda.train.trainer import RankTrainer

    trainer = RankTrainer(_recipe(SINGLE))
    model = trainer.model.module
    adapters = lora_parameters(model)
    ddp = trainer.model
    buffers = [*ddp.buffers, *ddp.expert_parallel_buffers]
    in_buffers = [p for b in buffers for p in b.params]
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    in_optimizer = [p for opt in optimizers for p in opt.model_param_group_index_map]
    main_numel = sum(p.numel() for opt in optimizers for g in opt.optimizer.param_groups
                     for p in g["params"])
    # The first row the trainer steps on (a fresh loader of the same seed), scored before and
    # after that step.
    r = trainer.recipe
    row = build_loader(r.data, seed=r.train.seed, parallel=r.parallel, layout=r.parallel.cp_layout,
                       vocab_size=r.model.vocab_size).next_row()

    def row_loss():
        with torch.no_grad():
            shard = trainer.shard(row)
            logp, _ = trainer.token_logprobs(shard)
            mask = shard.loss_mask[None].float()
            return float(-(logp * mask).sum() / mask.sum())

    base, start = _base_state(model), {n: p.detach().clone() for n, p in adapters.items()}
    before = row_loss()
    first = trainer.train_step()
    after_one = row_loss()
    b_moved = all(not torch.equal(p, start[n]) for n, p in adapters.items() if n.endswith(".B"))
    second = trainer.train_step()
    base_now = _base_state(model)
    out = dict(
        adapter_ids={id(p) for p in adapters.values()}, buffer_ids={id(p) for p in in_buffers},
        optimizer_ids={id(p) for p in in_optimizer}, n_adapters=len(adapters),
        adapter_numel=sum(p.numel() for p in adapters.values()),
        buffer_numel=sum(p.numel() for p in in_buffers),
        buffer_unpadded=sum(b.numel_unpadded for b in buffers), main_numel=main_numel,
        base_changed=[n for n, t in base.items() if not torch.equal(t, base_now[n])],
        b_moved=b_moved,
        unmoved=[n for n, p in adapters.items() if torch.equal(p, start[n])],
        losses=(before, after_one), metrics=(first, second), line=trainer.lora_line())
    trainer.close()
    return out


def test_ddp_and_optimizer_hold_only_the_adapters():
    """DDP's grad buffers and the distributed optimizer take exactly the adapters (their numel,
    up to megatron's 64-element alignment of each parameter's start); two steps leave every
    base tensor bitwise as it was (the routers' expert bias included) and move every adapter;
    the step lowers the loss of the row it trained on."""
    r = run_ranks(1, _one_rank_steps)[0]
    assert r["n_adapters"] > 0
    assert r["buffer_ids"] == r["adapter_ids"], "DDP's buffers hold other parameters"
    assert r["optimizer_ids"] == r["adapter_ids"], "the optimizer holds other parameters"
    assert r["buffer_numel"] == r["adapter_numel"] == r["main_numel"]
    assert r["adapter_numel"] <= r["buffer_unpadded"] < r["adapter_numel"] + 64 * r["n_adapters"]
    assert not r["base_changed"], f"base tensors changed: {r['base_changed'][:5]}"
    assert r["b_moved"] and not r["unmoved"], r["unmoved"][:5]
    before, after = r["losses"]
    assert after < before, f"the trained row's loss went {before} -> {after}"
    assert r["metrics"][0]["lora_params"] == r["adapter_numel"]  # TP1: shards are whole
    assert f"{r['adapter_numel']:,} adapter parameters train" in r["line"]


def _adapters(trainer) -> dict[str, torch.Tensor]:
    from skyrl_megatron_kda.model.lora import lora_parameters

    return {n: p.detach().clone() for n, p in lora_parameters(trainer.model.module).items()}


def _refusal(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _trainer(overrides):
    """A trainer whose loader packs rows as the TP1 x CP2 mesh does (so every mesh here steps on
    the same rows)."""
    from skyrl_megatron_kda.train.data import build_loader
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe, rows_like = _recipe(overrides), _recipe(TP1_CP2)
    loader = build_loader(recipe.data, seed=recipe.train.seed, parallel=rows_like.parallel,
                          layout=recipe.parallel.cp_layout, vocab_size=recipe.model.vocab_size)
    return RankTrainer(recipe, loader=loader)


def _train_saving(trainer, out_dir):
    """``STEPS`` steps, a checkpoint after step ``SAVE_AFTER``: (every step's metrics, the
    checkpoint's path, the adapters as saved)."""
    straight = []
    for step in range(STEPS):
        straight.append(trainer.train_step())
        if step + 1 == SAVE_AFTER:
            path, saved = trainer.save_checkpoint(out_dir), _adapters(trainer)
    return straight, path, saved


def _tp2_resume(rank, world, out_dir):
    """3 steps saved after step 2; the checkpoint loaded into a fresh trainer and stepped once;
    the refusals; the checkpoint loaded into TP1 x CP2 and stepped once."""
    from skyrl_megatron_kda.train import checkpoint, manifest

    trainer = _trainer(TP2_SP)
    straight, path, saved = _train_saving(trainer, out_dir)
    fingerprint, end = trainer.base_fingerprint(), _adapters(trainer)
    dims = {n: getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False)
            else None for n, p in lora_params(trainer).items()}
    trainer.close()

    resumed = _trainer([*TP2_SP, "run.resume=true"])
    at = resumed.load_checkpoint(path)
    after = [resumed.train_step() for _ in range(STEPS - at)]
    out = dict(straight=straight, at=at, after=after, end=end, resumed_end=_adapters(resumed),
               fingerprint=fingerprint, path=path, saved=saved, dims=dims)
    state, record = resumed.train_state(), manifest.verify(path)
    lora = state.lora
    other = {
        "rank": dataclasses.replace(state, lora={**lora, "rank": 8}),
        "targets": dataclasses.replace(state, lora={**lora, "exclude_modules": []}),
        "off": dataclasses.replace(state, lora=None, base_sha256=None),
    }
    out["refused"] = {k: manifest.lora_refusal(path, record, s.lora, s.base_sha256,
                                               checkpoint._mesh(s)) for k, s in other.items()}
    out["refused"]["full_weights"] = manifest.lora_refusal(
        path, {k: v for k, v in record.items() if k != "lora"}, lora, state.base_sha256,
        checkpoint._mesh(state))
    resumed.close()
    # Another base: the seed draws other initial weights.
    other_base = _trainer([*TP2_SP, "run.resume=true", "train.seed=1"])
    out["refused"]["base"] = _refusal(lambda: other_base.load_checkpoint(path))
    out["other_fingerprint"] = other_base.base_fingerprint()
    other_base.close()
    # Another mesh: the same base (CPU initialisation draws whole tensors) has the same
    # fingerprint, and the adapters load by their TP split.
    tp1 = _trainer([*TP1_CP2, "run.resume=true"])
    out["tp1_at"] = tp1.load_checkpoint(path)
    out["tp1_loaded"], out["tp1_fingerprint"] = _adapters(tp1), tp1.base_fingerprint()
    out["tp1_next"] = tp1.train_step()
    tp1.close()
    return out


def lora_params(trainer):
    from skyrl_megatron_kda.model.lora import lora_parameters

    return lora_parameters(trainer.model.module)


_RUN_DIR = tempfile.TemporaryDirectory(prefix="skyrl_kda_lora_")


@functools.cache
def tp2_resume() -> list[dict]:
    return run_ranks(2, _tp2_resume, _RUN_DIR.name)


def _assert_resume_repeats(r) -> None:
    """The resumed trainer's steps and final adapters equal the uninterrupted run's, bitwise."""
    assert r["at"] == SAVE_AFTER
    for key in ("loss", "grad_norm", "lr", "loss_tokens"):
        assert [m[key] for m in r["after"]] == [m[key] for m in r["straight"][SAVE_AFTER:]], key
    assert r["end"].keys() == r["resumed_end"].keys()
    differ = [n for n in r["end"] if not torch.equal(r["end"][n], r["resumed_end"][n])]
    assert not differ, f"adapters differ after the resume: {differ[:5]}"


def test_adapter_checkpoint_resumes_bit_exactly():
    """TP2 +SP: 3 steps equal 2 steps, a save, a fresh trainer loading it (its base rebuilt from
    the seed, fingerprint recomputed and matched) and 1 step: every loss, grad norm and every
    rank's adapter shards bitwise."""
    for r in tp2_resume():
        _assert_resume_repeats(r)
    # TP-split adapters: the two ranks' B shards of a column-parallel linear differ (a
    # replicated declaration would have given rank 1 rank 0's shard, and this test would fail).
    r0, r1 = tp2_resume()
    b = next(n for n in r0["end"] if n.endswith("linear_fc1.lora.B"))
    assert not torch.equal(r0["end"][b], r1["end"][b])


def _joined(name: str, r0: dict, r1: dict) -> torch.Tensor:
    """The whole adapter tensor ``name`` from the two TP ranks' shards saved at step 2. B of a
    gated MLP's fc1 holds each rank's gate rows, then its up rows (as the weight): the whole is
    every gate row, then every up row."""
    dim, shards = r0["dims"][name], [r0["saved"][name], r1["saved"][name]]
    if dim is None:
        return shards[0]
    if name.endswith("linear_fc1.lora.B"):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def test_adapter_checkpoint_loads_into_another_mesh():
    """TP2 +SP -> TP1 x CP2: the rebuilt base has the saving mesh's fingerprint; each loaded
    adapter is the TP2 ranks' shards joined along its split, bitwise; the next step's loss and
    grad norm are the saving mesh's up to fp32 summation order."""
    r0, r1 = tp2_resume()
    for r in (r0, r1):
        assert r["tp1_at"] == SAVE_AFTER and r["tp1_fingerprint"] == r0["fingerprint"]
        for name, loaded in r["tp1_loaded"].items():
            assert torch.equal(loaded, _joined(name, r0, r1)), name
    got, expected = r0["tp1_next"], r0["straight"][SAVE_AFTER]
    assert got["step"] == expected["step"] and got["loss_tokens"] == expected["loss_tokens"]
    assert abs(got["loss"] - expected["loss"]) / expected["loss"] < 1e-5, (got, expected)
    assert abs(got["grad_norm"] - expected["grad_norm"]) / expected["grad_norm"] < 1e-4


def test_resume_refusals_name_what_differs():
    """Other LoRA settings, full weights on either side, another base: one line each, naming the
    setting (or both fingerprints) and what to do."""
    r = tp2_resume()[0]
    refused = r["refused"]
    assert "train.lora.rank 4 -> 8" in refused["rank"] and "resume with" in refused["rank"]
    assert "train.lora.exclude_modules" in refused["targets"]
    assert "holds LoRA adapters only" in refused["off"]
    assert "holds full weights" in refused["full_weights"] and "train.lora.rank=0" in refused[
        "full_weights"]
    assert r["other_fingerprint"] != r["fingerprint"]
    base = refused["base"]
    assert r["fingerprint"][:16] in base and r["other_fingerprint"][:16] in base, base
    assert "train.seed" in base
    assert all("\n" not in m for m in refused.values())


def test_checkpoint_verify_reports_adapters_and_base(capsys):
    """``skyrl-kda checkpoint verify`` on the run's folder: the files match, and the line says
    the checkpoint holds LoRA adapters only and which base fingerprint they need."""
    from skyrl_megatron_kda.cli import main
    from skyrl_megatron_kda.train import manifest

    r = tp2_resume()[0]
    assert main(["checkpoint", "verify", _RUN_DIR.name]) == 0
    line = capsys.readouterr().out
    assert "ok, step 2" in line and "LoRA adapters only (rank 4" in line
    assert r["fingerprint"] in line
    record = manifest.read(r["path"])
    assert record["lora"]["settings"]["rank"] == 4
    assert record["lora"]["base_sha256"] == r["fingerprint"]


def _initial_a(rank, world, init_method, width, r):
    """A of an adapter that ``apply_lora`` hangs on one column-parallel linear at TP1."""
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from skyrl_megatron_kda.model.lora import apply_lora

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)
    model = torch.nn.Module()
    model.proj = ColumnParallelLinear(width, 8, config=config, init_method=torch.nn.init.zeros_,
                                      bias=False, gather_output=False,
                                      tp_group=parallel_state.get_tensor_model_parallel_group())
    apply_lora(model, rank=r, target_modules=["proj"], init_method=init_method)
    return model.proj.lora.A.detach().clone()


@pytest.mark.parametrize("init_method", ["kaiming", "xavier"])
def test_a_init_bound(init_method):
    """``init_method`` draws A uniform in +-1/sqrt(in) (kaiming, peft's) or +-sqrt(6/(in + rank))
    (xavier)."""
    r, width = 4, 96
    a = run_ranks(1, _initial_a, init_method, width, r)[0]
    bound = 1 / math.sqrt(width) if init_method == "kaiming" else math.sqrt(6 / (width + r))
    assert a.shape == (r, width)
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound, (a.abs().max(), bound)


def test_run_summary_says_lora_and_what_trains():
    """The driver's merged metrics keep ``lora_params`` and the run's last line says how many
    adapter parameters trained; a line without LoRA stays as it is."""
    from skyrl_megatron_kda.train.run import merge_rank_metrics, summary_line

    rank = {"step": 1, "loss": 5.5, "grad_norm": 1.0, "lr": 1e-3, "update_skipped": False,
            "tokens": 256, "loss_tokens": 250, "exchange": "a2a", "skipped_records": {},
            "step_time_s": 0.5, "cp_bytes": 0, "peak_gib": None}
    plain = merge_rank_metrics([rank])
    adapted = merge_rank_metrics([{**rank, "lora_params": 15216}, {**rank, "lora_params": 15216}])
    assert "lora_params" not in plain and adapted["lora_params"] == 15216
    assert "LoRA" not in summary_line([plain], "runs/x")
    assert summary_line([adapted], "runs/x") == (
        "1 steps, loss 5.5000 -> 5.5000; LoRA: 15,216 adapter parameters trained, base frozen; "
        "runs/x")


# Routed experts targeted (all-linear, nothing excluded) at TP1: EP2 (DP2, expert-DP 1) and EP1
# (DP2, expert-DP 2) see the same rows. Shared adapters (the default), and per-expert ones with
# normalize_moe_lora (rank 4 // top_k 2 = 2 on the routed experts).
EXPERT_LORA = ["train.lora.exclude_modules=[]"]
EXPERT_KINDS = {
    "shared": [],
    "per_expert": ["train.lora.share_expert_adapters=false", "train.lora.normalize_moe_lora=true"],
}
EP2 = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=2", "parallel.etp=1",
       "parallel.sequence_parallel=false", "run.num_workers=2", "model.dsa.tp_split=heads"]
EP1 = [*EP2, "parallel.ep=1"]
_LOCAL_EXPERT = r"^(.*\.experts)\.local_experts\.(\d+)\.(.*)$"


def _by_global_expert(trainer, adapters: dict) -> dict:
    """``adapters`` with each routed expert's local index replaced by its global one."""
    modules = dict(trainer.model.module.named_modules())
    out = {}
    for name, tensor in adapters.items():
        m = re.match(_LOCAL_EXPERT, name)
        if m is not None:
            experts = modules[m[1]]
            e = experts.ep_group.rank() * experts.num_local_experts + int(m[2])
            name = f"{m[1]}.local_experts.{e}.{m[3]}"
        out[name] = tensor
    return out


def _expert_resume(rank, world, out_dir):
    """For each kind of expert adapter: EP2, 3 steps saved after step 2; the checkpoint loaded
    into a fresh EP2 trainer and stepped once; loaded into EP1 and stepped once."""
    out = {}
    for kind, settings in EXPERT_KINDS.items():
        run_dir, overrides = f"{out_dir}/{kind}", [*EXPERT_LORA, *settings]
        trainer = _rank_trainer(_recipe([*overrides, *EP2]))
        straight, path, saved = _train_saving(trainer, run_dir)
        saved_global = _by_global_expert(trainer, saved)
        end = _adapters(trainer)
        end_global = _by_global_expert(trainer, end)
        ranks = {n: p.shape[0] for n, p in end.items() if n.endswith(".A")}
        trainer.close()
        resumed = _rank_trainer(_recipe([*overrides, *EP2, "run.resume=true"]))
        at = resumed.load_checkpoint(path)
        after = [resumed.train_step() for _ in range(STEPS - at)]
        resumed_end = _adapters(resumed)
        resumed.close()
        ep1 = _rank_trainer(_recipe([*overrides, *EP1, "run.resume=true"]))
        ep1_at = ep1.load_checkpoint(path)
        ep1_loaded = _adapters(ep1)
        ep1_loaded_global = _by_global_expert(ep1, ep1_loaded)
        ep1_next = ep1.train_step()
        ep1_end = _by_global_expert(ep1, _adapters(ep1))
        ep1.close()
        out[kind] = dict(straight=straight, at=at, after=after, end=end, resumed_end=resumed_end,
                         saved=saved, saved_global=saved_global, end_global=end_global,
                         ranks=ranks, path=path, ep1_at=ep1_at, ep1_loaded=ep1_loaded,
                         ep1_loaded_global=ep1_loaded_global, ep1_next=ep1_next, ep1_end=ep1_end)
    return out


def _rank_trainer(recipe):
    from skyrl_megatron_kda.train.trainer import RankTrainer

    return RankTrainer(recipe)


_EXPERT_RUN_DIR = tempfile.TemporaryDirectory(prefix="skyrl_kda_lora_experts_")


@functools.cache
def expert_resume() -> list[dict]:
    return run_ranks(2, _expert_resume, _EXPERT_RUN_DIR.name)


@pytest.mark.parametrize("kind", list(EXPERT_KINDS))
def test_expert_adapter_checkpoint_resumes_bit_exactly(kind):
    """Routed experts' adapters (shared, or per expert with normalize_moe_lora), TP1 x EP2: 3
    steps equal 2 steps + save + a fresh trainer loading it + 1 step, every loss, grad norm and
    adapter bitwise; the trainer built the kind the recipe names (the shared slot, or rank-2
    adapters under each local expert) and counts the whole model's adapters."""
    for r in expert_resume():
        r = r[kind]
        _assert_resume_repeats(r)
        moved = [n for n in r["end"] if ".experts." in n and n.endswith(".B")
                 and not torch.equal(r["end"][n], r["saved"][n])]
        assert moved, "no routed expert adapter moved in step 3"
        shared = [n for n in r["ranks"] if n.endswith("mlp.experts.linear_fc1.lora.A")]
        local = {n: v for n, v in r["ranks"].items() if ".local_experts." in n}
        if kind == "shared":
            assert shared and not local
        else:
            assert local and not shared and set(local.values()) == {2}, local
    # The whole model's count: every expert's adapter once, the same on both EP2 ranks.
    r0, r1 = (r[kind] for r in expert_resume())
    assert r0["straight"][0]["lora_params"] == r1["straight"][0]["lora_params"]
    whole = {**r0["end_global"], **r1["end_global"]}
    numel = sum(t.numel() for t in whole.values())
    assert r0["straight"][0]["lora_params"] == numel  # TP1: every tensor is whole


@pytest.mark.parametrize("kind", list(EXPERT_KINDS))
def test_expert_adapter_checkpoint_loads_at_ep1(kind):
    """The EP2 checkpoint loaded at EP1 (each rank all 8 experts): every adapter is the EP2
    one of the same global expert (shared ones: the one of the layer), bitwise; the next step's
    loss is the EP2 run's within 1e-5 and its adapters after the step within 1e-6 (Adam's state
    came along). Negative control (per expert): naming by local index would give EP1's expert I
    the EP2 rank 1's local expert I, global expert 4 + I: it differs."""
    r0, r1 = (r[kind] for r in expert_resume())
    ep2_saved = {**r0["saved_global"], **r1["saved_global"]}
    ep2_end = {**r0["end_global"], **r1["end_global"]}
    for r in (r0, r1):
        assert r["ep1_at"] == SAVE_AFTER
        assert r["ep1_loaded_global"].keys() == ep2_saved.keys()
        differ = [n for n, t in r["ep1_loaded_global"].items() if not torch.equal(t, ep2_saved[n])]
        assert not differ, f"loaded adapters differ from the EP2 ones: {differ[:5]}"
        got, expected = r["ep1_next"], r0["straight"][SAVE_AFTER]
        assert got["loss_tokens"] == expected["loss_tokens"]
        assert abs(got["loss"] - expected["loss"]) / expected["loss"] < 1e-5, (got, expected)
        far = [n for n, t in r["ep1_end"].items()
               if not torch.allclose(t, ep2_end[n], rtol=0, atol=1e-6)]
        assert not far, f"adapters after the EP1 step differ from EP2's: {far[:5]}"
    if kind == "per_expert":
        by_local = [n for n in r1["saved"] if ".local_experts." in n]
        assert by_local
        for name in by_local:  # rank 1's local I is global 4 + I; EP1's local I is global I
            assert not torch.equal(r1["saved"][name], r0["ep1_loaded"][name]), name


def test_expert_settings_changed_on_resume_are_refused():
    """``train.lora.share_expert_adapters`` or ``normalize_moe_lora`` other than the
    checkpoint's: one line naming the setting (the saved adapters have other keys or ranks)."""
    from skyrl_megatron_kda.train import manifest

    path = expert_resume()[0]["per_expert"]["path"]
    record = manifest.verify(path)
    r0, r1 = (r["per_expert"] for r in expert_resume())
    # the whole model's adapter tensors: every global expert's, the same on every mesh
    assert record["lora"]["adapter_tensors"] == len({**r0["end_global"], **r1["end_global"]})
    saved = record["lora"]["settings"]
    assert saved["share_expert_adapters"] is False and saved["normalize_moe_lora"] is True
    for key in ("share_expert_adapters", "normalize_moe_lora"):
        refusal = manifest.lora_refusal(path, record, {**saved, key: not saved[key]},
                                        record["lora"]["base_sha256"], record["mesh"])
        assert f"train.lora.{key} {saved[key]} -> {not saved[key]}" in refusal, refusal
        assert "resume with the checkpoint's train.lora settings" in refusal
        assert "\n" not in refusal
