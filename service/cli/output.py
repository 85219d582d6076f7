"""How the ``tidal`` command line prints: tables that fit the terminal, labelled
values that wrap, times, and ``--json``.

The width is ``$COLUMNS`` when set, else the terminal's when stdout is one;
output into a pipe or a file is never cut (a script reads every character).
A table that is too wide gives up space from the columns named ``shrink``
(free text such as a command or a message), widest need first, down to their
header's width; identifiers are never cut. A cut cell ends in ``…``.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import IO, Any

from pydantic import BaseModel

ELLIPSIS = "…"
MIN_COLUMN = 8  # a shrunk column keeps at least this much (or its header's width)
GAP = "  "


def terminal_width(stream: IO[str] | None = None) -> int | None:
    """Columns to fit in: ``$COLUMNS``, else the terminal's; None for a pipe or file."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    out = stream if stream is not None else sys.stdout
    try:
        if out.isatty():
            return os.get_terminal_size(out.fileno()).columns
    except (OSError, ValueError, AttributeError):
        pass
    return None


def cell(value: object) -> str:
    """A table cell: ``-`` for nothing, whitespace (a newline too) made single spaces."""
    if value is None:
        return "-"
    return " ".join(str(value).split())


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, ending in ``…`` when cut."""
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + ELLIPSIS if width > 0 else ""


def fit_widths(
    natural: Sequence[int], floors: Sequence[int], shrinkable: Sequence[int], width: int | None,
) -> list[int]:
    """Column widths that fit ``width`` (gaps included), taking space only from the
    ``shrinkable`` columns (indices), most surplus first, never below their floor.

    Returns the natural widths when they fit or ``width`` is None; a table that
    cannot fit even so keeps its floors (and overflows).
    """
    widths = list(natural)
    if width is None:
        return widths
    excess = sum(widths) + len(GAP) * (len(widths) - 1) - width
    while excess > 0:
        candidates = [i for i in shrinkable if widths[i] > floors[i]]
        if not candidates:
            break
        widest = max(candidates, key=lambda i: widths[i] - floors[i])
        others = [widths[i] - floors[i] for i in candidates if i != widest]
        # Take from the widest down to the next one's surplus, so space goes evenly.
        step = min(excess, widths[widest] - floors[widest] - max(others, default=0)) or 1
        widths[widest] -= step
        excess -= step
    return widths


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *,
    shrink: Sequence[str] = (), width: int | None = None,
) -> str:
    """Left-aligned columns two spaces apart; the last column is not padded.

    Args:
        headers: the column names.
        rows: the cells (``None`` prints ``-``).
        shrink: the headers of the columns that may be cut to fit ``width``.
        width: the width to fit (default :func:`terminal_width`).
    """
    if width is None:
        width = terminal_width()
    cells = [[str(h) for h in headers], *[[cell(c) for c in row] for row in rows]]
    natural = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    floors = [min(natural[i], max(len(h), MIN_COLUMN)) for i, h in enumerate(headers)]
    shrinkable = [headers.index(name) for name in shrink if name in headers]
    widths = fit_widths(natural, floors, shrinkable, width)
    lines = []
    for row in cells:
        texts = [cut(c, w) for c, w in zip(row, widths, strict=True)]
        padded = [t.ljust(w) for t, w in zip(texts[:-1], widths[:-1], strict=True)]
        lines.append(GAP.join([*padded, texts[-1]]).rstrip())
    return "\n".join(lines)


def labelled(pairs: Sequence[tuple[str, object]], *, width: int | None = None) -> list[str]:
    """``key:  value`` lines with the values aligned; a long value wraps under itself.

    ``width`` defaults to :func:`terminal_width`; None never wraps.
    """
    if width is None:
        width = terminal_width()
    if not pairs:
        return []
    key_width = max(len(k) for k, _ in pairs) + 1
    indent = " " * (key_width + len(GAP))
    lines = []
    for key, value in pairs:
        first = f"{key + ':':<{key_width}}{GAP}"
        text = cell(value)
        if width is None or len(first) + len(text) <= width or width <= len(indent) + 10:
            lines.append(first + text)
            continue
        lines += textwrap.wrap(text, width=width, initial_indent=first,
                               subsequent_indent=indent, break_on_hyphens=False)
    return lines


def age(when: datetime | None, *, now: datetime | None = None) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``: how long ago ``when`` was."""
    if when is None:
        return "-"
    seconds = max(0, int(((now or datetime.now(timezone.utc)) - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def clock(when: datetime, *, with_date: bool = True) -> str:
    """A time in the local zone, with or without its date."""
    local = when.astimezone()
    return local.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S")


def dump_json(data: BaseModel | Sequence[BaseModel] | dict[str, Any]) -> str:
    """Models (or lists of them) as the API's JSON, for ``--json`` output."""
    if isinstance(data, BaseModel):
        return data.model_dump_json(indent=2)
    if isinstance(data, dict):
        return json.dumps(data, indent=2, default=str)
    return json.dumps([item.model_dump(mode="json") for item in data], indent=2)
