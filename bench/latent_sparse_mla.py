"""Our sparse-MLA kernels (``dsa/ops/latent/``) against megatron-core 0.19.2's, kernel
alone, at the 1M recipe's per-rank share on one GPU, and checked against an fp32 reference.

Shape: ``--queries`` rows (65,536: one rank's share under ``tp_split=sequence``) x 64 heads, the
absorbed queries over a 1,048,576-token latent (512 channels), each query's selection pool-shaped
as GLM's indexer makes it: 512 distinct whole pools of 4 tokens among the complete pools it can
see, then its tail (2,051 indices), the queries being the sequence's last rows. megatron's
kernels get the queries and latent zero-padded to 576 channels (as ``model.dsa.kernel=fused``
gives them); ours the 512 channels. Each kernel's time is the median of ``--iters`` calls after a
warm-up (compilation); the backward's time includes its ``delta`` (megatron: its TileLang
pre-pass; ours: the torch sum it is given). TFLOP/s are in one convention for every kernel:
forward 2 H topk (576 + 512), backward 2 H topk (2 x 512 + 3 x 576) per query, topk = 2,048.

Checks: at the full shape, ours against megatron's (output, log-sum-exp, dq, dkv: relative
Frobenius error); on a small shape with -1 holes, a query with no key, 8 heads (padded to 16)
and 64 heads, both against the fp32 torch attention (``sparse_mla.sparse_latent_attention``);
and whether two backward calls give bitwise equal dkv (fp32 atomics: expected not).

``ours (defaults)`` is ``latent_forward``'s and ``latent_backward``'s defaults (at 64 heads the
warp-specialised forward and the stacked backward; the default ``--backward-configs`` add the
backward of 32-key rows, ``{"num_stages": 2, "store_split": 4}`` the default before it);
``--forward-configs`` times more tunings of our forward (``forward_program``'s keywords: key
block, pipeline stages, deferred sums; ``{"warp_specialized": false}`` is the pipelined one;
``{"warp_specialized": true, "ping_pong": true}`` the ping-pong forward, ``bench/experiments/``),
each with the default backward; ``--forward-only`` leaves every backward out. ``--flashmla`` adds FlashMLA's
sparse forward (``model.dsa.latent.attention_forward=flashmla``; vLLM's
build) with our backward on its log-sum-exp.

Each tuning is built into its program first: one our programs refuse (a keyword they do not
take, buffers beyond shared memory) is one line with exit status 2, before any GPU work.

Usage (CUDA + tilelang):  python3 bench/latent_sparse_mla.py [--queries 65536] [--flashmla]
                              [--forward-configs '[{"key_block": 32, "num_stages": 3}]'] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from kda_layer import timed  # bench/ is on sys.path when run as a script
import torch.nn.functional as F
from megatron.core.transformer.experimental_attention_variant.ops import (
    tilelang_sparse_mla_bwd,
    tilelang_sparse_mla_fwd,
)

from experiments import ping_pong_forward as forward  # the package's forward, or ping-pong
from skyrl_megatron_kda.dsa.ops.flashmla_forward import flashmla_forward
from skyrl_megatron_kda.dsa.ops.latent import backward, interface
from skyrl_megatron_kda.dsa.ops.latent.common import padded_width
from skyrl_megatron_kda.dsa.sparse_mla import sparse_latent_attention

HEADS, R, WIDTH, KPOOL, TOPK = 64, 512, 576, 4, 2048
SCALE = 256 ** -0.5
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def pool_shaped_indices(positions: torch.Tensor, gen: torch.Generator, block: int = 1024,
                        shared: float = 0.0):
    """[S, 2,051] int32: 512 distinct random complete pools before each position, then its tail.

    ``shared``: the fraction of each query's pools that all queries of its block of ``block``
    neighbours select (drawn among the pools the block's first query sees), a stand-in for the
    locality of real selections; at 0 every query draws its pools on its own (the same draws as
    without the argument)."""
    pools_per_query = TOPK // KPOOL
    n_shared = round(shared * pools_per_query)
    out = []
    for q0 in range(0, positions.numel(), block):
        pos = positions[q0:q0 + block]
        complete = (pos + 1) // KPOOL                              # pools that end at or before pos
        noise = torch.rand(pos.numel(), int(complete.max()), generator=gen, device=pos.device)
        noise = noise.masked_fill(torch.arange(noise.shape[1], device=pos.device)[None] >= complete[:, None], -1)
        if n_shared:
            if int(complete.min()) < n_shared:
                raise ValueError(f"the query at {int(pos[0])} sees {int(complete.min())} complete "
                                 f"pools, fewer than the {n_shared} its block shares")
            common = torch.randperm(int(complete.min()), generator=gen, device=pos.device)[:n_shared]
            noise[:, common] = -1
            pools = torch.cat([common.expand(pos.numel(), -1),
                               noise.topk(pools_per_query - n_shared, dim=-1).indices], -1)
        else:
            pools = noise.topk(pools_per_query, dim=-1).indices
        tokens = (pools[..., None] * KPOOL + torch.arange(KPOOL, device=pos.device)).flatten(1)
        tail_start = complete * KPOOL
        tail = tail_start[:, None] + torch.arange(KPOOL - 1, device=pos.device)
        tail = torch.where(tail <= pos[:, None], tail, -1)
        out.append(torch.cat([tokens, tail], -1).to(torch.int32))
    return torch.cat(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Megatron:
    """megatron-core's kernels on the 576-padded tensors, as the fused kernel calls them."""

    name = "megatron-core 0.19.2"

    def __init__(self, q, kv, idx):
        self.q = F.pad(q, (0, WIDTH - R)).contiguous()
        self.kv = F.pad(kv, (0, WIDTH - R)).contiguous()[:, None]
        self.idx = idx[:, None].contiguous()

    def forward(self):
        return tilelang_sparse_mla_fwd.sparse_mla_fwd_interface(self.q, self.kv, self.idx, SCALE)

    def backward(self, out, lse, grad):
        delta = tilelang_sparse_mla_bwd.sparse_mla_delta(out, grad)
        dq, dkv = tilelang_sparse_mla_bwd.sparse_mla_bwd(self.q, self.kv, None, grad, self.idx, lse,
                                                         sm_scale=SCALE, delta=delta)
        return dq[..., :R], dkv[:, 0, :R]

    def natural_lse(self, lse):
        return lse * math.log(2.0)


class Ours:
    """Our kernels with ``backward_program``'s keywords ``config`` and ``forward_program``'s
    ``forward_config``."""

    def __init__(self, q, kv, idx, forward_config=None, **config):
        self.q, self.kv, self.idx, self.config = q, kv, idx, config
        self.forward_config = forward_config or {}
        named = {**({"forward": self.forward_config} if self.forward_config else {}), **config}
        self.name = "ours " + (json.dumps(named) if named else "(defaults)")

    def forward(self):
        return forward.latent_forward(self.q, self.kv, self.idx, SCALE, **self.forward_config)

    def backward(self, out, lse, grad):
        delta = (out.float() * grad.float()).sum(-1)
        return interface.latent_backward(self.q, self.kv, grad, self.idx, lse, delta, SCALE,
                                      **self.config)

    def natural_lse(self, lse):
        return lse


class FlashMLAForward(Ours):
    """FlashMLA's sparse forward (``model.dsa.latent.attention_forward=flashmla``), our backward on
    its log-sum-exp."""

    def __init__(self, q, kv, idx):
        super().__init__(q, kv, idx)
        self.name = "FlashMLA forward (vLLM's build), our backward"

    def forward(self):
        return flashmla_forward(self.q, self.kv, self.idx, SCALE)


def small_checks(dev) -> dict:
    """Ours against the fp32 torch attention with -1 holes and a query with no key."""
    gen = torch.Generator(device=dev).manual_seed(1)
    results = {}
    for heads in (8, 64):
        tq, tk, topk = 300, 2000, 130
        q = torch.randn(tq, heads, R, generator=gen, device=dev) * 0.05
        kv = torch.randn(tk, R, generator=gen, device=dev)
        pos = torch.arange(tk - tq, tk, device=dev)[:, None]
        idx = (torch.rand(tq, topk, generator=gen, device=dev) * (pos + 1)).long()
        idx = idx.masked_fill(torch.rand(idx.shape, generator=gen, device=dev) < 0.2, -1)
        idx[7] = -1                                              # a query with no key
        idx = idx.to(torch.int32)
        grad = torch.randn(tq, heads, R, generator=gen, device=dev)
        qb, kvb, gb = q.bfloat16(), kv.bfloat16(), grad.bfloat16()
        qr, kvr = qb.float().requires_grad_(), kvb.float().requires_grad_()
        ref = sparse_latent_attention(qr, kvr, idx, SCALE)
        ref.backward(gb.float())
        out, lse = interface.latent_forward(qb, kvb, idx, SCALE)
        delta = (out.float() * gb.float()).sum(-1)
        dq, dkv = interface.latent_backward(qb, kvb, gb, idx, lse, delta, SCALE)
        results[f"heads_{heads}"] = dict(
            out=rel(out, ref), dq=rel(dq, qr.grad), dkv=rel(dkv, kvr.grad),
            empty_row_out_max=float(out[7].abs().max()), empty_row_lse=float(lse[7].abs().max()),
            empty_row_dq_max=float(dq[7].abs().max()))
    return results


def tunings(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, list[dict]]:
    """The --forward-configs and --backward-configs, each built into its program at the
    bench's shape first, so that one our programs refuse (or TileLang's absence) is one line
    before any GPU work, not a traceback mid-run."""
    configs = {}
    for kind, program in (("forward", forward.forward_program),
                          ("backward", backward.backward_program)):
        flag = f"--{kind}-configs"
        try:
            configs[kind] = json.loads(getattr(a, f"{kind}_configs"))
        except json.JSONDecodeError as e:
            p.error(f"{flag} is not a JSON list of keyword dicts: {e}")
        if not isinstance(configs[kind], list) or not all(isinstance(c, dict)
                                                           for c in configs[kind]):
            p.error(f"{flag} is not a JSON list of keyword dicts: {getattr(a, f'{kind}_configs')}")
        for config in configs[kind]:
            multiple = (interface.forward_index_multiple(HEADS, config) if kind == "forward"
                        else interface.backward_index_multiple(config))
            topk = padded_width(TOPK + KPOOL - 1, multiple)
            try:
                program(HEADS, R, topk, SCALE, **config)
            except (TypeError, ValueError) as e:
                p.error(f"{flag} {json.dumps(config)}: {e}")
            except RuntimeError as e:  # what the programs need is missing (TileLang)
                p.error(str(e))
    return configs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=65536)
    p.add_argument("--keys", type=int, default=1 << 20)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--backward-configs", default='[{}, {"num_stages": 1, "store_split": 4}, {"num_stages": 2, "store_split": 4}]',
                   help="JSON list of backward_program keyword sets to time")
    p.add_argument("--forward-configs", default="[]",
                   help="JSON list of forward_program keyword sets to time besides the default "
                        "(each with the default backward)")
    p.add_argument("--forward-only", action="store_true",
                   help="time and check the forwards only (no backward runs)")
    p.add_argument("--flashmla", action="store_true",
                   help="also FlashMLA's forward (needs vLLM's FlashMLA build)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    configs = tunings(p, a)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (TileLang and megatron-core's kernels)")
    dev = torch.device("cuda")
    log("small checks against the fp32 torch attention")
    checks = small_checks(dev)
    log(json.dumps(checks))
    gen = torch.Generator(device=dev).manual_seed(0)
    positions = torch.arange(a.keys - a.queries, a.keys, device=dev)
    idx = pool_shaped_indices(positions, gen)
    q = (torch.randn(a.queries, HEADS, R, generator=gen, device=dev) * 0.05).bfloat16()
    kv = torch.randn(a.keys, R, generator=gen, device=dev).bfloat16()
    grad = (torch.randn(a.queries, HEADS, R, generator=gen, device=dev) * 0.01).bfloat16()
    log(f"{a.queries} queries x {HEADS} heads over {a.keys} keys, {idx.shape[1]} indices each")
    fwd_tflop = 2 * HEADS * TOPK * (WIDTH + R) * a.queries / 1e12
    bwd_tflop = 2 * HEADS * TOPK * (2 * R + 3 * WIDTH) * a.queries / 1e12
    runs, reference = [], None
    impls = ([Megatron(q, kv, idx)] + [Ours(q, kv, idx, **c) for c in configs["backward"]]
             + [Ours(q, kv, idx, forward_config=c) for c in configs["forward"]])
    for impl in impls + ([FlashMLAForward(q, kv, idx)] if a.flashmla else []):
        out, lse = impl.forward()                                   # compiles
        fwd_ms = timed(impl.forward, 0, a.iters)[0]
        r = dict(kernel=impl.name, forward_ms=fwd_ms, forward_tflops=fwd_tflop / fwd_ms * 1e3)
        found = dict(out=out, lse=impl.natural_lse(lse))
        if not a.forward_only:
            found["dq"], found["dkv"] = impl.backward(out, lse, grad)  # compiles
            bwd_ms = timed(lambda: impl.backward(out, lse, grad), 0, a.iters)[0]
            r.update(backward_ms=bwd_ms, backward_tflops=bwd_tflop / bwd_ms * 1e3)
        if reference is None:
            reference = found
        else:
            r["vs_megatron"] = {name: rel(found[name], reference[name]) for name in found}
            if not a.forward_only:
                again = impl.backward(out, lse, grad)[1]
                r["dkv_bitwise_repeatable"] = bool(torch.equal(again, found["dkv"]))
        log(json.dumps(r))
        runs.append(r)
        del out, lse, found
    summary = dict(queries=a.queries, keys=a.keys, heads=HEADS, indices=idx.shape[1],
                   forward_tflop=fwd_tflop, backward_tflop=bwd_tflop, small_checks=checks,
                   runs=runs)
    log("summary " + json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
