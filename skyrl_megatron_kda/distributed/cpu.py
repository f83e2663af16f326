"""Run megatron-core on CPU ranks (the laptop / CI mode of the tiny recipe, the demo and the tests).

megatron-core hard-codes CUDA in these places we reach:

- its sequence-parallel collectives allocate buffers on ``torch.cuda.current_device()``:
  ``redirect_cuda_device_queries`` points that query at the CPU for the whole process;
- its optimizer stack: ``torch.tensor(..., device='cuda')`` for flags and norms,
  ``param.type() == 'torch.cuda.FloatTensor'`` to pick the main-parameter path, the current CUDA
  stream and ``synchronize`` in the DDP gradient sync and checkpoint writes, ``pin_memory`` for
  the host copy of an offloaded buffer. A CPU rank wraps each
  call into them in ``cuda_names_cpu()``: a torch function mode that, while active, places tensors
  asked for on ``cuda`` on the CPU and reports CPU tensor types under their CUDA names. It is
  scoped to those calls (the model's forward and backward run without it);
- its RNG tracker (``model_parallel_cuda_manual_seed``: per-TP and per-expert streams that
  TP-region code forks, e.g. the SP embedding's dropout scope) keeps CUDA generator states.
  ``seed_cpu_rng_tracker`` installs a tracker with the same streams on the CPU generator, seeded
  by megatron's own function, so the seeds per rank are megatron's;
- its all-to-all token dispatcher copies routing counts to the host on a side CUDA stream
  (``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream``, made when the first one is built, and
  ``torch.cuda.current_stream()`` on every dispatch): ``redirect_cuda_device_queries`` gives it
  the CPU rank's one stream;
- under expert TP it all-gathers each rank's received rows, whose counts differ between ranks
  (``torch.distributed.all_gather`` of uneven tensors), which gloo refuses (``ProcessGroupGloo::
  allgather: invalid tensor size``): on a CPU rank that call pads every tensor to the longest,
  gathers, and trims each back (``gather_uneven_rows``); even gathers and other backends pass
  through unchanged. Its all-to-all split sizes stay tensors where there is no GPU to copy
  them from: ``all_to_all_host_splits`` passes them as lists.

``prepare_cpu_rank`` installs what a CPU rank needs process-wide (the device and stream
queries, ``redirect_cuda_device_queries``, the padded gather and the host splits) before its process group
starts. Every entry point refuses to run where CUDA exists, so a GPU run never picks any of it
up.
"""


from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from torch.overrides import TorchFunctionMode

# torch's own, which the CPU rank's versions below call
_all_gather, _all_to_all_single = dist.all_gather, dist.all_to_all_single


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class _CudaNamesCPU(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            # A host copy (megatron's buffer offload, SkyRL's colocation offload): its callers
            # free the source's storage next, so a CPU rank must get a copy, not the same tensor.
            return args[0].clone()
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_names_cpu(enabled: bool = True) -> Iterator[None]:
    """While active, megatron's CUDA-only optimizer code runs on CPU tensors (no-op if disabled)."""
    if not enabled:
        yield
        return
    _need_cpu_only("cuda_names_cpu")
    # Stream queries and synchronisation (DDP's grad sync, checkpoint writes): a CPU rank has
    # one in-order stream, so there is nothing to wait for.
    saved = {name: getattr(torch.cuda, name) for name in _STREAM_CALLS}
    torch.cuda.current_stream, torch.cuda.synchronize = _CPUStream, _no_wait
    # Where code moves tensors back "to the GPU" (SkyRL's backload), the device is the CPU.
    torch.cuda.current_device = _cpu_device
    try:
        with _CudaNamesCPU():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


_STREAM_CALLS = ("current_stream", "synchronize", "current_device")


def _cpu_device() -> str:
    return "cpu"


def _no_wait(device=None) -> None:
    pass


class _CPUStream:
    """The one stream of a CPU rank: everything is already in order, so waits are no-ops."""

    def __init__(self, device=None):
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _CPUEvent:
        return _CPUEvent()


class _CPUEvent:
    """An event on the CPU rank's one stream: it has happened when it is recorded."""

    def synchronize(self) -> None:
        pass


def _need_cpu_only(what: str) -> None:
    if torch.cuda.is_available():
        raise RuntimeError(f"{what} is for CPU-only ranks; this process sees CUDA")


class CPURNGStatesTracker(CudaRNGStatesTracker):
    """megatron's tracker with its named streams kept as CPU generator states."""

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG stream {name!r} or seed {seed} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} was not added (seed the tracker first)")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def seed_cpu_rng_tracker(seed: int) -> None:
    """``model_parallel_cuda_manual_seed(seed)`` for a CPU rank: megatron's streams and seeds on a
    CPU tracker (replacing any tracker this process had)."""
    _need_cpu_only("seed_cpu_rng_tracker")
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    # megatron seeds the default CUDA generator first; on a CPU rank that is the CPU one.
    cuda_seed, torch.cuda.manual_seed = torch.cuda.manual_seed, torch.manual_seed
    try:
        mrandom.model_parallel_cuda_manual_seed(seed)
    finally:
        torch.cuda.manual_seed = cuda_seed


