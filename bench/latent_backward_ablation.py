"""Where our sparse-MLA backward's time goes at the 1M recipe's share: the kernel
(``latent_sparse_mla.backward_program``) as it is, and the same kernel built without its fp32
atomics into the latent gradient (each ``T.atomic_addx4`` made a no-op while the program is
built; its dkv is then wrong: a timing ablation, not a kernel). The difference bounds what a
backward that hid or avoided those atomics could save.

Inputs as in ``bench/latent_sparse_mla.py``: 65,536 queries x 64 heads over 1,048,576 keys of
512 channels, 2,051 pool-shaped indices each; the log-sum-exp from our forward. Each time is the
median of ``--iters`` calls after a warm-up.

Usage (CUDA + tilelang):  python3 bench/latent_backward_ablation.py [--iters 3]
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

import torch
from kda_layer import timed  # bench/ is on sys.path when run as a script
from latent_sparse_mla import HEADS, R, SCALE, pool_shaped_indices

from skyrl_megatron_kda.dsa import latent_sparse_mla as latent


@contextmanager
def atomics_left_out():
    """``T.atomic_addx4`` as a no-op statement while a program is built."""
    import tilelang.language as T

    real = T.atomic_addx4
    T.atomic_addx4 = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        T.atomic_addx4 = real


def build(topk: int):
    import tilelang

    return tilelang.compile(latent.backward_program(HEADS, R, topk, SCALE), out_idx=[-2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=65536)
    p.add_argument("--keys", type=int, default=1 << 20)
    p.add_argument("--iters", type=int, default=3)
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = pool_shaped_indices(torch.arange(a.keys - a.queries, a.keys, device=dev), gen)
    q = (torch.randn(a.queries, HEADS, R, generator=gen, device=dev) * 0.05).bfloat16()
    kv = torch.randn(a.keys, R, generator=gen, device=dev).bfloat16()
    grad = (torch.randn(a.queries, HEADS, R, generator=gen, device=dev) * 0.01).bfloat16()
    out, lse = latent.latent_forward(q, kv, idx, SCALE)
    delta = (out.float() * grad.float()).sum(-1)
    keys = latent._pad_keys(idx.to(torch.int32), latent.BACKWARD_KEY_BLOCK).contiguous()
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=dev)
    rows = {}
    for name in ("as it is", "without its latent-gradient atomics"):
        if name == "as it is":
            kernel = build(keys.shape[1])
        else:
            with atomics_left_out():
                kernel = build(keys.shape[1])
        run = lambda: kernel(q, kv, grad, keys, lse, delta, dkv)  # noqa: E731
        run()
        rows[name] = timed(run, 0, a.iters)[0]
        print(json.dumps({"backward": name, "ms": rows[name]}), flush=True)
    print(json.dumps({"atomics_ms": rows["as it is"] - rows["without its latent-gradient atomics"]}))


if __name__ == "__main__":
    main()
