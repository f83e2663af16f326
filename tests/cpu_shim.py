"""Test-only shim that lets megatron-core's CUDA-minded code run on CPU ranks (never used by the
package). megatron-core allocates collective buffers on ``torch.cuda.current_device()``; on a CPU
machine we point that at the CPU."""

import torch


def install() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
