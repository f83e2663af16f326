"""The policy worker SkyRL's ``RayPPOTrainer`` drives, one Ray actor per GPU.

It stays thin: the model, optimizer, schedule and checkpoints are ``train.trainer.RankTrainer``'s
(the same per-rank trainer ``skyrl-kda run`` uses) and the log-probs of SkyRL's padded rollout
batches are ``train.rl``'s; this class only adapts SkyRL's worker calls to them, with the inputs,
outputs, micro-batching and metric names of SkyRL's own Megatron policy worker
(``skyrl.backends.skyrl_train.workers.megatron.megatron_worker``). It serves every call of
SkyRL's RL loop.
"""

import logging
from collections import defaultdict
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Dict, List, Optional

import ray
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from omegaconf import OmegaConf
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry, compute_approx_kl
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
from skyrl.backends.skyrl_train.workers.worker_utils import (
    BatchIterator,
    all_reduce_metrics,
    compute_minibatch_rollout_logprob_diff_metrics,
    reduce_metrics,
)
from skyrl.env_vars import SKYRL_WORKER_NCCL_TIMEOUT_IN_S
from skyrl.train.utils.utils import ray_noset_visible_devices

from ...distributed.cpu import prepare_cpu_rank
from ...model.hf_io import save_hf_checkpoint
from ...train.checkpoint import latest_checkpoint
from ...train.manifest import read as read_manifest
from ...train.peft_adapters import hf_view
from ...train.rl import pack_rollout, token_logprobs
from ...train.trainer import RankTrainer
from . import offload, weight_sync
from .config import unsupported_trainer_settings
from .mesh import build_line, megatron_mesh_rank, mesh_rank
from .settings import (
    apply_decided,
    check_weights_folder,
    decided_settings,
    steps_only_extend_a_constant_schedule,
)

logger = logging.getLogger(__name__)

class _GroupReducer:
    """The ``strategy`` SkyRL's ``all_reduce_metrics`` takes: float metrics all-reduced over a
    given group, on this rank's device (so NCCL groups work too)."""

    def __init__(self, device: torch.device):
        self.device = device

    def all_reduce(self, data: Dict[str, float], op: str = "mean", group=None) -> Dict[str, float]:
        if not data:
            return {}
        names = sorted(data)
        values = torch.tensor([float(data[k]) for k in names], dtype=torch.float64,
                              device=self.device)
        ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}
        dist.all_reduce(values, op=ops[op], group=group)
        if op == "mean":
            values /= dist.get_world_size(group)
        return dict(zip(names, values.tolist()))


