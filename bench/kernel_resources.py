"""What our sparse-MLA TileLang programs compile to for Hopper, without a GPU: each program of
``dsa/ops/latent/`` (and the ping-pong forward of ``bench/experiments/``) at the 1M recipe's
shape (64 heads, 512 channels, the indices padded as ``latent_forward`` / ``latent_backward``
pad GLM's 2,051) lowered by ``tilelang.lower`` for sm_90a and compiled by ``nvcc -cubin
-Xptxas -v``. Per program: the MMA instructions in its CUDA source (Hopper's ``wgmma`` with their tile shapes, or the older
``mma.sync``), the shared memory it is launched with, and ptxas's registers and spills.
Registers spilled in a kernel's loop cost local-memory traffic every key block, and a product
that lowers to ``mma.sync`` loads its operands through registers, so these are what to check
before a GPU call.

Needs the ``tilelang`` package and ``nvcc`` (CUDA 12.3 or later for sm_90a), no GPU.

Usage:  python3 bench/kernel_resources.py [--forward-configs '[{...}]'] [--backward-configs '[{...}]']
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile

from experiments import ping_pong_forward as forward  # the package's forward, or ping-pong
from skyrl_megatron_kda.dsa.ops.latent import backward, interface
from skyrl_megatron_kda.dsa.ops.latent.common import padded_width
from skyrl_megatron_kda.dsa.ops.latent.forward import FORWARD_PASS_CONFIGS

HEADS, WIDTH, TOPK, SCALE = 64, 512, 2051, 256 ** -0.5
FORWARD_CONFIGS = ('[{"warp_specialized": false}, {"warp_specialized": true}, '
                   '{"warp_specialized": true, "ping_pong": true}]')
BACKWARD_CONFIGS = ('[{}, {"ordered": true}, {"stacked": true}, {"stacked": true, '
                    '"channel_split": 2}, {"stacked": true, "channel_split": 4, "store_split": 1}]')


def lowered(program, pass_configs: dict) -> tuple[str, int]:
    """The program's CUDA source and the dynamic shared memory its kernel is launched with."""
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90a"})
    with tvm.transform.PassContext(opt_level=3, config=pass_configs), target:
        artifact = tilelang.lower(program, target=target)
    (kernel,) = artifact.device_mod.functions.values()
    return artifact.kernel_source, int(kernel.attrs["dyn_shared_memory_buf"])


def compiled_resources(source: str, shared_bytes: int) -> dict:
    """ptxas's registers and spill bytes for ``source``, its MMA instructions, and its shared
    memory in KiB (the dynamic buffer and ptxas's static bytes)."""
    import tilelang

    root = os.path.dirname(tilelang.__file__)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cu")
        with open(path, "w") as f:
            f.write(source)
        run = subprocess.run(
            ["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-O3", "--use_fast_math",
             "-Xptxas=-v", "-DENABLE_BF16", "--expt-relaxed-constexpr", f"-I{root}/src",
             f"-I{root}/3rdparty/cutlass/include", f"-I{root}/3rdparty/tvm/include", path,
             "-o", path + ".cubin"], capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        raise RuntimeError(f"nvcc failed:\n{log[-3000:]}")
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    wgmma = sorted(set(re.findall(r"wgmma_(ss|rs)<[^>]*?, (\d+), (\d+), 16,", source)))
    static = re.search(r"(\d+) bytes smem", log)
    return {"registers": int(registers.group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "wgmma": [f"{kind} m{m}n{n}" for kind, m, n in wgmma],
            "mma_sync": source.count("tl::mma_sync<"),
            "shared_kib": round((shared_bytes + int(static.group(1) if static else 0)) / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--forward-configs", default=FORWARD_CONFIGS)
    p.add_argument("--backward-configs", default=BACKWARD_CONFIGS)
    a = p.parse_args()
    try:
        import tilelang
    except ImportError:
        p.error("needs the tilelang package (pip install 'skyrl-megatron-kda[gpu]')")
    if shutil.which("nvcc") is None:
        p.error("needs nvcc on PATH (CUDA 12.3 or later)")
    configs = {}
    for name in ("forward_configs", "backward_configs"):
        try:
            configs[name] = json.loads(getattr(a, name))
        except json.JSONDecodeError as e:
            p.error(f"--{name.replace('_', '-')} is not a JSON list of keyword dicts: {e}")
    forward_passes = {getattr(tilelang.PassConfigKey, k): True
                      for k in FORWARD_PASS_CONFIGS}
    for config in configs["forward_configs"]:
        try:
            topk = padded_width(TOPK, interface.forward_index_multiple(HEADS, config))
            program = forward.forward_program(HEADS, WIDTH, topk, SCALE, **config)
        except (TypeError, ValueError) as e:
            p.error(f"forward config {json.dumps(config)}: {e}")
        print(json.dumps({"forward": config, "topk": topk,
                          **compiled_resources(*lowered(program, forward_passes))}), flush=True)
    for config in configs["backward_configs"]:
        try:
            topk = padded_width(TOPK, interface.backward_index_multiple(config))
            program = backward.backward_program(HEADS, WIDTH, topk, SCALE, **config)
        except (TypeError, ValueError) as e:
            p.error(f"backward config {json.dumps(config)}: {e}")
        print(json.dumps({"backward": config, "topk": topk,
                          **compiled_resources(*lowered(program, {}))}), flush=True)


if __name__ == "__main__":
    main()
