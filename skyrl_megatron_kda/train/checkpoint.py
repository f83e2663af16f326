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

``<output_dir>/checkpoints/latest`` names the newest complete checkpoint; it is written after
the checkpoint itself, so an interrupted save never becomes the one ``--resume`` picks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .trainer import RankTrainer

logger = logging.getLogger(__name__)

OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
"""Megatron's optimizer state layout that any mesh can load (gathered canonical tensors)."""

LATEST = "latest"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / f"step_{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None when it has none."""
    marker = checkpoints_dir(output_dir) / LATEST
    if not marker.is_file():
        return None
    path = checkpoints_dir(output_dir) / marker.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{marker} names {path.name}, which does not exist")
    return path


def _mesh(trainer: RankTrainer) -> dict:
    p = trainer.recipe.parallel
    return {"world": dist.get_world_size(), "tp": p.tp, "cp": p.cp, "ep": p.ep, "etp": p.etp}


def _rng_state(trainer: RankTrainer) -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if not trainer.use_cpu:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(trainer: RankTrainer, state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if not trainer.use_cpu:
        torch.cuda.set_rng_state(state["cuda"])


def _model_sharded_state(trainer: RankTrainer) -> dict:
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
    metadata = {"dp_cp_group": trainer.dp_cp_group}
    # The unwrapped model: DDP's own sharded_state_dict would prefix "module.".
    return module_sharded_state(trainer.model.module, "", metadata, trainer.pgs.tp)


def module_sharded_state(module: torch.nn.Module, prefix: str, metadata: dict, tp_group) -> dict:
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

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


def _sharded_state(trainer: RankTrainer, *, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = _model_sharded_state(trainer)
    with trainer.cpu_mode():
        optimizer = trainer.optimizer.sharded_state_dict(
            model, is_loading=is_loading, metadata=OPTIMIZER_FORMAT)
    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": trainer.scheduler.state_dict(),
        "loader": trainer.loader.state_dict(),
        "step": trainer.step,
        "mesh": _mesh(trainer),
        # Keyed by global rank under the mesh: loads only where the same mesh saved it.
        "rng": ShardedObject(f"rng/{_mesh_key(trainer)}", _rng_state(trainer), (world,), (rank,),
                             replica_id=0),
    }


def _mesh_key(trainer: RankTrainer) -> str:
    return "_".join(f"{k}{v}" for k, v in _mesh(trainer).items())


def _continue_data(trainer: RankTrainer, saved: dict) -> None:
    """Continue the saved data stream. Rows are packed with the saved run's padding multiple (a
    CP2 run pads documents to 4 tokens, CP1 to 1), so a run on another mesh keeps that multiple
    when it is a multiple of its own, and reads exactly the rows the saved run would have."""
    from .data import PackedLoader

    old = trainer.loader
    if saved["pad_multiple"] != old.pad_multiple:
        if saved["pad_multiple"] % old.pad_multiple:
            raise ValueError(
                f"the checkpoint's rows pad documents to multiples of {saved['pad_multiple']} "
                f"tokens, which this mesh's CP layout cannot split (it needs multiples of "
                f"{old.pad_multiple}); resume on a mesh whose CP layout divides it")
        trainer.loader = PackedLoader(old.source, seq_len=old.seq_len,
                                      pad_multiple=saved["pad_multiple"],
                                      shuffle_buffer=old.shuffle_buffer, seed=old.seed,
                                      pad_id=old.pad_id)
    trainer.loader.load_state_dict(saved)


def _materialize_optimizer_state(trainer: RankTrainer) -> None:
    """Give a fresh optimizer its Adam state (and step counter) before a load fills it in place:
    without apex/TE, megatron's DistributedOptimizer reads the step from that state. megatron's
    own dummy step does it (zero gradients; the weights it touches are overwritten by the load)."""
    with trainer.cpu_mode():
        for opt in _optimizers(trainer):
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()


def _optimizers(trainer: RankTrainer) -> list:
    return getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])


@contextlib.contextmanager
def _adam_step_passes_through(trainer: RankTrainer):
    """Work around megatron-core 0.19.2 without apex/TE: torch's Adam keeps ``step`` as a tensor
    in every parameter's state, and ``DistributedOptimizer._set_main_param_and_optimizer_states``
    expects every such tensor among the loaded ones, while the loader deliberately leaves
    ``step`` out (it restores it from the param groups just before). Hand the already restored
    step back to it unchanged, for the duration of the load only."""
    patched = []
    for opt in _optimizers(trainer):
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


def _unshare_adam_steps(trainer: RankTrainer) -> None:
    """Work around megatron-core 0.19.2 without apex/TE: the load gives every parameter's state
    one shared ``step`` tensor, which torch's Adam then increments once per parameter, so the
    bias correction of the next step would be wrong. Give each parameter its own copy."""
    for opt in _optimizers(trainer):
        for param_state in opt.optimizer.state.values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                param_state["step"] = step.clone()


def save(trainer: RankTrainer, output_dir: str | Path) -> Path:
    """Write a checkpoint of the trainer's current step (collective: every rank calls it)."""
    from megatron.core import dist_checkpointing

    path = step_dir(output_dir, trainer.step)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with trainer.cpu_mode():
        dist_checkpointing.save(_sharded_state(trainer, is_loading=False), str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        marker = checkpoints_dir(output_dir) / LATEST
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(path.name)
        os.replace(tmp, marker)
    dist.barrier()
    logger.info("saved checkpoint %s", path)
    return path


def load(trainer: RankTrainer, path: str | Path) -> None:
    """Restore model, optimizer, scheduler, data position and (same mesh) RNG from ``path``."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    saved_mesh = dist_checkpointing.load_common_state_dict(str(path))["mesh"]
    same_mesh = saved_mesh == _mesh(trainer)
    _materialize_optimizer_state(trainer)
    request = _sharded_state(trainer, is_loading=True)
    if not same_mesh:
        del request["rng"]
        logger.warning("checkpoint %s was saved on mesh %s, this run is %s: RNG streams start "
                       "from the seed", path, saved_mesh, _mesh(trainer))
    with trainer.cpu_mode():
        state = dist_checkpointing.load(request, str(path))
    trainer.model.module.load_state_dict(state["model"])
    with trainer.cpu_mode(), _adam_step_passes_through(trainer):
        trainer.optimizer.load_state_dict(state["optimizer"])
    _unshare_adam_steps(trainer)
    # megatron's scheduler adds the saved step count to its own (it expects a fresh one): count
    # from 0, so that loading into a trainer that has already stepped (SkyRL's load_checkpoint
    # on a live worker) sets the saved LR too.
    trainer.scheduler.num_steps = 0
    trainer.scheduler.load_state_dict(state["scheduler"])
    _continue_data(trainer, state["loader"])
    trainer.step = int(state["step"])
    if same_mesh:
        _set_rng_state(trainer, state["rng"])
