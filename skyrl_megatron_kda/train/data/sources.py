"""Where documents come from: JSONL files read line by line, or seeded synthetic documents. A
source reads from a position and re-reads one document by reference, so the loader's state holds
positions and references, never token data."""

from __future__ import annotations

import logging
import math
import random
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, Protocol

import torch

from .records import BadRecord, Document, RecordRules, Ref, parse_record
from .stats import DataStats

logger = logging.getLogger(__name__)


Policy = Literal["skip", "stop"]


class Source(Protocol):
    """Where documents come from: read from a position, re-read one by reference."""

    def start(self) -> Ref: ...

    def read(self, position: Ref, stats: DataStats) -> Iterator[tuple[Document, Ref]]: ...

    def fetch(self, ref: Ref) -> Document: ...


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
        raise ValueError(f"data.path={str(p)!r} {_not_a_file(p)}")
    return [p]


def _not_a_file(path: Path) -> str:
    """What ``path`` is, when it is neither a file nor a folder: the reader seeks in its files
    (a resumed run goes straight to its position), which a pipe or device cannot do."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return (f"is {kind}, not a file: data.path must be a .jsonl file or a folder of them (the "
            "reader seeks in it to resume)")


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
