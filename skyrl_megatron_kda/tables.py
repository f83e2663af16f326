"""Plain-text tables for the command line: one builder, so that every table of ``plan``,
``bytes``, ``demo`` and ``recipes`` pads, aligns and separates its columns the same way."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def format_table(headers: Sequence[str] | None, rows: Iterable[Sequence[object]],
                 align: str | None = None, gap: int = 2) -> list[str]:
    """The lines of a table: ``headers`` (None: no header line) over ``rows``, each column as
    wide as its widest cell and ``gap`` spaces from the next.

    Cells are text already formatted by the caller (anything else goes through ``str``), so each
    column keeps the precision its numbers need. ``align`` has one character per column, ``<``
    (left) or ``>`` (right); by default the first column is left-aligned (labels) and the others
    right-aligned (numbers). Leading spaces of a left-aligned cell are kept, which indents
    sub-rows under their parent. Trailing spaces are dropped."""
    body = [[str(cell) for cell in row] for row in rows]
    table = ([list(headers)] if headers is not None else []) + body
    if not table:
        return []
    ncols = max(map(len, table))
    align = align or "<" + ">" * (ncols - 1)
    if len(align) != ncols or set(align) - {"<", ">"}:
        raise ValueError(f"align={align!r} must give '<' or '>' for each of the {ncols} columns")
    widths = [max((len(row[i]) for row in table if i < len(row)), default=0) for i in range(ncols)]
    sep = " " * gap
    return [sep.join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths)).rstrip()
            for row in table]
