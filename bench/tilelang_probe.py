"""Does megatron-core's TileLang SparseMLA run here, and does it equal our absorbed sparse MLA?

megatron-core 0.19.2 ships TileLang sparse-MLA kernels (forward and backward) specialised for a
576-wide query/latent and top-k widths that divide by 64; GLM's NoPE latent is 512 wide, so the
queries and the latent are zero-padded to 576 (zero channels add nothing to q.k; the value is the
first 512 channels) and the indices padded with -1. This probe checks the kernel against
``dsa.sparse_mla.sparse_latent_attention`` (fp32) on a small causal case, then times one
forward + backward at a per-rank share of the 1M recipe.

Usage (CUDA, with tilelang importable):  python3 bench/tilelang_probe.py [--queries 65536 --heads 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from skyrl_megatron_kda.dsa.sparse_mla import sparse_latent_attention

WIDTH, LATENT = 576, 512


def causal_indices(queries: int, keys: int, topk: int, generator: torch.Generator) -> torch.Tensor:
    """[queries, topk] int32: for query i (at position keys - queries + i) up to topk distinct
    earlier-or-equal positions, the rest -1."""
    out = torch.full((queries, topk), -1, dtype=torch.int32)
    for i in range(queries):
        pos = keys - queries + i
        n = min(topk, pos + 1)
        out[i, :n] = torch.randperm(pos + 1, generator=generator)[:n].to(torch.int32)
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def parity(sparse_mla, heads: int) -> dict:
    g = torch.Generator().manual_seed(0)
    queries, keys, topk = 192, 384, 128
    q = torch.randn(queries, heads, LATENT, generator=g) * 0.05
    latent = torch.randn(keys, LATENT, generator=g)
    idx = causal_indices(queries, keys, topk, g)
    scale = 1 / 16
    ref_q, ref_kv = q.clone().cuda().requires_grad_(), latent.clone().cuda().requires_grad_()
    ref = sparse_latent_attention(ref_q, ref_kv, idx.cuda(), scale)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    tq = F.pad(q, (0, WIDTH - LATENT)).cuda().bfloat16().requires_grad_()
    tkv = F.pad(latent, (0, WIDTH - LATENT))[:, None].cuda().bfloat16().requires_grad_()
    out, _ = sparse_mla(tq, tkv, idx[:, None].cuda().contiguous(), scale)
    out.backward(grad.bfloat16())
    return {"out": relative(out, ref), "dq": relative(tq.grad[..., :LATENT], ref_q.grad),
            "dlatent": relative(tkv.grad[:, 0, :LATENT], ref_kv.grad),
            "pad_grad_max": float(tkv.grad[:, 0, LATENT:].abs().max())}


def timed(sparse_mla, queries: int, keys: int, heads: int, topk: int, iters: int) -> dict:
    dev = torch.device("cuda")
    q = (torch.randn(queries, heads, WIDTH, device=dev) * 0.05).bfloat16()
    q[..., LATENT:] = 0
    kv = torch.randn(keys, 1, WIDTH, device=dev).bfloat16()
    kv[..., LATENT:] = 0
    # Causal for the last `queries` positions: each picks topk positions at or before itself.
    pos = torch.arange(keys - queries, keys, device=dev)[:, None]
    idx = (torch.rand(queries, topk, device=dev) * (pos + 1).float()).long().clamp(max=keys - 1)
    idx = idx.to(torch.int32)[:, None].contiguous()
    q.requires_grad_()
    kv.requires_grad_()
    times = []
    for i in range(iters + 1):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out, _ = sparse_mla(q, kv, idx, 1 / 16)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        q.grad = kv.grad = None
        print(f"  iter {i}: {times[-1] * 1e3:.1f} ms, peak above inputs {peak:.2f} GiB", flush=True)
    return {"ms": min(times[1:]) * 1e3, "first_ms": times[0] * 1e3, "peak_gib": peak}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=65536)
    p.add_argument("--keys", type=int, default=1048576)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--topk", type=int, default=2112, help="2,051 selected keys padded to 64")
    p.add_argument("--iters", type=int, default=2)
    args = p.parse_args()
    import tilelang
    from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA

    print(f"tilelang {tilelang.__version__}; megatron SparseMLA available: {SparseMLA is not None}")
    if SparseMLA is None:
        return
    for heads in (16, 64):
        t0 = time.perf_counter()
        print(f"parity, {heads} heads (bf16 kernel vs fp32 torch core):", parity(SparseMLA.apply, heads),
              f"({time.perf_counter() - t0:.1f} s incl. compile)", flush=True)
    print(f"timing: {args.queries} queries x {args.heads} heads over {args.keys} keys, top-k {args.topk}")
    print(timed(SparseMLA.apply, args.queries, args.keys, args.heads, args.topk, args.iters))


if __name__ == "__main__":
    main()
