"""One JSONL record -> a training document's token ids, or :class:`BadRecord` naming ``file:line``
and the reason."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch


Ref = tuple[int, ...]
"""Where a document can be read again: (file index, line number, byte offset) or (index,)."""


class BadRecord(ValueError):
    """A record that cannot become a training document; the message is ``file:line: kind: detail``."""

    def __init__(self, file: str, line: int, kind: str, detail: str):
        super().__init__(f"{file}:{line}: {kind}: {detail}")
        self.file, self.line, self.kind, self.detail = file, line, kind, detail

    def __reduce__(self):
        # Rebuilt from its four fields where it is unpickled (a Ray driver receiving a rank's
        # error): the default would call __init__ with the message alone and fail.
        return type(self), (self.file, self.line, self.kind, self.detail)


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
