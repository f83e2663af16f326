"""Hugging Face checkpoints (transformers ``glm5_next``, safetensors) in and out of ``GLMModel``.

Why a name table and not Megatron-Bridge: Megatron-Bridge 0.6.2 pins ``transformers<=5.12.1``
(``glm5_next`` needs 5.23), pulls flashinfer / nvidia-resiliency-ext / TE-only extras, and has
no ``glm5_next`` bridge; GLM's KDA and mHC tensors would need custom mappings anyway.

On-disk names are the released checkpoint's (what transformers' ``save_pretrained`` writes after
reversing its load-time renames): per-expert MoE tensors, separate q/k/v conv taps, ``hc_*``
hyper-connection tensors, forget-gate tensors directly under ``self_attn``. ``name_table`` maps
each megatron tensor to the HF tensor(s) it is made of (``docs/model.md`` prints the table):

    kind "copy": the same tensor            kind "glu": megatron fc1 = cat([gate, up])
    kind "conv": megatron conv [3, HK, W] = stack of the q/k/v conv taps [HK, 1, W]

TP/ETP sharding is generic: a tensor megatron marks ``tensor_model_parallel`` is sliced along its
``partition_dim`` (``distributed.tensor_parallel.shard_of``; GLU fc1 as [gate shard; up shard]); routed experts are
split over EP by ``model.moe.moe_weight_name_map``. Loading reads only this rank's experts.
Vision-tower tensors and the MTP layer (index ``num_layers``) are not part of the text model: they
are ignored on load and copied through on export when a source checkpoint is given.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import MoEConfig, Recipe
from ..distributed.tensor_parallel import all_gathered, shard_of, unshard
from .moe import HF_MOE_NAMES, moe_weight_name_map

TEXT = "model.language_model."
LM_HEAD = "lm_head.weight"

TOP_NAMES = {
    "embedding.weight": TEXT + "embed_tokens.weight",
    "final_norm.weight": TEXT + "norm.weight",
}
"""Outside the layers (``output_layer.weight`` <- ``lm_head.weight`` unless embeddings are tied)."""

LAYER_NAMES = {
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
"""Every layer: mHC and the two block norms (HF prefix ``model.language_model.layers.{i}.``)."""

KDA_NAMES = {
    "self_attention.q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.k_proj.weight": "self_attn.k_proj.weight",
    "self_attention.v_proj.weight": "self_attn.v_proj.weight",
    "self_attention.conv_weight": ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight",
                                   "self_attn.v_conv1d.weight"),
    "self_attention.f_a_weight": "self_attn.f_a_proj.weight",
    "self_attention.f_b_proj.weight": "self_attn.f_b_proj.weight",
    "self_attention.A_log": "self_attn.A_log",
    "self_attention.dt_bias": "self_attn.dt_bias",
    "self_attention.b_proj.weight": "self_attn.b_proj.weight",
    "self_attention.g_a_weight": "self_attn.g_a_proj.weight",
    "self_attention.g_b_proj.weight": "self_attn.g_b_proj.weight",
    "self_attention.o_norm_weight": "self_attn.o_norm.weight",
    "self_attention.o_proj.weight": "self_attn.o_proj.weight",
}
"""KDA layers (kda/layer.py)."""

DSA_NAMES = {
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.core_attention.indexer.linear_wq_b.weight": "self_attn.indexer.wq_b.weight",
    "self_attention.core_attention.indexer.linear_wk.weight": "self_attn.indexer.wk.weight",
    "self_attention.core_attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "self_attention.core_attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "self_attention.core_attention.indexer.linear_weights_proj.weight":
        "self_attn.indexer.weights_proj.weight",
    "self_attention.core_attention.indexer.kpool_compress_ape":
        "self_attn.indexer.index_kpool_compress_ape",
    "self_attention.core_attention.indexer.kpool_compress_gate":
        "self_attn.indexer.index_kpool_compress_gate",
}
"""DSA layers (dsa/layer.py: megatron MLA + the pooled indexer)."""

DENSE_NAMES = {
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
"""Dense-FFN layers (megatron MLP, SwiGLU fc1 = [gate; up])."""


@dataclass(frozen=True)
class Entry:
    """One megatron tensor and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # "copy" | "glu" | "conv"
    expert: bool = False
    """A routed expert's tensor: sharded over ETP and split over EP (the others over TP)."""


