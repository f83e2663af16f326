"""The trainer a KDA SkyRL job runs: SkyRL's synchronous or its fully async trainer, as SkyRL's
settings ask, each building the KDA policy and reference workers.

``trainer.fully_async.enabled=true`` selects ``FullyAsyncRayPPOTrainer`` (SkyRL's own
``main_base`` always builds the synchronous one; its fully async example swaps the trainer the
same way). With ``trainer.fully_async.simulate_training=true`` SkyRL builds no models and its
``FullyAsyncTrainerSim`` stands in for training, so no KDA worker is involved and SkyRL's class
runs as it is.
"""

from skyrl.train.fully_async_trainer import FullyAsyncRayPPOTrainer
from skyrl.train.fully_async_trainer_sim import FullyAsyncTrainerSim
from skyrl.train.trainer import RayPPOTrainer

from .config import uses_reference
from .mesh import build_line
from .reference import KDARefWorker
from .workers import KDAPolicyWorker


class KDAWorkers:
    """Mixed into a SkyRL trainer: ``build_models`` starts the KDA workers in place of those SkyRL
    picked. The worker calls are the same under both trainers."""

    def build_models(self, PolicyWorker, CriticWorker, RefWorker):
        # apply_recipe refused a critic, so SkyRL never starts that group; it starts the
        # reference group only for its KL terms (use_kl_loss / use_kl_in_reward).
        built = super().build_models(KDAPolicyWorker, None, KDARefWorker)
        # The workers' own lines go to SkyRL's infra log; the console says it once per group.
        recipe = self.cfg.trainer.kda.resolve()
        roles = ["policy", "reference"] if uses_reference(self.cfg.trainer) else ["policy"]
        for role in roles:
            print(build_line(recipe, role), flush=True)
        return built


class KDAPPOTrainer(KDAWorkers, RayPPOTrainer):
    """SkyRL's synchronous trainer with the KDA workers."""


class KDAFullyAsyncTrainer(KDAWorkers, FullyAsyncRayPPOTrainer):
    """SkyRL's fully async trainer (generation overlaps training, staleness-bounded) with the KDA
    workers."""


def trainer_class(cfg) -> type:
    """The trainer class SkyRL's settings ask for."""
    fa = cfg.trainer.fully_async
    if not fa.enabled:
        return KDAPPOTrainer
    return FullyAsyncTrainerSim if fa.simulate_training else KDAFullyAsyncTrainer


def trainer_line(cfg) -> str:
    """The dry run's line saying which trainer will run and why."""
    cls = trainer_class(cfg)
    fa = cfg.trainer.fully_async
    if cls is KDAPPOTrainer:
        return f"trainer: {cls.__name__} (synchronous; trainer.fully_async.enabled=false)"
    return (f"trainer: {cls.__name__} (fully async: max_staleness_steps={fa.max_staleness_steps}, "
            f"num_parallel_generation_workers={fa.num_parallel_generation_workers}"
            f"{', simulate_training: no models built' if fa.simulate_training else ''})")
