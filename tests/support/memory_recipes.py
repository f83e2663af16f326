"""Recipes and the saved-tensor census shared by the memory tests (``tests/test_memory_*.py``)."""

from __future__ import annotations

import torch

from skyrl_megatron_kda.recipes import load_recipe
from tests.support.ranks import run_ranks
from tests.support.tiny_models import build_on_mesh, token_ids, token_loss

TINY = "glm53_flash_tiny"


FULL = "glm53_flash_1m"


SINGLE = ["parallel.tp=1", "parallel.cp=1", "parallel.ep=1", "parallel.etp=1",
          "parallel.sequence_parallel=false", "run.num_workers=1"]


ON_GPU_UNFUSED_LOSS = ("train.offload_activations=false", "train.loss_chunk_tokens=null")
"""The 1M recipe without two of its levers: activations kept on the GPU, megatron's loss."""


def full_recipe(*overrides: str):
    """The 1M recipe with ``overrides``."""
    return load_recipe(FULL, list(overrides)).recipe


class _SavedTensorCensus:
    """Bytes of the storages autograd holds for backward at the end of a forward, by the module
    that first saved each one; parameter storages are left out (they are counted as params).

    A storage counts while at least one saved reference to it is alive (a graph that forward
    built and dropped releases its tensors), so reused addresses are not confused."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list] = {}  # ptr -> [refcount, nbytes, module]
        self.stack = [""]
        names = {mod: n for n, mod in model.named_modules()}
        for mod in model.modules():
            mod.register_forward_pre_hook(lambda mod, args: self.stack.append(names[mod]))
            mod.register_forward_hook(lambda mod, args, out: (self.stack.pop(), None)[1])

    def pack(self, t):
        census = self

        class Holder:
            def __init__(self):
                self.t, self.ptr = t, t.untyped_storage().data_ptr()
                entry = census.live.setdefault(self.ptr, [0, t.untyped_storage().nbytes(),
                                                          census.stack[-1]])
                entry[0] += 1

            def __del__(self):
                entry = census.live.get(self.ptr)
                if entry is not None:
                    entry[0] -= 1
                    if entry[0] == 0:
                        del census.live[self.ptr]

        return Holder()

    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ptr, (_, nbytes, module) in self.live.items():
            if ptr not in self.params:
                out[module] = out.get(module, 0) + nbytes
        return out


def _part(module: str) -> str:
    if not module.startswith("layers."):
        return "head"
    parts = module.split(".")
    layer = parts[1]
    if len(parts) == 2 or parts[2] in ("attn_hc", "ffn_hc", "input_layernorm", "pre_mlp_layernorm"):
        return f"{layer}.mhc_norms"
    return f"{layer}.{'attention' if parts[2] == 'self_attention' else 'mlp'}"


def _census_on_rank(rank, world, overrides_list):
    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        model = build_on_mesh(recipe)
        census = _SavedTensorCensus(model)
        ids = token_ids(recipe)
        with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda h: h.t):
            # Labels in their own storage, as the trainer's: the fused loss keeps them.
            loss = token_loss(model, ids, ids.roll(-1, 1))
        parts: dict[str, int] = {}
        for module, nbytes in census.by_module().items():
            parts[_part(module)] = parts.get(_part(module), 0) + nbytes
        loss.sum().backward()  # the held tensors are what backward needs
        out.append(parts)
    return out


def saved_tensor_census() -> tuple[dict, dict]:
    """What autograd keeps on CPU, by part (``_part``), for each variant of the tiny recipe, and the
    variants' recipes: one spawned rank builds each model and runs its forward."""
    variants = {
        "fp32": SINGLE,
        "bf16": SINGLE + ["model.params_dtype=bfloat16"],
        "bf16_T96": SINGLE + ["model.params_dtype=bfloat16", "data.seq_len=96"],
        "fp32_unfused": SINGLE + ["model.dsa.kernel=unfused"],
        "bf16_unfused": SINGLE + ["model.params_dtype=bfloat16", "model.dsa.kernel=unfused"],
        "full": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=full"],
        "selective": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=selective"],
        "selective_kda": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=selective",
                                   "train.recompute_layers=[kda]"],
        "full_dsa": SINGLE + ["model.params_dtype=bfloat16", "train.recompute=full",
                              "train.recompute_layers=[dsa]"],
        "offload": SINGLE + ["model.params_dtype=bfloat16", "train.offload_activations=true"],
        # the fused loss, with chunks that do not divide the 256 tokens
        "fp32_fused_loss": SINGLE + ["train.loss_chunk_tokens=100"],
        "bf16_fused_loss": SINGLE + ["model.params_dtype=bfloat16", "train.loss_chunk_tokens=100"],
        # MoE token chunks that do not divide the 256 rows
        "fp32_moe_chunks": SINGLE + ["train.moe_chunk_tokens=100"],
        "bf16_moe_chunks": SINGLE + ["model.params_dtype=bfloat16", "train.moe_chunk_tokens=100"],
    }
    (result,) = run_ranks(1, _census_on_rank, list(variants.values()))
    return dict(zip(variants, result)), {k: load_recipe(TINY, v).recipe for k, v in variants.items()}