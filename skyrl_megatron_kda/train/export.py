"""``skyrl-kda export RUN_DIR --out HF_DIR``: a run's latest sharded checkpoint as a Hugging Face
glm5_next safetensors folder.

Why ranks at all: the sharded checkpoint of the full model only fits when spread over a mesh, and
``model.hf_io.save_hf_checkpoint`` gathers TP/EP shards with collectives. So the driver starts one
Ray actor per rank (``workers.group.ActorGroup``, as ``skyrl-kda run`` does), each builds the
model on the run's mesh (or on another one given with ``--set``: the checkpoint reshards) and
loads only the model part of the checkpoint (no optimizer, no data); global rank 0 writes.

The source checkpoint (default: the run's ``run.init_from_hf``) supplies ``config.json``, the
tensors the trunk does not train (vision tower, MTP layer) and its other non-weight files
(tokenizer, generation config), so the result is a complete folder transformers can load.

A LoRA run's checkpoint holds the adapters only (docs/lora.md): each rank rebuilds the base as
the run began (``run.init_from_hf``, else the seed's initialisation), hangs the checkpoint's
adapters on it (its ``train.lora`` settings, from the manifest), checks the base's fingerprint
against the saved one (``manifest.lora_refusal``) and loads the adapters. The export is then the
merged model, W + (alpha/r) B A (``peft_adapters.hf_view``), or with ``adapters=True``
(``--adapters``) the adapters alone as a PEFT folder (``peft_adapters.save_peft_adapter``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from ..config import LoRAConfig, Recipe
from ..distributed.cpu import cuda_names_cpu
from ..model.glm import build_model
from ..model.hf_io import load_hf_checkpoint, save_hf_checkpoint
from ..model.lora import apply_lora
from ..recipes import load_recipe
from . import checkpoint, manifest
from .checkpoint_failures import explained_failures
from .outputs import RECIPE
from .peft_adapters import hf_view, save_peft_adapter
from .run import rank_group
from .setup import init_parallel_state, seed_everything
from .stop import Interrupted, StopSignals
from .trainer import base_fingerprint

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt",
                   ".pth")
"""Files of a source folder that are weights (written by the export, never copied)."""


def run_recipe(run_dir: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe a run ran (its ``recipe.yaml``), with ``--set`` overrides (e.g. another mesh)."""
    path = Path(run_dir) / RECIPE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: RUN_DIR must be a `skyrl-kda run` output "
                                "folder")
    return load_recipe(path, overrides).recipe


def load_run_model(recipe: Recipe, path: str | Path):
    """Rank side: the GLM model on ``recipe``'s mesh with the weights of checkpoint ``path``.

    torch.distributed must be initialised; megatron's parallel state is set up here (tear it down
    with ``parallel_state.destroy_model_parallel``). The checkpoint's files are verified against
    its manifest first; only the model's shards are read."""
    record = checkpoint.verified_manifest(path)
    use_cpu = recipe.run.device == "cpu"
    init_parallel_state(recipe)
    seed_everything(recipe.train.seed, use_cpu)  # the build draws init values (a LoRA run's base)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    model = build_model(recipe, use_cpu=use_cpu, pg_collection=pgs)
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if record.get("lora") is not None:
        request = {"model": _adapters_on_base(model, recipe, path, record, metadata, pgs)}
    else:
        # The same declaration of every tensor's sharding as the trainer's save (checkpoint.py).
        request = {"model": checkpoint.module_sharded_state(model, "", metadata, pgs.tp)}
    with cuda_names_cpu(use_cpu), explained_failures("loading", path):
        state = dist_checkpointing.load(request, str(path))
    result = model.load_state_dict(state["model"], strict=record.get("lora") is None)
    wrong = result.unexpected_keys + [k for k in result.missing_keys if ".lora." in k]
    if wrong:
        raise ValueError(f"checkpoint {path}: its adapters do not match the model's: {wrong[:3]}")
    return model


