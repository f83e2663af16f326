"""A LoRA model in Hugging Face terms (docs/lora.md, "Export and weight sync"): the merged weights
W + (alpha/r) B A under glm5_next's names, and the adapters as a PEFT folder.

- ``hf_view(model)``: what ``model.hf_io``'s export (``export_hf_tensors``, ``save_hf_checkpoint``)
  and the weight sync (``integrations/skyrl/weight_sync.py``) read instead of the model. Without
  adapters it is the model itself. With them it shows the base's tensors under their own names
  (the adapters' hidden), and each adapted weight shard as W + (alpha/r) B A, summed in fp32 and
  cast to W's dtype (``LoRAAdapter.delta_weight``, as ``model.lora.merge_lora`` merges), computed
  when the export reads that tensor: the training model is left unmerged, and one adapted shard
  at a time is held twice.
- ``save_peft_adapter(model, out_dir)``: the adapters gathered over TP, written as the ``peft``
  library reads them: ``adapter_model.safetensors`` with
  ``base_model.model.<module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r] per adapted
  HF linear (transformers' module path in glm5_next, ``MODULE_PATHS``), and
  ``adapter_config.json`` (``r``, ``lora_alpha``, the modules as ``target_modules``). A gated
  MLP's ``linear_fc1`` is HF's ``gate_proj`` and ``up_proj``: each takes A whole and its half of
  B, which is exactly W_gate + (alpha/r) B_gate A. Routed experts' adapters are refused there
  (glm5_next holds its experts as fused parameters, not linears peft can wrap); they merge.
- ``save_sync_adapter(model, out_dir)``: the folder SkyRL's adapter-only weight sync
  (``merge_lora=false``) hands the sampler, in vLLM's terms: the PEFT folder above plus the routed
  experts' adapters under the checkpoint's per-expert linears (``mlp.experts.{e}.gate_proj``, by
  global expert; a shared adapter written under every expert), each adapter's scale folded into
  its B and ``lora_alpha`` written equal to ``r`` (vLLM's scale is then 1, whatever each
  adapter's own rank under ``normalize_moe_lora``).
- ``merge_adapter_folder(adapter_dir, base)``: the base checkpoint's tensors with such a
  folder (or a plain PEFT folder) added, W + (lora_alpha/r) B A in fp32, under their on-disk
  names: what the project's sampler serves for an adapter-only version.

``skyrl-kda export`` (``train.export``) writes the merged weights and the PEFT folder; the SkyRL
weight sync publishes the merged weights (``merge_lora=true``) or the sync folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..distributed.tensor_parallel import all_gathered, unshard
from ..lora.adapter import LoRAAdapter, LoRAWeightSlot, SharedExpertAdapter
from ..model.hf_io import Entry, SafetensorsCheckpoint, name_table

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""What ``peft.PeftModel`` puts before the base model's module names in its state dict."""

