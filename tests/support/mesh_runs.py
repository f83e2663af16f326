"""Shared training runs of the tiny GLM recipe on spawned gloo ranks (computed once per test
session, used by test_train.py and test_checkpoint.py).

- 4 ranks, TP2 x CP2 +SP, EP2: 5 steps for each exchange (a2a, allgather, state); the a2a run
  saves a checkpoint after step 2.
- 2 ranks, TP2 x CP1 +SP, EP2: the same 5 steps (the CP=1 reference), then the CP2 checkpoint
  loaded into this mesh (CP2 -> CP1) and one step.
- the same 2 ranks as TP1 x CP2, EP2: the checkpoint loaded (TP2 -> TP1) and one step.
- the 2 ranks as TP2 x CP1 again with the memory settings on (recompute, host offload, chunked
  loss, KDA head groups, mHC map chunks) and the allgather MoE dispatcher (the checkpoint was
  saved under alltoall): the checkpoint loaded and one step.

Every mesh reads the rows of the CP2 run (documents padded to multiples of 2*cp = 4 tokens), so
the losses are comparable; each run's model starts from the same seed.
"""

from __future__ import annotations

import functools
import tempfile

from tests.support.ranks import run_ranks

STEPS = 5
SAVE_AFTER = 2
EXCHANGES = ("a2a", "allgather", "state")
CP2 = ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true", "run.num_workers=4"]
CP1 = ["parallel.tp=2", "parallel.cp=1", "parallel.sequence_parallel=true", "run.num_workers=2"]
TP1 = ["parallel.tp=1", "parallel.cp=2", "parallel.sequence_parallel=false", "run.num_workers=2"]
# The memory settings and the MoE dispatcher, which a checkpoint must not depend on (saved
# without them, under alltoall; loaded with them).
LEVERS = ["train.recompute=full", "train.offload_activations=true", "train.loss_chunk_tokens=5",
          "kda.kernel_head_group=1", "model.hyper_connections.map_chunk_rows=7",
          "model.moe.dispatcher=allgather"]


def _recipe(overrides):
    from skyrl_megatron_kda.recipes import load_recipe

    return load_recipe("glm53_flash_tiny", [f"train.steps={STEPS}", *overrides], environ={}).recipe


def _trainer(overrides):
    """A trainer whose loader packs rows as the CP2 mesh does."""
    from skyrl_megatron_kda.train.data import build_loader
    from skyrl_megatron_kda.train.trainer import RankTrainer

    recipe = _recipe(overrides)
    rows_like = _recipe(CP2)
    loader = build_loader(recipe.data, seed=recipe.train.seed, parallel=rows_like.parallel,
                          layout=recipe.parallel.cp_layout, vocab_size=recipe.model.vocab_size)
    return RankTrainer(recipe, loader=loader)


def _cp2_runs(rank, world, ckpt_dir):
    out = {}
    for exchange in EXCHANGES:
        trainer = _trainer([*CP2, f"kda.cp_exchange={exchange}"])
        metrics = []
        for step in range(STEPS):
            metrics.append(trainer.train_step())
            if exchange == "a2a" and step + 1 == SAVE_AFTER:
                trainer.save_checkpoint(ckpt_dir)
        trainer.close()
        out[exchange] = metrics
    return out


def _world2_runs(rank, world, ckpt_dir):
    from skyrl_megatron_kda.train.checkpoint import latest_checkpoint

    trainer = _trainer(CP1)
    out = {"cp1": [trainer.train_step() for _ in range(STEPS)]}
    trainer.close()
    for name, mesh in (("cp2_to_cp1", CP1), ("tp2_to_tp1", TP1), ("memory_levers", CP1 + LEVERS)):
        trainer = _trainer(mesh)
        resumed_at = trainer.load_checkpoint(str(latest_checkpoint(ckpt_dir)))
        out[name] = {"resumed_at": resumed_at, "next": trainer.train_step()}
        trainer.close()
    return out


@functools.cache
def mesh_runs() -> dict:
    """{"cp2": {exchange: [metrics] * STEPS}, "cp1": [...], "cp2_to_cp1": ..., "tp2_to_tp1": ...}
    as rank 0 reports them."""
    with tempfile.TemporaryDirectory() as ckpt_dir:
        cp2 = run_ranks(4, _cp2_runs, ckpt_dir)[0]
        world2 = run_ranks(2, _world2_runs, ckpt_dir)[0]
    return {"cp2": cp2, **world2}