def _kind(hf: tuple[str, ...], megatron: str) -> str:
    if len(hf) == 1:
        return "copy"
    return "conv" if megatron.endswith("conv_weight") else "glu"


_FUSED_EXPERT = re.compile(r"^experts\.(gate_up_proj|down_proj)\[(\d+)\]$")


def _on_disk_moe_names(fused: str) -> tuple[str, ...]:
    """moe.py names routed experts by the runtime fused tensors (``experts.gate_up_proj[e]``);
    checkpoints store one tensor per expert and projection."""
    match = _FUSED_EXPERT.match(fused)
    if match is None:
        return (fused,)
    proj, e = match.groups()
    if proj == "down_proj":
        return (f"experts.{e}.down_proj.weight",)
    return (f"experts.{e}.gate_proj.weight", f"experts.{e}.up_proj.weight")


def moe_layer_entries(moe: MoEConfig, *, ep_rank: int = 0, ep_size: int = 1,
                      megatron_prefix: str = "", hf_prefix: str = "") -> list[Entry]:
    """One MoE layer's tensors on EP rank ``ep_rank`` (its routed experts only): megatron's
    MoELayer names under ``megatron_prefix``, the checkpoint's on-disk names under ``hf_prefix``
    (a layer's ``mlp.`` on both sides in ``name_table``)."""
    out = []
    for name, fused in moe_weight_name_map(moe, ep_rank=ep_rank, ep_size=ep_size).items():
        hf = tuple(hf_prefix + n for f in fused for n in _on_disk_moe_names(f))
        megatron = megatron_prefix + name
        out.append(Entry(megatron, hf, _kind(hf, megatron), expert=name.startswith("experts.")))
    return out


def name_table(recipe: Recipe, *, ep_rank: int = 0, ep_size: int = 1) -> list[Entry]:
    """Every tensor of the megatron model on EP rank ``ep_rank`` (its routed experts only), in a
    fixed order, with its full HF names."""
    m = recipe.model
    out: list[Entry] = []

    def add(megatron: str, hf) -> None:
        hf = (hf,) if isinstance(hf, str) else tuple(hf)
        out.append(Entry(megatron, hf, _kind(hf, megatron)))

    for name, hf in TOP_NAMES.items():
        add(name, hf)
    for i, (mixer, mlp) in enumerate(zip(m.layer_types(), m.mlp_types())):
        meg, hf_prefix = f"layers.{i}.", f"{TEXT}layers.{i}."
        tables = [LAYER_NAMES, KDA_NAMES if mixer == "kda" else DSA_NAMES]
        if mlp == "dense":
            tables.append(DENSE_NAMES)
        for table in tables:
            for name, hf in table.items():
                hf = (hf,) if isinstance(hf, str) else hf
                add(meg + name, [hf_prefix + h for h in hf])
        if mlp == "moe":
            out.extend(moe_layer_entries(m.moe, ep_rank=ep_rank, ep_size=ep_size,
                                         megatron_prefix=f"{meg}mlp.", hf_prefix=f"{hf_prefix}mlp."))
    if not m.tie_word_embeddings:
        add("output_layer.weight", LM_HEAD)
    return out


def expected_hf_names(recipe: Recipe) -> set[str]:
    """All HF tensor names of the text model (all experts)."""
    return {n for e in name_table(recipe) for n in e.hf}


def _ignored(name: str, recipe: Recipe) -> bool:
    """Tensors of the checkpoint that are not the text trunk: the vision tower and the MTP layer."""
    return name.startswith("model.visual.") or name.startswith(
        f"{TEXT}layers.{recipe.model.num_layers}.")


# --- HF tensors <-> full megatron tensors ----------------------------------------------------


def _to_megatron(entry: Entry, tensors: list[torch.Tensor]) -> torch.Tensor:
    if entry.kind == "copy":
        return tensors[0]
    if entry.kind == "glu":
        return torch.cat(tensors, dim=0)
    return torch.stack([t.squeeze(1) for t in tensors])  # conv: 3 x [HK, 1, W] -> [3, HK, W]