MODULE_PATHS = (("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
                ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."))
"""On-disk HF names (``model.hf_io``'s) whose module sits elsewhere in transformers' glm5_next
(its load-time renames, ``conversion_mapping``): KDA's forget-gate projections live under
``forget_gate``. PEFT keys name modules as the loaded model holds them."""


def lora_adapters(model: torch.nn.Module) -> dict[str, LoRAAdapter | SharedExpertAdapter]:
    """Each adapter by the name of the base tensor it adapts: ``...q_proj.weight`` for a linear's,
    ``...self_attention.f_a_weight`` for a raw weight's (the ``LoRAWeightSlot`` names it), each
    routed expert's ``...local_experts.{i}.linear_fc1.weight`` for its own adapter or the MoE
    layer's shared one (``share_expert_adapters``: the same adapter under every expert)."""
    out = {}
    for name, module in model.named_modules():
        shared = module.__dict__.get("_shared_lora")
        if isinstance(shared, SharedExpertAdapter):
            out[f"{name}.weight"] = shared
            continue
        adapter = module._modules.get("lora")
        if not isinstance(adapter, LoRAAdapter):
            continue
        if isinstance(module, LoRAWeightSlot):
            owner = name.rpartition(".")[0]
            out[f"{owner}.{module.param_name}" if owner else module.param_name] = adapter
        else:
            out[f"{name}.weight"] = adapter
    return out


class _MergedShard:
    """Stands for one adapted weight shard where ``export_hf_tensors`` reads it: ``detach()`` is
    the merged shard, computed then; the TP marks are the weight's (``unshard`` reads them)."""

    def __init__(self, weight: torch.Tensor, adapter: LoRAAdapter | SharedExpertAdapter):
        self.weight, self.adapter = weight, adapter
        for mark in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(weight, mark):
                setattr(self, mark, getattr(weight, mark))

    @torch.no_grad()
    def detach(self) -> torch.Tensor:
        w = self.weight.detach()
        return (w.float() + self.adapter.delta_weight()).to(w.dtype)


class MergedLoRAView:
    """A LoRA model as ``model.hf_io``'s export reads a model (``recipe``, ``pg_collection``, the
    named parameters and the state dict), with the adapters merged into their weights on read
    and hidden themselves. Reads only: nothing of the model changes."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.recipe = model.recipe
        self.pg_collection = model.pg_collection
        self.adapters = lora_adapters(model)

    def named_parameters(self) -> Iterator[tuple[str, object]]:
        for name, param in self.model.named_parameters():
            if ".lora." in f".{name}":
                continue
            adapter = self.adapters.get(name)
            yield name, param if adapter is None else _MergedShard(param, adapter)

    def state_dict(self, keep_vars: bool = False) -> dict:
        state = self.model.state_dict(keep_vars=keep_vars)
        return {k: v for k, v in state.items() if ".lora." not in f".{k}"}


def hf_view(model: torch.nn.Module):
    """What to export or publish of ``model``: the model itself without adapters, else its
    ``MergedLoRAView``. Raw weights adapted through a slot are merged too (``f_a_weight``)."""
    adapters = lora_adapters(model)
    if not adapters:
        return model
    params = dict(model.named_parameters())
    missing = sorted(name for name in adapters if name not in params)
    if missing:
        raise ValueError(f"LoRA adapters on tensors the model does not hold: {missing[:3]}")
    return MergedLoRAView(model)


# -- the PEFT folder -----------------------------------------------------------------------------

def module_path(hf_weight: str) -> str:
    """transformers' module path of the linear whose on-disk weight is ``hf_weight``."""
    for disk, loaded in MODULE_PATHS:
        hf_weight = hf_weight.replace(disk, loaded)
    return hf_weight.removesuffix(".weight")


def _entries_by_tensor(model, ep_rank: int) -> dict[str, Entry]:
    """``name_table``'s entries of EP rank ``ep_rank`` by megatron tensor name."""
    ep_size = model.pg_collection.ep.size()
    return {e.megatron: e for e in name_table(model.recipe, ep_rank=ep_rank, ep_size=ep_size)}


@torch.no_grad()
def peft_adapter_tensors(model: torch.nn.Module, *, experts: bool = False,
                         fold_scale: bool = False) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` as PEFT's state dict (``base_model.model.<module>.lora_A.weight``
    [r, in], ``.lora_B.weight`` [out, r]), whole (gathered over TP), in the adapters' dtype.
    ``experts``: the routed experts' adapters too, under the checkpoint's per-expert linears
    (gathered over ETP and EP), else refused. ``fold_scale``: each B multiplied by its adapter's
    alpha/r (in fp32, cast back). Collective over TP and EP: every rank of the model calls it
    and gets every tensor."""
    ep = model.pg_collection.ep
    per_ep_rank = [_entries_by_tensor(model, ep_rank=r) for r in range(ep.size())]
    entries = per_ep_rank[ep.rank()]
    out: dict[str, torch.Tensor] = {}
    for tensor, adapter in sorted(lora_adapters(model).items()):
        entry = entries.get(tensor)
        if entry is None or entry.kind not in ("copy", "glu"):
            raise ValueError(f"LoRA adapter on {tensor}: no HF linear to name it by in "
                             "model/hf_io.py's table")
        if entry.expert and not experts:
            raise ValueError(f"LoRA adapter on {tensor}: routed experts' adapters have no PEFT "
                             "layout here")
        group = adapter.tp_group
        a = unshard(adapter.A.detach(), adapter.A, group)
        b = unshard(adapter.B.detach(), adapter.B, group, glu=entry.kind == "glu")
        if fold_scale:
            b = (b.float() * adapter.scaling).to(b.dtype)
        owners = [(entry, a, b)]
        if entry.expert and ep.size() > 1:  # every EP rank's expert at this local index
            a_parts, b_parts = all_gathered(a, ep), all_gathered(b, ep)
            owners = [(per_ep_rank[r][tensor], a_parts[r], b_parts[r]) for r in range(ep.size())]
        for owner, a_whole, b_whole in owners:
            halves = b_whole.chunk(len(owner.hf), dim=0)  # glu: [B_gate; B_up], as the weight
            for hf, b_part in zip(owner.hf, halves):
                module = PEFT_PREFIX + module_path(hf)
                out[f"{module}.lora_A.weight"] = a_whole.cpu().clone()  # one per HF linear
                out[f"{module}.lora_B.weight"] = b_part.cpu().clone()
    return out


def peft_adapter_config(model: torch.nn.Module, modules: list[str], *,
                        base_model: str | None = None, scale_folded: bool = False) -> dict:
    """``adapter_config.json`` of ``model``'s adapters on ``modules`` (transformers' module
    paths): peft's LoRA fields, the scale ``lora_alpha / r`` being our ``alpha / rank``. With
    ``scale_folded`` (each B carries its own alpha/r) ``r`` is the largest adapter rank and
    ``lora_alpha`` equals it, so a reader's scale is 1."""
    adapters = list(lora_adapters(model).values())
    ranks = {a.rank for a in adapters}
    alphas = {a.alpha for a in adapters}
    if scale_folded:
        rank = max(ranks)
        ranks, alphas = {rank}, {float(rank)}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"adapters of several ranks {sorted(ranks)} or alphas {sorted(alphas)}: "
                         "one adapter_config.json holds one r and lora_alpha")
    dropout = max(getattr(a, "dropout", 0.0) for a in adapters)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": ranks.pop(), "lora_alpha": alphas.pop(), "lora_dropout": dropout,
        "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
    }


def _save_adapter_folder(model: torch.nn.Module, out_dir, *, base_model, dtype,
                         for_sync: bool) -> list[str]:
    if not lora_adapters(model):
        raise ValueError("the model has no LoRA adapters to write as a PEFT folder")
    tensors = peft_adapter_tensors(model, experts=for_sync, fold_scale=for_sync)
    modules = sorted({k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in tensors})
    config = peft_adapter_config(model, modules, base_model=base_model, scale_folded=for_sync)
    if dist.is_initialized() and dist.get_rank() != 0:
        return modules
    os.makedirs(out_dir, exist_ok=True)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return modules


def save_peft_adapter(model: torch.nn.Module, out_dir: str | os.PathLike, *,
                      base_model: str | None = None, dtype: torch.dtype | None = None) -> list[str]:
    """Write ``model``'s adapters as a PEFT folder (``adapter_model.safetensors`` and
    ``adapter_config.json``) in ``out_dir``; global rank 0 writes, every rank must call it.
    ``base_model`` is recorded as ``base_model_name_or_path``; ``dtype`` casts the tensors.
    Returns the adapted modules' paths."""
    return _save_adapter_folder(model, out_dir, base_model=base_model, dtype=dtype,
                                for_sync=False)


def save_sync_adapter(model: torch.nn.Module, out_dir: str | os.PathLike, *,
                      base_model: str | None = None, dtype: torch.dtype | None = None) -> list[str]:
    """Write ``model``'s adapters as the adapter-only weight sync's folder (vLLM's layout: routed
    experts per expert, the scales folded into B, ``lora_alpha == r``); as ``save_peft_adapter``
    otherwise (collective, rank 0 writes)."""
    return _save_adapter_folder(model, out_dir, base_model=base_model, dtype=dtype,
                                for_sync=True)


def disk_weight_name(module: str) -> str:
    """The on-disk weight of transformers' module path ``module`` (``module_path``'s inverse)."""
    name = f"{module}.weight"
    for disk, loaded in MODULE_PATHS:
        name = name.replace(loaded, disk)
    return name


@torch.no_grad()
def merge_adapter_folder(adapter_dir: str | os.PathLike, base: SafetensorsCheckpoint
                         ) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint ``base``, each adapted one as W + (lora_alpha/r) B A (the
    product and sum in fp32, cast to W's dtype), under its on-disk name, from the PEFT folder
    ``adapter_dir`` (``save_peft_adapter``'s or ``save_sync_adapter``'s)."""
    config = json.loads(open(os.path.join(adapter_dir, ADAPTER_CONFIG)).read())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    merged = {name: base.get(name) for name in sorted(base.keys())}
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        name = disk_weight_name(module)
        if name not in merged:
            raise ValueError(f"{adapter_dir}: adapter on {module}, which the base checkpoint "
                             f"does not hold ({name})")
        a, b = tensors[key].float(), tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"].float()
        w = merged[name]
        merged[name] = (w.float() + scale * (b @ a)).to(w.dtype)
    return merged
