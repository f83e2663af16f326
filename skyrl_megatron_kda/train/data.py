"""Training data: long documents from JSONL, packed into THD rows, split over CP (and SP).

The pipeline, one way::

    source (JSONL line by line, or synthetic) -> seeded shuffle buffer (documents)
      -> greedy, order-preserving packing into rows of exactly ``seq_len`` tokens
      -> shard_for_rank (Megatron's CP layout from ``distributed.cp_layout``)

Every document is padded to a multiple of ``pad_multiple`` (the CP layout cuts each packed sequence
into ``2*cp`` chunks) and the row's tail is one masked padding sequence, so ``cu_seqlens`` always
end at ``seq_len``. The loader's state holds positions and document references, never token data,
so it stays small at 1M-token documents and a resumed loader re-reads its buffer and yields exactly
the rows an uninterrupted one would.

Bad records raise :class:`BadRecord` naming ``file:line`` and the reason (policy ``stop``), or are
skipped and counted per file and reason in :class:`DataStats` (policy ``skip``), which is logged at
the end of every pass over the corpus; the trainer reports the counts in every metrics line.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch

from ..config import DataConfig, ParallelConfig
from ..distributed.cp_layout import LAYOUTS, layout_kind, rank_rows

logger = logging.getLogger(__name__)

Layout = Literal["zigzag", "contiguous"]
Policy = Literal["skip", "stop"]
Ref = tuple[int, ...]
"""Where a document can be read again: (file index, line number, byte offset) or (index,)."""

STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Bad records and counts


class BadRecord(ValueError):
    """A record that cannot become a training document; the message is ``file:line: kind: detail``."""

    def __init__(self, file: str, line: int, kind: str, detail: str):
        super().__init__(f"{file}:{line}: {kind}: {detail}")
        self.file, self.line, self.kind, self.detail = file, line, kind, detail

    def __reduce__(self):
        # Rebuilt from its four fields where it is unpickled (a Ray driver receiving a rank's
        # error): the default would call __init__ with the message alone and fail.
        return type(self), (self.file, self.line, self.kind, self.detail)


@dataclass
class DataStats:
    """What the loader did, so that nothing is dropped unseen: packed work and skips per reason."""

    documents: int = 0
    """Documents packed into rows."""
    document_tokens: int = 0
    """Tokens of those documents (before padding)."""
    padding_tokens: int = 0
    """Padding tokens in emitted rows (per-document padding and row tails)."""
    rows: int = 0
    """Rows emitted."""
    blank_lines: int = 0
    """Whitespace-only lines (not records, so not errors)."""
    epochs_completed: int = 0
    """Full passes over the corpus."""
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    """Bad records skipped under on_bad_record=skip: file -> reason (BadRecord.kind) -> count,
    over every pass so far."""

    def count_skip(self, file: str, kind: str) -> None:
        per_file = self.skipped.setdefault(file, {})
        per_file[kind] = per_file.get(kind, 0) + 1

    def skipped_by_reason(self) -> dict[str, int]:
        """Skips of all files, by reason."""
        out: dict[str, int] = {}
        for reasons in self.skipped.values():
            for kind, n in reasons.items():
                out[kind] = out.get(kind, 0) + n
        return out

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped_by_reason().values())

    def summary(self) -> str:
        """One log line with every count."""
        return (f"data: {self.epochs_completed} epochs, {self.rows} rows, {self.documents} documents, "
                f"{self.document_tokens} document tokens, {self.padding_tokens} padding tokens, "
                f"{self.blank_lines} blank lines, {skip_summary(self.skipped)}")

    def state_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in ("documents", "document_tokens", "padding_tokens",
                                                 "rows", "blank_lines", "epochs_completed")},
                "skipped": {f: dict(r) for f, r in self.skipped.items()}}

    @classmethod
    def from_state_dict(cls, state: dict) -> DataStats:
        skipped = state["skipped"]
        if any(isinstance(n, int) for n in skipped.values()):
            # Saved before skips were counted per file: keep the counts, say what is unknown.
            skipped = {UNRECORDED_FILE: skipped}
        return cls(**{**state, "skipped": {f: dict(r) for f, r in skipped.items()}})


UNRECORDED_FILE = "(file not recorded)"
"""The file of skips restored from a loader state saved when skips were counted by reason only."""


def skip_summary(skipped: dict[str, dict[str, int]]) -> str:
    """``skipped N bad records (file: reason=n, ...; file: ...)``, or ``skipped 0 bad records``:
    a file -> reason -> count mapping (``DataStats.skipped``, a metrics line's
    ``skipped_records``) in one line."""
    total = sum(n for reasons in skipped.values() for n in reasons.values())
    if not total:
        return "skipped 0 bad records"
    files = "; ".join(f"{file}: " + ", ".join(f"{k}={v}" for k, v in sorted(reasons.items()))
                      for file, reasons in sorted(skipped.items()))
    return f"skipped {total} bad records ({files})"


# ---------------------------------------------------------------------------------------------
# Records -> documents


@dataclass(frozen=True)
class Document:
    """One document's token ids (int32, to halve the buffer's memory) and where to re-read it."""

    ref: Ref
    tokens: torch.Tensor


@dataclass(frozen=True)
class RecordRules:
    """How a JSONL record becomes token ids, and the limits it must meet."""

    vocab_size: int
    max_tokens: int
    """Longest document that fits one row (data.seq_len)."""
    encode: Callable[[str], list[int]] | None = None
    """Tokenizer for "text" records; None: such records are a configuration error."""
    eos_id: int | None = None
    """Appended to every "text" document when not None."""


def list_jsonl(path: str | Path) -> list[Path]:
    """The files of ``data.path``: the file itself, or a directory's *.jsonl in name order (so the
    order, and with it every row, is the same on every machine)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.jsonl") if f.is_file())
        if not files:
            raise ValueError(f"data.path={str(p)!r} is a directory without *.jsonl files")
        return files
    if not p.is_file():
        raise ValueError(f"data.path={str(p)!r} does not exist")
    return [p]


