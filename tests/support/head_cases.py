"""The LM head's test case: final hidden states, an output weight and labels of distinct sizes,
each rank's share of them, and the output layer as GLMModel runs it without
``train.loss_chunk_tokens`` (tests/test_fused_loss.py, tests/test_head.py)."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel

S, B, D, V = 38, 2, 24, 50  # CP-rank tokens, batch, hidden, vocabulary: distinct sizes
CHUNKS = (5, 19, 76, 200)  # rows are S * B = 76: does not divide, divides, one chunk, larger


def inputs():
    """(hidden [S, B, D], weight [V, D], labels [S, B], loss mask [S, B]), the same on every rank."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(S, B, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) / D ** 0.5 * 3  # peaked softmaxes: max matters
    labels = torch.randint(0, V, (S, B), generator=gen)
    mask = (torch.rand(S, B, generator=gen) > 0.3).float()  # ignored tokens: zero gradient
    return hidden, weight, labels, mask


def rank_leaves(hidden, weight, rank: int, world: int, sp: bool):
    """This TP rank's hidden rows (its SP shard under ``sp``, else all) and vocabulary shard of
    the weight, as fresh leaves that collect gradients."""
    v = V // world
    rows = slice(rank * S // world, (rank + 1) * S // world) if sp else slice(None)
    return (hidden[rows].clone().requires_grad_(),
            weight[rank * v:(rank + 1) * v].clone().requires_grad_())


def output_logits(hidden, weight, group, sp):
    """The output layer as GLMModel runs it without the setting: its input mapping (SP gather,
    else the TP copy) and the matmul, [S, B, V/tp]."""
    if sp and group.size() > 1:
        full = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=group)
    else:
        full = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=group)
    return torch.matmul(full, weight.t())
