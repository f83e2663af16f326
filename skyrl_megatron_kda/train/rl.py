"""RL steps on external batches: per-token log-probs of padded rollout rows, a policy-loss
backward, and the optimizer step on its own (what SkyRL's policy worker calls).

``RankTrainer.train_step`` runs its own loader's rows with a cross-entropy loss in one call; an RL
loop instead hands every rank the same padded batch ``sequences`` [B, S] / ``attention_mask``
[B, S] (prompts left-padded, responses right-padded) and a loss over the log-probs, and steps the
optimizer separately. The path here, per micro-batch:

1. ``pack_rollout``: the real tokens of each row become one document of a packed THD row
   (``data.pack_row``, padded for the recipe's CP layout), with the map back to [B, S].
2. ``token_logprobs``: the model's head on this rank's shard (``RankModel.token_logprobs``: CP,
   and SP inside the layers), ``log p`` under softmax(logits / temperature) over the TP
   vocabulary shards and, on request, the entropy; the model computes them as the fine-tune loss
   (``GLMModel.token_logprobs``: in token chunks under ``train.loss_chunk_tokens``, so an RL step
   fits where the fine-tune does). ``GatherCP`` all-gathers the CP shards into natural token
   order and scatters them back into the batch's [B, S] layout.
3. The caller's loss (a function of the [B, S] log-probs, the same on every TP and CP rank) is
   backpropagated as a *sum*: ``GatherCP`` hands each CP rank the gradient of its own rows only,
   megatron's DDP (built with ``calculate_per_token_loss``) sums parameter gradients over DP x CP,
   and ``RankTrainer.finalize_grads`` without a token count does not rescale them.

Row ``b``'s value at column ``t`` is ``log p(sequences[b, t] | real tokens of row b before t)``;
columns whose token is padding or the row's first real token are 0 (no prediction exists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed.cp_layout import LAYOUTS
from .data.packing import PackedRow, pack_row, pad_multiple, padded_length, row_multiple


@dataclass(frozen=True)
class PackedRollout:
    """A padded batch laid out as one packed row, with where each prediction goes back.

    ``row.labels[src[i]]`` is the token at ``(dst_row[i], dst_col[i])`` of the batch, predicted
    from the packed position ``src[i]``."""

    row: PackedRow
    src: torch.Tensor
    dst_row: torch.Tensor
    dst_col: torch.Tensor
    shape: tuple[int, int]


def pack_rollout(sequences: torch.Tensor, attention_mask: torch.Tensor, parallel,
                 layout: str = "zigzag", pad_id: int = 0) -> PackedRollout:
    """``sequences`` / ``attention_mask`` [B, S] (1 = real token, anywhere in the row) -> one
    packed row whose length meets ``data.row_multiple`` for ``parallel`` and ``layout``."""
    if sequences.dim() != 2 or sequences.shape != attention_mask.shape:
        raise ValueError(f"sequences {tuple(sequences.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be [batch, seq_len]")
    sequences, real = sequences.cpu().long(), attention_mask.cpu().bool()
    lengths = real.sum(dim=1)
    if int(lengths.min()) < 1:
        empty = int((lengths < 1).nonzero()[0])
        raise ValueError(f"row {empty} of the batch has no real token (attention_mask all 0)")
    multiple = pad_multiple(parallel, layout)
    docs, src, dst_row, dst_col, start = [], [], [], [], 0
    for b in range(sequences.shape[0]):
        cols = real[b].nonzero().squeeze(1)
        docs.append(sequences[b, cols])
        # Packed position start + j predicts the row's real token j + 1 (pack_row's labels).
        src.append(torch.arange(start, start + len(cols) - 1))
        dst_row.append(torch.full((len(cols) - 1,), b))
        dst_col.append(cols[1:])
        start += padded_length(len(cols), multiple)
    seq_len = padded_length(start, row_multiple(parallel, layout))
    row = pack_row(docs, seq_len, multiple, pad_id)
    return PackedRollout(row, torch.cat(src), torch.cat(dst_row), torch.cat(dst_col),
                         tuple(sequences.shape))


class GatherCP(torch.autograd.Function):
    """All-gather per-token values of every CP rank into natural order [seq_len].

    Every CP rank then computes the same loss from the same full tensor, so the backward takes
    this rank's rows of the incoming gradient as they are (no reduction: summing over the CP
    group would count the replicated loss ``cp`` times)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, positions: list[torch.Tensor], rank: int, group):
        ctx.mine = positions[rank]
        full = local.new_zeros(sum(p.numel() for p in positions))
        if len(positions) == 1:
            full[ctx.mine] = local
            return full
        parts = [torch.empty_like(local) for _ in positions]
        dist.all_gather(parts, local.contiguous(), group=group)
        for pos, part in zip(positions, parts):
            full[pos] = part
        return full

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        return grad_full[ctx.mine], None, None, None


def token_logprobs(trainer, rollout: PackedRollout, temperature: float = 1.0, *,
                   entropy: bool = False, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, S] (and the entropy [B, S] of each predicting distribution when
    ``entropy``) of ``rollout`` under ``trainer``'s model, identical on every rank of a DP
    replica. Differentiable when grad is enabled (call ``model.train()`` / ``eval()`` first)."""
    logp, ent = trainer.token_logprobs(trainer.shard(rollout.row), temperature=temperature,
                                       entropy=entropy, entropy_grad=entropy_grad)
    cp_group = trainer.pgs.cp
    p = trainer.recipe.parallel
    positions = [pos.to(logp.device) for pos in
                 LAYOUTS[trainer.recipe.parallel.cp_layout].positions(rollout.row.cu_seqlens, p.cp)]
    outputs = []
    for local in (logp, ent):
        if local is None:
            outputs.append(None)
            continue
        full = GatherCP.apply(local[0], positions, cp_group.rank(), cp_group)
        index = (rollout.dst_row.to(full.device), rollout.dst_col.to(full.device))
        outputs.append(full.new_zeros(rollout.shape).index_put(index, full[rollout.src.to(full.device)]))
    return outputs[0], outputs[1]
