"""The reference worker SkyRL builds for its KL terms (``trainer.algorithm.use_kl_loss`` or
``use_kl_in_reward``): the recipe's model without DDP or optimizer (``train.trainer.RankModel``),
serving ``forward`` (the log-probs SkyRL stores as ``base_action_log_probs``).

Weights: SkyRL calls ``init_model`` with ``trainer.ref.model.path`` (which SkyRL sets to the
policy's path when unset) and, for ``update_ref_every_epoch``, with the folder the policy's
``save_hf_model`` just wrote. The policy's own path gives the policy's initial weights (the
recipe's ``run.init_from_hf`` when it names one, as for the policy); any other path, an explicit
reference model or the policy's export, is loaded as it is.

The calls it shares with the policy worker (the process group and mesh rank, log-probs of a
rollout batch, colocation offload) are the policy worker's own methods, so both roles run the
same code on the same mesh and, with the same weights, give bitwise the same log-probs.
"""

from typing import Optional

import ray
import torch
import torch.distributed as dist
from skyrl.backends.skyrl_train.workers.worker import RefWorkerBase

from ...train.trainer import RankModel
from .mesh import build_line
from .settings import apply_decided, check_weights_folder, reference_settings
from .workers import KDAPolicyWorkerBase


class KDARefWorkerBase(RefWorkerBase):
    """SkyRL reference worker whose model is the recipe in ``cfg.kda`` (``cfg``: SkyRL's
    ``cfg.trainer``), forward only."""

    init_worker_process_group = KDAPolicyWorkerBase.init_worker_process_group
    _set_pad_token_id = KDAPolicyWorkerBase._set_pad_token_id
    _check_supported = KDAPolicyWorkerBase._check_supported
    _action_logprobs = KDAPolicyWorkerBase._action_logprobs
    offload_to_cpu = KDAPolicyWorkerBase.offload_to_cpu
    backload_to_gpu = KDAPolicyWorkerBase.backload_to_gpu

    def init_model(self, model_path: Optional[str] = None, num_training_steps: Optional[int] = None):
        """Build the recipe's model (no DDP, no optimizer) with the weights of ``model_path``
        (``settings.reference_settings``); None: the recipe's weights, else a seeded random
        init (the policy's, for the same recipe and ``trainer.seed``). Called again (SkyRL's
        ``update_ref_every_epoch``), it replaces the model it holds."""
        if getattr(self, "trainer", None) is not None:
            self.trainer.close()  # megatron's groups are rebuilt with the new model
            self.trainer = self.model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        recipe, self.decided = reference_settings(self.cfg, self.recipe, model_path)
        check_weights_folder(self.decided)
        self.trainer = RankModel(apply_decided(recipe, self.decided))
        self.model = self.trainer.model
        if dist.get_rank() == 0:  # Ray forwards an actor's stdout to the driver's console
            print(build_line(self.trainer.recipe, "reference"), flush=True)

    def forward(self, data):
        """Per-sample ``logprobs`` of the rollout batch under the reference model, in
        micro-batches of ``micro_forward_batch_size_per_gpu``, without grad (the policy worker's
        ``forward``, at the same temperature as the policy: SkyRL's Megatron backend does so)."""
        return KDAPolicyWorkerBase.forward(self, data)


KDARefWorker = ray.remote(num_gpus=1)(KDARefWorkerBase)
"""The Ray actor class handed to ``RayPPOTrainer.build_models`` as the reference worker."""