def _decode_json(raw: bytes, file: str, line: int) -> dict:
    """Bytes of one line -> the record object. A UTF-8 byte order mark (what some Windows editors
    write) is dropped at the start of a file, where it is not part of the first record."""
    try:
        text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
    except UnicodeDecodeError as err:
        raise BadRecord(file, line, "non_utf8",
                        f"byte {raw[err.start]:#04x} at column {err.start} is not valid UTF-8") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadRecord(file, line, "invalid_json",
                        f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise BadRecord(file, line, "wrong_type",
                        f"record is a JSON {type(record).__name__}, expected an object")
    return record


def _ids_of_record(record: dict, rules: RecordRules, file: str, line: int) -> list[int]:
    """The token ids a record stands for, before the range and length checks."""
    keys = [k for k in ("text", "input_ids") if k in record]
    if len(keys) != 1:
        raise BadRecord(file, line, "wrong_type",
                        f'expected exactly one of "text" or "input_ids", got keys {sorted(record)}')
    if keys[0] == "text":
        text = record["text"]
        if not isinstance(text, str):
            raise BadRecord(file, line, "wrong_type",
                            f'"text" is a {type(text).__name__}, expected a string')
        if not text:
            raise BadRecord(file, line, "empty", '"text" is empty')
        if rules.encode is None:
            # A configuration error, not a bad record: every text record would fail the same way.
            raise ValueError(f'{file}:{line}: record carries "text" but data.tokenizer_path is not set')
        ids = list(rules.encode(text))
        if not ids:
            raise BadRecord(file, line, "empty", '"text" tokenizes to no tokens')
        return ids + [rules.eos_id] if rules.eos_id is not None else ids
    ids = record["input_ids"]
    if not isinstance(ids, list):
        raise BadRecord(file, line, "wrong_type",
                        f'"input_ids" is a {type(ids).__name__}, expected a list of ints')
    for i, x in enumerate(ids):
        if type(x) is not int:  # bool is an int subclass; true/false are not token ids
            raise BadRecord(file, line, "wrong_type",
                            f'"input_ids"[{i}] is a {type(x).__name__} ({x!r}), expected an int')
    if not ids:
        raise BadRecord(file, line, "empty", '"input_ids" is empty')
    return ids


def _checked_tokens(ids: list[int], rules: RecordRules, file: str, line: int) -> torch.Tensor:
    """Range and length checks; int32 tensor of the ids."""
    if len(ids) > rules.max_tokens:
        raise BadRecord(file, line, "too_long",
                        f"document has {len(ids)} tokens, more than one sequence "
                        f"(data.seq_len={rules.max_tokens})")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= rules.vocab_size:
        bad = next(i for i, x in enumerate(ids) if not 0 <= x < rules.vocab_size)
        raise BadRecord(file, line, "token_out_of_range",
                        f"token id {ids[bad]} at index {bad} is outside [0, {rules.vocab_size})")
    return torch.tensor(ids, dtype=torch.int32)


def parse_record(raw: bytes, rules: RecordRules, file: str, line: int) -> torch.Tensor:
    """One JSONL line -> int32 token ids, or BadRecord naming ``file:line`` and the reason."""
    record = _decode_json(raw, file, line)
    return _checked_tokens(_ids_of_record(record, rules, file, line), rules, file, line)


class Source(Protocol):
    """Where documents come from: read from a position, re-read one by reference."""

    def start(self) -> Ref: ...

    def read(self, position: Ref, stats: DataStats) -> Iterator[tuple[Document, Ref]]: ...

    def fetch(self, ref: Ref) -> Document: ...


class JsonlSource:
    """JSONL files read line by line from a (file index, line number, byte offset) position, so a
    corpus never has to fit in memory and a resumed reader seeks straight to where it was."""

    def __init__(self, files: Sequence[str | Path], rules: RecordRules, on_bad_record: Policy = "stop"):
        if on_bad_record not in ("skip", "stop"):
            raise ValueError(f"on_bad_record={on_bad_record!r}; expected 'skip' or 'stop'")
        self.files = [Path(f) for f in files]
        self.rules = rules
        self.on_bad_record = on_bad_record

    def start(self) -> Ref:
        return (0, 1, 0)

    def read(self, position: Ref, stats: DataStats) -> Iterator[tuple[Document, Ref]]:
        """Documents from ``position`` on, each with the position just after it; bad records stop
        or are counted in ``stats`` by policy."""
        file_index, line, offset = position
        for index in range(file_index, len(self.files)):
            if index != file_index:
                line, offset = 1, 0
            with open(self.files[index], "rb") as f:
                f.seek(offset)
                for raw in f:
                    ref, offset, line = (index, line, offset), offset + len(raw), line + 1
                    doc = self._document(raw, ref, stats)
                    if doc is not None:
                        yield doc, (index, line, offset)

    def fetch(self, ref: Ref) -> Document:
        """Re-read the (valid) document at ``ref``: how a resumed loader refills its buffer."""
        index, line, offset = ref
        with open(self.files[index], "rb") as f:
            f.seek(offset)
            raw = f.readline()
        return Document(ref, parse_record(raw, self.rules, str(self.files[index]), line))

    def _document(self, raw: bytes, ref: Ref, stats: DataStats) -> Document | None:
        if not raw.strip():
            stats.blank_lines += 1
            return None
        file, line = str(self.files[ref[0]]), ref[1]
        try:
            return Document(ref, parse_record(raw, self.rules, file, line))
        except BadRecord as err:
            if self.on_bad_record == "stop":
                raise
            stats.count_skip(err.file, err.kind)
            logger.debug("skipping bad record %s", err)
            return None


class SyntheticSource:
    """Seeded documents with something to learn (used when data.path is None): document ``i`` is
    a function of (seed, i) alone, with log-uniform lengths in [1, max_tokens] so rows mix short
    and long ones. Each repeats a random motif of 2-8 tokens drawn from a small alphabet, so a
    model can learn the alphabet and to copy the motif: the loss of a working trainer falls
    (uniform random tokens would pin it at ln(vocab))."""

    ALPHABET = 16

    def __init__(self, *, vocab_size: int, max_tokens: int, num_documents: int = 1024, seed: int = 0):
        self.vocab_size, self.max_tokens = vocab_size, max_tokens
        self.num_documents, self.seed = num_documents, seed

    def start(self) -> Ref:
        return (0,)

    def read(self, position: Ref, stats: DataStats) -> Iterator[tuple[Document, Ref]]:
        for i in range(position[0], self.num_documents):
            yield self.fetch((i,)), (i + 1,)

    def fetch(self, ref: Ref) -> Document:
        i = ref[0]
        rng = random.Random(f"synthetic:{self.seed}:{i}")
        length = min(self.max_tokens, int(math.exp(rng.uniform(0.0, math.log(self.max_tokens)))))
        gen = torch.Generator().manual_seed(rng.getrandbits(63))
        alphabet = min(self.ALPHABET, self.vocab_size)
        motif = torch.randint(0, alphabet, (rng.randint(2, 8),), generator=gen, dtype=torch.int32)
        length = max(length, 1)
        return Document(ref, motif.repeat(-(-length // motif.numel()))[:length])


# ---------------------------------------------------------------------------------------------
# Packing


def pad_multiple(parallel: ParallelConfig, layout: Layout = "zigzag") -> int:
    """What every packed sequence's length must divide by, as the layout kind says: the zigzag
    layout cuts each sequence into 2*cp chunks; the contiguous one cuts the row anywhere."""
    return layout_kind(layout).sequence_multiple(parallel.cp)


def row_multiple(parallel: ParallelConfig, layout: Layout = "zigzag") -> int:
    """What ``seq_len`` must divide by: the per-sequence multiple (the tail padding sequence is one
    too), and, under SP, each CP rank's rows must split evenly over the TP group."""
    sp_ranks = parallel.cp * (parallel.tp if parallel.sequence_parallel else 1)
    return math.lcm(pad_multiple(parallel, layout), sp_ranks)


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


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


def pack_row(docs: Sequence[torch.Tensor], seq_len: int, multiple: int, pad_id: int = 0) -> PackedRow:
    """Lay ``docs`` (which must fit once padded) one after the other into a row of ``seq_len``."""
    tokens = torch.full((seq_len,), pad_id, dtype=torch.long)
    labels = torch.full((seq_len,), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(seq_len, dtype=torch.float32)
    position_ids = torch.zeros(seq_len, dtype=torch.long)
    bounds, real_lengths, start = [0], [0], 0
    for doc in docs:
        n, padded = len(doc), padded_length(len(doc), multiple)
        if start + padded > seq_len:
            raise ValueError(f"documents need more than seq_len={seq_len} tokens once padded")
        tokens[start:start + n] = doc
        labels[start:start + n - 1] = doc[1:]
        loss_mask[start:start + n - 1] = 1.0
        position_ids[start:start + padded] = torch.arange(padded)
        real_lengths.append(n)
        start += padded
        bounds.append(start)
    if start < seq_len:  # the tail: one masked padding sequence
        position_ids[start:] = torch.arange(seq_len - start)
        real_lengths.append(0)
        bounds.append(seq_len)
    return PackedRow(tokens, labels, loss_mask, position_ids, torch.tensor(bounds, dtype=torch.int32),
                     torch.tensor(real_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# CP / SP split


@dataclass(frozen=True)
class RankShard:
    """One rank's part of a row.

    ``tokens``/``labels``/``loss_mask``/``position_ids`` are this CP rank's rows in Megatron's CP
    layout: what the model takes, identical on every TP rank (under SP the embedding scatters its
    output over TP itself, and the loss runs on the TP-gathered rows). ``hidden_positions`` are the
    natural positions of the rows this rank's hidden states hold inside the layers: the CP rows,
    then this TP rank's contiguous SP slice (``distributed.cp_layout.rank_rows``). ``cu_seqlens`` are the
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
                   sequence_parallel: bool = False, layout: Layout = "zigzag") -> RankShard:
    """This (cp_rank, tp_rank)'s part of ``row`` in the layout ``distributed.cp_layout.LAYOUTS[layout]``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CP layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    if not (0 <= cp_rank < cp and 0 <= tp_rank < tp):
        raise ValueError(f"rank (cp_rank={cp_rank}, tp_rank={tp_rank}) outside cp={cp}, tp={tp}")
    positions = rank_rows(row.cu_seqlens, cp, tp, cp_rank, tp_rank, False, layout)
    hidden = rank_rows(row.cu_seqlens, cp, tp, cp_rank, tp_rank, sequence_parallel, layout)
    return RankShard(row.tokens[positions], row.labels[positions], row.loss_mask[positions],
                     row.position_ids[positions], positions, hidden, row.cu_seqlens,
                     row.cu_seqlens_unpadded)


# ---------------------------------------------------------------------------------------------
# The loader


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
    and the first that no longer fits closes the row and opens the next. Packing runs on across
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


# ---------------------------------------------------------------------------------------------
# From the config


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a local directory only (nothing is downloaded)."""
    from transformers import AutoTokenizer  # heavy import, only when text records need it

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """Text -> ids without BOS or other special tokens (documents are raw text; EOS is a policy)."""
    def encode(text: str) -> list[int]:
        # verbose=False: 1M-token documents exceed model_max_length by design.
        return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return encode


def _record_rules(data: DataConfig, vocab_size: int | None) -> RecordRules:
    """Tokenizer, EOS and vocabulary bound for the JSONL records."""
    encode: Callable[[str], list[int]] | None = None
    eos_id: int | None = None
    if data.tokenizer_path is not None:
        tokenizer = load_tokenizer(data.tokenizer_path)
        encode = _text_encoder(tokenizer)
        if data.append_eos:
            if tokenizer.eos_token_id is None:
                raise ValueError(f"data.append_eos=true but the tokenizer at {data.tokenizer_path!r} "
                                 "has no EOS token; set data.append_eos=false")
            eos_id = tokenizer.eos_token_id
        vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if vocab_size is None:
        raise ValueError("vocab_size is needed to check input_ids: pass the model's vocabulary size "
                         "or set data.tokenizer_path")
    return RecordRules(vocab_size=vocab_size, max_tokens=data.seq_len, encode=encode, eos_id=eos_id)


def build_loader(data: DataConfig, *, seed: int, parallel: ParallelConfig | None = None,
                 layout: Layout = "zigzag", vocab_size: int | None = None, pad_id: int = 0,
                 synthetic_documents: int = 1024) -> PackedLoader:
    """The loader for ``data``: JSONL at data.path, or synthetic documents when it is None.

    ``vocab_size`` bounds token ids (default: the tokenizer's size); padding follows the CP layout
    of ``parallel``, and seq_len must divide by ``row_multiple``.
    """
    parallel = parallel or ParallelConfig()
    multiple, row = pad_multiple(parallel, layout), row_multiple(parallel, layout)
    if data.seq_len % row:
        raise ValueError(f"data.seq_len={data.seq_len} must divide by {row} for the {layout} CP layout "
                         f"at cp={parallel.cp}, tp={parallel.tp}, "
                         f"sequence_parallel={parallel.sequence_parallel}")
    if data.path is None:
        if vocab_size is None:
            raise ValueError("synthetic data (data.path unset) needs vocab_size")
        source: Source = SyntheticSource(vocab_size=vocab_size, max_tokens=data.seq_len,
                                         num_documents=synthetic_documents, seed=seed)
    else:
        source = JsonlSource(list_jsonl(data.path), _record_rules(data, vocab_size), data.on_bad_record)
    return PackedLoader(source, seq_len=data.seq_len, pad_multiple=multiple,
                        shuffle_buffer=data.shuffle_buffer, seed=seed, pad_id=pad_id)
