"""Weight sync from the KDA policy worker to SkyRL's inference side.

SkyRL 0.4.0's workers (``Worker.init_weight_sync_state``) build a ``WeightSource`` over the live
model and hand it to vLLM's trainer-side transfer engine (``build_trainer_engine``); each sync is
then one ``engine.send_weights()`` between the trainer's ``pause_generation`` and
``resume_generation``. This module gives the KDA worker:

- ``HFWeightSource``: vLLM's ``WeightSource`` contract (``metadata()`` and ``__iter__``, equal
  element for element and in the same order on every rank) over ``model.hf_io.export_hf_tensors``
  (full tensors in HF names, collective), cast to the inference dtype. It is what SkyRL's
  ``nccl`` and ``ipc`` engines send (``vllm_weight_source`` puts vLLM's base class under it).
- ``DiskPublisher``: an engine with the same ``send_weights()`` that publishes the weights as a
  versioned Hugging Face folder (``<dir>/v000001``, ...), atomically: the folder is written under
  a temporary name, renamed into place, and only then named in ``<dir>/LATEST``. Each version
  records how many optimizer steps its weights have taken (``TRAIN_STEP``), which a restart
  cannot renumber the way it renumbers versions. An inference client that is a
  ``DiskSyncTarget`` (``glm5_next_client.Glm5NextInferenceClient``) reloads the newest version
  when SkyRL resumes or wakes it. vLLM needs none of this, so it runs on a laptop.

Under LoRA, SkyRL's ``merge_lora`` decides what is sent:

- ``true``: both send the merged weights W + (alpha/r) B A (``train.peft_adapters.hf_view``),
  computed per tensor as it is sent; the training model stays unmerged, and the sampler serves
  the base model's name with the trained policy.
- ``false``: the adapters only, as SkyRL's Megatron worker sends them with ``sync_mode=disk``
  (``train.peft_adapters.save_sync_adapter``: vLLM's layout, scales folded into B). The disk
  publisher's version folder then holds that adapter folder, naming the base checkpoint the
  sampler adds it to (``run.init_from_hf``); for vLLM engines it is written to
  ``trainer.policy.model.lora.lora_sync_path`` and loaded by SkyRL's ``load_lora_adapter`` call
  (``sync_adapter_to_vllm``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ...model.hf_io import export_hf_tensors, save_hf_checkpoint
from ...train.peft_adapters import hf_view, save_sync_adapter

LATEST = "LATEST"
"""File in a publish folder naming its newest complete version folder."""

TRAIN_STEP = "TRAIN_STEP"
"""File in a version folder: the optimizer steps its weights have taken (0: the initial weights).
Version numbers restart with a job's publish folder; this number is the trainer's, which a
checkpoint restores."""

VLLM_BACKENDS = ("nccl", "ipc")
"""SkyRL transfer strategies this worker's source serves (``get_transfer_strategy``'s names)."""


class WeightMeta(NamedTuple):
    """One tensor of the stream: vLLM's ``ParamMeta`` fields, in its order."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]


class HFWeightSource:
    """The model's full tensors in HF names and order, cast to ``dtype``: vLLM's ``WeightSource``
    contract. Iterating is collective (every rank of the model must iterate to the end) and every
    rank gets every tensor; ``metadata()`` is one dry iteration, cached (as SkyRL's
    ``MegatronWeightSource``), so it is collective the first time only."""

    meta_type = WeightMeta

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self._model = hf_view(model)  # a LoRA model's merged weights
        self._dtype = dtype
        self._meta: Optional[List] = None

    def metadata(self) -> List:
        if self._meta is None:
            self._meta = [self.meta_type(name, self._dtype, tuple(t.shape))
                          for name, t in export_hf_tensors(self._model)]
        return self._meta

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, tensor in export_hf_tensors(self._model):
            yield name, tensor.to(self._dtype).detach().contiguous()