class KDAPolicyWorkerBase(PolicyWorkerBase):
    """SkyRL policy worker whose model is the recipe in ``cfg.kda`` (``cfg`` is SkyRL's
    ``cfg.trainer``), built and stepped by ``RankTrainer``."""

    def init_worker_process_group(self) -> None:
        # SkyRL asks for the mesh rank right after this call and builds the model later, so the
        # rank comes from megatron's rank arithmetic; RankTrainer creates the groups and
        # init_model checks that both agree.
        self.recipe = self.cfg.kda.resolve()
        if not dist.is_initialized():
            if self.recipe.run.device == "cpu":  # a CPU recipe (examples/rl_tiny): gloo ranks
                prepare_cpu_rank()
                backend = "gloo"
            else:  # the GPU SkyRL's Worker exports as LOCAL_RANK, computed the same way here
                torch.cuda.set_device(int(ray.get_gpu_ids()[0]) if ray_noset_visible_devices() else 0)
                backend = "cpu:gloo,cuda:nccl"
            dist.init_process_group(backend=backend,
                                    timeout=timedelta(seconds=SKYRL_WORKER_NCCL_TIMEOUT_IN_S))
        if dist.get_world_size() != self.recipe.run.num_workers:
            raise ValueError(f"SkyRL started {dist.get_world_size()} workers but the recipe "
                             f"has run.num_workers={self.recipe.run.num_workers}")
        self.mesh_rank = mesh_rank(self.recipe, dist.get_rank())

    def init_model(self, model_path: Optional[str] = None, num_training_steps: Optional[int] = None):
        """Build the recipe's model with SkyRL's settings (``settings.decided_settings``): the
        weights from ``model_path`` (SkyRL's ``trainer.policy.model.path``, an HF folder) unless
        the recipe names ``run.init_from_hf``; None: the recipe's, else a seeded random init."""
        self.decided = decided_settings(self.cfg, self.recipe, model_path=model_path,
                                        num_training_steps=num_training_steps)
        check_weights_folder(self.decided)
        self.trainer = RankTrainer(apply_decided(self.recipe, self.decided))
        actual = megatron_mesh_rank(self.recipe)
        if actual != self.mesh_rank:
            raise RuntimeError(f"rank {dist.get_rank()}: SkyRL was given {self.mesh_rank} but "
                               f"megatron built {actual}")
        if dist.get_rank() == 0:  # Ray forwards an actor's stdout to the driver's console
            print(build_line(self.trainer.recipe, "policy"), flush=True)

    def _set_pad_token_id(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def get_lr(self) -> float:
        return self.trainer.optimizer.param_groups[0]["lr"]

    def set_lr(self, learning_rate: float) -> None:
        """Refused (SkyRL's own would do nothing here: it sets an optimizer this worker keeps in
        its trainer). The LR follows the recipe's schedule, which checkpoints restore."""
        raise NotImplementedError(
            f"KDAPolicyWorker.set_lr({learning_rate}): the learning rate follows the recipe's train "
            "schedule (train.lr, warmup_steps, min_lr: megatron's OptimizerParamScheduler); "
            "external LR schedules (Tinker's set_lr) are not supported")

    # -- the RL calls ----------------------------------------------------------------------------

    def _check_supported(self) -> None:
        problems = unsupported_trainer_settings(self.cfg)
        if problems:
            raise ValueError("KDAPolicyWorker: " + "; ".join(problems))

    def _action_logprobs(self, sequences, attention_mask, num_actions: int, *,
                         entropy: bool = False, entropy_grad: bool = False):
        """Log-probs (and entropies) [B, num_actions] of the last ``num_actions`` tokens of each
        row, as SkyRL's workers slice them from the [B, S] per-token values."""
        rollout = pack_rollout(sequences, attention_mask, self.trainer.recipe.parallel,
                               self.trainer.recipe.parallel.cp_layout)
        logp, ent = token_logprobs(self.trainer, rollout, self.cfg.algorithm.temperature,
                                   entropy=entropy, entropy_grad=entropy_grad)
        return logp[:, -num_actions:], None if ent is None else ent[:, -num_actions:]

    def _policy_loss(self, loss_fn: Optional[str], loss_fn_config: Optional[Dict[str, Any]]):
        """(name, function, config) of the loss: SkyRL's ``PolicyLossRegistry`` entry named by
        ``loss_fn`` (default ``cfg.algorithm.policy_loss_type``), with ``loss_fn_config``
        merged over ``cfg.algorithm`` into the same config class, as SkyRL's workers do."""
        name = loss_fn if loss_fn is not None else self.cfg.algorithm.policy_loss_type
        config = self.cfg.algorithm
        if loss_fn_config:
            merged = OmegaConf.merge(OmegaConf.create(asdict(config)), OmegaConf.create(loss_fn_config))
            config = type(config).from_dict_config(merged)
        return name, PolicyLossRegistry.get(name), config

    def _reduce_over_dp(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """SkyRL's reduction: losses summed, the rest averaged (``_min``/``_max`` kept) over the
        DP group without CP (every CP and TP rank of a replica holds the same values)."""
        return all_reduce_metrics(metrics, _GroupReducer(self.trainer._device()),
                                  group=parallel_state.get_data_parallel_group(with_context_parallel=False),
                                  sum_loss_metrics=True)

    def forward(self, data, loss_fn: Optional[str] = None,
                loss_fn_config: Optional[Dict[str, Any]] = None,
                return_per_token_outputs: bool = True) -> WorkerOutput:
        """Per-sample ``logprobs`` (length ``response_length``) of SkyRL's rollout batch, in
        micro-batches of ``micro_forward_batch_size_per_gpu``, without grad."""
        self._check_supported()
        if loss_fn is not None:
            raise ValueError(f"KDAPolicyWorker.forward(loss_fn={loss_fn!r}): forward with a loss "
                             "(SkyRL's SFT / Tinker evaluation) is not implemented; the RL loop "
                             "calls forward without one")
        self.trainer.model.eval()
        rows = []
        with torch.no_grad():
            for micro in data.chunk(self.cfg.micro_forward_batch_size_per_gpu):
                logp, _ = self._action_logprobs(micro["sequences"], micro["attention_mask"],
                                                micro.metadata["response_length"])
                rows.append(logp.cpu())
        log_probs = torch.cat(rows)
        return WorkerOutput(loss_fn_outputs=[{"logprobs": r.tolist()} for r in log_probs], metrics={})

    def forward_backward(self, data, loss_fn: Optional[str] = None,
                         loss_fn_config: Optional[Dict[str, Any]] = None,
                         return_per_token_outputs: bool = True) -> WorkerOutput:
        """SkyRL's policy loss on its rollout batch, gradients accumulated until ``optim_step``,
        in micro-batches of ``micro_train_batch_size_per_gpu``; returns the metrics of SkyRL's
        Megatron worker (``final_loss``, ``policy_loss``, ``policy_entropy``, ``policy_kl``,
        ``loss_metrics/*``, ``policy_lr``; ``loss`` and ``response_length`` for cross_entropy)
        and per-sample ``logprobs``."""
        self._check_supported()
        name, policy_loss_fn, config = self._policy_loss(loss_fn, loss_fn_config)
        self.trainer.model.train()
        micro_batches = list(BatchIterator(data, self.cfg.micro_train_batch_size_per_gpu))
        # Policy losses arrive pre-scaled to sum over micro-batches and DP ranks, which is how
        # our DDP reduces gradients; the entropy term is a mean, so it is spread over them.
        spread = len(micro_batches) * self.mesh_rank.dp_size
        all_metrics, outputs = defaultdict(list), []
        for experience in micro_batches:
            experience.to_device(self.trainer._device())
            metrics = self._backward_micro(experience, name, policy_loss_fn, config, spread,
                                           return_per_token_outputs)
            outputs.extend(metrics.pop("loss_fn_outputs"))
            for key, value in metrics.items():
                all_metrics[key].append(value)
        status = reduce_metrics(all_metrics, sum_loss_metrics=True)
        if name != "cross_entropy":
            status["policy_lr"] = self.get_lr()
        return WorkerOutput(loss_fn_outputs=outputs, metrics=self._reduce_over_dp(status))

    def _backward_micro(self, exp, name: str, policy_loss_fn, config, spread: int,
                        return_per_token_outputs: bool) -> Dict[str, Any]:
        sft = name == "cross_entropy"
        logp, ent = self._action_logprobs(exp.sequences, exp.attention_mask, exp.num_actions,
                                          entropy=not sft, entropy_grad=config.use_entropy_loss)
        policy_loss, loss_metrics = policy_loss_fn(
            logp, exp.action_log_probs, exp.advantages, config=config, loss_mask=exp.loss_mask,
            rollout_logprobs=exp.rollout_logprobs)
        if sft:
            loss = policy_loss
            metrics = {"loss": policy_loss.item(), "response_length": exp.num_actions}
        else:
            entropy = masked_mean(ent, exp.loss_mask)
            loss = policy_loss
            if config.use_entropy_loss:
                loss = loss - entropy * config.entropy_loss_coef / spread
            kl = self._kl_loss(logp, exp, config)
            if kl is not None:  # a mean like the entropy term, so spread the same way
                loss = loss + kl * config.kl_loss_coef / spread
            metrics = {"final_loss": loss.item(), "policy_loss": policy_loss.item(),
                       "policy_entropy": entropy.item(),
                       "policy_kl": 0.0 if kl is None else kl.item(),
                       **{f"loss_metrics/{k}": v for k, v in loss_metrics.items()},
                       **compute_minibatch_rollout_logprob_diff_metrics(
                           logp, exp.rollout_logprobs, exp.loss_mask)}
        loss.backward()
        metrics["loss_fn_outputs"] = self._per_sample_outputs(
            logp.detach(), exp, sft) if return_per_token_outputs else [{} for _ in range(len(logp))]
        return metrics

    @staticmethod
    def _kl_loss(logp: torch.Tensor, exp, config) -> Optional[torch.Tensor]:
        """SkyRL's KL loss (``use_kl_loss``) of the policy's log-probs against the reference's
        (``base_action_log_probs``), as SkyRL's workers compute it: ``compute_approx_kl`` with
        ``kl_estimator_type``, the masked mean per sequence, then the mean; None when off."""
        if not config.use_kl_loss:
            return None
        if exp.base_action_log_probs is None:
            raise ValueError("trainer.algorithm.use_kl_loss=true but the batch has no "
                             "base_action_log_probs (the reference model's log-probs)")
        kl = compute_approx_kl(logp, exp.base_action_log_probs, loss_mask=exp.loss_mask,
                               kl_estimator_type=config.kl_estimator_type)
        return masked_mean(kl, exp.loss_mask, dim=-1).mean()

    @staticmethod
    def _per_sample_outputs(logp: torch.Tensor, exp, sft: bool) -> List[Dict[str, list]]:
        """The last ``valid_len`` response log-probs of each sample (and, for cross_entropy, the
        masked NLL), ``valid_len`` from the response mask, else the loss mask."""
        mask = exp.response_mask if exp.response_mask is not None else exp.loss_mask
        valid = ((mask > 0).sum(dim=1) if mask is not None
                 else torch.full((len(logp),), logp.shape[1])).tolist()
        logp = logp.cpu()
        nll = (-logp if exp.loss_mask is None else -logp * exp.loss_mask.cpu()) if sft else None
        out = []
        for i, n in enumerate(valid):
            item = {"logprobs": logp[i, logp.shape[1] - n:].tolist()}
            if sft:
                item["elementwise_loss"] = nll[i, logp.shape[1] - n:].tolist()
            out.append(item)
        return out

    def optim_step(self) -> float:
        """Reduce the gradients accumulated since the last step (once, over DP x CP), step the
        optimizer and the LR schedule, clear the buffers; returns the grad norm (pre-clip).

        A non-finite gradient norm follows the recipe's ``train.on_nonfinite`` as in
        ``skyrl-kda run`` (``train.step_guard``): ``stop`` raises ``NonFiniteStep`` with nothing
        applied; ``skip`` drops the update and returns the norm, so SkyRL's ``grad_norm``
        metric shows the skipped step as nan or inf (and rank 0 logs it)."""
        self.trainer.finalize_grads()
        grad_norm, _, _ = self.trainer.optimizer_step()
        return grad_norm

    # -- weight sync into the inference engines (integrations/skyrl/weight_sync.py) --------------

    async def init_weight_sync_state(self, inference_engine_client, inference_engine_cfg):
        await weight_sync.init_weight_sync_state(self, inference_engine_client, inference_engine_cfg,
                                                 super().init_weight_sync_state)

    def _build_weight_source(self, dtype: torch.dtype, backend: str):
        return weight_sync.vllm_weight_source(self.trainer.model.module, dtype, backend)

    async def broadcast_to_inference_engines(self, inference_engine_client, inference_engine_cfg,
                                             model_id: Optional[str] = None):
        await weight_sync.broadcast_to_inference_engines(self, inference_engine_client,
                                                         inference_engine_cfg, model_id)

    # -- colocation (trainer.placement.colocate_all) ---------------------------------------------

    def offload_to_cpu(self, offload_optimizer: bool = True, offload_model: bool = True) -> None:
        """Model and/or gradient buffers + optimizer state off the GPU (``offload.py``)."""
        logger.info("%s rank %d: offload_to_cpu(model=%s, optimizer=%s)", type(self).__name__,
                    dist.get_rank(), offload_model, offload_optimizer)
        offload.offload_to_cpu(self.trainer, offload_optimizer=offload_optimizer,
                               offload_model=offload_model)
        if not self.trainer.use_cpu and not getattr(self, "_offload_reported", False):
            # once per worker: what colocation leaves resident beside the inference engines
            self._offload_reported = True
            print(f"{type(self).__name__} rank {dist.get_rank()}: after offload_to_cpu the GPU "
                  f"holds {torch.cuda.memory_allocated() / 2**30:.3f} GiB of its tensors "
                  f"({torch.cuda.memory_reserved() / 2**30:.3f} GiB reserved)", flush=True)

    def backload_to_gpu(self, backload_optimizer: bool = True, backload_model: bool = True) -> None:
        """The inverse of ``offload_to_cpu``."""
        logger.info("%s rank %d: backload_to_gpu(model=%s, optimizer=%s)", type(self).__name__,
                    dist.get_rank(), backload_model, backload_optimizer)
        offload.backload_to_gpu(self.trainer, backload_optimizer=backload_optimizer,
                                backload_model=backload_model)

    # -- checkpoints and HF export ----------------------------------------------------------------
    # SkyRL saves to and loads from the same ``ckpt_dir`` (``global_step_N/policy``); inside it
    # the trainer keeps its own layout (``checkpoints/step_N`` and the ``latest`` marker).

    def save_checkpoint(self, ckpt_dir: str, tokenizer=None) -> None:
        """Sharded checkpoint of model, optimizer, schedule and RNG (collective, synchronous)."""
        self.trainer.save_checkpoint(ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> int:
        """Restore what ``save_checkpoint(ckpt_dir)`` wrote; returns the step it continues from."""
        if not (load_optimizer_states and load_lr_scheduler_states):
            raise ValueError("KDAPolicyWorker restores model, optimizer and schedule together")
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            raise FileNotFoundError(f"{ckpt_dir} holds no checkpoint written by "
                                    "KDAPolicyWorker.save_checkpoint")
        # A resume with another trainer.max_training_steps (SkyRL's "train further") changes only
        # train.steps, which SkyRL's constant schedule does not use: this run's schedule applies.
        extend = steps_only_extend_a_constant_schedule(read_manifest(path)["schedule"],
                                                       self.trainer.recipe)
        step = self.trainer.load_checkpoint(str(path), override_schedule=extend)
        logger.info("%s rank %d: restored checkpoint step %d (model, optimizer, schedule, RNG) "
                    "from %s", type(self).__name__, dist.get_rank(), step, path)
        return step

    def finalize_pending_saves(self) -> None:
        """Nothing is pending: ``save_checkpoint`` returns once the checkpoint is written."""

    def save_hf_model(self, export_dir: str, tokenizer=None) -> None:
        """The model as a glm5_next safetensors checkpoint (collective; rank 0 writes), with the
        config (and non-text tensors) of ``run.init_from_hf`` when the run started from one;
        under LoRA the merged weights (``peft_adapters.hf_view``)."""
        save_hf_checkpoint(hf_view(self.trainer.model.module), export_dir,
                           source=self.trainer.recipe.run.init_from_hf)
        if tokenizer is not None and dist.get_rank() == 0:
            tokenizer.save_pretrained(export_dir)


KDAPolicyWorker = ray.remote(num_gpus=1)(KDAPolicyWorkerBase)
"""The Ray actor class handed to ``RayPPOTrainer.build_models`` (one GPU each, as SkyRL's own)."""
