"""The step's phases outside the layers: the distributed optimizer (on the GPU, or its
``train.optimizer_offload_fraction`` on the host) and the host-offload copies of the layer
inputs."""

from __future__ import annotations

from ..config import Recipe
from ..memory.census import rank_parameters
from ..memory.offload import offloaded_tensor_bytes
from ..memory.states import grad_bytes, optimizer_shards
from . import calibration as cal
from .common import GiB, Part, group_link, scale, seconds


def optimizer_part(recipe: Recipe) -> Part:
    """The distributed optimizer: Adam over this rank's shard (dense parameters / DP x CP,
    experts / expert-DP), its ``train.optimizer_offload_fraction`` on the host (megatron's
    hybrid optimizer: the fp32 gradients copied to host memory, Adam on the CPU, the fp32
    parameters copied back, one after another) and the rest on the GPU, each at its measured
    rate; and the gradient reduce-scatter + parameter all-gather over those groups."""
    p = recipe.parallel
    dense_shards, expert_shards = optimizer_shards(recipe)
    groups = [g for g in rank_parameters(recipe) if g.trainable]
    shard = sum(g.numel / (expert_shards if g.expert else dense_shards) for g in groups)
    on_host = shard * recipe.train.optimizer_offload_fraction
    compute = ((shard - on_host) * cal.OPTIMIZER_S_PER_ELEMENT * scale(recipe).memory
               + on_host * cal.HOST_ADAM_S_PER_ELEMENT)
    copies = on_host * 8 * cal.HOST_COPY_S_PER_BYTE  # fp32 gradient out, fp32 parameter back
    comm = 0.0
    for expert, size, stride in ((False, dense_shards, p.tp), (True, expert_shards, p.ep * p.etp)):
        if size <= 1:
            continue
        part = [g for g in groups if g.expert == expert]
        grads = sum(g.numel * grad_bytes(recipe, g) for g in part)
        params = sum(g.bytes for g in part)
        comm += seconds((grads + params) * (size - 1) / size, group_link(recipe, stride, size))
    what = "grad reduce-scatter + param all-gather over DP x CP"
    if on_host:
        what += "; the host's share copied over PCIe"
    return Part("optimizer", 0, compute, comm + copies, what)


def offload_part(recipe: Recipe) -> Part:
    """Host-offload copies: each layer input to pinned host memory in forward and back in
    backward, ordered on the compute stream, at the rate measured as step time on the slice."""
    if not recipe.train.offload_activations:
        return Part("host-offload copies", 0, 0.0, 0.0)
    sizes = offloaded_tensor_bytes(recipe) or []
    nbytes = 2 * sum(sizes) * recipe.data.micro_batch_size
    return Part("host-offload copies", 0, 0.0, nbytes / (cal.OFFLOAD_EXPOSED_GIB_S * GiB),
                "PCIe, not overlapped")
