"""What a run writes: ``Report`` (every section's results) as results.json, results.md and memory_timeline.png.

``layer_table`` and ``capacity_table`` are the Markdown tables of results.md; ``plot_timelines`` draws the
memory-over-time figure; ``report_from_json`` rebuilds a ``Report`` from results.json (``--replot``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relay_compile.bench.capacity import CapacityResult
from relay_compile.bench.configs import BenchOptions, GiB, MiB
from relay_compile.bench.measure import LayerResult, RowResult
from relay_compile.bench.numerics import NumericsResult, errors_table
from relay_compile.bench.progress import fmt_bytes, fmt_ms, fmt_x
from relay_compile.bench.rows import A2A_EAGER
from relay_compile.bench.timeline import Timeline

log = logging.getLogger(__name__)

_warned_no_matplotlib: list[bool] = []


def plot_timelines(timelines: Sequence[Timeline], title: str, path: Path) -> bool:
    """One panel per row, shared byte axis, dashed peak lines and the start of backward; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _warned_no_matplotlib:
            log.warning("plot_timelines: matplotlib is not installed; %s not drawn (--replot draws it from "
                        "results.json)", path)
            _warned_no_matplotlib.append(True)
        return False
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 2.6 * len(timelines) + 0.6), sharey=True, squeeze=False)
    peak = max((max(t.bytes) for t in timelines if t.bytes), default=1)
    unit, scale = ("GiB", GiB) if peak >= GiB else ("MiB", MiB)
    top = peak / scale * 1.1 or 1.0
    for ax, tl in zip(axes[:, 0], timelines, strict=True):
        ax.step(tl.times_ms, [b / scale for b in tl.bytes], where="post", lw=1.0)
        ax.axhline(tl.peak_bytes / scale, ls="--", lw=0.8, color="gray")
        if tl.backward_starts_ms is not None:
            ax.axvline(tl.backward_starts_ms, ls=":", lw=0.8, color="red")
            ax.text(tl.backward_starts_ms, top * 0.92, " backward", color="red", fontsize=8)
        ax.set_ylim(0, top)
        ax.set_ylabel(f"{unit} above start")
        ax.set_title(f"{tl.row}: peak {fmt_bytes(tl.peak_bytes)}", fontsize=10)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_json_and_markdown(out: Path, data: dict[str, Any] | None, markdown: str) -> list[Path]:
    """``out/results.json`` (unless ``data`` is None) and ``out/results.md``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if data is not None:
        paths.append(out / "results.json")
        paths[-1].write_text(json.dumps(data, indent=1, default=str))
    paths.append(out / "results.md")
    paths[-1].write_text(markdown)
    return paths


def environment() -> dict[str, Any]:
    """torch and Python versions, the date and the GPU's name (where there is one), for results.json."""
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def layer_table(result: LayerResult, opts: BenchOptions) -> str:
    """Markdown table of one configuration: measured columns, then the simulated link model."""
    lines = [
        f"**{result.label}** (resident inputs+weights {fmt_bytes(result.resident_bytes)}; link model "
        f"{opts.link_gbps:g} GB/s, simulated)",
        "",
        "| row | fwd ms | bwd ms | fwd+bwd ms | time vs a2a | peak | peak vs a2a | link MB/transfer fwd/bwd "
        "(model) | link ms (model) | total ms (model) | total vs a2a (model) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result.rows:
        if r.skipped:
            lines.append(f"| {r.row} | - | - | - | - | - | - | - | - | - | - | skipped: {r.skipped} |")
            continue
        lk = r.link or {}
        link_mb = (f"{lk['bytes_fwd'] / MiB:.1f} x{lk['transfers_fwd']} / {lk['bytes_bwd'] / MiB:.1f} "
                   f"x{lk['transfers_bwd']}") if lk else "-"
        lines.append(
            f"| {r.row} | {fmt_ms(r.fwd_ms)} | {fmt_ms(r.bwd_ms)} | {fmt_ms(r.total_ms)} | {fmt_x(r.time_ratio)} "
            f"| {fmt_bytes(r.peak_bytes)} | {fmt_x(r.peak_ratio)} | {link_mb} | {fmt_ms(lk.get('link_ms'))} "
            f"| {fmt_ms(lk.get('total_ms'))} | {fmt_x(r.model_ratio)} | {r.note} |"
        )
    if result.check:
        lines += ["", result.check]
    return "\n".join(lines)


def capacity_table(results: Sequence[CapacityResult]) -> str:
    """Markdown table of capacity searches on one configuration, with each row's ratio to eager a2a's."""
    if not results:
        return ""
    lines = [f"Capacity: largest tokens per rank (multiple of {results[0].step}) whose resident inputs+weights+"
             f"forward/backward peak fit {fmt_bytes(results[0].budget_bytes)}. {results[0].config}",
             "", "| row | max tokens/rank | memory at max | vs a2a | probes |", "|---|---:|---:|---:|---:|"]
    base = next((r.max_tokens for r in results if r.row == A2A_EAGER), None)
    for r in results:
        ratio = f"{r.max_tokens / base:.2f}x" if base else "-"
        limit = f">= {r.max_tokens} (search limit)" if r.limited_by_search else str(r.max_tokens)
        lines.append(f"| {r.row} | {limit} | {fmt_bytes(r.bytes_at_max)} | {ratio} | {len(r.probes)} |")
    return "\n".join(lines)


@dataclass(kw_only=True)
class Report:
    """Everything one run produced, written as ``results.json`` + ``results.md`` (+ PNG, snapshots) under ``out``."""

    options: BenchOptions
    sections: list[tuple[str, list[LayerResult]]] = field(default_factory=list)
    capacity: list[CapacityResult] = field(default_factory=list)
    timelines: list[Timeline] = field(default_factory=list)
    timeline_title: str = ""
    numerics: list[NumericsResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=environment)

    def section(self, title: str) -> list[LayerResult]:
        for name, results in self.sections:
            if name == title:
                return results
        self.sections.append((title, []))
        return self.sections[-1][1]

    def to_json(self) -> dict[str, Any]:
        return {
            "environment": self.env,
            "options": dataclasses.asdict(self.options),
            "notes": self.notes,
            "sections": [{"title": t, "layers": [dataclasses.asdict(r) for r in rs]} for t, rs in self.sections],
            "capacity": [dataclasses.asdict(c) for c in self.capacity],
            "timelines": [dataclasses.asdict(t) for t in self.timelines],
            "timeline_title": self.timeline_title,
            "numerics": [dataclasses.asdict(n) for n in self.numerics],
        }

    def markdown(self) -> str:
        env = self.env
        out = [
            "# RelayMoE single-layer benchmark (simulated EP)",
            "",
            f"torch {env['torch']}" + (f", {env['gpu']}" if "gpu" in env else ", CPU") + f", {env['date']}. "
            "Rank 0 of an N-rank stand-in group whose peers are copies of this rank (symmetric routing): "
            "memory and compute are this rank's, link time is NOT simulated; '(model)' columns add "
            f"transfers at {self.options.link_gbps:g} GB/s per the model in relay_compile/bench/link_model.py. "
            f"Times: median of {self.options.repeats} after {self.options.warmup} warm-up steps. Peak: bytes "
            "allocated above resident inputs and weights during one forward+backward. Routing: Qwen3 router "
            "(softmax top-k, renormalized) over random tokens.",
            "",
        ]
        out += [f"- {n}" for n in self.notes]
        for title, results in self.sections:
            out += ["", f"## {title}", ""]
            for r in results:
                out += [layer_table(r, self.options), ""]
        if self.capacity:
            out += ["", "## Capacity", "", capacity_table(self.capacity), ""]
        if self.timelines:
            out += ["", "## Memory over time", "", self.timeline_title, "",
                    "| row | peak | snapshot |", "|---|---:|---|"]
            out += [f"| {t.row} | {fmt_bytes(t.peak_bytes)} | {t.snapshot_file or '-'} |" for t in self.timelines]
            out += ["", "![memory over time](memory_timeline.png)", ""]
        for n in self.numerics:
            out += ["", f"## bf16 numerics: {n.label}", "", f"Each leaf's max |error| / max |truth|, then (rows `rms`) its rms error / rms truth; truth: {n.truth}.",
                     "", errors_table(n.errors, next(iter(n.errors))), ""]
        return "\n".join(out) + "\n"

    def write(self, out: Path, *, with_json: bool = True) -> list[Path]:
        """Write results.json, results.md and (with timelines) memory_timeline.png; the paths written."""
        paths = write_json_and_markdown(out, self.to_json() if with_json else None, self.markdown())
        if self.timelines and plot_timelines(self.timelines, self.timeline_title, out / "memory_timeline.png"):
            paths.append(out / "memory_timeline.png")
        return paths


def report_from_json(data: dict[str, Any]) -> Report:
    """Rebuild a ``Report`` from ``results.json`` (to redraw tables and plots on another machine)."""
    opts = BenchOptions(**data["options"])
    rep = Report(options=opts, notes=list(data.get("notes", [])), timeline_title=data.get("timeline_title", ""),
                 env=dict(data.get("environment", {})))
    for sec in data.get("sections", []):
        layers = []
        for lr in sec["layers"]:
            rows = [RowResult(**r) for r in lr.pop("rows")]
            layers.append(LayerResult(rows=rows, **lr))
        rep.sections.append((sec["title"], layers))
    rep.capacity = [CapacityResult(**{**c, "probes": [tuple(p) for p in c["probes"]]})
                    for c in data.get("capacity", [])]
    rep.timelines = [Timeline(**t) for t in data.get("timelines", [])]
    rep.numerics = [NumericsResult(**n) for n in data.get("numerics", [])]
    return rep
