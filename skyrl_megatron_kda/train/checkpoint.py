"""Sharded checkpoints of a training run with megatron-core's ``dist_checkpointing``.

One checkpoint is a directory ``<output_dir>/checkpoints/step_<N>/`` holding:

- the model (each rank writes its TP/EP shards; megatron's sharded state dict),
- the distributed optimizer in megatron's ``fully_reshardable`` form (each parameter's Adam state
  in its canonical, unsharded shape), so a checkpoint loads into another mesh (CP2 -> CP1,
  TP2 -> TP1, other DP),
- common state that rank 0 writes: the LR scheduler, the data loader's position
  (``PackedLoader.state_dict``; identical on every rank, see ``trainer``), the step,
- each rank's RNG state (CPU generator, megatron's tracker streams, and CUDA's on GPU), restored
  only on the same mesh: RNG streams belong to ranks, so another mesh starts them from the seed
  (logged; nothing in the GLM model draws random numbers while training).

Last, rank 0 hashes every file the ranks wrote into ``manifest.json`` (``train.manifest``: sizes,
sha256, step, mesh, schedule settings, recipe hash), once all ranks have finished writing.
``<output_dir>/checkpoints/latest`` names the newest complete checkpoint; it is written after
the manifest, so an interrupted save never becomes the one ``--resume`` picks. ``load`` checks
the files against the manifest first (rank 0 hashes them) and refuses a mismatch naming the file.
A ``latest`` that is empty, names a missing folder, or is missing beside step folders is refused
naming the step folder that verifies (``LatestError``, ``latest_advice``). A save or load that
megatron fails raises ``CheckpointFailed``: the rank and its own error in one line, not torch's
``CheckpointException ranks:dict_keys([0])`` (``checkpoint_failures``).

Under LoRA (``TrainState.lora``) the model part is the adapters (``adapter_checkpoint``: routed
experts' own adapters by global expert over EP x ETP, shared ones whole), the optimizer part
their Adam state; the manifest adds the settings, the whole model's adapter tensor count and
the base's fingerprint (``manifest.lora_refusal``).

The trainer hands its pieces over as a ``TrainState``; ``load`` restores model, optimizer,
scheduler and RNG in place and returns the step and the data position (``Restored``), which the
trainer applies to its own loader.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ..config import ParallelConfig
from ..distributed.cpu import cuda_names_cpu
from . import manifest
from .adapter_checkpoint import adapter_sharded_state, whole_adapter_count
from .checkpoint_failures import check_free_space, explained_failures
from .step_guard import finite_on_every_rank

logger = logging.getLogger(__name__)

OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
"""Megatron's optimizer state layout that any mesh can load (gathered canonical tensors)."""

LATEST = "latest"


@dataclass
class TrainState:
    """One rank's training state as a checkpoint sees it. ``model``, ``optimizer`` and
    ``scheduler`` are saved from and restored into in place; ``step`` and ``loader_state`` are
    values (what ``load`` read comes back in ``Restored``)."""

    model: torch.nn.Module
    """The unwrapped model (DDP's own ``sharded_state_dict`` would prefix ``module.``)."""
    optimizer: Any
    """megatron's distributed optimizer (possibly chained)."""
    scheduler: Any
    """megatron's ``OptimizerParamScheduler``."""
    step: int
    loader_state: dict
    """``PackedLoader.state_dict()``, the same on every rank."""
    parallel: ParallelConfig
    use_cpu: bool
    tp_group: Any
    dp_cp_group: Any
    schedule: dict
    """``TrainConfig.schedule()`` of the run: recorded in the manifest, compared on load."""
    recipe_sha256: str
    """``manifest.recipe_hash`` of the run's recipe (recorded in the manifest)."""
    lora: dict | None = None
    """``train.lora`` of a LoRA run, whose checkpoints hold the adapters only (None: no LoRA)."""
    base_sha256: str | None = None
    """``trainer.base_fingerprint`` of the frozen base under LoRA (recorded, compared on load)."""

    def cpu_mode(self):
        """Context for megatron's CUDA-only checkpoint and optimizer code on CPU ranks."""
        return cuda_names_cpu(self.use_cpu)