def vllm_weight_source(model: torch.nn.Module, dtype: torch.dtype, backend: str):
    """``HFWeightSource`` as a subclass of vLLM's ``WeightSource`` with its ``ParamMeta``, for
    SkyRL's ``build_trainer_engine`` (``backend`` is SkyRL's resolved transfer strategy)."""
    if backend not in VLLM_BACKENDS:
        raise ValueError(
            f"weight sync backend {backend!r} is not served by the KDA policy worker (it serves "
            f"{', '.join(VLLM_BACKENDS)} and the disk publisher); set "
            "generator.inference_engine.weight_sync_backend=nccl")
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class VllmHFWeightSource(HFWeightSource, WeightSource):
        meta_type = ParamMeta

    return VllmHFWeightSource(model, dtype)


# -- the disk backend ---------------------------------------------------------------------------

class DiskSyncTarget:
    """An inference client that loads the weights ``DiskPublisher`` writes to
    ``weight_sync_dir``; the policy worker picks the disk backend for it."""

    weight_sync_dir: str


def version_folder(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def latest_version(root: str | os.PathLike) -> Optional[Tuple[int, Path]]:
    """(version, folder) named by ``root/LATEST``, or None before the first publish."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    return int(name.lstrip("v")), Path(root) / name


def published_train_step(folder: str | os.PathLike) -> int:
    """The optimizer steps the weights in a published version ``folder`` have taken."""
    marker = Path(folder) / TRAIN_STEP
    if not marker.is_file():
        raise FileNotFoundError(f"{folder} has no {TRAIN_STEP} file: not a version folder that "
                                "DiskPublisher wrote")
    return int(marker.read_text())


def _replace_file(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old content or the new, never a partial one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class DiskPublisher:
    """A trainer-side engine (``send_weights()``, as vLLM's) that publishes the model as the next
    version folder under ``root``. Collective; global rank 0 writes. ``train_step`` gives the
    optimizer steps the model has taken, recorded in the folder (``TRAIN_STEP``). ``keep`` older
    versions stay (a reader may still be loading one); the rest are removed after the new one is
    named."""

    # The flags SkyRL's worker reads from its engines (weight_senders.SkyrlTrainerCapabilities).
    skyrl_handles_prefix_cache_reset = False
    skyrl_force_disable_expandable_segments = False
    skyrl_empty_cache_after_send = True

    def __init__(self, model: torch.nn.Module, root: str | os.PathLike, dtype: torch.dtype, *,
                 train_step: Callable[[], int], source: Optional[str] = None, keep: int = 2,
                 adapters_only: bool = False):
        if keep < 1:
            raise ValueError(f"DiskPublisher keep={keep}: keep at least the newest version")
        if adapters_only and source is None:
            raise ValueError("adapter-only weight sync (merge_lora=false) needs the base checkpoint "
                             "the sampler adds the adapters to: set run.init_from_hf, or "
                             "merge_lora=true")
        self.model, self.root, self.dtype, self.source, self.keep = model, Path(root), dtype, source, keep
        self.train_step, self.adapters_only = train_step, adapters_only

    def send_weights(self) -> int:
        """Publish the next version; returns its number (on every rank)."""
        writer = dist.get_rank() == 0
        current = latest_version(self.root) if writer else None
        box = [0 if current is None else current[0]]
        dist.broadcast_object_list(box, src=0)  # the writer's disk decides for every rank
        version = box[0] + 1
        tmp = self.root / f".incoming-v{version:06d}"
        if writer:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a publish that was killed
        if self.adapters_only:
            save_sync_adapter(self.model, tmp, base_model=os.path.abspath(self.source),
                              dtype=self.dtype)
        else:
            save_hf_checkpoint(hf_view(self.model), tmp, source=self.source, dtype=self.dtype)
        if writer:
            (tmp / TRAIN_STEP).write_text(str(self.train_step()))
            final = version_folder(self.root, version)
            os.rename(tmp, final)  # atomic: readers see no folder or a complete one
            _replace_file(self.root / LATEST, final.name)
            for old in range(version - self.keep, 0, -1):
                folder = version_folder(self.root, old)
                if not folder.exists():
                    break
                shutil.rmtree(folder)
        return version


# -- what the worker's calls do ------------------------------------------------------------------

def inference_dtype(ie_cfg) -> torch.dtype:
    """SkyRL's ``generator.inference_engine.model_dtype`` as a torch dtype (SkyRL's parser)."""
    from skyrl.train.utils.utils import str_to_torch_dtype

    return str_to_torch_dtype(ie_cfg.model_dtype)


async def init_weight_sync_state(worker, client, ie_cfg, inherited) -> None:
    """The worker's ``init_weight_sync_state``: a ``DiskPublisher`` for a ``DiskSyncTarget``
    client; otherwise SkyRL's own (``inherited``), which builds vLLM's engine over
    ``worker._build_weight_source``."""
    if not isinstance(client, DiskSyncTarget):
        await inherited(client, ie_cfg)
        return
    trainer = worker.trainer
    worker._weight_sync_engine = DiskPublisher(
        trainer.model.module, client.weight_sync_dir, inference_dtype(ie_cfg),
        train_step=lambda: trainer.step, source=trainer.recipe.run.init_from_hf,
        adapters_only=adapters_only(worker.cfg))
    dist.barrier()


def adapters_only(trainer_cfg) -> bool:
    """Whether the sync sends the adapters alone: a LoRA policy with SkyRL's ``merge_lora=false``."""
    return (trainer_cfg.policy.model.lora.rank > 0
            and not trainer_cfg.policy.megatron_config.lora_config.merge_lora)


async def sync_adapter_to_vllm(worker, client, ie_cfg) -> None:
    """SkyRL's adapter-only disk sync to vLLM engines: the adapter folder written to
    ``lora_sync_path`` (global rank 0 writes: a path every engine reads), then, from rank 0,
    ``load_lora_adapter`` on SkyRL's HTTP client or a ``LoraLoadRequest`` on another client."""
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        SKYRL_LORA_ADAPTER_NAME,
        RemoteInferenceClient,
    )

    path = worker.cfg.policy.model.lora.lora_sync_path
    trainer = worker.trainer
    source = trainer.recipe.run.init_from_hf
    save_sync_adapter(trainer.model.module, path, dtype=inference_dtype(ie_cfg),
                      base_model=None if source is None else os.path.abspath(source))
    dist.barrier()
    if dist.get_rank() == 0:
        if isinstance(client, RemoteInferenceClient):
            await client.load_lora_adapter(SKYRL_LORA_ADAPTER_NAME, path)
        else:
            from skyrl.backends.skyrl_train.weight_sync import LoraLoadRequest

            await client.update_named_weights(LoraLoadRequest(lora_path=path,
                                                              lora_name=SKYRL_LORA_ADAPTER_NAME))
    dist.barrier()


async def broadcast_to_inference_engines(worker, client, ie_cfg, model_id) -> None:
    """One sync, inside the trainer's pause / resume: the disk publish, or SkyRL's own bracket
    around vLLM's ``send_weights`` (``Worker._sync_weights_to_inference_engines``)."""
    if model_id is not None:
        raise ValueError(f"broadcast_to_inference_engines(model_id={model_id!r}): per-tenant "
                         "LoRA adapters are not supported by the KDA policy worker")
    engine = worker._weight_sync_engine
    if isinstance(engine, DiskPublisher):
        await worker._weight_sync_thread(engine.send_weights)
        dist.barrier()
        return
    if adapters_only(worker.cfg):
        await sync_adapter_to_vllm(
            worker, client if client is not None else worker._weight_sync_inference_client, ie_cfg)
        return
    await worker._sync_weights_to_inference_engines(
        client if client is not None else worker._weight_sync_inference_client, ie_cfg)