def _to_hf(entry: Entry, full: torch.Tensor) -> list[torch.Tensor]:
    if entry.kind == "copy":
        return [full]
    if entry.kind == "glu":
        return list(full.chunk(2, dim=0))
    return [t.unsqueeze(1) for t in full.unbind(0)]


# --- checkpoint files ------------------------------------------------------------------------


class SafetensorsCheckpoint:
    """Lazy reader of a HF checkpoint folder (``model.safetensors`` or a sharded index)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            with safe_open(single, "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.path} has neither model.safetensors nor "
                                    "model.safetensors.index.json")
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open
        self._files: dict[str, object] = {}

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def _file(self, name: str):
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = self._open(os.path.join(self.path, file), "pt")
        return self._files[file]

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def numel(self, name: str) -> int:
        """Elements of tensor ``name``, from the file's header (no data is read)."""
        return math.prod(self._file(name).get_slice(name).get_shape())


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by state-dict name (megatron's _extra_state left out)."""
    out = dict(model.named_parameters())
    out.update({k: v for k, v in model.state_dict(keep_vars=True).items()
                if not k.endswith("_extra_state") and k not in out})
    return out


def _check_table_covers_model(entries: list[Entry], tensors: dict[str, torch.Tensor]) -> None:
    names = {e.megatron for e in entries}
    unmapped, absent = sorted(set(tensors) - names), sorted(names - set(tensors))
    if unmapped or absent:
        raise RuntimeError(
            "model/hf_io.py's name table and the model disagree (a module was renamed?): "
            f"model tensors without an HF name: {unmapped}; table names not in the model: {absent}")


def empty_shared_experts(recipe: Recipe, ckpt: SafetensorsCheckpoint) -> set[str]:
    """The zero-element shared-expert tensors of ``ckpt`` when the recipe has no shared expert:
    transformers builds an MLP of width ``n_shared_experts * moe_intermediate_size = 0`` and saves
    its empty weights. They hold nothing, so they are not unexpected; any other shape still is."""
    if recipe.model.moe.num_shared_experts:
        return set()
    shared = [HF_MOE_NAMES[k] for k in ("shared_gate", "shared_up", "shared_down")]
    names = {f"{TEXT}layers.{i}.mlp.{n}" for i, mlp in enumerate(recipe.model.mlp_types())
             if mlp == "moe" for n in shared}
    return {n for n in names & ckpt.keys() if ckpt.numel(n) == 0}


def check_hf_keys(recipe: Recipe, names: set[str]) -> None:
    """Refuse a checkpoint that lacks text-model tensors or has tensors we would not load."""
    expected = expected_hf_names(recipe)
    missing = sorted(expected - names)
    unexpected = sorted(n for n in names - expected if not _ignored(n, recipe))
    if missing or unexpected:
        raise KeyError(
            f"HF checkpoint does not match the recipe's model: missing {len(missing)} tensors "
            f"{missing[:50]}{' ...' if len(missing) > 50 else ''}; unexpected {len(unexpected)} "
            f"tensors {unexpected[:50]}{' ...' if len(unexpected) > 50 else ''}")


# --- config -----------------------------------------------------------------------------------


def hf_text_config(recipe: Recipe) -> dict:
    """``Glm5NextTextConfig`` keyword arguments of the recipe's model; raises where glm5_next
    cannot express the recipe."""
    m, k, d, moe, hc = recipe.model, recipe.kda, recipe.model.dsa, recipe.model.moe, recipe.model.hyper_connections
    bad = []
    if k.gate_low_rank != k.head_dim or k.output_gate_low_rank != k.head_dim:
        bad.append(f"kda gate ranks ({k.gate_low_rank}, {k.output_gate_low_rank}) != kda.head_dim "
                   f"{k.head_dim} (glm5_next ties them)")
    if k.l2norm_eps != 1e-6:
        bad.append(f"kda.l2norm_eps={k.l2norm_eps} (glm5_next: 1e-6)")
    if k.norm_eps != m.rms_norm_eps:
        bad.append(f"kda.norm_eps={k.norm_eps} != model.rms_norm_eps={m.rms_norm_eps}")
    if moe.score_function != "sigmoid" or not moe.score_correction_bias:
        bad.append("glm5_next's router is sigmoid with a score-correction bias")
    if moe.swiglu_limit is None:
        bad.append("model.moe.swiglu_limit=None (glm5_next always clamps)")
    if bad:
        raise ValueError("the recipe's model is not expressible as glm5_next: " + "; ".join(bad))
    return dict(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        intermediate_size=m.dense_ffn_hidden_size, rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        layer_types=["linear_attention" if t == "kda" else "indexed_attention" for t in m.layer_types()],
        mlp_layer_types=["dense" if t == "dense" else "sparse" for t in m.mlp_types()],
        indexer_types=["full"] * m.num_layers,
        linear_num_heads=k.num_heads, linear_head_dim=k.head_dim, linear_conv_kernel_dim=k.conv_size,
        linear_lower_bound=k.gate_lower_bound,
        num_attention_heads=d.num_heads, num_key_value_heads=d.num_heads, q_lora_rank=d.q_lora_rank,
        kv_lora_rank=d.kv_lora_rank, qk_nope_head_dim=d.qk_nope_head_dim,
        qk_rope_head_dim=d.qk_rope_head_dim, v_head_dim=d.v_head_dim, index_n_heads=d.index_num_heads,
        index_head_dim=d.index_head_dim, index_topk=d.index_topk, index_kpool=d.index_kpool,
        index_kpool_always_select_tail=True,
        n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.ffn_hidden_size, n_shared_experts=moe.num_shared_experts,
        routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=moe.norm_topk_prob,
        swiglu_limit=moe.swiglu_limit, n_group=1, topk_group=1,
        hc_mult=hc.num_streams, hc_sinkhorn_iters=hc.sinkhorn_iterations, hc_eps=hc.eps,
    )


def _read_text_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    text = dict(cfg.get("text_config") or cfg)  # flat text-only checkpoints keep it at the top
    linear = text.get("linear_attn_config") or {}
    for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                         ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                         ("linear_lower_bound", "gate_lower_bound")):
        if theirs in linear:
            text.setdefault(ours, linear[theirs])
    return text