@dataclass(frozen=True)
class Restored:
    """What ``load`` read that the caller applies itself: the step the run continues from and the
    saved data position (whose ``pad_multiple`` may be another mesh's)."""

    step: int
    loader_state: dict


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f"step_{step:08d}"


class LatestError(FileNotFoundError):
    """``checkpoints/latest`` is empty, names a missing folder, or is missing beside step
    folders: one line saying so, and which step folder verifies and the command that continues
    from it (``latest_advice``)."""


_STEP_DIR = re.compile(r"step_(\d+)")


def step_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The run's ``step_N`` folders as (N, path), newest first (finished saves or not)."""
    ckpts = checkpoints_dir(output_dir)
    if not ckpts.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpts.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


RESUME = "continue with skyrl-kda run RECIPE --resume"
"""What ``latest_advice`` tells to do with the step folder that verifies (``--from-step N`` is
added); ``export`` says ``export it with skyrl-kda export ...`` instead."""


def latest_advice(output_dir: str | Path, problem: str, action: str = RESUME) -> str:
    """``problem`` (what is wrong with ``latest``) and what to do: the newest step folder whose
    files verify against its manifest (``manifest.verify``; one without a manifest is a save
    that did not finish) and the command (``action``) that continues from it, or that none
    can."""
    skipped = []
    for step, path in step_dirs(output_dir):
        try:
            manifest.verify(path)
        except manifest.CheckpointError as err:
            why = str(err).removeprefix(f"checkpoint {path}").lstrip(": ").split(" (")[0]
            skipped.append(f"{path.name} {why}" if why.startswith("has ") else
                           f"{path.name}: {why}")
            continue
        newer = f" (newer: {'; '.join(skipped)})" if skipped else ""
        return f"{problem}; {path.name} verifies: {action} --from-step {step}{newer}"
    if skipped:
        return (f"{problem}, and no step folder verifies ({'; '.join(skipped)}): nothing to "
                "continue from; start over with --overwrite")
    return f"{problem}, and there is no step folder: nothing to continue from"


def latest_checkpoint(output_dir: str | Path, action: str = RESUME) -> Path | None:
    """The newest complete checkpoint of a run (the one ``latest`` names), or None where there is
    no ``latest`` (no save has finished, or it was removed: ``resume_checkpoint`` tells those
    apart). An empty ``latest``, one naming anything but a ``step_N`` folder of its own
    ``checkpoints/``, or one naming a folder that does not exist, raises ``LatestError`` with
    ``latest_advice``."""
    marker = checkpoints_dir(output_dir) / LATEST
    if not marker.is_file():
        return None
    name = marker.read_text().strip()
    if not name:
        raise LatestError(latest_advice(output_dir, f"{marker} is empty", action))
    if not _STEP_DIR.fullmatch(name):
        # A path (one climbing into another run's folder) would load, export and verify another
        # run's checkpoint as this one's.
        raise LatestError(latest_advice(output_dir, f"{marker} names {name!r}, which is not a "
                                                    "step_N folder beside it", action))
    path = checkpoints_dir(output_dir) / name
    if not path.is_dir():
        raise LatestError(latest_advice(output_dir, f"{marker} names {name}, which does not "
                                                    "exist", action))
    return path


def resume_checkpoint(output_dir: str | Path, action: str = RESUME) -> Path | None:
    """The checkpoint a run continues from (``latest_checkpoint``); None where the run has no
    step folder at all. A missing ``latest`` beside step folders is never guessed past: it raises
    ``LatestError`` naming the step folder that verifies (``--resume --from-step N`` loads it)."""
    path = latest_checkpoint(output_dir, action)
    if path is None and step_dirs(output_dir):
        raise LatestError(latest_advice(output_dir,
                                        f"{checkpoints_dir(output_dir) / LATEST} is missing", action))
    return path


