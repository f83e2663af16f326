"""Recipes and the saved-tensor census shared by the memory tests (``tests/test_memory_*.py``)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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

EP2 = ["parallel.tp=2", "parallel.cp=1", "parallel.ep=2", "parallel.etp=1",
       "parallel.sequence_parallel=true", "run.num_workers=2"]
"""TP2 +SP x EP2 on 2 ranks: the routed rows cross EP only."""


EP2_ETP2 = ["parallel.tp=2", "parallel.cp=1", "parallel.ep=2", "parallel.etp=2",
            "parallel.sequence_parallel=true", "run.num_workers=4"]
"""TP2 +SP x EP2 x ETP2 on 4 ranks: the routed rows cross EP, then ETP."""


def moe_variants(mesh: list[str]) -> dict[str, list[str]]:
    """Each dispatcher with and without MoE token chunks (40 rows: a partial last chunk of a
    rank's 64), bf16 (the fp32 combine copy exists), at ``mesh``."""
    base = mesh + ["model.params_dtype=bfloat16", "data.seq_len=128"]
    return {f"{dispatcher}{' chunks' if chunks else ''}":
            base + [f"model.moe.dispatcher={dispatcher}", f"train.moe_chunk_tokens={chunks}"]
            for dispatcher in ("allgather", "alltoall") for chunks in (0, 40)}


class _Fp32Casts(TorchDispatchMode):
    """Bytes of the bf16 -> fp32 copies of D-wide rows that an MoE layer's own code makes (not
    its router's, experts' or shared expert's), by layer index: the dispatcher's fp32 combine."""

    def __init__(self, census: _SavedTensorCensus, hidden: int):
        super().__init__()
        self.census, self.hidden, self.bytes = census, hidden, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        module = self.census.stack[-1].split(".")
        if (func is torch.ops.aten._to_copy.default and args[0].dtype == torch.bfloat16
                and out.dtype == torch.float32 and out.shape[-1] == self.hidden
                and len(module) == 3 and module[2] == "mlp"):
            layer = int(module[1])
            self.bytes[layer] = self.bytes.get(layer, 0) + out.untyped_storage().nbytes()
        return out


def _moe_census_on_rank(rank, world, overrides_list):
    """Per recipe: the bytes autograd keeps in each MoE layer's block at the end of the forward,
    the rows that reached the layer's experts in the forward, the fp32 copies its combine made
    (``_Fp32Casts``) and megatron's global all-gather buffer after the backward."""
    from megatron.core import parallel_state

    out = []
    for overrides in overrides_list:
        recipe = load_recipe(TINY, overrides).recipe
        model = build_on_mesh(recipe)
        rows: dict[int, int] = {}
        for i, layer in enumerate(model.layers):
            if recipe.model.mlp_types()[i] == "moe":
                layer.mlp.experts.register_forward_pre_hook(
                    lambda mod, args, i=i: rows.__setitem__(i, rows.get(i, 0) + args[0].shape[0]))
        census = _SavedTensorCensus(model)
        ids = token_ids(recipe)
        casts = _Fp32Casts(census, recipe.model.hidden_size)
        with torch.autograd.graph.saved_tensors_hooks(census.pack, lambda h: h.t), casts:
            loss = token_loss(model, ids, ids.roll(-1, 1))
        assignments = dict(rows)  # the forward's; chunks rebuilt in backward add to ``rows``
        kept = {}
        for module, nbytes in census.by_module().items():
            part = _part(module)
            kept[part] = kept.get(part, 0) + nbytes
        loss.sum().backward()
        buffers = parallel_state.get_global_memory_buffer().buffer
        out.append(dict(kept={i: kept[f"{i}.mlp"] for i in assignments}, assignments=assignments,
                        fp32_combine={i: casts.bytes.get(i, 0) for i in assignments},
                        gather_buffer=sum(t.numel() * t.element_size() for t in buffers.values())))
    return out


def moe_backward_variants(mesh: list[str]) -> dict[str, list[str]]:
    """Each dispatcher, unchunked, on a shape where the tokens' D-wide tensors outweigh the
    experts' own (hidden 256, 16 experts of width 16, 512 tokens), bf16."""
    base = mesh + ["model.params_dtype=bfloat16", "data.seq_len=512", "model.hidden_size=256",
                   "model.moe.num_experts=16", "model.moe.ffn_hidden_size=16"]
    return {d: base + [f"model.moe.dispatcher={d}"] for d in ("allgather", "alltoall")}


def _moe_backward_peak(rank: int, recipe, repeats: int = 2) -> tuple[int, int]:
    """The bytes the first MoE block's backward allocates at its highest point (LiveBytes,
    garbage collector off), its parameters' gradients handed off as they accumulate, as DDP's
    hook does; and the rows that reached its experts. The smallest of ``repeats`` forward and
    backward passes on the same input: the working set is a floor that a run can only exceed
    (a buffer freed late raises that run's peak)."""
    import gc

    from tests.support.live_bytes import LiveBytes

    from skyrl_megatron_kda.memory.rows import rows_of

    model = build_on_mesh(recipe)
    mlp = model.layers[recipe.model.mlp_types().index("moe")].mlp
    for param in mlp.parameters():
        param.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    rows = []
    mlp.experts.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows_of(recipe).sp, 1, recipe.model.hidden_size, generator=g)
    x = x.to(torch.bfloat16)
    grad = None
    peaks = []
    for _ in range(repeats):
        out, _ = mlp(x.detach().requires_grad_())
        if grad is None:
            grad = torch.randn(out.shape, generator=g).to(out.dtype)
        # Some of the backward's tensors are freed by the garbage collector, not by their
        # reference count: with it off they count every run alike, wherever a collection
        # would have fallen.
        gc.collect()
        gc.disable()
        try:
            with LiveBytes() as live:
                out.backward(grad)
        finally:
            gc.enable()
        peaks.append(live.peak)
        del out
    assert len(set(rows)) == 1, rows  # the same routing each pass
    return min(peaks), rows[0]


def _moe_census_and_peaks_on_rank(rank, world, census_list, backward_list):
    recipes = [load_recipe(TINY, overrides).recipe for overrides in backward_list]
    return _moe_census_on_rank(rank, world, census_list), [_moe_backward_peak(rank, r) for r in recipes]


def moe_census(world: int, mesh: list[str], backward: bool = False):
    """``moe_variants(mesh)``' recipes, and per rank per variant what ``_moe_census_on_rank``
    reads; with ``backward`` also ``moe_backward_variants(mesh)``' recipes and per rank their
    MoE block's backward peak (``_moe_backward_peak``): one call of ``world`` pooled ranks."""
    variants = moe_variants(mesh)
    peak_variants = moe_backward_variants(mesh) if backward else {}
    results = run_ranks(world, _moe_census_and_peaks_on_rank, list(variants.values()),
                        list(peak_variants.values()))
    recipes = {name: load_recipe(TINY, overrides).recipe for name, overrides in variants.items()}
    census = [dict(zip(variants, per_rank)) for per_rank, _ in results]
    if not backward:
        return recipes, census
    peak_recipes = {name: load_recipe(TINY, o).recipe for name, o in peak_variants.items()}
    return recipes, census, peak_recipes, [dict(zip(peak_variants, peaks)) for _, peaks in results]
