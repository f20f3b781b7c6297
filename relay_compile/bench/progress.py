"""What the bench prints while it runs: one ``Progress`` line per measurement, and the number formats of its
lines and tables (``fmt_ms``, ``fmt_bytes``, ``fmt_x``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from relay_compile.bench.configs import GiB, MiB


class Progress:
    """One printed line per finished measurement, flushed at once; counts and elapsed time."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.count = 0
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def line(self, text: str) -> None:
        self.count += 1
        print(f"[{self.count:3d} {self.elapsed():6.1f}s] {text}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        print(f"           {text}", file=self.stream, flush=True)


def fmt_ms(v: float | None) -> str:
    """Milliseconds with two decimals; ``-`` for None."""
    return "-" if v is None else f"{v:.2f}"


def fmt_bytes(v: int | float | None) -> str:
    """``2.70 GiB``, ``3.9 MiB``, ``12 KiB``: one unit per value, picked by its size."""
    if v is None:
        return "-"
    if abs(v) >= GiB:
        return f"{v / GiB:.2f} GiB"
    if abs(v) >= MiB:
        return f"{v / MiB:.1f} MiB"
    return f"{v / 1024:.0f} KiB"


def fmt_x(v: float | None) -> str:
    """A ratio, ``1.25x``; ``-`` for None."""
    return "-" if v is None else f"{v:.2f}x"

