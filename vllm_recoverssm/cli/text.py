"""Names and units shared by the command-line reports."""

from __future__ import annotations

MODE_TITLES = {"recovery": "recovery", "full_state": "full-state"}
"""How a report names each mode."""


def mib(n: float) -> str:
    """``n`` bytes in MiB, two decimals."""
    return f"{n / (1 << 20):.2f} MiB"
