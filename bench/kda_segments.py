"""Probe: where fla's chunk_kda spends its time on one long sequence, and what splitting it helps.

fla's state pass (``chunk_gated_delta_rule_fwd_h`` forward, ``..._bwd_dhu`` backward) walks the
chunks of a sequence one after another, with parallelism only over heads and value blocks. With
8 heads on a 132-SM GPU that pass is latency-bound, which is why the state exchange's summaries
(and any second pass) cost so much. This script measures, in one run:

- chunk_kda fwd+bwd on one sequence of T tokens vs the same tokens cut into P independent
  segments (cu_seqlens), so the ratio shows how much of the time is the sequential pass;
- the top CUDA kernels of the one-sequence run (``--profile``).

Usage (CUDA):  python bench/kda_segments.py --tokens 524288 --heads 8 --segments 1,8,32,128
"""

from __future__ import annotations

import argparse

import torch
from kda_layer import timed  # bench/ is on sys.path when run as a script


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=524288)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--segments", default="1,8,32,128")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    return p.parse_args()


def make_step(args, segments: int, backward: bool):
    from fla.ops.kda import chunk_kda

    T, H, K, dev = args.tokens, args.heads, args.head_dim, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen).requires_grad_(backward)

    q, k, v, f = (leaf(1, T, H, K) for _ in range(4))
    b = leaf(1, T, H)
    a_log = torch.rand(H, device=dev).mul(15).add(1).log().requires_grad_(backward)
    dt_bias = leaf(H * K, dtype=torch.float32)
    do = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, generator=gen)
    cu = None
    if segments > 1:
        cu = torch.linspace(0, T, segments + 1, device=dev).round().long()

    def step():
        with torch.set_grad_enabled(backward):
            o, _ = chunk_kda(q, k, v, f, b, A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                             lower_bound=-5.0, cu_seqlens=cu)
        if backward:
            o.backward(do)
            for t in (q, k, v, f, b, a_log, dt_bias):
                t.grad = None

    return step


def profile(step) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main() -> None:
    args = parse_args()
    rows = []
    for p in (int(s) for s in args.segments.split(",")):
        fwd, _ = timed(make_step(args, p, backward=False), args.warmup, args.iters)
        both, _ = timed(make_step(args, p, backward=True), args.warmup, args.iters)
        rows.append((p, fwd, both))
        print(f"segments {p:4d}: fwd {fwd:7.1f} ms  fwd+bwd {both:7.1f} ms", flush=True)
    if args.profile:
        profile(make_step(args, 1, backward=True))
    base = rows[0][2]
    print(f"\nchunk_kda T={args.tokens} heads={args.heads} K={args.head_dim} bf16")
    print("segments   fwd ms   fwd+bwd ms   vs 1 segment")
    for p, fwd, both in rows:
        print(f"{p:8d} {fwd:8.1f} {both:12.1f} {base / both:13.2f}x")


if __name__ == "__main__":
    main()