def _mesh(state: TrainState) -> dict:
    p = state.parallel
    return {"world": dist.get_world_size(), "tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp}


def _rng_state(use_cpu: bool) -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if not use_cpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(use_cpu: bool, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if not use_cpu:
        torch.cuda.set_rng_state(state["cuda"])


def _model_sharded_state(state: TrainState) -> dict:
    """The model's sharded state dict, every tensor declared with its true TP sharding.

    megatron's default ``MegatronModule.sharded_state_dict`` has two gaps this model falls into:
    a plain torch container (the GLM model's ``ModuleList`` of layers) is saved through its
    ``state_dict()``, so every linear under it would be declared replicated, and only TP rank 0's
    shard would be written (TP rank 1 would load rank 0's weights on resume); and a module's own
    TP-parallel parameters (the KDA layer's conv taps, ``A_log``, ``dt_bias``) are declared
    replicated too. This walk calls every module that has its own ``sharded_state_dict`` (the
    parallel linears, MLP, MoE, MLA) and declares the remaining parameters from the
    ``tensor_model_parallel`` / ``partition_dim`` attributes megatron puts on TP-parallel ones.
    """
    metadata = {"dp_cp_group": state.dp_cp_group}
    if state.lora is not None:
        return adapter_sharded_state(state.model, metadata, state.tp_group)
    return module_sharded_state(state.model, "", metadata, state.tp_group)


def module_sharded_state(module: torch.nn.Module, prefix: str, metadata: dict, tp_group) -> dict:
    default = MegatronModule.sharded_state_dict
    if getattr(type(module), "sharded_state_dict", default) is not default:
        return module.sharded_state_dict(prefix=prefix, sharded_offsets=(), metadata=metadata)
    tp_group = getattr(module, "tp_group", None) or tp_group
    local: dict = {}
    module._save_to_state_dict(local, "", keep_vars=True)  # own parameters, buffers, extra state
    tp_axes = {name: p.partition_dim for name, p in module._parameters.items()
               if p is not None and getattr(p, "tensor_model_parallel", False)}
    out = make_sharded_tensors_for_checkpoint(local, prefix, tp_axes, (), tp_group=tp_group,
                                              dp_cp_group=metadata["dp_cp_group"])
    for name, child in module.named_children():
        out.update(module_sharded_state(child, f"{prefix}{name}.", metadata, tp_group))
    return out


def _sharded_state(state: TrainState, *, is_loading: bool) -> dict:
    model = _model_sharded_state(state)
    with state.cpu_mode():
        optimizer = state.optimizer.sharded_state_dict(
            model, is_loading=is_loading, metadata=OPTIMIZER_FORMAT)
    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": state.scheduler.state_dict(),
        "loader": state.loader_state,
        "step": state.step,
        "mesh": _mesh(state),
        # Keyed by global rank under the mesh: loads only where the same mesh saved it.
        "rng": ShardedObject(f"rng/{_mesh_key(state)}", _rng_state(state.use_cpu), (world,),
                             (rank,), replica_id=0),
    }


def _mesh_key(state: TrainState) -> str:
    return "_".join(f"{k}{v}" for k, v in _mesh(state).items())


def _materialize_optimizer_state(state: TrainState) -> None:
    """Give a fresh optimizer its Adam state (and step counter) before a load fills it in place:
    without apex/TE, megatron's DistributedOptimizer reads the step from that state. megatron's
    own dummy step does it (zero gradients; the weights it touches are overwritten by the load)."""
    with state.cpu_mode():
        for opt in _optimizers(state):
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()


def _optimizers(state: TrainState) -> list:
    return getattr(state.optimizer, "chained_optimizers", [state.optimizer])


@contextlib.contextmanager
def _adam_step_passes_through(state: TrainState):
    """Work around megatron-core 0.19.2 without apex/TE: torch's Adam keeps ``step`` as a tensor
    in every parameter's state, and ``DistributedOptimizer._set_main_param_and_optimizer_states``
    expects every such tensor among the loaded ones, while the loader deliberately leaves
    ``step`` out (it restores it from the param groups just before). Hand the already restored
    step back to it unchanged, for the duration of the load only."""
    patched = []
    for opt in _optimizers(state):
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _opt=opt, _original=original):
            group, order = _opt.model_param_group_index_map[model_param]
            main = _opt.optimizer.param_groups[group]["params"][order]
            step = _opt.optimizer.state[main].get("step")
            if isinstance(step, torch.Tensor) and "step" not in tensors:
                tensors = {**tensors, "step": step}
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method


