"""Tensors saved for backward kept in host memory between forward and backward
(``train.offload_activations``).

Why not torch's ``save_on_cpu`` as is: it copies every saved tensor, parameters included (a
linear layer saves its weight, which stays on the device for the whole step anyway), and does not
say how much host memory it holds. ``HostOffload`` is the same pair of saved-tensor hooks (pinned
host copies, non-blocking transfers on the compute stream) with three differences: tensors in a
parameter's storage stay where they are, a tensor saved by several ops is copied once, and it counts the host bytes it holds as the caching
host allocator rounds pinned blocks (``pinned_block_bytes``), so the plan's host figure is
checked against it.

Under ``train.recompute=full`` what autograd saves outside the rebuilt layers is each layer's
input streams (the reentrant checkpoint's one saved tensor), the token ids and the head's
tensors. The model applies the hooks to the embedding and the layers only (``GLMModel.forward``):
the head's tensors are saved last and read first, so on the host they would lower no peak and
cost two copies. Each copy goes to the host in forward and back to its device in the layer's
backward.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..memory.offload import pinned_block_bytes


class _HostCopy:
    """One saved tensor's host copy; gives its bytes back to the count when autograd drops it.
    A tensor on the host already (a CPU run) is held as is, and counted the same way."""

    def __init__(self, owner: HostOffload, tensor: torch.Tensor):
        self.owner = owner
        self.device = tensor.device
        if tensor.device.type == "cpu":
            self.host = tensor
        else:
            self.host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
            # Ordered on the compute stream: later kernels cannot reuse the device memory first.
            self.host.copy_(tensor, non_blocking=True)
        self.nbytes = tensor.numel() * tensor.element_size()
        owner._hold(self.nbytes)

    def restore(self) -> torch.Tensor:
        return self.host.to(self.device, non_blocking=True)

    def __del__(self):
        self.owner._release(self.nbytes)


class HostOffload:
    """Saved-tensor hooks: ``with offload.hooks(model): loss = model(...)``.

    ``held`` / ``peak``: host bytes of the copies alive now / at most since ``reset_peak``, in
    pinned blocks (``pinned_block_bytes``) when the model is on a GPU, else as they are.
    ``saved``: byte sizes of the copies alive now (the census of a CPU test)."""

    def __init__(self):
        self._param_storages: set[int] = set()
        self.pinned = False
        self._copies: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self.saved: list[int] = []
        self.held = 0
        self.peak = 0

    def _hold(self, nbytes: int) -> None:
        self.saved.append(nbytes)
        self.held += pinned_block_bytes(nbytes) if self.pinned else nbytes
        self.peak = max(self.peak, self.held)

    def _release(self, nbytes: int) -> None:
        self.saved.remove(nbytes)
        self.held -= pinned_block_bytes(nbytes) if self.pinned else nbytes

    def reset_peak(self) -> None:
        self.peak = self.held

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self._param_storages:
            return tensor  # a parameter (or a view of one): on the device for the whole step
        # One copy per tensor that several ops save (an RMSNorm's fp32 input, say): found by
        # its identity while the tensor and its copy are both alive.
        key = (id(tensor), tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tensor.stride(), tensor.dtype)
        seen = self._copies.get(key)
        if seen is not None and seen[0]() is tensor and seen[1]() is not None:
            return seen[1]()
        copy = _HostCopy(self, tensor)
        self._copies[key] = (weakref.ref(tensor), weakref.ref(copy))
        return copy

    @staticmethod
    def _unpack(packed):
        return packed.restore() if isinstance(packed, _HostCopy) else packed

    def hooks(self, model: nn.Module):
        """The hooks for one forward of ``model``. Its parameter storages are read here, not
        once: megatron's DDP moves parameters into its contiguous buffer after the model is
        built."""
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.pinned = any(p.is_cuda for p in model.parameters())
        self._copies.clear()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
