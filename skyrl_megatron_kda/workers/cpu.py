"""Run megatron-core on CPU ranks (the laptop / CI mode of the tiny recipe and the demo).

megatron-core allocates the buffers of its sequence-parallel collectives on
``torch.cuda.current_device()``. A CPU worker points that query at the CPU; nothing else of
megatron-core needs changing for the modules we use. Only CPU workers call this, and it refuses
to run where CUDA is available, so a GPU run can never pick it up by accident.
"""

import torch


def redirect_cuda_device_queries() -> None:
    """Make ``torch.cuda.current_device()`` name the CPU in this process."""
    if torch.cuda.is_available():
        raise RuntimeError("redirect_cuda_device_queries is for CPU-only processes; this one sees CUDA")
    torch.cuda.current_device = lambda: "cpu"
