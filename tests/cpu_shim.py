"""Test processes run megatron-core on CPU the way CPU workers do (see workers/cpu.py)."""

from skyrl_megatron_kda.workers.cpu import redirect_cuda_device_queries as install  # noqa: F401
