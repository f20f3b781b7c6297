"""Every row at every length it is asked for, and the largest tokens per rank each row trains within the budget.

    runs = RowRuns(trainer, settings, progress)
    result = runs.search(policy)                   # doubling from settings.start, then bisection
    runs.measure_at(result, tokens)                # one more length (the bars' comparison points)

One compiled runner per (backend, partitioner budget), shared by the rows that need the same one, and one
probe per (runner, length): the ``relaymoe + budget`` row at budget 1.0 *is* the ``relaymoe`` row, so it reuses
that row's compilation and measurements instead of repeating them. A ``budget`` row probes the fractions
``budget.BudgetChooser`` proposes, largest first, and keeps the first that fits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from relay_compile.backend import compiled_reports
from relay_compile.bench.capacity import largest_fitting
from relay_compile.bench.full_model.budget import LADDER, BudgetChooser
from relay_compile.bench.full_model.link import step_link_ms
from relay_compile.bench.full_model.model import LayerRunner
from relay_compile.bench.full_model.policies import Policy, layer_runner
from relay_compile.bench.full_model.training import Probe, Trainer
from relay_compile.bench.progress import Progress, fmt_bytes

log = logging.getLogger(__name__)

__all__ = ["RowResult", "RowRuns", "SearchSettings", "TimeBudgetSpent"]


@dataclass(frozen=True, kw_only=True)
class SearchSettings:
    """How rows are measured and searched. Lengths are tokens per rank, multiples of ``step`` (one sequence)."""

    budget_bytes: int
    start: int
    step: int
    max_tokens: int
    warmup: int = 1
    repeats: int = 2
    inner_compiler: str = "inductor"
    # Compiled rows compile every length for its own size (else one compile with the token dimension dynamic).
    static_shapes: bool = False
    link_gbps: float = 450.0
    ladder: tuple[float, ...] = LADDER
    # Bisection stops once the gap is at most this fraction of the largest fitting length (or one step).
    rel_tol: float = 0.0
    # A time.perf_counter() value: probes that would start later are not made (the search stops there).
    deadline: float | None = None


class TimeBudgetSpent(Exception):
    """The run's time budget is spent: no more probes."""


@dataclass(kw_only=True)
class RowResult:
    """One row (JSON-able): its policy, every probe in the order made, its largest fitting tokens per rank."""

    row: str
    backend: str
    recompute: str
    note: str = ""
    probes: list[Probe] = field(default_factory=list)
    max_tokens: int = 0  # 0: not even one sequence fits
    limited_by_search: bool = False  # max_tokens is the search's upper end, not a measured limit
    regions_rewritten: int = 0  # relaymoe rows: MoE regions the backend rewrote into rings (all graphs)
    regions_refused: int = 0
    seconds: float = 0.0  # wall time of the row's search, compilation included
    error: str = ""

    def at(self, tokens: int) -> Probe | None:
        """The fitting probe at ``tokens``, if one was made."""
        return next((p for p in self.probes if p.tokens == tokens and p.fits), None)


