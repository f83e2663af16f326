"""Per-GPU memory estimate of a recipe: parameters, gradients, optimizer state, activations.

Why an estimate of our own: the 1M-token recipe cannot run on these machines, and the question
"does it fit, and which term breaks it" must be answered before renting 64 GPUs. Every formula
follows what the code of this package allocates on one rank (docs/memory.md lists each tensor);
nothing is fitted to a measurement. Each term lives with what it counts:

- ``census.py``: the parameters of one rank, exactly;
- ``states.py``: gradients, the distributed optimizer's state, megatron's all-gather buffer;
- the activations autograd keeps for backward, per block: ``blocks.py`` (hyper-connections,
  norms, the dense MLP), ``kda.py`` (modelled on fla's GPU kernels, with the exchange's transient
  buffers), ``dsa.py`` (the kernel's own terms), ``moe.py``, ``head.py`` (embedding, output
  layer, loss); ``layers.py`` sums a layer under its recompute mode; every block but KDA runs
  the same torch/megatron code on CPU and GPU, and a CPU test checks those terms against
  autograd's saved tensors;
- ``phases.py``: activations are not all alive at once; the peak is the largest of a few phases
  of the step, each the activations alive then plus its working set;
- ``offload.py``: what ``train.offload_activations`` keeps in host memory;
- ``estimate.py`` assembles them (``estimate_memory``), ``table.py`` prints the ``plan`` table.

Not counted: allocator fragmentation and caching, NCCL/communication buffers other than the KDA
exchange's, CUDA context (about 0.5-1 GiB), gradients of activations other than fla's kernel
backward (for example the MLPs' and the projections' input gradients).
"""

from __future__ import annotations

from .estimate import MemoryEstimate, estimate_memory
from .table import GiB, memory_lines

__all__ = ["GiB", "MemoryEstimate", "estimate_memory", "memory_lines"]
