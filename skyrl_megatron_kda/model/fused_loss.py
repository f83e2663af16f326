"""Output layer + vocab-parallel cross entropy in token chunks, never forming the whole logits.

Why our own: megatron-core 0.19.2 has no fused linear cross entropy (its fused
vocab-parallel cross entropy still takes the full logits), and Liger-Kernel's and Apple's
cut-cross-entropy's fused versions are Triton kernels over the whole vocabulary on one device:
neither is vocab-parallel over TP nor runs on CPU, where the tests run. This is a torch
``autograd.Function`` with megatron's arithmetic, chunk by chunk.

Per chunk of ``chunk`` token rows of the (TP-gathered under SP) final hidden states:

- forward: logits ``[chunk, V/tp]`` = ``h @ W.T`` in the activation dtype, then fp32 (as the
  output layer + ``logits.float()``); the row max, all-reduced (MAX) over TP; the shifted
  target logit (0 off this rank's shard) and the sum of ``exp``, all-reduced (SUM) over TP;
  loss = ``log(sum_exp) - target``: megatron's ``vocab_parallel_cross_entropy`` step by step.
- backward: the chunk's logits again, softmax from the kept max and sum (bit for bit
  megatron's), minus the one-hot target, times the loss gradient; then the hidden-state
  gradient of the chunk and the weight gradient (accumulated in fp32 over chunks).

Kept for backward: the rank's hidden rows as given (the SP shard under SP: gathered again in
backward, as megatron's SP linear does), the labels and two fp32 numbers per token (max, sum of
exp): no ``[tokens, vocab]`` tensor. The hidden-state gradient is reduce-scattered over TP under
SP, all-reduced without SP (what the output layer's input mapping does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.utils import VocabUtility


def _gather_rows(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The CP rank's rows from this TP rank's SP shard (first dim); as is without SP."""
    world = dist.get_world_size(group)
    if not sequence_parallel or world == 1:
        return x
    out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_rows(grad: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Sum the hidden-state gradient over the vocabulary shards: reduce-scatter to the SP shard
    under SP, all-reduce without."""
    world = dist.get_world_size(group)
    if world == 1:
        return grad
    if not sequence_parallel:
        dist.all_reduce(grad, group=group)
        return grad
    out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
    return out


def _target_columns(labels: torch.Tensor, vocab_shard: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each label in this rank's vocabulary shard, 0 where off the shard; mask of the
    labels off the shard), as megatron's ``calculate_predicted_logits``."""
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        vocab_shard, dist.get_rank(group), dist.get_world_size(group))
    off = (labels < start) | (labels >= end)
    return (labels - start).masked_fill(off, 0), off


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits [rows, V/tp] of hidden rows: the matmul in the activation dtype, as the
    output layer computes them, then fp32 as the loss reads them, divided by the sampling
    temperature (the RL path's ``logits / temperature``)."""
    logits = torch.matmul(h, weight.t()).float()
    return logits if temperature == 1.0 else logits / temperature


class _ChunkedLinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, group, sequence_parallel, temperature, entropy):
        full = _gather_rows(hidden, group, sequence_parallel).flatten(0, -2)  # [N, D]
        flat = labels.reshape(-1)
        if full.shape[0] != flat.numel():
            raise ValueError(f"{full.shape[0]} hidden rows after the SP gather, {flat.numel()} labels")
        cols, off = _target_columns(flat, weight.shape[0], group)
        n = flat.numel()
        row_max = torch.empty(n, dtype=torch.float32, device=full.device)
        sum_exp = torch.empty_like(row_max)
        loss = torch.empty_like(row_max)
        # sum of exp(z) * z over the vocabulary (z: the max-shifted logits), for the entropy
        weighted = torch.empty_like(row_max) if entropy else row_max.new_empty(0)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            logits = _chunk_logits(full[lo:hi], weight, temperature)
            m = logits.max(dim=-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            logits -= m[:, None]
            target = logits[torch.arange(hi - lo, device=logits.device), cols[lo:hi]]
            target.masked_fill_(off[lo:hi], 0.0)
            # One all-reduce for all sums, as megatron's fused variant concatenates them.
            if entropy:
                exp = logits.exp()
                sums = torch.cat((target, exp.sum(dim=-1), (exp * logits).sum(dim=-1)))
            else:
                sums = torch.cat((target, logits.exp_().sum(dim=-1)))
            dist.all_reduce(sums, group=group)
            target, s, *w = sums.split(hi - lo)
            row_max[lo:hi], sum_exp[lo:hi] = m, s
            loss[lo:hi] = torch.log(s) - target
            if entropy:
                weighted[lo:hi] = w[0]
        ctx.save_for_backward(hidden, weight, flat, row_max, sum_exp, *([weighted] if entropy else []))
        ctx.chunk, ctx.group, ctx.sequence_parallel = chunk, group, sequence_parallel
        ctx.temperature = temperature
        ent = torch.log(sum_exp) - weighted / sum_exp if entropy else weighted
        return loss.view(labels.shape), ent.view(labels.shape if entropy else (0,))

    @staticmethod
    def backward(ctx, grad_loss, grad_entropy):
        hidden, weight, flat, row_max, sum_exp, *weighted = ctx.saved_tensors
        group, sp = ctx.group, ctx.sequence_parallel
        full = _gather_rows(hidden, group, sp).flatten(0, -2)
        cols, off = _target_columns(flat, weight.shape[0], group)
        grad_loss = grad_loss.reshape(-1).float()
        with_entropy = grad_entropy is not None and bool(weighted)
        if with_entropy:
            grad_entropy = grad_entropy.reshape(-1).float()
            mean_z = weighted[0] / sum_exp  # sum p z over the vocabulary
        grad_full = torch.empty_like(full)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        n = flat.numel()
        for lo in range(0, n, ctx.chunk):
            hi = min(lo + ctx.chunk, n)
            h = full[lo:hi]
            z = _chunk_logits(h, weight, ctx.temperature)
            z -= row_max[lo:hi, None]
            # In place unless the entropy's gradient still needs z.
            probs = (z.exp() if with_entropy else z.exp_()).div_(sum_exp[lo:hi, None])
            rows = torch.arange(hi - lo, device=probs.device)
            grad = probs.clone() if with_entropy else probs
            grad[rows, cols[lo:hi]] -= 1.0 - off[lo:hi].float()
            grad.mul_(grad_loss[lo:hi, None])
            if with_entropy:
                # d entropy / d z_j = p_j * (sum p z - z_j)
                grad += probs * (mean_z[lo:hi, None] - z) * grad_entropy[lo:hi, None]
            if ctx.temperature != 1.0:
                grad /= ctx.temperature
            g = grad.to(h.dtype)  # the logits' gradient reaches the output layer in its dtype
            grad_full[lo:hi] = torch.matmul(g, weight)
            grad_weight += torch.matmul(g.t(), h)
        grad_hidden = _reduce_rows(grad_full.view(-1, *hidden.shape[1:]), group, sp)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 *, chunk: int, tp_group, sequence_parallel: bool,
                                 temperature: float = 1.0, entropy: bool = False
                                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 loss [S, b] of ``vocab_parallel_cross_entropy(hidden @ weight.T /
    temperature, labels)`` without the ``[S, b, V/tp]`` logits; with ``entropy`` also the
    entropy [S, b] of each token's softmax (the RL path's), differentiable as well.

    ``hidden`` [s, b, D]: this rank's final hidden states (its SP shard of the CP rank's S rows
    when ``sequence_parallel``, else all S); ``weight`` [V/tp, D]: this TP rank's vocabulary
    shard of the output layer; ``labels`` [S, b] int64 (every TP rank the same); ``chunk``: token
    rows per step (the last step takes the rest)."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if hidden.dim() != 3 or labels.dim() != 2:
        raise ValueError(f"hidden must be [s, b, D] and labels [S, b], got {tuple(hidden.shape)} "
                         f"and {tuple(labels.shape)}")
    loss, ent = _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk, tp_group,
                                                 sequence_parallel, float(temperature), entropy)
    return (loss, ent) if entropy else loss
