"""The one markdown-table renderer every results table goes through (reports, experiments, CLI).

    markdown_table(["model", "bytes/token"], [["Llama-3-8B", 131072]], align="lr")

gives a GitHub-flavoured table: a header row, an alignment row (`---` left, `---:` right,
`:---:` centre) and one row per entry. Cells are `str()`ed (format numbers before), newlines
become spaces, and a `|` inside a cell is escaped, so any text stays one cell of one row.
"""
from __future__ import annotations

from typing import Any, Sequence

_RULES = {"l": "---", "r": "---:", "c": ":---:"}


def cell(value: Any) -> str:
    """One cell's text: on one line, with `|` escaped."""
    return " ".join(str(value).split()).replace("|", "\\|")


def markdown_table(headers: Sequence[Any], rows: Sequence[Sequence[Any]], align: str | None = None) -> list[str]:
    """The table's lines. align: one letter per column, l / r / c (default: all left)."""
    align = align or "l" * len(headers)
    if len(align) != len(headers) or set(align) - set(_RULES):
        raise ValueError(f"align {align!r}: one of l, r, c per column ({len(headers)})")
    bad = [i for i, r in enumerate(rows) if len(r) != len(headers)]
    if bad:
        raise ValueError(f"row {bad[0]} has {len(rows[bad[0]])} cells for {len(headers)} columns")
    line = lambda cells: "| " + " | ".join(cell(c) for c in cells) + " |"  # noqa: E731
    return [line(headers), "|" + "|".join(_RULES[a] for a in align) + "|"] + [line(r) for r in rows]
