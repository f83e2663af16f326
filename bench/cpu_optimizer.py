"""The optimizer step on the host, as megatron-core's ``HybridDeviceOptimizer`` runs it under
``optimizer_offload_fraction=1.0`` with ``overlap_cpu_optimizer_d2h_h2d=false``: the fp32
gradients copied from the GPU into pinned host buffers, ``torch.optim.AdamW`` over pinned fp32
master parameters on the CPU, the parameters copied back to the GPU, one after another.

Prints and writes (``--json``) seconds per element of each phase, the rates the step-time model
prices ``train.optimizer_offload_fraction`` with (``steptime/calibration.py``).

    python3 bench/cpu_optimizer.py --elements 268435456 --threads 12 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _timed(fn, iters: int) -> float:
    """Best wall time of ``iters`` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 28, help="parameter elements")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own, all cores)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: needs a GPU (the copies run between it and pinned host memory)")
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.elements
    gpu_grad = torch.randn(n, device="cuda")
    gpu_param = torch.empty(n, device="cuda")
    master = torch.randn(n).pin_memory()
    master.grad = torch.empty(n).pin_memory()
    adam = torch.optim.AdamW([master], lr=1e-6, weight_decay=0.1)

    d2h = _timed(lambda: master.grad.copy_(gpu_grad, non_blocking=True), args.iters)
    step = _timed(adam.step, args.iters)
    h2d = _timed(lambda: gpu_param.copy_(master, non_blocking=True), args.iters)
    result = {
        "device": torch.cuda.get_device_name(),
        "host_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "elements": n,
        "d2h_s": d2h, "adam_s": step, "h2d_s": h2d,
        "adam_s_per_element": step / n,
        "copy_s_per_byte": (d2h + h2d) / (8 * n),
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