def check_hf_config(recipe: Recipe, path: str | os.PathLike) -> None:
    """Refuse a checkpoint whose config.json describes another model than the recipe's."""
    stated = _read_text_config(os.fspath(path))
    wrong = []
    for key, want in hf_text_config(recipe).items():
        if key not in stated:
            continue  # unstated: transformers' default, nothing to compare
        have = stated[key]
        same = (math.isclose(have, want, rel_tol=1e-9) if isinstance(want, float) and have is not None
                else have == want)
        if not same:
            wrong.append(f"{key}: checkpoint {have!r}, recipe {want!r}")
    if wrong:
        raise ValueError(f"{path}/config.json does not match the recipe: " + "; ".join(wrong))


# --- load / export ---------------------------------------------------------------------------


def _groups(model):
    pgs = model.pg_collection
    return pgs.tp, pgs.expt_tp, pgs.ep


@torch.no_grad()
def load_hf_checkpoint(model, path: str | os.PathLike, *, check_config: bool = True) -> None:
    """Load a glm5_next safetensors checkpoint into ``model`` (a ``GLMModel`` on this rank),
    each tensor sliced to this rank's TP / ETP shard and EP experts. Every rank calls it."""
    recipe = model.recipe
    ckpt = SafetensorsCheckpoint(path)
    if check_config:
        check_hf_config(recipe, path)
    check_hf_keys(recipe, ckpt.keys() - empty_shared_experts(recipe, ckpt))
    tp, etp, ep = _groups(model)
    entries = name_table(recipe, ep_rank=ep.rank(), ep_size=ep.size())
    load_hf_tensors(model, entries, ckpt.get, tp=tp, etp=etp)


