"""Training data: long documents from JSONL, packed into THD rows, split over CP (and SP).

The pipeline, one way::

    source (sources.py: JSONL line by line, or synthetic) -> seeded shuffle buffer (loader.py)
      -> greedy, order-preserving packing into rows of exactly ``seq_len`` tokens (packing.py)
      -> distributed.rank_split.shard_for_rank (the CP layout of ``distributed.cp_layout``)

Records become documents in ``records.py``; bad ones raise :class:`records.BadRecord` naming
``file:line`` and the reason (policy ``stop``), or are skipped and counted per file and reason in
:class:`stats.DataStats` (policy ``skip``). ``build.py`` builds the loader of a recipe.
"""

from __future__ import annotations

from ...distributed.rank_split import PackedRow
from .build import build_loader
from .loader import PackedLoader, continue_loader

__all__ = ["PackedLoader", "PackedRow", "build_loader", "continue_loader"]
