"""The peak of the bytes a block of code allocates on CPU, seen from torch's dispatcher: the CPU
stand-in for CUDA's ``max_memory_allocated`` in the memory census of a working set (what a
backward allocates and frees again, which a saved-tensor census cannot see)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Inside ``with LiveBytes() as live:`` every storage an op creates is counted from the op
    to the death of the last tensor on it; ``live.peak`` is the largest sum reached. Memory that
    existed before the block (op inputs' storages, and views of them) is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self._tensors: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self._tensors[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._tensors[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self._tensors:
                self._tensors[key][1] += 1
            elif key in inputs:
                continue  # a view of (or in place on) memory this block did not allocate
            else:
                self._tensors[key] = [t.untyped_storage().nbytes(), 1]
                self.current += self._tensors[key][0]
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, key)
        return out
