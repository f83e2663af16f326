"""The LM head's per-token log-probs and entropies, two ways: whole logits and token chunks.

Both take this TP rank's vocabulary shard and return, per token, ``log p(label)`` under
``softmax(logits / temperature)`` over the whole vocabulary (fp32) and, on request, that
distribution's entropy:

- ``logprobs_from_logits`` is the reference: the output layer's logits [S, b, V/tp], megatron's
  ``vocab_parallel_cross_entropy`` (its negative is the log-prob) and ``vocab_parallel_entropy``
  below. It keeps the fp32 softmax [S, b, V/tp] for backward.
- ``chunked_logprobs`` is the fast path: model/fused_loss.py's chunked output layer + cross
  entropy, never forming the [S, b, V/tp] logits (``train.loss_chunk_tokens``).

``GLMModel.token_logprobs`` picks one (the recipe's setting) and tests/test_head.py holds the
fast path to the reference: values, entropy and both gradients, at TP1 and TP2.

``entropy_grad`` says whether the entropy is differentiable: the RL loss backpropagates it only
with an entropy bonus (SkyRL's ``use_entropy_loss``); otherwise it is a metric, and without its
graph the reference keeps no second copy of the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)

from .fused_loss import chunked_linear_cross_entropy


def vocab_parallel_entropy(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """Entropy [...] of softmax(logits) from this TP rank's vocabulary shard ``logits`` [..., V/tp].

    ``H = log Z - sum p z`` with ``Z`` and ``sum e^z z`` summed over TP by megatron's
    ``reduce_from_tensor_model_parallel_region`` (backward: identity, right for a loss replicated
    on every TP rank); the max shift is a detached all-reduce (the entropy does not depend on it)."""
    shift = logits.detach().max(dim=-1).values
    if tp_group.size() > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    z = logits - shift[..., None]
    e = z.exp()
    total = reduce_from_tensor_model_parallel_region(e.sum(dim=-1), tp_group)
    weighted = reduce_from_tensor_model_parallel_region((e * z).sum(dim=-1), tp_group)
    return total.log() - weighted / total


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, tp_group, *,
                         temperature: float = 1.0, entropy: bool = False,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [S, b], entropy [S, b] or None) from the output layer's ``logits`` [S, b, V/tp]
    and ``labels`` [S, b] (every TP rank the same). The reference: whole fp32 logits.

    fp32 ``logits`` at temperature 1 are shifted in place (megatron's cross entropy does so to
    its input): the model reads them no more, and a copy would double the head's memory."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = vocab_parallel_entropy(z, tp_group)
        if ent.requires_grad:
            z = z.clone()  # the entropy's graph keeps them, and the cross entropy shifts in place
    return -vocab_parallel_cross_entropy(z, labels, tp_group=tp_group), ent


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                     chunk: int, tp_group, sequence_parallel: bool, temperature: float = 1.0,
                     entropy: bool = False, entropy_grad: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same from the final hidden states ``hidden`` [s, b, D] (the SP shard under
    ``sequence_parallel``) and this rank's output weight shard ``weight`` [V/tp, D], ``chunk``
    token rows at a time (model/fused_loss.py, which checks the temperature). The fast path."""
    out = chunked_linear_cross_entropy(hidden, weight, labels, chunk=chunk, tp_group=tp_group,
                                       sequence_parallel=sequence_parallel,
                                       temperature=temperature, entropy=entropy)
    loss, ent = out if entropy else (out, None)
    if ent is not None and not (entropy_grad and torch.is_grad_enabled()):
        ent = ent.detach()  # backward then skips the entropy's term, as without its graph
    return -loss, ent
