"""A packed row (``train.data.packing`` builds them) and how it is cut over the mesh: each
(CP rank, TP rank)'s rows in the recipe's CP layout (``cp_layout``), and the positions its
hidden states hold under sequence parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cp_layout import LayoutName, layout_kind, rank_rows


@dataclass(frozen=True)
class PackedRow:
    """One THD row of exactly seq_len tokens in natural order.

    ``labels[i]`` is the next token of the same document; ``loss_mask`` is 0 on each document's
    last token and on all padding (whose tokens and labels are ``pad_id``). ``cu_seqlens`` [n+1]
    int32 are the padded boundaries the CP layout and the kernels use (the tail padding, when
    there is one, is the last sequence); ``cu_seqlens_unpadded`` are the cumulative real (unpadded)
    lengths of the same sequences, the tail counting 0 (Megatron's ``cu_seqlens_q`` beside
    ``cu_seqlens_q_padded``); ``position_ids`` restart at 0 in every sequence.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_unpadded: torch.Tensor

    @property
    def num_documents(self) -> int:
        return int((self.cu_seqlens_unpadded.diff() > 0).sum())


@dataclass(frozen=True)
class RankShard:
    """One rank's part of a row.

    ``tokens``/``labels``/``loss_mask``/``position_ids`` are this CP rank's rows in Megatron's CP
    layout: what the model takes, identical on every TP rank (under SP the embedding scatters its
    output over TP itself, and the loss runs on the TP-gathered rows). ``hidden_positions`` are the
    natural positions of the rows this rank's hidden states hold inside the layers: the CP rows,
    then this TP rank's contiguous SP slice (``cp_layout.rank_rows``). ``cu_seqlens`` are the
    global natural boundaries that PackedSeqParams carries.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    positions: torch.Tensor
    hidden_positions: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_unpadded: torch.Tensor


def shard_for_rank(row: PackedRow, cp: int, cp_rank: int, tp: int = 1, tp_rank: int = 0,
                   sequence_parallel: bool = False, layout: LayoutName = "zigzag") -> RankShard:
    """This (cp_rank, tp_rank)'s part of ``row`` in the layout ``cp_layout.LAYOUTS[layout]``."""
    layout_kind(layout)  # an unknown name is refused before the ranks are checked
    if not (0 <= cp_rank < cp and 0 <= tp_rank < tp):
        raise ValueError(f"rank (cp_rank={cp_rank}, tp_rank={tp_rank}) outside cp={cp}, tp={tp}")
    positions = rank_rows(row.cu_seqlens, cp, tp, cp_rank, tp_rank, False, layout)
    hidden = rank_rows(row.cu_seqlens, cp, tp, cp_rank, tp_rank, sequence_parallel, layout)
    return RankShard(row.tokens[positions], row.labels[positions], row.loss_mask[positions],
                     row.position_ids[positions], positions, hidden, row.cu_seqlens,
                     row.cu_seqlens_unpadded)
