"""What a full-model run writes: results.json (raw), results.md (tables, bars) and full_model.png (figure).

``FullModelReport.from_json`` rebuilds a report from results.json, to redraw the tables and figure elsewhere
(``--replot``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay_compile.bench.configs import GiB
from relay_compile.bench.full_model.bars import Bar, comparison_lengths, evaluate_bars
from relay_compile.bench.full_model.policies import A2A_EAGER
from relay_compile.bench.full_model.search import RowResult
from relay_compile.bench.full_model.training import Probe
from relay_compile.bench.progress import fmt_bytes, fmt_ms
from relay_compile.bench.results import environment, write_json_and_markdown

log = logging.getLogger(__name__)

__all__ = ["FullModelReport"]

FIGURE = "full_model.png"


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _summary_table(rows: Sequence[RowResult]) -> list[str]:
    eager = next((r for r in rows if r.row == A2A_EAGER), None)
    lines = [("| row | backend | recompute | largest tokens/rank | vs a2a eager | tok/s there | step ms there | "
              "peak there | budget there | regions rewritten | search s |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.row} | {r.backend} | {r.recompute} | failed: {r.error} |||||||| {r.seconds:.0f} |")
            continue
        top = r.at(r.max_tokens) or Probe(tokens=r.max_tokens, fits=False)  # none fits: dashes
        ratio = f"{r.max_tokens / eager.max_tokens:.2f}x" if eager and eager.max_tokens else "-"
        limit = f">= {r.max_tokens} (search limit)" if r.limited_by_search else str(r.max_tokens)
        lines.append(
            f"| {r.row} | {r.backend} | {r.recompute} | {limit} | {ratio} | {_fmt(top.tokens_per_s, '.0f')} "
            f"| {fmt_ms(top.step_ms)} | {fmt_bytes(top.peak_bytes)} "
            f"| {_fmt(top.memory_budget, 'g')} | {r.regions_rewritten if r.backend == 'relaymoe' else '-'} "
            f"| {r.seconds:.0f} |")
    return lines


def _probe_table(rows: Sequence[RowResult]) -> list[str]:
    lines = ["| row | tokens/rank | budget | step ms | tok/s | peak | fits | link ms (model) | step + link ms (model) |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        for p in sorted(r.probes, key=lambda p: (p.tokens, p.memory_budget is None, -(p.memory_budget or 0))):
            fits = "yes" if p.fits else (p.error or "over budget")
            total = None if p.step_ms is None or p.link_ms is None else p.step_ms + p.link_ms
            lines.append(f"| {r.row} | {p.tokens} | {_fmt(p.memory_budget, 'g')} | {fmt_ms(p.step_ms)} "
                         f"| {_fmt(p.tokens_per_s, '.0f')} | {fmt_bytes(p.peak_bytes)} | {fits} "
                         f"| {fmt_ms(p.link_ms)} | {fmt_ms(total)} |")
    return lines


def _bar_table(bars: Sequence[Bar]) -> list[str]:
    lines = ["| bar | measured | target | met | compared | with link time (model) |", "|---|---:|---:|---|---|---:|"]
    lines += [f"| {b.name} | {_fmt(b.value, '.2f')}x | >= {b.target:g}x | {'yes' if b.met else 'NO'} | {b.detail} "
              f"| {_fmt(b.with_link, '.2f')}{'x' if b.with_link is not None else ''} |" for b in bars]
    return lines


def plot(rows: Sequence[RowResult], budget_bytes: int, title: str, path: Path) -> bool:
    """tokens/s and peak memory against tokens per rank, one line per row; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("full_model: matplotlib is not installed; %s not drawn (--replot draws it)", path)
        return False
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in rows:
        fitting = sorted((p for p in r.probes if p.fits), key=lambda p: p.tokens)
        measured = sorted((p for p in r.probes if p.peak_bytes is not None), key=lambda p: p.tokens)
        # The budget row shares the plain relaymoe row's lengths up to its largest: dashed, to show both.
        style = {"ls": "--", "marker": "s", "ms": 4} if r.recompute == "budget" else {"marker": "o"}
        if fitting:
            line, = speed.plot([p.tokens for p in fitting], [p.tokens_per_s for p in fitting], label=r.row, **style)
            speed.axvline(r.max_tokens, color=line.get_color(), ls=":", lw=0.8)
        if measured:
            memory.plot([p.tokens for p in measured], [(p.peak_bytes or 0) / GiB for p in measured], label=r.row,
                        **style)
        if r.recompute == "budget":  # which partitioner budget each length used
            for p in measured:
                memory.annotate(f"{p.memory_budget:g}", (p.tokens, (p.peak_bytes or 0) / GiB), fontsize=7,
                                textcoords="offset points", xytext=(0, -11), ha="center")
    memory.axhline(budget_bytes / GiB, color="red", ls="--", lw=1, label="memory budget")
    for ax, ylabel in ((speed, "tokens/s per rank (dotted: largest fitting length)"),
                       (memory, "peak GiB per rank (numbers: partitioner budget)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    speed.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@dataclass(kw_only=True)
class FullModelReport:
    """Everything one run produced (JSON-able through ``to_json``)."""

    config: dict[str, Any]
    label: str
    settings: dict[str, Any]
    rows: list[RowResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=environment)

    def bars(self) -> list[Bar]:
        return evaluate_bars(self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "environment": self.env, "config": self.config, "label": self.label, "settings": self.settings,
            "notes": self.notes, "rows": [dataclasses.asdict(r) for r in self.rows],
            "largest_tokens_per_rank": {r.row: r.max_tokens for r in self.rows},
            "comparison_lengths": comparison_lengths(self.rows),
            "bars": [{**dataclasses.asdict(b), "met": b.met} for b in self.bars()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FullModelReport:
        rows = [RowResult(**{**r, "probes": [Probe(**p) for p in r["probes"]]}) for r in data["rows"]]
        return cls(config=data["config"], label=data["label"], settings=data["settings"], rows=rows,
                   notes=list(data["notes"]), env=dict(data["environment"]))

    def markdown(self) -> str:
        env, s = self.env, self.settings
        out = [
            "# Full-model training on one device (simulated EP)", "",
            f"torch {env['torch']}" + (f", {env['gpu']}" if "gpu" in env else ", CPU") + f", {env['date']}.", "",
            (f"Model: {self.label}; tokens per rank are whole sequences packed in one batch. Per rank: "
             f"{self.config['dtype']} parameters and gradients, fp32 master weights and fp32 AdamW state (16 bytes "
             "per bf16 parameter during backward); AdamW over every parameter, the replicated ones' gradients "
             "all-reduced over the EP group. Rank 0 of a stand-in EP group whose peers mirror it: memory and compute "
             "are this rank's, link time is NOT simulated ('(model)' columns add the modeled transfers at "
             f"{s['link_gbps']:g} GB/s, back to back: pessimistic for the ring, which overlaps them). Memory budget "
             f"{fmt_bytes(s['budget_bytes'])} per rank (the allocator's cap on CUDA: an out-of-memory error means "
             f"'does not fit'); times: median of {s['repeats']} step(s) after {s['warmup']} warm-up, CUDA events. "
             "Peak: the most allocated during a step, parameters and optimizer state included. 'budget': the "
             "torch partitioner's activation memory budget the row compiled with (relaymoe + budget chooses it "
             "per length: the largest of its ladder that fits)."), "",
        ]
        out += [f"- {n}" for n in self.notes]
        out += ["", "## Bars (issue 14)", "", *_bar_table(self.bars()), "",
                "## Largest tokens per rank that trains, per row", "", *_summary_table(self.rows), "",
                "## Every measured length", "", *_probe_table(self.rows), "", f"![full model]({FIGURE})", ""]
        return "\n".join(out)

    def write(self, out: Path, *, with_json: bool = True) -> list[Path]:
        """results.json, results.md and the figure under ``out``; the paths written."""
        paths = write_json_and_markdown(out, self.to_json() if with_json else None, self.markdown())
        if any(r.probes for r in self.rows) and plot(self.rows, self.settings["budget_bytes"], self.label,
                                                     out / FIGURE):
            paths.append(out / FIGURE)
        return paths
