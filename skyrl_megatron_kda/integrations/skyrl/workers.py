"""The policy worker SkyRL's ``RayPPOTrainer`` drives, one Ray actor per GPU.

It stays thin: the model, optimizer, schedule and checkpoints are ``train.trainer.RankTrainer``'s
(the same per-rank trainer ``skyrl-kda run`` uses); this class only adapts SkyRL's worker calls to
it. The RL calls that need more than ``RankTrainer`` offers today are listed in
``NOT_INTEGRATED`` and raise; the entrypoint refuses to launch a job while that list is not empty.
"""

import os
from datetime import timedelta
from typing import Optional

import ray
import torch
import torch.distributed as dist
from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
from skyrl.env_vars import SKYRL_WORKER_NCCL_TIMEOUT_IN_S

from .mesh import megatron_mesh_rank, mesh_rank

NOT_INTEGRATED = {
    "forward": "log-probs of SkyRL's rollout batches (RankTrainer steps packed rows of its own "
               "data loader, not external batches)",
    "forward_backward": "the policy loss on SkyRL's rollout batches",
    "optim_step": "a step separate from forward_backward (RankTrainer.train_step does both)",
    "init_weight_sync_state": "weight sync into the inference engines (vLLM serving glm5_next "
                              "from this model's layout)",
    "broadcast_to_inference_engines": "weight sync into the inference engines",
    "offload_to_cpu": "offloading for trainer.placement.colocate_all=true",
    "backload_to_gpu": "offloading for trainer.placement.colocate_all=true",
}
"""SkyRL worker calls the KDA policy worker cannot serve yet -> what is missing."""


class NotIntegratedError(NotImplementedError):
    """A SkyRL worker call the KDA integration does not implement yet."""

    def __init__(self, call: str):
        super().__init__(f"KDAPolicyWorker.{call}: not integrated yet; needs {NOT_INTEGRATED[call]}"
                         " (docs/skyrl.md lists what is and is not integrated)")


class KDAPolicyWorkerBase(PolicyWorkerBase):
    """SkyRL policy worker whose model is the recipe in ``cfg.kda`` (``cfg`` is SkyRL's
    ``cfg.trainer``), built and stepped by ``RankTrainer``."""

    def init_worker_process_group(self) -> None:
        # SkyRL asks for the mesh rank right after this call and builds the model later, so the
        # rank comes from megatron's rank arithmetic; RankTrainer creates the groups and
        # init_model checks that both agree.
        self.recipe = self.cfg.kda.resolve()
        if not dist.is_initialized():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="cpu:gloo,cuda:nccl",
                                    timeout=timedelta(seconds=SKYRL_WORKER_NCCL_TIMEOUT_IN_S))
        if dist.get_world_size() != self.recipe.run.num_workers:
            raise ValueError(f"SkyRL started {dist.get_world_size()} policy workers but the recipe "
                             f"has run.num_workers={self.recipe.run.num_workers}")
        self.mesh_rank = mesh_rank(self.recipe, dist.get_rank())

    def init_model(self, model_path: Optional[str] = None, num_training_steps: Optional[int] = None):
        """Build the recipe's model; SkyRL's ``model_path`` is the tokenizer's and the rollout
        engines' (the recipe's ``model`` section decides the trained model)."""
        from ...train.trainer import RankTrainer

        self.trainer = RankTrainer(self.recipe)
        actual = megatron_mesh_rank(self.recipe)
        if actual != self.mesh_rank:
            raise RuntimeError(f"rank {dist.get_rank()}: SkyRL was given {self.mesh_rank} but "
                               f"megatron built {actual}")

    def _set_pad_token_id(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def get_lr(self) -> float:
        return self.trainer.optimizer.param_groups[0]["lr"]

    def save_checkpoint(self, ckpt_dir: str, tokenizer=None) -> None:
        self.trainer.save_checkpoint(ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> int:
        if not (load_optimizer_states and load_lr_scheduler_states):
            raise ValueError("KDAPolicyWorker restores model, optimizer and schedule together")
        return self.trainer.load_checkpoint(ckpt_dir)


def _refuse(call: str):
    def method(self, *args, **kwargs):
        raise NotIntegratedError(call)

    method.__name__ = call
    method.__doc__ = f"Not integrated yet: {NOT_INTEGRATED[call]}."
    return method


# Override SkyRL's inherited versions, which would run against a model this worker does not hold.
for _call in NOT_INTEGRATED:
    setattr(KDAPolicyWorkerBase, _call, _refuse(_call))

KDAPolicyWorker = ray.remote(num_gpus=1)(KDAPolicyWorkerBase)
"""The Ray actor class handed to ``RayPPOTrainer.build_models`` (one GPU each, as SkyRL's own)."""
