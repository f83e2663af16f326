"""The fused (chunked) output layer + cross entropy against megatron's unfused loss, on one GPU.

The 1M recipe's per-rank share of the loss: 524,288 tokens (one CP rank's rows, all of them on
every TP rank after the SP gather) x a 19,360-column vocabulary shard (154,880 / TP8), hidden
4096, bf16. ``unfused`` is what the model runs without ``train.loss_chunk_tokens``: the output
layer's logits, ``.float()``, megatron-core's ``vocab_parallel_cross_entropy``; ``fused`` is
``model.fused_loss.chunked_linear_cross_entropy``. Forward + backward, time and peak memory
above the inputs, at each T until the unfused loss runs out of memory.

Usage (CUDA):  python3 bench/fused_loss.py [--tokens 65536,131072,262144,524288 --chunk 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

from skyrl_megatron_kda.model.fused_loss import chunked_linear_cross_entropy


def run(kind: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, 1, hidden, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, device="cuda") * hidden ** -0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens, 1), generator=g, device="cuda")
    group = parallel_state.get_tensor_model_parallel_group()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    if kind == "fused":
        loss = chunked_linear_cross_entropy(h, w, labels, chunk=chunk, tp_group=group,
                                            sequence_parallel=False)
    else:
        loss = vocab_parallel_cross_entropy((h @ w.t()).float(), labels)
    loss.sum().backward()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {"kind": kind, "tokens": tokens, "ms": ms, "peak_gib": peak,
            "loss_mean": float(loss.float().mean())}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="65536,131072,262144,524288")
    p.add_argument("--vocab", type=int, default=154880 // 8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=8192)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    for t in (int(x) for x in a.tokens.split(",")):
        for kind in ("fused", "unfused"):
            try:
                run(kind, t, a.vocab, a.hidden, a.chunk)  # warm-up
                print(json.dumps(run(kind, t, a.vocab, a.hidden, a.chunk)), flush=True)
            except torch.cuda.OutOfMemoryError as err:
                print(json.dumps({"kind": kind, "tokens": t, "oom": str(err).splitlines()[0]}),
                      flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
