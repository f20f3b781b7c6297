"""The issue's bars (issue 14) read off the rows: where to compare, and whether each bar is met.

    capacity vs a2a eager     largest tokens per rank of the best relaymoe row / a2a eager's        >= 3.0
    capacity vs best a2a      ... / the best a2a row's (any recompute policy)                        >= 2.0
    speed at a2a eager's max  relaymoe tokens/s / a2a eager's, at a2a eager's largest length        >= 1.0
    speed where a2a needs     relaymoe + budget tokens/s / the best a2a row's that fits, at the
      full recompute          largest length only a2a + full AC fits (its max, beyond every other
                              a2a row's)                                                             >= 1.25

A bar whose comparison point does not exist (a row failed, or a2a never needs full recompute) has no value
and is not met. The speed bars also give the ratio with the modeled link time added to both steps
(``link.py``: transfers back to back, so pessimistic for the ring, which overlaps them); the bar itself is
on measured times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relay_compile.bench.full_model.policies import A2A_EAGER
from relay_compile.bench.full_model.search import RowResult

__all__ = ["Bar", "comparison_lengths", "evaluate_bars"]

FULL_AC = "a2a + full AC"
RELAY = "relaymoe"
RELAY_BUDGET = "relaymoe + budget"


@dataclass(frozen=True, kw_only=True)
class Bar:
    """One bar (JSON-able): the measured ratio against its target, and what was compared."""

    name: str
    value: float | None
    target: float
    detail: str
    # Speed bars: the same ratio with each step's modeled link time added (simulated).
    with_link: float | None = None

    @property
    def met(self) -> bool:
        return self.value is not None and self.value >= self.target


def _row(rows: Sequence[RowResult], name: str) -> RowResult | None:
    return next((r for r in rows if r.row == name and not r.error), None)


def _a2a(rows: Sequence[RowResult]) -> list[RowResult]:
    return [r for r in rows if r.backend != "relaymoe" and not r.error]


def comparison_lengths(rows: Sequence[RowResult]) -> dict[str, int]:
    """``eager max``: a2a eager's largest length; ``full AC only``: where only a2a + full AC fits (if anywhere)."""
    out = {}
    eager = _row(rows, A2A_EAGER)
    if eager is not None and eager.max_tokens:
        out["eager max"] = eager.max_tokens
    full = _row(rows, FULL_AC)
    others = [r.max_tokens for r in _a2a(rows) if r.row != FULL_AC]
    if full is not None and full.max_tokens and full.max_tokens > max(others, default=0):
        out["full AC only"] = full.max_tokens
    return out


def _speed_bar(name: str, target: float, rows: Sequence[RowResult], relay: str, base: Sequence[RowResult],
               tokens: int | None) -> Bar:
    """tokens/s of row ``relay`` over the fastest of ``base`` at ``tokens`` (no value where not measured)."""
    if tokens is None:
        return Bar(name=name, value=None, target=target, detail="no such length in this run")
    ring = _row(rows, relay)
    mine = ring.at(tokens) if ring is not None else None
    theirs = [(r.row, p) for r in base if (p := r.at(tokens)) is not None]
    if mine is None or not theirs:
        return Bar(name=name, value=None, target=target, detail=f"not both measured at T={tokens}")
    other, best = max(theirs, key=lambda rp: rp[1].tokens_per_s or 0.0)
    assert mine.step_ms and best.step_ms, "a fitting probe has a step time"
    with_link = None
    if mine.link_ms is not None and best.link_ms is not None:
        with_link = (best.step_ms + best.link_ms) / (mine.step_ms + mine.link_ms)
    return Bar(name=name, value=best.step_ms / mine.step_ms, target=target, with_link=with_link,
               detail=f"T={tokens}: {relay} {mine.tokens_per_s:.0f} tok/s vs {other} {best.tokens_per_s:.0f} tok/s")


def evaluate_bars(rows: Sequence[RowResult]) -> list[Bar]:
    """The four bars of the module docstring."""
    relay_max = max((r.max_tokens for r in rows if r.backend == "relaymoe" and not r.error), default=0)
    eager = _row(rows, A2A_EAGER)
    best_a2a = max(_a2a(rows), key=lambda r: r.max_tokens, default=None)
    bars = []
    for name, base, target in (("largest tokens/rank vs a2a eager", eager, 3.0),
                               ("largest tokens/rank vs best a2a row", best_a2a, 2.0)):
        if base is None or not base.max_tokens or not relay_max:
            bars.append(Bar(name=name, value=None, target=target, detail="a row did not fit at any length"))
            continue
        bars.append(Bar(name=name, value=relay_max / base.max_tokens, target=target,
                        detail=f"relaymoe {relay_max} vs {base.row} {base.max_tokens}"))
    lengths = comparison_lengths(rows)
    bars.append(_speed_bar("tokens/s at a2a eager's largest length", 1.0, rows, RELAY, [eager] if eager else [],
                           lengths.get("eager max")))
    bars.append(_speed_bar("tokens/s where a2a needs full recompute", 1.25, rows, RELAY_BUDGET, _a2a(rows),
                           lengths.get("full AC only")))
    return bars
