"""What the loader did, so that nothing is dropped unseen: packed work, and bad records skipped
(policy ``skip``) per file and reason, logged at the end of every pass over the corpus; the
trainer reports the counts in every metrics line."""

from __future__ import annotations

from dataclasses import dataclass, field


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