class RowRuns:
    """Runs rows on one trainer; shares compilations and probes between rows (module docstring)."""

    def __init__(self, trainer: Trainer, settings: SearchSettings, progress: Progress) -> None:
        self.trainer, self.settings, self.progress = trainer, settings, progress
        self._runners: dict[tuple[str, float | None], LayerRunner] = {}
        self._probes: dict[tuple[str, float | None, int], Probe] = {}
        self._choosers: dict[str, BudgetChooser] = {}
        # runner key -> (regions rewritten, refused) by the compilations it triggered
        self._regions: dict[tuple[str, float | None], tuple[int, int]] = {}
        self._used: dict[str, set[tuple[str, float | None]]] = {}

    @staticmethod
    def _key(policy: Policy, fraction: float | None) -> tuple[str, float | None]:
        # Budget 1.0 is torch's default partitioner: the same compilation as the plain row's; a checkpointing
        # row compiles another function.
        body = policy.recompute if policy.recompute in ("full", "moe") else "none"
        runner = f"{policy.backend}/{body}" if policy.compiles else policy.name
        return (runner, None if fraction == 1.0 else fraction)

    def _probe(self, policy: Policy, fraction: float | None, tokens: int) -> Probe:
        key = self._key(policy, fraction)
        self._used.setdefault(policy.name, set()).add(key)
        if (*key, tokens) not in self._probes:
            s = self.settings
            if key not in self._runners:
                self._runners[key] = layer_runner(policy, inner_compiler=s.inner_compiler, memory_budget=key[1],
                                                  static_shapes=s.static_shapes)
            seen = len(compiled_reports())
            probe = self.trainer.probe(self._runners[key], tokens, warmup=s.warmup, repeats=s.repeats,
                                       budget_bytes=s.budget_bytes)
            regions = [r.status for report in compiled_reports()[seen:] for r in report.regions]
            done = self._regions.get(key, (0, 0))
            self._regions[key] = (done[0] + regions.count("rewritten"), done[1] + regions.count("refused"))
            probe.link_ms = step_link_ms(self.trainer.model.cfg, policy, tokens, s.link_gbps)
            self._probes[(*key, tokens)] = probe
        return dataclasses.replace(self._probes[(*key, tokens)], memory_budget=fraction)

    def _budget_probes(self, policy: Policy, tokens: int) -> list[Probe]:
        """The fractions the chooser proposes, largest first, up to the first that fits (every one tried)."""
        chooser = self._choosers.setdefault(policy.name, BudgetChooser(self.settings.budget_bytes,
                                                                       self.settings.ladder))
        tried = []
        for fraction in chooser.candidates(tokens):
            tried.append(self._probe(policy, fraction, tokens))
            chooser.record(fraction, tokens, tried[-1].peak_bytes if tried[-1].fits else None,
                           tried[-1].resident_bytes)
            if tried[-1].fits:
                break
        return tried or [Probe(tokens=tokens, fits=False, error="every budget failed at a shorter length")]

    def _measure(self, policy: Policy, result: RowResult, tokens: int) -> Probe:
        """The row at ``tokens`` (a budget row: each fraction tried is recorded); the last probe made."""
        if self.settings.deadline is not None and time.perf_counter() > self.settings.deadline:
            raise TimeBudgetSpent(f"time budget spent before T={tokens}")
        probes = (self._budget_probes(policy, tokens) if policy.recompute == "budget"
                  else [self._probe(policy, None, tokens)])
        for probe in probes:
            result.probes.append(probe)
            self._report(policy, probe)
        return probes[-1]

    def _report(self, policy: Policy, p: Probe) -> None:
        head = f"{policy.name:<18} | T={p.tokens:>7}"
        budget = "" if p.memory_budget is None else f" | budget {p.memory_budget:g}"
        if p.step_ms is None:
            self.progress.line(f"{head} | {p.error}{budget}")
            return
        verdict = "fits" if p.fits else f"over {fmt_bytes(self.settings.budget_bytes)}"
        self.progress.line(f"{head} | step {p.step_ms:9.1f} ms | {p.tokens_per_s:9.0f} tok/s | peak "
                           f"{fmt_bytes(p.peak_bytes)} ({verdict}){budget}")

    def search(self, policy: Policy) -> RowResult:
        """The row at ``start``, doubling, then bisecting to its largest fitting tokens per rank."""
        s = self.settings
        result = RowResult(row=policy.name, backend=policy.backend, recompute=policy.recompute, note=policy.note)
        t0 = time.perf_counter()
        try:
            result.max_tokens, result.limited_by_search = largest_fitting(
                lambda t: self._measure(policy, result, t).fits, start=s.start, step=s.step, top=s.max_tokens,
                rel_tol=s.rel_tol)
        except TimeBudgetSpent as e:  # keep what was found: a lower bound
            result.max_tokens = max((p.tokens for p in result.probes if p.fits), default=0)
            result.limited_by_search = True
            result.note += f"; search stopped: {e}"
            self.progress.line(f"{policy.name:<18} | search stopped: {e}")
        except Exception as e:  # one failing row must not lose the others
            result.error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            self.progress.line(f"{policy.name:<18} | failed: {result.error}")
            log.debug("row %s failed", policy.name, exc_info=True)
        result.seconds = time.perf_counter() - t0
        regions = [self._regions.get(key, (0, 0)) for key in self._used.get(policy.name, ())]
        result.regions_rewritten = sum(r[0] for r in regions)
        result.regions_refused = sum(r[1] for r in regions)
        return result

    def measure_at(self, policy: Policy, result: RowResult, tokens: int) -> Probe | None:
        """The row at one more length (within its largest fitting one); None where it does not fit or failed."""
        if result.error or not 0 < tokens <= result.max_tokens:
            return None
        if (done := result.at(tokens)) is not None:
            return done
        try:
            probe = self._measure(policy, result, tokens)
        except TimeBudgetSpent:
            return None
        except Exception as e:  # noqa: BLE001 - a failed comparison point must not lose the run's results
            self.progress.line(f"{policy.name:<18} | T={tokens} failed: {type(e).__name__}: {e}"[:400])
            return None
        return probe if probe.fits else None
