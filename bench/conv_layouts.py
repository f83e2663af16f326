"""How the KDA layer's short conv is best called on its q|k|v projection, on one GPU.

The projection GEMM writes q|k|v|beta side by side ([T, 3C + H]); fla's chunk kernels need q, k
and v each contiguous. Times forward + backward (ms, median) of the ways to get there:

- ``three strided``: one conv per q/k/v on its strided column view (outputs contiguous): what
  the layer does, and, with the head rows of each piece computed again, the state exchange;
- the same cut into the state exchange's pieces (varlen), with or without each piece starting
  from its halo rows as fla's ``initial_state``, or as batch rows with it;
- ``three contiguous``: the per-part conv on contiguous inputs (what the strides cost);
- ``one wide + copies``: one conv over the [T, 3C] view, then each of q/k/v copied out of it.

Results: bench/results/h200_kda_conv_layouts/ (docs/benchmarks.md).
Usage (on a CUDA machine): python bench/conv_layouts.py --tokens 131072 --channels 1024
"""

from __future__ import annotations

import argparse
import json

import torch

from kda_layer import timed  # this folder's layer benchmark: the same timing


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--channels", type=int, default=1024, help="C: q, k and v width each (heads x head_dim)")
    p.add_argument("--heads", type=int, default=8, help="beta columns beside q|k|v in the GEMM output")
    p.add_argument("--width", type=int, default=4, help="conv taps")
    p.add_argument("--pieces", type=int, default=2, help="pieces with halo states (the state exchange's)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    return p.parse_args()


def conv(x, weight, cu_seqlens, initial_state):
    """fla's conv + SiLU (the layer's ``kernel.causal_conv_silu`` calls it without the last two)."""
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x, weight, initial_state=initial_state, activation="silu", cu_seqlens=cu_seqlens)[0]


def main() -> None:
    args = parse_args()
    T, C, W = args.tokens, args.channels, args.width
    g = torch.Generator(device="cuda").manual_seed(0)
    gemm_out = torch.randn(T, 3 * C + args.heads, device="cuda", dtype=torch.bfloat16, generator=g)
    qkv_view = gemm_out[:, : 3 * C].requires_grad_(False)
    weight = (torch.randn(3, C, W, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    dys = [torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    cu = torch.linspace(0, T, args.pieces + 1, device="cuda").long()
    states = (torch.randn(args.pieces, 3 * C, W, device="cuda", generator=g)).to(torch.bfloat16)

    def three(x_parts, varlen: bool, with_states: bool):
        """One conv per part; ``varlen``: the pieces as packed sequences (else, with states, as
        batch rows of one piece each); ``with_states``: each piece starts from halo rows."""
        def step():
            leaves = [x.detach().requires_grad_() for x in x_parts]
            outs = []
            for x, w, s, dy in zip(leaves, weight.unbind(0), states.chunk(3, dim=1), dys):
                rows = x if varlen or not with_states else x.reshape(args.pieces, T // args.pieces, C)
                y = conv(rows, w, cu if varlen else None, s.contiguous() if with_states else None)
                outs.append(y.reshape(dy.shape))
            torch.autograd.backward(outs, dys)
        return step

    def wide(with_pieces):
        def step():
            x = qkv_view.detach().unsqueeze(0).requires_grad_()
            y = conv(x, weight.flatten(0, 1), cu if with_pieces else None, states if with_pieces else None)
            outs = [part.contiguous() for part in y.chunk(3, dim=-1)]
            torch.autograd.backward(outs, dys)
        return step

    strided = [qkv_view[:, i * C:(i + 1) * C].unsqueeze(0) for i in range(3)]
    contiguous = [x.contiguous() for x in strided]
    runs = {
        "three strided": three(strided, False, False),
        "three strided, pieces + halo states": three(strided, True, True),
        "three strided, pieces, no states": three(strided, True, False),
        "three strided, batch rows + halo states": three(strided, False, True),
        "three contiguous": three(contiguous, False, False),
        "three contiguous, pieces + halo states": three(contiguous, True, True),
        "three contiguous, batch rows + halo states": three(contiguous, False, True),
        "one wide + copies": wide(False),
        "one wide + copies, pieces + halo states": wide(True),
    }
    results = {name: timed(step, 3, args.iters)[0] for name, step in runs.items()}
    base = results["three strided"]
    print(f"conv + SiLU fwd+bwd of q, k, v: T={T}, C={C}, W={W}, bf16 (one run)")
    print(f"{'layout':42s} {'ms':>7s} {'vs three strided':>17s}")
    for name, ms in results.items():
        print(f"{name:42s} {ms:7.3f} {ms / base:17.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {**vars(args), "json": None}, "ms": results}, f, indent=1)


if __name__ == "__main__":
    main()