def prepare_cpu_rank() -> None:
    """Run megatron-core's model code on this CPU-only process: its CUDA queries answered by the
    CPU (``redirect_cuda_device_queries``), ``torch.distributed.all_gather`` taking uneven
    tensors on gloo (``gather_uneven_rows``) and ``all_to_all_single`` split sizes as tensors
    (``all_to_all_host_splits``)."""
    redirect_cuda_device_queries()
    dist.all_gather = gather_uneven_rows
    dist.all_to_all_single = all_to_all_host_splits


def redirect_cuda_device_queries() -> None:
    """Make ``torch.cuda.current_device()`` name the CPU and ``torch.cuda.current_stream()``
    (and the all-to-all token dispatcher's side stream) the CPU rank's one stream, in this
    process."""
    _need_cpu_only("redirect_cuda_device_queries")
    torch.cuda.current_device = _cpu_device
    torch.cuda.current_stream = _CPUStream
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CPUStream()


def gather_uneven_rows(tensor_list, tensor, group=None, async_op=False):
    """``torch.distributed.all_gather`` that also gathers tensors of different row counts on
    gloo: each rank's ``tensor`` is padded to the longest of ``tensor_list`` (the row counts
    every rank expects), the padded tensors are gathered, and each is trimmed into its output.
    Any other call (equal shapes, another backend, async, other dims differing) is torch's."""
    shapes = {tuple(t.shape) for t in tensor_list}
    rows = max((t.shape[0] for t in tensor_list if t.dim()), default=0)
    if (len(shapes) == 1 or async_op or any(t.dim() == 0 for t in tensor_list)
            or {s[1:] for s in shapes} != {tuple(tensor.shape[1:])}
            or dist.get_backend(group) != "gloo"):
        return _all_gather(tensor_list, tensor, group=group, async_op=async_op)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in tensor_list]
    _all_gather(gathered, padded, group=group)
    for out, got in zip(tensor_list, gathered):
        out.copy_(got[:out.shape[0]])
    return None


def all_to_all_host_splits(output, input, output_split_sizes=None, input_split_sizes=None,
                           group=None, async_op=False):
    """``torch.distributed.all_to_all_single`` that also takes its split sizes as tensors: the
    all-to-all token dispatcher holds them as host arrays once it has copied them from the
    GPU, and on a CPU rank (nothing to copy) they stay tensors, which torch's signature
    refuses."""
    def host(sizes):
        return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes
    return _all_to_all_single(output, input, host(output_split_sizes), host(input_split_sizes),
                              group=group, async_op=async_op)
