"""The shape and source of the training batches."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import ConfigSection, PositiveInt


class DataConfig(ConfigSection):
    """Shape of the training batches."""

    seq_len: PositiveInt = 8192
    """Tokens per sequence (for packed batches, per packed row)."""
    micro_batch_size: PositiveInt = 1
    """Sequences per micro-batch on each data-parallel rank."""
    path: str | None = None
    """A JSONL file or a directory of *.jsonl files (read in name order); None: synthetic data."""
    tokenizer_path: str | None = None
    """Local Hugging Face tokenizer directory; required when records carry "text"."""
    on_bad_record: Literal["skip", "stop"] = "stop"
    """What a bad record does: stop with file:line and reason, or skip it and count the reason."""
    shuffle_buffer: PositiveInt = 1024
    """Documents held by the seeded shuffle buffer (1: keep file order)."""
    append_eos: bool = Field(default=True, strict=True)
    """Append the tokenizer's EOS token to every "text" document (input_ids are taken as given)."""
