"""The embedding, the final norm, the output layer and the loss: what they keep, tensor by tensor,
and the loss's working set (the logits, or one chunk of them under ``train.loss_chunk_tokens``)."""

from __future__ import annotations

from ..config import Recipe
from .rows import act_bytes, rows_of


HEAD_LABEL = "embedding + head + loss"
"""The plan's row of what the embedding, final norm, output layer and loss keep."""


def head_tensor_bytes(recipe: Recipe) -> list[int]:
    """Embedding, final norm, output layer and loss, one entry per tensor kept: the token ids
    (int64), the final norm (fp32 input copy, rsqrt, normalised rows), the output layer's input
    [s, D], and the loss's per-token tensors (``loss_kept_bytes_per_token``)."""
    m, w, r = recipe.model, act_bytes(recipe), rows_of(recipe)
    D = m.hidden_size
    norm = [r.sp * D * 4, r.sp * 4, r.sp * D * w]
    return [*embedding_tensor_bytes(recipe), *norm, r.sp * D * w,
            *(r.cp * n for n in loss_kept_bytes_per_token(recipe))]


def embedding_tensor_bytes(recipe: Recipe) -> list[int]:
    """What the embedding keeps: the rank's token ids (int64)."""
    return [rows_of(recipe).cp * 8]


def head_activation_bytes(recipe: Recipe) -> int:
    """What the embedding, final norm, output layer and loss keep (``head_tensor_bytes``)."""
    return sum(head_tensor_bytes(recipe))


def loss_kept_bytes_per_token(recipe: Recipe) -> list[int]:
    """What the loss keeps per token of the CP rank, one entry per tensor. Unfused (megatron's
    vocab-parallel cross entropy): the fp32 softmax over the vocabulary shard [V/tp], the target
    mask (bool) and the masked target (int64). ``train.loss_chunk_tokens``
    (model/fused_loss.py): the labels (int64) and the all-reduced fp32 row max and sum of exp."""
    if recipe.train.loss_chunk_tokens is not None:
        return [8, 4, 4]
    return [recipe.model.vocab_size // recipe.parallel.tp * 4, 1, 8]


def loss_working_bytes(recipe: Recipe) -> tuple[str, int]:
    """The loss phase's working set on top of what is kept, with its label.

    Unfused: the logits [S, V/tp] in the activation dtype (before their fp32 copy in forward,
    their gradient in backward). ``train.loss_chunk_tokens`` = c (model/fused_loss.py's
    backward, its largest point): the gathered hidden rows [S, D] (under SP with tp > 1; else
    the kept input itself) and their gradient [S, D] in the activation dtype, the fp32 weight
    gradient accumulator and one chunk's product [V/tp, D] (in the activation dtype), and one
    chunk's logits [c, V/tp]: fp32, with the matmul's output in the activation dtype (bf16)
    alive at the fp32 copy, or the gradient cast to it after (fp32 needs neither)."""
    m, p, w, r = recipe.model, recipe.parallel, act_bytes(recipe), rows_of(recipe)
    shard = m.vocab_size // p.tp
    chunk = recipe.train.loss_chunk_tokens
    if chunk is None:
        return "bf16 logits", r.cp * shard * w
    gathered = r.cp * m.hidden_size * w if p.sequence_parallel and p.tp > 1 else 0
    rows = gathered + r.cp * m.hidden_size * w
    weight = shard * m.hidden_size * (4 + w)
    logits = min(chunk, r.cp) * shard * (4 + (w if w != 4 else 0))
    return f"fused loss chunk of {chunk}", rows + weight + logits