def _unshare_adam_steps(state: TrainState) -> None:
    """Work around megatron-core 0.19.2 without apex/TE: the load gives every parameter's state
    one shared ``step`` tensor, which torch's Adam then increments once per parameter, so the
    bias correction of the next step would be wrong. Give each parameter its own copy."""
    for opt in _optimizers(state):
        for param_state in opt.optimizer.state.values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                param_state["step"] = step.clone()


def _clear_for_save(path: Path, output_dir: str | Path) -> None:
    """Make ``path`` ready for a new save (rank 0): a step folder that ``latest`` does not name is
    what an interrupted save left, removed so that the manifest lists only the new files; the one
    ``latest`` names (saved again at the same step) loses its manifest first, so that a save cut
    short now reads as unfinished instead of passing for the old checkpoint."""
    marker = checkpoints_dir(output_dir) / LATEST
    named = marker.read_text().strip() if marker.is_file() else None
    if not path.exists():
        return
    if path.name == named:
        (path / manifest.MANIFEST).unlink(missing_ok=True)
    else:
        logger.warning("removing %s: a save that did not finish (no %s names it)", path, LATEST)
        shutil.rmtree(path)


class NonFiniteState(ValueError):
    """A save refused because the weights or optimizer state hold inf or NaN."""


def _state_is_finite(state: TrainState) -> bool:
    """Whether every rank's weights, fp32 main parameters and Adam moments are finite (collective).
    The largest magnitude of each tensor is what is checked: inf or NaN there is the only way a
    value is not finite, and unlike a sum of squares it cannot overflow for finite values."""
    tensors = list(state.model.parameters())
    for opt in _optimizers(state):
        tensors += [p for group in opt.optimizer.param_groups for p in group["params"]]
        tensors += [v for param_state in opt.optimizer.state.values() for v in param_state.values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
    largest = torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)
    return finite_on_every_rank(bool(torch.isfinite(largest)), largest.device)


def _kept(output_dir: str | Path) -> str:
    """What a refused save leaves to resume from."""
    last = latest_checkpoint(output_dir)
    return f"{LATEST} stays at {last.name}" if last is not None else "no checkpoint yet"


