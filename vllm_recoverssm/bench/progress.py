"""A dependency-free progress bar on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30


class Progress:
    """Counts steps; redraws one line on a terminal, prints one line per step otherwise."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()

    def step(self, label: str) -> None:
        """Announce the step about to run and count it."""
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        head = f"{self.done:>{len(str(self.total))}}/{self.total} {elapsed:6.1f}s {label}"
        if self.tty:
            filled = BAR_WIDTH * self.done // self.total
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.stream.write(f"\r\033[K[{bar}] {head}")
        else:
            self.stream.write(f"bench {head}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
