"""The endless stream of packed rows over repeated passes of a source: a seeded shuffle buffer,
greedy order-preserving packing, and a state small enough at 1M-token documents (positions and
references) from which a resumed loader yields exactly the rows an uninterrupted one would."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

import torch

from ...distributed.rank_split import PackedRow
from .packing import pack_row, padded_length
from .records import Document, Ref
from .sources import Source
from .stats import DataStats

logger = logging.getLogger(__name__)


STATE_VERSION = 1


def _rng_for_epoch(seed: int, epoch: int) -> random.Random:
    """A fresh shuffle RNG per pass, so pass k's order does not depend on how pass k-1 ended."""
    return random.Random(f"shuffle:{seed}:{epoch}")


def _rng_to_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from_state(state: list) -> random.Random:
    rng = random.Random()
    rng.setstate((state[0], tuple(state[1]), state[2]))
    return rng


class PackedLoader:
    """Endless stream of PackedRows over repeated passes of a source.

    Order: documents enter a shuffle buffer of ``shuffle_buffer`` documents; once it is full (or
    the pass has ended) a seeded draw takes one out; documents fill rows greedily in that order,
    and the first that does not fit closes the row and opens the next. Packing runs on across
    passes. ``state_dict()`` between rows is enough to resume exactly.
    """

    def __init__(self, source: Source, *, seq_len: int, pad_multiple: int = 1,
                 shuffle_buffer: int = 1024, seed: int = 0, pad_id: int = 0):
        if seq_len % pad_multiple:
            raise ValueError(f"seq_len={seq_len} must divide by pad_multiple={pad_multiple}: the "
                             "tail padding sequence must meet the CP layout too")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer={shuffle_buffer} must be >= 1")
        self.source, self.seq_len, self.pad_multiple = source, seq_len, pad_multiple
        self.shuffle_buffer, self.seed, self.pad_id = shuffle_buffer, seed, pad_id
        self.stats = DataStats()
        self._epoch = 0
        self._epoch_documents = 0  # documents read in this pass: a pass with none is an error
        self._position = source.start()
        self._exhausted = False
        self._buffer: list[Document] = []
        self._carry: Document | None = None
        self._rng = _rng_for_epoch(seed, 0)
        self._reader: Iterator[tuple[Document, Ref]] | None = None

    def __iter__(self) -> Iterator[PackedRow]:
        while True:
            yield self.next_row()

    def next_row(self) -> PackedRow:
        """The next row: greedy, order-preserving packing of the shuffled documents."""
        docs: list[torch.Tensor] = []
        used = 0
        while used < self.seq_len:
            doc = self._carry if self._carry is not None else self._next_document()
            self._carry = None
            need = padded_length(len(doc.tokens), self.pad_multiple)
            if used + need > self.seq_len:
                self._carry = doc
                break
            docs.append(doc.tokens)
            used += need
        row = pack_row(docs, self.seq_len, self.pad_multiple, self.pad_id)
        self._count_row(docs)
        return row

    def _count_row(self, docs: list[torch.Tensor]) -> None:
        real = sum(len(d) for d in docs)
        self.stats.rows += 1
        self.stats.documents += len(docs)
        self.stats.document_tokens += real
        self.stats.padding_tokens += self.seq_len - real

    def _next_document(self) -> Document:
        """One document out of the shuffle buffer, refilling it and starting new passes as needed."""
        self._fill_buffer()
        if not self._buffer:
            self._end_epoch()
            self._fill_buffer()
        j = self._rng.randrange(len(self._buffer))
        doc = self._buffer[j]
        self._buffer[j] = self._buffer[-1]
        self._buffer.pop()
        return doc

    def _fill_buffer(self) -> None:
        while len(self._buffer) < self.shuffle_buffer and not self._exhausted:
            if self._reader is None:
                self._reader = self.source.read(self._position, self.stats)
            item = next(self._reader, None)
            if item is None:
                self._exhausted, self._reader = True, None
                break
            doc, self._position = item
            self._buffer.append(doc)
            self._epoch_documents += 1

    def _end_epoch(self) -> None:
        if self._epoch_documents == 0:
            raise ValueError("a full pass over the data gave no usable documents; "
                             f"{self.stats.summary()}")
        self.stats.epochs_completed += 1
        log = logger.warning if self.stats.total_skipped else logger.info
        log("end of pass %d: %s", self._epoch, self.stats.summary())
        self._epoch += 1
        self._epoch_documents = 0
        self._position, self._exhausted = self.source.start(), False
        self._rng = _rng_for_epoch(self.seed, self._epoch)

    def state_dict(self) -> dict:
        """Position between rows: references (not tokens) of the buffered and carried documents,
        the read position, the shuffle RNG and the counts. Plain Python types only."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "pad_multiple": self.pad_multiple,
            "epoch": self._epoch,
            "epoch_documents": self._epoch_documents,
            "position": list(self._position),
            "exhausted": self._exhausted,
            "buffer": [list(d.ref) for d in self._buffer],
            "carry": None if self._carry is None else list(self._carry.ref),
            "rng": _rng_to_state(self._rng),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``: re-reads the buffered documents by reference."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')} != {STATE_VERSION}")
        for key in ("seed", "seq_len", "pad_multiple"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data loader state has {key}={state[key]} but this loader has "
                                 f"{getattr(self, key)}: the rows would differ from the saved run")
        self._epoch, self._epoch_documents = state["epoch"], state["epoch_documents"]
        self._position, self._exhausted = tuple(state["position"]), state["exhausted"]
        self._buffer = [self.source.fetch(tuple(ref)) for ref in state["buffer"]]
        self._carry = None if state["carry"] is None else self.source.fetch(tuple(state["carry"]))
        self._rng = _rng_from_state(state["rng"])
        self.stats = DataStats.from_state_dict(state["stats"])
        self._reader = None


def continue_loader(loader: PackedLoader, saved: dict) -> PackedLoader:
    """``loader`` continuing the saved data stream ``saved`` (a ``state_dict``), or a copy of it
    that can. Rows are packed with the saved run's padding multiple (a CP2 run pads documents to 4
    tokens, CP1 to 1), so a run on another mesh keeps that multiple when it is a multiple of its
    own, and reads exactly the rows the saved run would have."""
    if saved["pad_multiple"] != loader.pad_multiple:
        if saved["pad_multiple"] % loader.pad_multiple:
            raise ValueError(
                f"the checkpoint's rows pad documents to multiples of {saved['pad_multiple']} "
                f"tokens, which this mesh's CP layout cannot split (it needs multiples of "
                f"{loader.pad_multiple}); resume on a mesh whose CP layout divides it")
        loader = PackedLoader(loader.source, seq_len=loader.seq_len,
                              pad_multiple=saved["pad_multiple"],
                              shuffle_buffer=loader.shuffle_buffer, seed=loader.seed,
                              pad_id=loader.pad_id)
    loader.load_state_dict(saved)
    return loader