@torch.no_grad()
def load_hf_tensors(module: torch.nn.Module, entries: list[Entry],
                    read: Callable[[str], torch.Tensor], *, tp, etp) -> None:
    """Copy the HF tensors of ``entries`` (``read(hf_name)``, full and unsharded) into
    ``module``'s parameters and buffers, each sliced to this rank's TP shard (ETP for routed
    experts). ``entries`` must name every tensor of ``module``; ``tp`` / ``etp`` are the process
    groups (anything with ``rank()`` and ``size()``)."""
    tensors = _model_tensors(module)
    _check_table_covers_model(entries, tensors)
    for entry in entries:
        target = tensors[entry.megatron]
        full = _to_megatron(entry, [read(n) for n in entry.hf])
        group = etp if entry.expert else tp
        piece = shard_of(full, target, group.rank(), group.size(), glu=entry.kind == "glu")
        if piece.shape != target.shape:
            raise ValueError(f"{entry.megatron} <- {list(entry.hf)}: shard shape "
                             f"{tuple(piece.shape)} != parameter shape {tuple(target.shape)}")
        target.copy_(piece)


@torch.no_grad()
def export_hf_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded) tensors of ``model`` under their HF names, in ``name_table`` order.

    A collective: every rank of the model must iterate it to the end (TP/ETP all-gathers, EP
    all-gathers of the routed experts); every rank receives every tensor."""
    recipe = model.recipe
    tp, etp, ep = _groups(model)
    mine = name_table(recipe, ep_rank=ep.rank(), ep_size=ep.size())
    per_ep_rank = [name_table(recipe, ep_rank=r, ep_size=ep.size()) for r in range(ep.size())]
    tensors = _model_tensors(model)
    _check_table_covers_model(mine, tensors)
    for j, entry in enumerate(mine):
        param = tensors[entry.megatron]  # carries megatron's TP attributes (detach() drops them)
        full = unshard(param.detach(), param, etp if entry.expert else tp, glu=entry.kind == "glu")
        if entry.expert and ep.size() > 1:
            parts = all_gathered(full, ep)
            owners = [(per_ep_rank[r][j], parts[r]) for r in range(ep.size())]
        else:
            owners = [(entry, full)]
        for owner, tensor in owners:
            yield from zip(owner.hf, (t.contiguous() for t in _to_hf(owner, tensor)))


def save_hf_checkpoint(model, out_dir: str | os.PathLike, *, source: str | os.PathLike | None = None,
                       max_shard_bytes: int = 4 << 30, dtype: torch.dtype | None = None) -> None:
    """Write ``model`` as a glm5_next safetensors checkpoint (global rank 0 writes; every rank
    must call it). With ``source`` (the checkpoint it was loaded from), its config.json and the
    tensors that are not the text trunk (vision tower, MTP layer) are copied through, so the
    result loads in transformers; without it, config.json is a flat text config from the recipe.
    ``dtype`` casts the model's tensors (None: as trained)."""
    writer = dist.get_rank() == 0 if dist.is_initialized() else True
    out_dir = os.fspath(out_dir)
    shard: dict[str, torch.Tensor] = {}
    size = 0
    written: list[tuple[str, list[str]]] = []

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(written) + 1:05d}.safetensors"
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        written.append((name, list(shard)))
        shard, size = {}, 0

    def add(name: str, tensor: torch.Tensor) -> None:
        nonlocal size
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.cpu().clone()
        size += nbytes

    if writer:
        os.makedirs(out_dir, exist_ok=True)
    for name, tensor in export_hf_tensors(model):
        if writer:
            add(name, tensor if dtype is None else tensor.to(dtype))
    if not writer:
        return
    if source is not None:
        src = SafetensorsCheckpoint(source)
        for name in sorted(n for n in src.keys() if _ignored(n, model.recipe)):
            add(name, src.get(name))
        shutil.copyfile(os.path.join(os.fspath(source), "config.json"),
                        os.path.join(out_dir, "config.json"))
    else:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({"model_type": "glm5_next", **hf_text_config(model.recipe)}, f, indent=2)
    if shard:
        flush()
    _write_index(out_dir, written)


def _write_index(out_dir: str, written: list[tuple[str, list[str]]]) -> None:
    """Rename shards to HF's ``model-0000k-of-0000n`` and write the index json."""
    n = len(written)
    weight_map = {}
    for k, (name, keys) in enumerate(written, start=1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(out_dir, name), os.path.join(out_dir, final))
        weight_map.update({key: final for key in keys})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
