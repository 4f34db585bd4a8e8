"""Names and units shared by the command-line reports."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..config.state_mode import StateMode

_ALIGN_WIDTH = re.compile(r"[<>^]?\d*")


def mode_title(name: str) -> str:
    """How a report names a state mode (``name`` itself when it is not one)."""
    try:
        return StateMode.parse(name).label
    except ValueError:
        return name


def mib(n: float) -> str:
    """``n`` bytes in MiB, two decimals."""
    return f"{n / (1 << 20):.2f} MiB"


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]]) -> list[str]:
    """A plain-text table: the header, a rule as wide as it, then one line per row.

    ``columns`` are (title, format spec) pairs, cells are joined by one space; a title takes
    its spec's alignment and width (``">9.1%"`` places it as ``">9"``). A column ``("", "")``
    with empty cells widens the gap before the next one.
    """
    header = " ".join(format(title, _ALIGN_WIDTH.match(spec).group(0))  # type: ignore[union-attr]
                      for title, spec in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(" ".join(format(cell, spec)
                              for cell, (_, spec) in zip(row, columns, strict=True)))
    return lines