def _adapters_on_base(model, recipe: Recipe, path, record: dict, metadata: dict, pgs) -> dict:
    """A LoRA checkpoint's rank side: the base as the run built it (``run.init_from_hf`` loaded,
    else the seed's initialisation), the checkpoint's adapters (its ``train.lora``) hung on it and
    the base's fingerprint checked against the saved one; returns the adapters' sharded state
    to load."""
    if recipe.run.init_from_hf is not None:
        load_hf_checkpoint(model, recipe.run.init_from_hf)
    lora = LoRAConfig.model_validate(record["lora"]["settings"])
    apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
               target_modules=lora.target_modules, exclude_modules=lora.exclude_modules,
               seed=recipe.train.seed, init_method=lora.init_method,
               share_expert_adapters=lora.share_expert_adapters,
               normalize_moe_lora=lora.normalize_moe_lora)
    fingerprint = base_fingerprint(model, pgs.tp, metadata["dp_cp_group"])
    p = recipe.parallel
    mesh = {"world": dist.get_world_size(), "tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp}
    refusal = manifest.lora_refusal(path, record, record["lora"]["settings"], fingerprint, mesh)
    if refusal is not None:
        raise ValueError(refusal.replace("resume with", "export with"))
    return checkpoint.adapter_sharded_state(model, metadata, pgs.tp)


def _export_rank(rank: int, world: int, recipe: Recipe, path: str, out_dir: str,
                 source: str | None, adapters: bool = False) -> None:
    model = load_run_model(recipe, path)
    try:
        if adapters:
            save_peft_adapter(model, out_dir, base_model=source or recipe.run.init_from_hf)
        else:  # a LoRA model's merged weights
            save_hf_checkpoint(hf_view(model), out_dir, source=source)
    finally:
        parallel_state.destroy_model_parallel()


def copy_non_weight_files(source: str | Path, out_dir: str | Path) -> list[str]:
    """The source's tokenizer, generation config and other plain files (not weights, not
    config.json, which the export already wrote); returns the names copied."""
    copied = []
    for entry in sorted(Path(source).iterdir()):
        name = entry.name
        if not entry.is_file() or name == "config.json" or name.endswith(WEIGHT_SUFFIXES):
            continue
        shutil.copyfile(entry, Path(out_dir) / name)
        copied.append(name)
    return copied


EXPORT = "export it with skyrl-kda export RUN_DIR --out HF_DIR"
"""What a broken ``latest`` tells to do with the step folder that verifies
(``checkpoint.latest_advice``)."""


def export_checkpoint(run_dir: str | Path, from_step: int | None = None) -> Path:
    """The checkpoint ``export`` writes: the one ``latest`` names, or ``step_N`` for
    ``from_step``. A missing, empty or broken ``latest`` names the step folder that verifies and
    ``--from-step N`` (``checkpoint.LatestError``)."""
    if from_step is not None:
        path = checkpoint.step_dir(run_dir, from_step)
        if not path.is_dir():
            raise FileNotFoundError(f"--from-step {from_step}: {path} does not exist")
        return path
    path = checkpoint.resume_checkpoint(run_dir, EXPORT)
    if path is None:
        raise FileNotFoundError(f"{checkpoint.checkpoints_dir(run_dir)} has no checkpoint to export")
    return path


def check_out_dir(out: Path) -> None:
    """Refuse, before Ray starts, an ``HF_DIR`` that rank 0 could not write: one that holds
    files, one below a file, or one on a filesystem that refuses writes (read-only)."""
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: export into a new folder")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder: export into a new folder")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"--out {out}: {existing} is a file, so no folder can be made "
                                 "below it: export into a new folder elsewhere")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = ("its filesystem is read-only" if os.statvfs(existing).f_flag & os.ST_RDONLY
               else "no write permission")
        raise PermissionError(f"--out {out}: {existing} cannot be written ({why}): export to "
                              "a writable folder")


def export(run_dir: str | Path, out_dir: str | Path, *, overrides: Sequence[str] = (),
           source: str | None = None, use_source: bool = True,
           from_step: int | None = None, adapters: bool = False) -> tuple[Path, int]:
    """Export ``run_dir``'s latest checkpoint (``from_step``: ``step_N``) to ``out_dir``;
    returns (checkpoint, step). Everything the driver can check (the checkpoint, the source,
    ``out_dir``) is refused before Ray starts.

    ``source`` defaults to the run's ``run.init_from_hf``; without one (or ``use_source=False``)
    config.json is a flat text config from the recipe and nothing is copied through. SIGTERM or
    Ctrl-C stops it at once (``stop.Interrupted``): the ranks and a Ray started here end, and
    what it wrote into ``out_dir`` is removed. A LoRA run exports merged weights, or with
    ``adapters`` its adapters as a PEFT folder (``adapter_model.safetensors``,
    ``adapter_config.json``; nothing copied from the source)."""
    recipe = run_recipe(run_dir, overrides)
    ckpt = export_checkpoint(run_dir, from_step)
    if not use_source:
        source = None
    elif source is None:
        source = recipe.run.init_from_hf
    if source is not None and not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"source checkpoint {source!r} has no config.json (pass --source, "
                                "or --no-source for a config.json made from the recipe)")
    out = Path(out_dir)
    check_out_dir(out)
    record = manifest.read(ckpt)  # an unfinished save is refused before Ray starts
    step = int(record["step"])
    if adapters and record.get("lora") is None:
        raise ValueError(f"--adapters: {ckpt} holds full weights (a run without LoRA, "
                         "train.lora.rank=0): export it without --adapters")
    made = not out.exists()
    with StopSignals() as stop:  # phase "starting" throughout: a signal stops it at once
        try:
            _export_on_ranks(recipe, stop, ckpt, out, source, adapters)
        except KeyboardInterrupt:
            if stop.signum is None:
                raise
            _remove_partial(out, made)
            raise Interrupted(stop.signum, f"stopped by {signal.Signals(stop.signum).name} during "
                              f"the export of {ckpt}; nothing kept in {out}") from None
    if source is not None and not adapters:
        copied = copy_non_weight_files(source, out)
        logger.info("copied from %s: %s", source, ", ".join(copied) or "nothing")
    return ckpt, step


def _export_on_ranks(recipe: Recipe, stop: StopSignals, ckpt: Path, out: Path,
                     source: str | None, adapters: bool = False) -> None:
    with rank_group(recipe, stop) as group:
        group.run(_export_rank, recipe, str(ckpt.resolve()), str(out.resolve()),
                  None if source is None else str(Path(source).resolve()), adapters)


def _remove_partial(out: Path, made: bool) -> None:
    """What an interrupted export wrote (``out`` was new or empty when it started)."""
    if made:
        shutil.rmtree(out, ignore_errors=True)
    elif out.is_dir():
        for entry in out.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
