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
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import ray
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from ..config import Recipe
from ..distributed.cpu import cuda_names_cpu
from ..model.glm import build_model
from ..model.hf_io import save_hf_checkpoint
from ..recipes import load_recipe
from ..workers.group import ActorGroup, ensure_ray
from . import checkpoint, manifest
from .checkpoint_failures import explained_failures
from .outputs import RECIPE
from .setup import init_parallel_state, seed_everything

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
    checkpoint.verified_manifest(path)
    use_cpu = recipe.run.device == "cpu"
    init_parallel_state(recipe)
    seed_everything(recipe.train.seed, use_cpu)  # the build draws init values, then overwritten
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    model = build_model(recipe, use_cpu=use_cpu, pg_collection=pgs)
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    # The same declaration of every tensor's sharding as the trainer's save (checkpoint.py).
    request = {"model": checkpoint.module_sharded_state(model, "", metadata, pgs.tp)}
    with cuda_names_cpu(use_cpu), explained_failures("loading", path):
        state = dist_checkpointing.load(request, str(path))
    model.load_state_dict(state["model"])
    return model


def _export_rank(rank: int, world: int, recipe: Recipe, path: str, out_dir: str,
                 source: str | None) -> None:
    model = load_run_model(recipe, path)
    try:
        save_hf_checkpoint(model, out_dir, source=source)
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


def export(run_dir: str | Path, out_dir: str | Path, *, overrides: Sequence[str] = (),
           source: str | None = None, use_source: bool = True) -> tuple[Path, int]:
    """Export ``run_dir``'s latest checkpoint to ``out_dir``; returns (checkpoint, step).

    ``source`` defaults to the run's ``run.init_from_hf``; without one (or ``use_source=False``)
    config.json is a flat text config from the recipe and nothing is copied through."""
    recipe = run_recipe(run_dir, overrides)
    ckpt = checkpoint.latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{checkpoint.checkpoints_dir(run_dir)} has no checkpoint to export")
    if not use_source:
        source = None
    elif source is None:
        source = recipe.run.init_from_hf
    if source is not None and not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"source checkpoint {source!r} has no config.json (pass --source, "
                                "or --no-source for a config.json made from the recipe)")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: export into a new folder")
    step = int(manifest.read(ckpt)["step"])  # an unfinished save is refused before Ray starts
    started_here = ensure_ray(recipe.run)
    try:
        group = ActorGroup.for_recipe(recipe)
        try:
            group.run(_export_rank, recipe, str(ckpt.resolve()), str(out.resolve()),
                      None if source is None else str(Path(source).resolve()))
        finally:
            group.shutdown()
    finally:
        if started_here:
            ray.shutdown()
    if source is not None:
        copied = copy_non_weight_files(source, out)
        logger.info("copied from %s: %s", source, ", ".join(copied) or "nothing")
    return ckpt, step
