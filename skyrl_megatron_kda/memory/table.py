"""The ``plan`` table of a memory estimate, and the host memory lines after it."""

from __future__ import annotations

from collections.abc import Iterable

from ..config import Recipe
from ..tables import format_table
from .estimate import MemoryEstimate, estimate_memory
from .dsa import SELECTION_LABEL
from .head import HEAD_LABEL
from .lora import lora_linears
from .offload import host_activation_bytes
from .rows import rows_of
from .states import optimizer_shards


GiB = 2**30

H200_BYTES = 143_771 * 2**20
"""Memory of one H200 as ``nvidia-smi`` reports it (143,771 MiB, "141 GB")."""


def memory_lines(recipe: Recipe, gpu_bytes: int | None = None) -> list[str]:
    """The ``plan`` table: per-GPU memory of every term, the total, and the share of the GPU.

    ``gpu_bytes`` None: an H200 for ``run.device=gpu`` (the GPU this project targets), unknown
    on CPU. Units: GiB, or MiB when the total is below 1 GiB."""
    est = estimate_memory(recipe)
    dense_shard, expert_shard = optimizer_shards(recipe)
    r = rows_of(recipe)
    unit, scale = ("GiB", GiB) if est.total >= GiB else ("MiB", 2**20)
    t = recipe.train
    grad_dtype = "fp32" if t.grad_reduce_in_fp32 else recipe.model.params_dtype
    on_host = f"; {t.optimizer_offload_fraction:.0%} on the host" if t.optimizer_offload_fraction else ""
    adapters = lora_linears(recipe)
    only = "; LoRA adapters only" if adapters else ""

    def rows(items: Iterable[tuple[str, int]], indent: int = 0) -> list[tuple[str, str]]:
        return [(" " * indent + label, f"{nbytes / scale:.2f}") for label, nbytes in items]

    title = (
        f"per-GPU memory estimate ({unit}): one packed row of {r.whole} tokens, {r.cp} per CP "
        f"rank, {r.sp} residual-stream rows per rank; train.recompute={est.recompute} "
        f"({', '.join(recipe.train.recompute_layers)} layers), "
        f"offload_activations={str(est.offloaded).lower()}")
    if adapters:
        title += (f"; train.lora.rank={t.lora.rank} on {len(adapters)} linears, every base "
                  "parameter frozen (no gradient, no optimizer state)")
    frozen = " (base frozen)" if adapters else ""
    table = rows([(f"parameters{frozen} (+ router buffers)", sum(est.params.values()) + est.buffers)])
    table += rows(((label, v) for label, v in est.params.items() if v), 2)
    table += rows([
        (f"gradients ({grad_dtype} DDP buffer{only})", est.grads),
        (f"optimizer (Adam; dense /{dense_shard}, experts /{expert_shard}{on_host}{only})",
         est.optimizer),
        ("megatron's all-gather buffer (its largest gather)", est.gather_buffer),
        ("activations kept for backward", sum(est.activations.values())),
    ])
    # Offloaded: the layers' tensors (and the token ids) are in host memory, the head's and the
    # kept DSA selections (the checkpoints', not saved tensors) are not.
    on_gpu = (HEAD_LABEL, SELECTION_LABEL)
    table += rows(((label + (" (host memory)" if est.offloaded and label not in on_gpu else ""), v)
                   for label, v in est.activations.items() if v), 2)
    table += rows([(f"KDA exchange transient ({est.exchange}, one layer)", est.exchange_buffers),
                   ("peak phase (activations + working set)", est.peak_phase[1])])
    for label, nbytes in est.phases.items():
        table += rows([(label, nbytes)], 2)
        if label.startswith("DSA"):
            table += rows([("of which the DSA layer itself", est.dsa_layer)], 4)
    table += rows([("total: states + peak phase", est.total)])
    lines = [title, *format_table(None, table)]
    if gpu_bytes is None and recipe.run.device == "gpu":
        gpu_bytes, gpu_name = H200_BYTES, "H200"
    else:
        gpu_name = "GPU"
    if gpu_bytes is None:
        lines.append("GPU memory: unknown (run.device=cpu; --gpu-memory-gib to compare)")
    else:
        verdict = "fits" if est.total <= gpu_bytes else "does NOT fit"
        lines.append(f"vs. {gpu_name} {gpu_bytes / GiB:.1f} GiB: {est.total / gpu_bytes:.1%} "
                     f"-> {verdict}")
    return lines + host_memory_lines(recipe, est)


def host_memory_lines(recipe: Recipe, est: MemoryEstimate) -> list[str]:
    """What each GPU's rank keeps in host memory, and a node's worth (``cluster.gpus_per_node``)."""
    t = recipe.train
    activations, exact = host_activation_bytes(recipe)
    if not activations and not est.host_optimizer:
        return ["host memory per GPU: none beyond the process (nothing offloaded)"]
    parts = []
    if activations:
        how = "pinned blocks" if recipe.run.device == "gpu" else "as saved"
        parts.append(f"activations {activations / GiB:.2f} GiB (train.offload_activations, {how}"
                     + ("" if exact else "; at least: layers not under full recompute") + ")")
    if est.host_optimizer:
        parts.append(f"optimizer state {est.host_optimizer / GiB:.2f} GiB "
                     f"(train.optimizer_offload_fraction={t.optimizer_offload_fraction:g}; "
                     "modelled only: a run refuses it, megatron-core 0.19.2's "
                     "HybridDeviceOptimizer cannot hold fp32 parameters)")
    per_gpu = activations + est.host_optimizer
    node = recipe.cluster.gpus_per_node
    return [f"host memory per GPU: {' + '.join(parts)}",
            f"host memory per node: {per_gpu * node / GiB:.2f} GiB "
            f"({node} GPUs, cluster.gpus_per_node)"]
