"""Spend the memory the ring frees: choose the partitioner's activation memory budget from a byte budget.

torch's min-cut partitioner takes ``activation_memory_budget``, a fraction: 1.0 saves what runs fastest, 0.0
saves only the compiled graph's inputs (each layer's input) and recomputes the rest in backward, and in between
it recomputes what costs least runtime per byte freed. This module only picks the fraction; torch decides which
activations it covers.

``BudgetChooser`` picks, for a step of T tokens per rank, the largest fraction on a short ladder whose step
fits the byte budget (the GPU's memory): a fraction that did not fit at some T is skipped at every larger T; a
fraction measured before predicts its peak in proportion to T (``resident + bytes_per_token * T``, which
over-estimates at larger T: the step's fixed buffers scale too) and is skipped when the prediction is over the
budget, except the smallest fraction left, which is always tried. The caller probes the candidates in order and
reports back (``record``): a wrong prediction costs a probe or a slower fraction, never a wrong capacity.

Each fraction is a compilation of its own (``policies.layer_runner``): the ladder is short to bound them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LADDER", "BudgetChooser"]

# Fractions tried, largest first. 1.0 is torch's default: the plain relaymoe row's compilation.
LADDER: tuple[float, ...] = (1.0, 0.5, 0.0)


@dataclass
class BudgetChooser:
    """Which partitioner budgets to try at a length, from what earlier steps used (module docstring)."""

    budget_bytes: int
    ladder: tuple[float, ...] = LADDER
    # fraction -> (resident bytes, peak bytes above resident per token), from its latest fitting step.
    slopes: dict[float, tuple[int, float]] = field(default_factory=dict)
    # fraction -> the fewest tokens per rank at which it did not fit.
    failed_at: dict[float, int] = field(default_factory=dict)

    def predicted_peak(self, fraction: float, tokens: int) -> int | None:
        if fraction not in self.slopes:
            return None
        resident, per_token = self.slopes[fraction]
        return int(resident + per_token * tokens)

    def candidates(self, tokens: int) -> list[float]:
        """Fractions to try at ``tokens``, largest first: not known to fail, and not predicted over the budget
        unless it is the smallest left."""
        left = [f for f in self.ladder if self.failed_at.get(f, tokens + 1) > tokens]
        out = [f for f in left[:-1] if (self.predicted_peak(f, tokens) or 0) <= self.budget_bytes]
        return out + left[-1:]

    def record(self, fraction: float, tokens: int, peak_bytes: int | None, resident_bytes: int | None) -> None:
        """What a step at ``fraction`` and ``tokens`` used; ``peak_bytes`` None or over the budget: no fit."""
        if peak_bytes is None or resident_bytes is None or peak_bytes > self.budget_bytes:
            self.failed_at[fraction] = min(tokens, self.failed_at.get(fraction, tokens))
            return
        self.slopes[fraction] = (resident_bytes, (peak_bytes - resident_bytes) / tokens)