def _reclaimed_bytes(path: Path, output_dir: str | Path) -> int:
    """What ``_clear_for_save`` frees before the save: an unfinished save's folder at ``path``."""
    marker = checkpoints_dir(output_dir) / LATEST
    named = marker.read_text().strip() if marker.is_file() else None
    if not path.is_dir() or path.name == named:
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save(state: TrainState, output_dir: str | Path) -> Path:
    """Write a checkpoint of ``state`` at its step (collective: every rank calls it): the shards,
    then (rank 0, once every rank has written) the manifest, then ``latest``.

    A state whose weights or optimizer state hold inf or NaN is refused before anything is
    written (``NonFiniteState``): ``latest`` keeps naming the last finite checkpoint. The
    manifest records that the check passed (``finite``). So is a checkpoint larger than the
    free space (``checkpoint_failures.NoSpaceForCheckpoint``, errno 28)."""
    if not _state_is_finite(state):
        raise NonFiniteState(f"step {state.step}: the weights or optimizer state hold inf or NaN; "
                             f"not saved ({_kept(output_dir)})")
    path = step_dir(output_dir, state.step)
    request = _sharded_state(state, is_loading=False)
    check_free_space(request, path, f"step {state.step}", _kept(output_dir),
                     _reclaimed_bytes(path, output_dir), next(state.model.parameters()).device)
    if dist.get_rank() == 0:
        _clear_for_save(path, output_dir)
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with state.cpu_mode(), explained_failures("saving", path):
        dist_checkpointing.save(request, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        manifest.write(path, step=state.step, mesh=_mesh(state), schedule=state.schedule,
                       recipe_sha256=state.recipe_sha256, finite=True,
                       lora=state.lora and {
                           "settings": state.lora, "base_sha256": state.base_sha256,
                           "adapter_tensors": whole_adapter_count(state.model)[0]})
        marker = checkpoints_dir(output_dir) / LATEST
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(path.name)
        os.replace(tmp, marker)
    dist.barrier()
    logger.info("saved checkpoint %s", path)
    return path


def verified_manifest(path: str | Path) -> dict:
    """The manifest of checkpoint ``path`` after rank 0 has checked every file against it
    (hashed once, not once per rank); collective: every rank gets it, or raises rank 0's
    ``manifest.CheckpointError``."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    result: list = [None]
    if dist.get_rank() == 0:
        try:
            result[0] = manifest.verify(path)
        except manifest.CheckpointError as err:
            result[0] = err
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], manifest.CheckpointError):
        raise result[0]
    return result[0]


def _load_model(state: TrainState, saved: dict) -> None:
    # A LoRA checkpoint holds the adapters only; the base is the one the trainer built.
    result = state.model.load_state_dict(saved, strict=state.lora is None)
    wrong = result.unexpected_keys + [k for k in result.missing_keys if ".lora." in k]
    if wrong:
        raise ValueError(f"the checkpoint's adapters do not match this model's: {wrong[:3]}")


def load(state: TrainState, path: str | Path, *, override_schedule: bool = False) -> Restored:
    """Restore model, optimizer, scheduler and (same mesh) RNG from ``path`` into ``state``'s
    objects; returns the saved step and data position for the caller to continue from.

    The files are verified against the checkpoint's manifest first. A checkpoint trained under
    other schedule settings (``TrainConfig.schedule``) is refused naming them, unless
    ``override_schedule``: then this run's settings drive the schedule from the saved step."""
    path = Path(path)
    record = verified_manifest(path)
    changes = manifest.schedule_changes(record["schedule"], state.schedule)
    if changes and not override_schedule:
        raise ValueError(f"checkpoint {path} was trained with other schedule settings: "
                         f"{', '.join(changes)} (override_schedule applies this run's)")
    refusal = manifest.lora_refusal(path, record, state.lora, state.base_sha256, _mesh(state))
    if refusal is not None:
        raise ValueError(refusal)
    saved_mesh = record["mesh"]
    same_mesh = saved_mesh == _mesh(state)
    _materialize_optimizer_state(state)
    request = _sharded_state(state, is_loading=True)
    if not same_mesh:
        del request["rng"]
        logger.warning("checkpoint %s was saved on mesh %s, this run is %s: RNG streams start "
                       "from the seed", path, saved_mesh, _mesh(state))
    with state.cpu_mode(), explained_failures("loading", path):
        saved = dist_checkpointing.load(request, str(path))
    _load_model(state, saved["model"])
    with state.cpu_mode(), _adam_step_passes_through(state):
        state.optimizer.load_state_dict(saved["optimizer"])
    _unshare_adam_steps(state)
    # megatron's scheduler adds the saved step count to its own (it expects a fresh one): count
    # from 0, so that loading into a trainer that has already stepped (SkyRL's load_checkpoint
    # on a live worker) sets the saved LR too.
    state.scheduler.num_steps = 0
    # megatron's own switch: keep the scheduler's (this run's) values instead of the saved ones.
    state.scheduler.override_opt_param_scheduler = override_schedule
    state.scheduler.load_state_dict(saved["scheduler"])
    if same_mesh:
        _set_rng_state(state.use_cpu, saved["rng"])
    return Restored(step=int(saved["step"]), loader_state=saved["loader"])
