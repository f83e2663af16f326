"""The contract every sparse-attention kernel of the DSA layer fulfils (``DSAKernel``).

The layer (``dsa.layer``) never branches on the kernel; it makes three calls:

- ``kv_inputs(latent, kv_up_weight, dims)``: what the core attention takes for the whole
  sequence's normalised KV latent [T, b, R] (the latent itself, for a kernel that attends in the
  absorbed layout; the up-projected keys and values, for one that does not);
- ``indices(indexer, qr, weights, keys, gate, layout)``: the natural token positions each query
  row attends to, [b, s, index_topk + kpool - 1], -1 = none (the indexer's selection):
  ``index_topk / kpool`` pools of ``kpool`` consecutive tokens (all -1 for a pool not chosen),
  then the query's ``kpool - 1`` tail (``kept_selection`` keeps it in that compact form);
- ``attention(core, query, key, value, kv_up_weight, indices, layout)``: [s, b, heads * dv].

The class side carries what needs no tensors: the ``name`` users choose it by, whether it can
attend by rows (``tp_split=sequence``), the rule that refuses a recipe (``refusal``: the
recipe rules and ``auto`` ask it), and the memory terms ``plan`` reads (``kept_bytes``,
``working_sets``) on a ``DSAShape``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ...config import DSAConfig
    from ..batch_rows import DSABatchRows


@dataclass(frozen=True)
class KVDims:
    """The local heads and per-head widths of the kv up projection (what ``kv_inputs`` splits)."""

    heads: int
    qk_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class DSAShape:
    """One rank's DSA layer as the memory terms see it (``memory.dsa.dsa_shape`` builds it).

    ``whole``: tokens of the sequence (T); ``cp_rows`` / ``sp_rows``: rows of the rank's CP rank
    and of the rank itself; ``rows`` queries with ``heads`` heads each are the rank's attention
    share (``model.dsa.tp_split``), ``index_rows`` its indexer's queries, ``by_rows`` whether
    the layer attends by rows (the sequence split: the share's q latent comes by all-to-all);
    ``act_bytes``: bytes of one activation value."""

    dsa: DSAConfig
    whole: int
    cp_rows: int
    sp_rows: int
    tp: int
    cp: int
    act_bytes: int
    rows: int
    heads: int
    index_rows: int
    by_rows: bool


class DSAKernel(ABC):
    """One implementation of the DSA layer's indexer selection and sparse attention. An instance
    is built once per model from the recipe's ``model.dsa`` section (its block sizes) and shared
    by every DSA layer's modules."""

    name: ClassVar[str]
    """The ``model.dsa.kernel`` value that selects it."""
    splits_rows: ClassVar[bool]
    """Whether it can attend with every head on a share of its CP rank's rows
    (``tp_split=sequence``)."""
    auto_candidate: ClassVar[bool] = True
    """Whether ``model.dsa.kernel=auto`` may pick it (first unrefused in registration order)."""
    working_set_label: ClassVar[str]
    """What dominates its transient memory (the label of ``plan``'s DSA phase)."""
    options: ClassVar[str | None] = None
    """The ``model.dsa`` section that holds its own options (``config.model.KERNEL_OPTIONS``:
    ``model.dsa.latent.*`` for the latent kernel), or None; the recipe rules refuse another
    kernel's section set while it runs."""
    rate_key: ClassVar[str | None] = None
    """The key of its measured sparse-attention rates in the step-time calibration
    (``steptime.calibration.DSA_ATTENTION_S``), or None where it has no GPU run at the rank's
    share: the step-time model then refuses to price it."""

    def __init__(self, dsa: DSAConfig):
        self.dsa = dsa

    @classmethod
    def options_of(cls, dsa: DSAConfig):
        """Its own section of ``dsa`` (``options``)."""
        if cls.options is None:
            raise ValueError(f"model.dsa.kernel={cls.name} has no options section")
        return getattr(dsa, cls.options)

    # -- what a recipe may use --------------------------------------------------------------

    @classmethod
    def refusal(cls, device: str) -> str | None:
        """Why it cannot run on ``run.device``, or None."""
        return None

    # -- the layer's calls ------------------------------------------------------------------

    @abstractmethod
    def kv_inputs(self, latent: torch.Tensor, kv_up_weight: torch.Tensor,
                  dims: KVDims) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(key, value) the core attention receives for the whole sequence's latent [T, b, R]."""

    @abstractmethod
    def indices(self, indexer, qr: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                gate: torch.Tensor, layout: DSABatchRows) -> torch.Tensor:
        """The selection of ``indexer`` (``layer.GlmKPoolIndexer``) for this rank's query rows,
        from their q latent ``qr`` (this rank's own rows; under ``tp_split=sequence`` its share,
        ``DSABatchRows.attention_rows``), the head ``weights`` of this rank's own rows and the
        whole sequence's indexer ``keys`` and pool ``gate`` [T, b, d] in natural order."""

    @abstractmethod
    def attention(self, core, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                  kv_up_weight: torch.Tensor, indices: torch.Tensor,
                  layout: DSABatchRows) -> torch.Tensor:
        """The sparse attention of ``core`` (``layer.GlmDSAttention``: its softmax scale and
        config): query [s, b, n, d] of this CP rank's rows and this TP rank's heads (under
        ``tp_split=sequence``: this rank's share of the rows and every head), with the kv
        up-projection weight of those heads -> [s, b, n * dv]."""

    # -- what plan reads --------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def kept_bytes(cls, shape: DSAShape) -> int:
        """Bytes one DSA layer keeps for backward beyond the MLA projections' own (per rank)."""

    @classmethod
    @abstractmethod
    def working_sets(cls, shape: DSAShape) -> dict[str, int]:
        """Transient bytes of each stage of one DSA layer (per rank); ``plan`` takes the largest."""
