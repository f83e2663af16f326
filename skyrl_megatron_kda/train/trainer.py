"""One rank of a training job: megatron parallel state, the model wrapped in megatron-core's DDP
and distributed optimizer, the LR schedule, and one optimizer step on packed THD rows.

``RankTrainer`` is the per-rank API the Ray driver (``train.run``) and SkyRL's worker classes call
(``RankModel``, its base, is the model alone: what SkyRL's reference worker serves forward with):
torch.distributed must already be initialised (one process per rank), then::

    trainer = RankTrainer(recipe)
    metrics = trainer.train_step()  # {"step", "loss", "grad_norm", "tokens", ...}

The loss is the token-masked mean over the whole global batch (every DP replica and CP shard):
each rank backpropagates its local *sum*, megatron's DDP sums gradients over DP x CP
(``calculate_per_token_loss``) and ``finalize_model_grads`` divides them by the global count of
loss tokens. So the step does not depend on how the tokens are split over ranks, which is what
makes CP1 and CP2 losses comparable.

LoRA (``train.lora.rank`` > 0, docs/lora.md): adapters are hung on the built model (the
released weights loaded) before DDP and the optimizer exist, so both hold the adapters only;
the base stays frozen, the routers' expert bias included, and checkpoints hold the adapters
with a fingerprint of the base (``base_fingerprint``).

Data: every rank reads the same global rows (``dp * micro_batch_size`` per step, in loader
order) and keeps those of its DP replica, split over CP (and SP) in Megatron's layout. Reading the
other replicas' rows too keeps the loader state identical on every rank, so one saved position
resumes any mesh.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    apply_factories,
    is_main_replica,
)
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from ..config import Recipe
from ..distributed.cpu import cuda_names_cpu
from ..distributed.rank_split import RankShard, shard_for_rank
from ..model import glm
from ..model.hf_io import load_hf_checkpoint
from ..model.lora import apply_lora
from . import checkpoint, manifest, memory_report
from .adapter_checkpoint import whole_adapter_count
from .data import PackedLoader, PackedRow, build_loader, continue_loader
from .optimizer import ddp_config, optimizer_config
from .setup import init_parallel_state, seed_everything
from .step_guard import StepGuard

logger = logging.getLogger(__name__)

BuildModel = Callable[..., torch.nn.Module]
"""``model.glm.build_model``'s contract: ``build_model(recipe, *, use_cpu, pg_collection)`` gives
a module whose ``token_logprobs(input_ids [1, s], labels [1, s], *, packed_seq_params,
temperature, entropy, entropy_grad)`` returns (per-token fp32 log-probs [1, s], entropies [1, s]
or None), with ``cp_bytes()`` / ``reset_cp_bytes()`` counting KDA CP traffic."""


def load_initial_weights(module: torch.nn.Module, recipe: Recipe) -> bool:
    """Load ``run.init_from_hf`` into the freshly built model; True when it did.

    Called before megatron's DDP and optimizer exist on purpose: DDP copies every parameter into
    its contiguous buffer and the distributed optimizer takes its (fp32) main parameters from
    those at construction, so loading first is what makes both start from the released weights.
    With ``run.resume`` the checkpoint about to be loaded holds the weights, so the folder is
    only checked for existence (it is still the run's recorded source for ``skyrl-kda export``);
    under LoRA the checkpoint holds the adapters only, so the base is loaded on resume too.
    """
    path = recipe.run.init_from_hf
    if path is None:
        return False
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"run.init_from_hf={path!r} is not a folder on {socket.gethostname()} (rank "
            f"{dist.get_rank()}): every node needs the Hugging Face checkpoint at this path")
    if recipe.run.resume and not recipe.train.lora.enabled:
        if dist.get_rank() == 0:
            logger.info("run.resume: weights come from the run's checkpoint, not %s", path)
        return False
    load_hf_checkpoint(module, path)
    if dist.get_rank() == 0:
        logger.info("initial weights loaded from %s", path)
    return True


class RankModel:
    """The recipe's model on one rank, without DDP or optimizer: megatron parallel state, seeds,
    the GLM model (``run.init_from_hf`` loaded) and the per-rank inputs of a packed row.

    What a forward-only role needs (SkyRL's reference worker) and the base ``RankTrainer`` adds
    training to; ``train.rl.token_logprobs`` runs on either (``shard``, ``token_logprobs``,
    ``pgs``, ``recipe``)."""

    def __init__(self, recipe: Recipe, *, build_model: BuildModel | None = None):
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed initialised (one "
                               "process per rank)")
        self.recipe = recipe
        self.use_cpu = recipe.run.device == "cpu"
        init_parallel_state(recipe)
        seed_everything(recipe.train.seed, self.use_cpu)
        self.pgs = ProcessGroupCollection.use_mpu_process_groups()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)

        module = (build_model or glm.build_model)(recipe, use_cpu=self.use_cpu,
                                                  pg_collection=self.pgs)
        if not self.use_cpu:
            # Parameters megatron's DDP does not take into its CUDA buffers (the frozen DSA
            # indexer) and module-made ones must be on the GPU too, as in megatron's get_model.
            module.cuda(torch.cuda.current_device())
        load_initial_weights(module, recipe)
        self.model = module
        # The model itself: ``model`` is it here, and megatron's DDP around it in RankTrainer
        # (whose forward only calls it), so the head is called on this one.
        self.module = module

    def shard(self, row: PackedRow) -> RankShard:
        """This rank's part of a packed row (CP, and SP inside the layers) in the recipe's layout."""
        p, pgs = self.recipe.parallel, self.pgs
        return shard_for_rank(row, p.cp, pgs.cp.rank(), p.tp, pgs.tp.rank(), p.sequence_parallel,
                              self.recipe.parallel.cp_layout)

    def model_inputs(self, shard: RankShard) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(input_ids [1, s_local], position_ids [1, s_local], PackedSeqParams) of a shard, on this
        rank's device: what the model's forward takes."""
        device = self._device()
        cu = shard.cu_seqlens.to(device)
        cu_real = shard.cu_seqlens_unpadded.to(device)
        longest = int(cu.diff().max())
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
                                 cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        return shard.tokens[None].to(device), shard.position_ids[None].to(device), packed

    def token_logprobs(self, shard: RankShard, *, temperature: float = 1.0, entropy: bool = False,
                       entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's head on a shard: (log-probs [1, s_local] of its labels, entropies or None),
        the fine-tune loss's and the RL path's one call (``GLMModel.token_logprobs``)."""
        tokens, _, packed = self.model_inputs(shard)
        return self.module.token_logprobs(tokens, shard.labels[None].to(tokens.device),
                                          packed_seq_params=packed, temperature=temperature,
                                          entropy=entropy, entropy_grad=entropy_grad)

    def cpu_mode(self):
        """Context for calls into megatron's CUDA-only optimizer code (``distributed.cpu``)."""
        return cuda_names_cpu(self.use_cpu)

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.use_cpu else torch.device("cuda", torch.cuda.current_device())

    def close(self) -> None:
        """Tear down megatron's process groups (the torch.distributed world stays)."""
        parallel_state.destroy_model_parallel()


class RankTrainer(RankModel):
    """Model, optimizer, schedule and data of one rank; ``train_step`` runs one optimizer step.

    ``build_model`` defaults to ``model.glm.build_model``; ``loader`` to the recipe's data.
    The pieces of a step are public for ``train.rl`` (SkyRL's RL calls, whose batches and loss
    come from outside): ``shard`` / ``token_logprobs`` for a packed row, ``finalize_grads`` and
    ``optimizer_step`` once the gradients of a step are accumulated.
    """

    def __init__(self, recipe: Recipe, *, build_model: BuildModel | None = None,
                 loader: PackedLoader | None = None):
        # Before anything is built: refuses the settings megatron cannot build (optimizer offload).
        opt_config = optimizer_config(recipe)
        super().__init__(recipe, build_model=build_model)
        self.config = get_model_config(self.model)
        # The loss below is a per-rank token sum: DDP must sum gradients (not average them) and
        # finalize_model_grads divides by the global token count.
        self.config.calculate_per_token_loss = True
        self.lora_params = self._apply_lora() if recipe.train.lora.enabled else None
        self._base_fingerprint: str | None = None
        self.model = DistributedDataParallel(self.config, ddp_config(recipe), self.model)
        t = recipe.train
        with self.cpu_mode():
            self.optimizer = get_megatron_optimizer(opt_config, [self.model])
            self.scheduler = build_scheduler(self.optimizer, recipe)
        self.loader = loader or build_loader(
            recipe.data, seed=t.seed, parallel=recipe.parallel, layout=recipe.parallel.cp_layout,
            vocab_size=recipe.model.vocab_size)
        self.step = 0
        self.guard = StepGuard.of(t)
        self._memory_report_due = recipe.run.memory_report  # the first step of this process

    def _apply_lora(self) -> int:
        """Adapters on the recipe's targets, seeded by ``train.seed`` (routed experts' shared or
        per-expert, normalized or not, as ``train.lora`` says); the routers' expert bias frozen
        too (megatron's ``frozen_expert_bias``), so that nothing of the base changes and an
        adapter checkpoint is the whole trained state. Returns the number of adapter parameters
        of the whole model, the same on every mesh (``whole_adapter_count``: TP/ETP shards
        joined, every EP rank's experts, a shared expert adapter once)."""
        lora = self.recipe.train.lora
        names = apply_lora(self.model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                           target_modules=lora.target_modules,
                           exclude_modules=lora.exclude_modules, seed=self.recipe.train.seed,
                           init_method=lora.init_method,
                           share_expert_adapters=lora.share_expert_adapters,
                           normalize_moe_lora=lora.normalize_moe_lora)
        if not self.use_cpu:  # A is drawn on the CPU
            self.model.cuda(torch.cuda.current_device())
        for module in self.model.modules():
            if hasattr(module, "expert_bias"):
                module.frozen_expert_bias = True
        tensors, count = whole_adapter_count(self.model)
        if dist.get_rank() == 0:
            logger.info("LoRA rank %d on %d linears of rank 0: %d adapter tensors, %d parameters "
                        "train in the whole model, the base is frozen", lora.rank, len(names),
                        tensors, count)
        return count

    def lora_line(self) -> str | None:
        """One line saying what trains under LoRA (None without it)."""
        if self.lora_params is None:
            return None
        lora = self.recipe.train.lora
        return (f"LoRA rank {lora.rank}, alpha {lora.alpha:g}: {self.lora_params:,} adapter "
                f"parameters train, the base is frozen")

    def base_fingerprint(self) -> str | None:
        """The frozen base's ``base_fingerprint`` under LoRA (None without it);
        collective on its first call, then kept: the base does not change."""
        if self.lora_params is None:
            return None
        if self._base_fingerprint is None:
            self._base_fingerprint = base_fingerprint(self.model.module, self.pgs.tp,
                                                      self.dp_cp_group)
        return self._base_fingerprint

    # -- one step ---------------------------------------------------------------------------

    def _my_rows(self) -> list:
        mbs = self.recipe.data.micro_batch_size
        rows = [self.loader.next_row() for _ in range(self.dp_size * mbs)]
        return rows[self.dp_rank * mbs:(self.dp_rank + 1) * mbs]

    def _forward_backward(self, row) -> tuple[torch.Tensor, torch.Tensor]:
        """Local (loss sum, loss-token count) of one row, with its gradients accumulated."""
        shard = self.shard(row)
        logp, _ = self.token_logprobs(shard)
        loss = -logp  # megatron's per-token cross entropy
        mask = shard.loss_mask[None].to(device=self._device(), dtype=torch.float32)
        if loss.shape != mask.shape:
            raise ValueError(f"model returned loss of shape {tuple(loss.shape)}; expected per-token "
                             f"loss {tuple(mask.shape)} for this rank's rows")
        local = (loss.float() * mask).sum()
        local.backward()
        return local.detach(), mask.sum()

    def finalize_grads(self, num_tokens: torch.Tensor | None = None) -> None:
        """Megatron's end-of-accumulation reduction: sums the gradients over DP x CP (DDP was built
        with ``calculate_per_token_loss``, so it sums) and the SP norms over TP; with
        ``num_tokens`` it divides them by that count, all-reduced in place. Run once per step."""
        with self.cpu_mode():
            finalize_model_grads([self.model], num_tokens=num_tokens)

    def optimizer_step(self, loss: float | None = None) -> tuple[float, float, bool]:
        """Apply the finalized gradients under ``train.on_nonfinite`` (``step_guard``): optimizer
        step (with clipping) and LR schedule, unless the global ``loss`` or the gradient norm is
        not finite (then ``NonFiniteStep`` is raised, or under ``skip`` the update is dropped and
        the schedule stays, as megatron's own training loop does for a skipped update); then
        clear the grad buffers for the next accumulation. Returns (grad norm, the LR it stepped
        with, whether the update was applied)."""
        lr = self.optimizer.param_groups[0]["lr"]
        applied, grad_norm = self.guard.step(self.optimizer, self.step + 1, loss, self._device(),
                                             self.cpu_mode)
        if applied:
            self.scheduler.step(increment=1)
        self.step += 1
        # optimizer.zero_grad clears the main (fp32) grads only; DDP's buffers hold the next
        # accumulation, so clear them too (train_step also clears both before it starts).
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return grad_norm, lr, applied

    def train_step(self) -> dict:
        """One optimizer step; returns this rank's metrics (loss and counts are global). With
        ``run.memory_report`` the first one also writes what held the GPU at its peak."""
        if not self._memory_report_due:
            return self._train_step()
        self._memory_report_due = False
        path = Path(self.recipe.run.output_dir) / f"memory_report_rank{dist.get_rank()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with memory_report.recording(path):
            return self._train_step()

    def _train_step(self) -> dict:
        start = time.perf_counter()
        self.model.module.reset_cp_bytes()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.model.train()
        loss_sum = torch.zeros((), device=self._device())
        count = torch.zeros((), device=self._device())
        rows = self._my_rows()
        for row in rows:
            s, n = self._forward_backward(row)
            loss_sum, count = loss_sum + s, count + n
        # Sums the gradients over DP x CP (and SP norms over TP), then divides them by the
        # global number of loss tokens, which it all-reduces in place.
        num_tokens = count.clone()
        self.finalize_grads(num_tokens)
        if int(num_tokens) == 0:
            raise ValueError(f"step {self.step + 1}: the global batch has no loss tokens")
        # The global loss before the step: a non-finite one stops or skips it (step_guard).
        total = torch.stack([loss_sum, count])
        dist.all_reduce(total, group=self.dp_cp_group)
        loss = float(total[0] / total[1])
        grad_norm, lr, applied = self.optimizer_step(loss)
        return {
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "update_skipped": not applied,
            "tokens": len(rows) * self.dp_size * self.recipe.data.seq_len,
            "loss_tokens": int(total[1]),
            "step_time_s": time.perf_counter() - start,
            "exchange": self.recipe.kda.cp_exchange,
            "cp_bytes": self.model.module.cp_bytes(),
            # Every rank reads every row, so this rank's counts are the run's.
            "skipped_records": self.loader.stats.state_dict()["skipped"],
            # Peak of torch's allocator since the run started (what `skyrl-kda plan` estimates).
            "peak_gib": None if self.use_cpu else torch.cuda.max_memory_allocated() / 2**30,
            **({} if self.lora_params is None else {"lora_params": self.lora_params}),
        }

    def train_state(self) -> checkpoint.TrainState:
        """What a checkpoint saves of this rank and restores into it."""
        return checkpoint.TrainState(
            model=self.model.module, optimizer=self.optimizer, scheduler=self.scheduler,
            step=self.step, loader_state=self.loader.state_dict(), parallel=self.recipe.parallel,
            use_cpu=self.use_cpu, tp_group=self.pgs.tp, dp_cp_group=self.dp_cp_group,
            schedule=self.recipe.train.schedule(), recipe_sha256=manifest.recipe_hash(self.recipe),
            lora=(self.recipe.train.lora.model_dump(mode="json")
                  if self.lora_params is not None else None),
            base_sha256=self.base_fingerprint())

    def save_checkpoint(self, output_dir: str) -> str:
        """Sharded checkpoint of this step under ``output_dir/checkpoints`` (every rank calls it)."""
        return str(checkpoint.save(self.train_state(), output_dir))

    def load_checkpoint(self, path: str, override_schedule: bool = False) -> int:
        """Restore a checkpoint directory (any mesh), verified against its manifest; returns the
        step it continues from. The loader continues the saved data stream (rebuilt when the
        saved mesh padded differently). Other schedule settings than the checkpoint's are
        refused unless ``override_schedule`` (``checkpoint.load``)."""
        restored = checkpoint.load(self.train_state(), path, override_schedule=override_schedule)
        self.loader = continue_loader(self.loader, restored.loader_state)
        self.step = restored.step
        return self.step


def base_fingerprint(model: torch.nn.Module, tp_group, dp_cp_group) -> str:
    """sha256 of the frozen base, the same on every mesh that holds the same weights
    (collective). Every tensor outside the adapters is taken as the checkpoint declares it
    (``checkpoint.module_sharded_state``: its key, global shape and this rank's slice); each
    element of the whole tensor is counted once, by the rank holding its main replica, as a
    64-bit mix of its global index and its bits, summed mod 2^64 per tensor; the sums of all
    ranks are added per key and hashed with key, dtype and shape in key order."""
    sharded = checkpoint.module_sharded_state(model, "", {"dp_cp_group": dp_cp_group}, tp_group)
    apply_factories(sharded)  # megatron's swiglu weight split into its two halves
    sums: dict[str, list] = {}
    for shard in nested_values(sharded):
        if (not isinstance(shard, ShardedTensor) or ".lora." in shard.key
                or not is_main_replica(shard.replica_id)):
            continue
        entry = sums.setdefault(shard.key, [0, str(shard.dtype), tuple(shard.global_shape)])
        entry[0] = (entry[0] + _shard_sum(shard)) & _MASK64
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    total: dict[str, list] = {}
    for rank_sums in gathered:
        for key, (value, dtype, shape) in rank_sums.items():
            entry = total.setdefault(key, [0, dtype, shape])
            entry[0] = (entry[0] + value) & _MASK64
    text = "".join(f"{key} {dtype} {shape} {value:016x}\n"
                   for key, (value, dtype, shape) in sorted(total.items()))
    return hashlib.sha256(text.encode()).hexdigest()


_MASK64 = (1 << 64) - 1
# splitmix64's constants as signed int64 (torch's integer arithmetic wraps mod 2^64)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                 0x94D049BB133111EB))
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK_ELEMENTS = 1 << 24


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (logical shifts by masking the arithmetic ones)."""
    z = z + _GOLDEN
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _shard_sum(shard) -> int:
    """Sum mod 2^64 over a ShardedTensor's local elements of mix(mix(global index) + bits),
    the first local dim taken in pieces of at most ``_CHUNK_ELEMENTS`` elements."""
    local = tuple(shard.local_shape)
    data = shard.data.detach().reshape(local or (1,))
    offset = tuple(shard.global_offset[shard.prepend_axis_num:]) or (0,)
    shape = tuple(shard.global_shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # the prepended axes (an expert's index) place the whole local tensor
    base = sum(o * s for o, s in zip(shard.global_offset[:shard.prepend_axis_num], strides))
    inner = strides[shard.prepend_axis_num:] or [1]
    rows = max(1, _CHUNK_ELEMENTS // max(1, data[0].numel()))
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, data.shape[0], rows):
        piece = data[start:start + rows]
        index = torch.full(piece.shape, base, dtype=torch.int64, device=data.device)
        for d, size in enumerate(piece.shape):
            first = offset[d] + (start if d == 0 else 0)
            view = [1] * piece.dim()
            view[d] = size
            steps = torch.arange(first, first + size, dtype=torch.int64, device=data.device)
            index += steps.view(view) * inner[d]
        bits = piece.contiguous().view(_INT_OF_SIZE[piece.element_size()]).to(torch.int64)
        total += _mix64(_mix64(index) + bits).sum()
    return int(total) & _MASK64


def build_scheduler(optimizer, recipe: Recipe):
    """Megatron's scheduler: linear warmup to ``train.lr`` over ``train.warmup_steps``, then
    cosine decay to ``train.min_lr`` at ``train.steps``; weight decay constant."""
    t = recipe.train
    warmup = t.warmup_steps
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(t.steps, warmup + 1), lr_decay_style="cosine",
        start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=t.steps,
        wd_incr_style="constant")
