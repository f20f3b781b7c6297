"""Timing and peak memory of rows on one configuration, side by side in this process (``measure_layer``).

Each row runs rank 0 of the configuration's stand-in group: ``opts.warmup`` steps, then ``opts.repeats`` timed
forward+backward steps (medians; with ``opts.interleave`` the rows take their timed steps in turns, one step of
every row per round), then one step under ``relay_compile.memory.PeakMemory``; the link model
(``relay_compile.bench.link_model``) adds the modeled link time. Results are ``RowResult``s in a ``LayerResult``,
with ratios to the row ``A2A_EAGER``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from relay_compile.bench.configs import BenchOptions, LayerConfig
from relay_compile.bench.inputs import LayerInputs, make_inputs
from relay_compile.bench.link_model import link_model
from relay_compile.bench.progress import Progress, fmt_bytes, fmt_ms
from relay_compile.bench.rows import A2A_EAGER, LayerFn, RowSkipped, RowSpec, default_rows
from relay_compile.bench.standin_group import drop_pending_messages, standin_group
from relay_compile.memory import PeakMemory
from relay_compile.runtime import chunk_graphs

log = logging.getLogger(__name__)

# Seconds of time budget a compiling row needs left to start (compilation takes tens of seconds to minutes).
COMPILE_RESERVE_S = 120.0


def clear_grads(fn: LayerFn, inp: LayerInputs) -> None:
    """Before a step: no gradient left from the last one, in the inputs or in parameters the layer owns (a layer
    that owns some, a module's, exposes ``clear_grads()``: torchtitan's rows)."""
    inp.clear_grads()
    owned = getattr(fn, "clear_grads", None)
    if owned is not None:
        owned()


def forward_backward(fn: LayerFn, inp: LayerInputs) -> Tensor:
    """One forward+backward; gradients land in the leaves' ``.grad``."""
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    y.backward(inp.grad_y_TH)
    return y


def time_step(fn: LayerFn, inp: LayerInputs, device: str) -> tuple[float, float]:
    """(forward ms, backward ms) of one step: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    clear_grads(fn, inp)
    if device.startswith("cuda"):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
        mid.record()
        y.backward(inp.grad_y_TH)
        end.record()
        end.synchronize()
        return start.elapsed_time(mid), mid.elapsed_time(end)
    t0 = time.perf_counter()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    t1 = time.perf_counter()
    y.backward(inp.grad_y_TH)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def gpu_us_per_call(fn: Callable[[], object], calls: int = 50, warmup: int = 3) -> float:
    """GPU time per call of ``fn`` in microseconds: CUDA events around ``calls`` calls issued back to back,
    after ``warmup`` calls and a drained queue (for probes of single ops; ``time_step`` times a layer)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def peak_step(fn: LayerFn, inp: LayerInputs, device: str) -> int:
    """Peak bytes above the resident inputs and weights during one forward+backward (``relay_compile.memory``).

    Everything allocated inside the step counts: the ring's transfer buffers (allocated inside its op), weight
    gradients, ``dx``, ``d_scores``; and, for a step that ran chunk programs (``runtime.chunk_graphs``), all
    the memory they hold: allocated before the step (warm-up steps made them) and their graphs' pools, which the
    allocator counts as free once a capture ends though the replays use them (``held_bytes``).
    """
    clear_grads(fn, inp)
    runs = chunk_graphs.runs()
    with PeakMemory(device) as mem:
        y = forward_backward(fn, inp)
        del y
    return mem.peak_bytes + (chunk_graphs.held_bytes() if chunk_graphs.runs() > runs else 0)


def free_cached(device: str) -> None:
    """Between rows and probes on a GPU: drop unreachable cycles and return cached blocks (avoids false OOMs)."""
    if device.startswith("cuda"):
        gc.collect()  # costs ~0.3 s: not on the CPU, where nothing is cached
        torch.cuda.empty_cache()


def _error_summary(e: BaseException, limit: int = 300) -> str:
    """One line for a table: the exception's type and message, with the root cause of wrapped errors."""
    if is_oom(e):
        return "out of memory: " + " ".join(str(e).split())[:limit]
    parts = [f"{type(e).__name__}: {' '.join(str(e).split())}"]
    cause = e.__cause__ or e.__context__
    if cause is not None and cause is not e:
        parts.append(f"caused by {type(cause).__name__}: {' '.join(str(cause).split())}")
    text = "; ".join(parts).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def row_failure(spec: RowSpec, e: Exception) -> str:
    """What a row that raised says in its table cell (``RowSkipped``: its message; else the error, after which
    messages a failed ring left posted are dropped)."""
    if isinstance(e, RowSkipped):
        return str(e)
    log.debug("row %s failed", spec.name, exc_info=True)
    drop_pending_messages()
    return _error_summary(e)


def after_row(fn: LayerFn | None, inp: LayerInputs, device: str) -> None:
    """After a row, failed or not: no gradient left in the inputs or the row's parameters, cached blocks freed."""
    if fn is not None:
        clear_grads(fn, inp)
    inp.clear_grads()
    free_cached(device)


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is an out-of-memory error (the allocator's, or one whose message says so)."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


@dataclass(kw_only=True)
class RowResult:
    """One measured row (JSON-able). Times in ms (medians), memory in bytes; None where not measured."""

    row: str
    kind: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    total_ms: float | None = None
    peak_bytes: int | None = None
    time_ratio: float | None = None  # total_ms / eager a2a's
    peak_ratio: float | None = None  # peak_bytes / eager a2a's
    link: dict[str, Any] | None = None  # LinkModel fields (simulated)
    model_ratio: float | None = None  # link-modeled total / eager a2a's link-modeled total
    spread: float | None = None  # slowest over fastest timed step, minus 1
    note: str = ""
    skipped: str = ""


@dataclass(kw_only=True)
class LayerResult:
    """All rows of one configuration (JSON-able): the configuration, its label, resident bytes and the check."""

    config: dict[str, Any]
    label: str
    resident_bytes: int
    rows: list[RowResult] = field(default_factory=list)
    check: str = ""

    def row(self, name: str) -> RowResult:
        for r in self.rows:
            if r.row == name:
                return r
        raise KeyError(f"no row {name!r} in {self.label}; rows: {[r.row for r in self.rows]}")


def _check_ring(cfg: LayerConfig, fns: dict[str, LayerFn], inp: LayerInputs) -> str:
    """Forward of ``ring overlap`` against eager a2a on this configuration's inputs (max error / max |y|)."""
    if A2A_EAGER not in fns or "ring overlap" not in fns:
        return ""
    with torch.no_grad():
        args = (inp.x_TH.detach(), inp.topk_ids_TK, inp.topk_scores_TK.detach(), *(w.detach() for w in inp.weights))
        want = fns[A2A_EAGER](*args).float()
        got = fns["ring overlap"](*args).float()
    rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    return f"ring overlap vs a2a eager forward: max |diff| / max |y| = {rel:.2e}"


def measure_layer(
    cfg: LayerConfig,
    opts: BenchOptions,
    rows: Sequence[RowSpec] | None = None,
    *,
    extra_rows: Sequence[RowSpec] = (),
    progress: Progress | None = None,
    weights: list[Tensor] | None = None,
    into: LayerResult | None = None,
    deadline: float | None = None,
) -> LayerResult:
    """Measure every row on one configuration, side by side in this process.

    Args:
        rows: default ``default_rows(opts)``; the row named ``"a2a eager"`` is the baseline of ratios.
        extra_rows: appended rows (for example a future compiled reference layer).
        weights: reuse this rank's experts (same shapes as ``make_weights(cfg)``).
        into: append the rows to this earlier result of the same configuration (inputs are seeded, so they
            are the same tensors) and recompute its ratios.
        deadline: a ``time.perf_counter()`` value; rows that would start after it are skipped and say so.

    A row that raises ``RowSkipped``, runs out of memory or fails keeps its place with the reason in ``skipped``.
    """
    progress = progress or Progress()
    chunk_graphs.clear()  # what another configuration's rows left held is not this one's
    specs = list(rows if rows is not None else default_rows(opts)) + list(extra_rows)
    group = standin_group(cfg.ep)
    inp = make_inputs(cfg, weights)
    result = into or LayerResult(config=dataclasses.asdict(cfg), label=cfg.label(), resident_bytes=inp.resident_bytes())
    fns: dict[str, LayerFn] = {}
    in_turns: list[tuple[RowSpec, RowResult, LayerFn]] = []  # built and warm, timed together (opts.interleave)
    for spec in specs:
        row = RowResult(row=spec.name, kind=spec.kind, note=spec.note)
        result.rows.append(row)
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and (left <= 0 or (spec.compiles and left < COMPILE_RESERVE_S)):
            row.skipped = ("time budget spent" if left <= 0
                           else f"less than {COMPILE_RESERVE_S:g} s of the time budget left to compile")
            _report_row(progress, cfg, row)
            continue
        fn: LayerFn | None = None
        try:
            fn = spec.build(cfg, group)
            for _ in range(opts.warmup):
                time_step(fn, inp, cfg.device)
            if opts.interleave:
                in_turns.append((spec, row, fn))
                clear_grads(fn, inp)
                continue
            _complete_row(cfg, opts, spec, row, fn, inp, [time_step(fn, inp, cfg.device) for _ in range(_n(opts))])
            fns[spec.name] = fn
        except Exception as e:  # one failing row must not lose the others
            row.skipped = row_failure(spec, e)
        after_row(fn, inp, cfg.device)
        _report_row(progress, cfg, row)
    times = _time_in_turns(cfg, opts, in_turns, inp)
    for spec, row, fn in in_turns:
        try:
            if not row.skipped:
                _complete_row(cfg, opts, spec, row, fn, inp, times[spec.name])
                fns[spec.name] = fn
        except Exception as e:  # noqa: BLE001 -- as above
            row.skipped = row_failure(spec, e)
        after_row(fn, inp, cfg.device)
        _report_row(progress, cfg, row)
    check = _check_ring(cfg, fns, inp)
    if check:
        result.check = check
        progress.note(check)
    _fill_ratios(result)
    del inp, fns
    free_cached(cfg.device)
    return result


def _n(opts: BenchOptions) -> int:
    return max(1, opts.repeats)


def _complete_row(
    cfg: LayerConfig, opts: BenchOptions, spec: RowSpec, row: RowResult, fn: LayerFn, inp: LayerInputs,
    times: list[tuple[float, float]],
) -> None:
    """A timed row's medians, its peak (one more step, ``opts.memory``) and its link model."""
    row.fwd_ms = statistics.median(t[0] for t in times)
    row.bwd_ms = statistics.median(t[1] for t in times)
    row.total_ms = row.fwd_ms + row.bwd_ms  # the sum of the medians, as the link model uses them
    totals = [f + b for f, b in times]
    row.spread = round(max(totals) / min(totals) - 1, 4) if min(totals) > 0 else None
    if opts.memory:
        row.peak_bytes = peak_step(fn, inp, cfg.device)
    row.link = dataclasses.asdict(link_model(cfg, spec, row.fwd_ms, row.bwd_ms, opts.link_gbps))


def _time_in_turns(
    cfg: LayerConfig, opts: BenchOptions, rows: list[tuple[RowSpec, RowResult, LayerFn]], inp: LayerInputs
) -> dict[str, list[tuple[float, float]]]:
    """``opts.repeats`` rounds of one step of every row in turn: each row's (forward, backward) ms. A row whose
    step raises gets the reason in ``skipped`` and leaves the later rounds."""
    times: dict[str, list[tuple[float, float]]] = {spec.name: [] for spec, _, _ in rows}
    for _ in range(_n(opts)):
        for spec, row, fn in rows:
            if row.skipped:
                continue
            try:
                times[spec.name].append(time_step(fn, inp, cfg.device))
            except Exception as e:  # noqa: BLE001 -- one failing row must not lose the others
                row.skipped = row_failure(spec, e)
            clear_grads(fn, inp)
    return times


# A variant a script times beside others: its layer function, and what it runs under (a patch; ``nullcontext``).
Variant = tuple[LayerFn, Callable[[], contextlib.AbstractContextManager]]


def time_variants(variants: dict[str, Variant], inp: LayerInputs, device: str, rounds: int, warmup: int = 2
                  ) -> dict[str, list[tuple[float, float]]]:
    """``warmup`` then ``rounds`` rounds of one step of every variant in turn, each under its context: the kept
    rounds' (forward, backward) ms per variant (a script's A/B of patched code paths; ``measure_layer`` times a
    sweep's rows)."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for round_ in range(warmup + rounds):
        for name, (fn, context) in variants.items():
            with context():
                t = time_step(fn, inp, device)
            if round_ >= warmup:
                times[name].append(t)
    return times


def variants_table(times: dict[str, list[tuple[float, float]]], baseline: str,
                   peaks: dict[str, int] | None = None) -> list[str]:
    """A markdown table of ``time_variants``' medians: forward, backward and step ms, the step over ``baseline``'s,
    the steps' spread (max - min over the median) and, given, the peak MiB."""
    ref = statistics.median(sum(t) for t in times[baseline])
    peak_head, peak_rule = (" peak MiB |", "---:|") if peaks else ("", "")
    lines = [f"| row | forward ms | backward ms | step ms | / {baseline} | spread |{peak_head}",
             f"|---|---:|---:|---:|---:|---:|{peak_rule}"]
    for name, ts in times.items():
        steps = [sum(t) for t in ts]
        m = statistics.median(steps)
        forward, backward = statistics.median(f for f, _ in ts), statistics.median(b for _, b in ts)
        peak = f" {peaks[name] / 2**20:.0f} |" if peaks else ""
        lines.append(f"| {name} | {forward:.2f} | {backward:.2f} | {m:.2f} | {m / ref:.3f}x | "
                     f"{(max(steps) - min(steps)) / m:.1%} |{peak}")
    return lines


def _report_row(progress: Progress, cfg: LayerConfig, row: RowResult) -> None:
    head = f"{cfg.name} EP={cfg.ep} T={cfg.tokens} | {row.row:<34}"
    if row.skipped:
        progress.line(f"{head} | skipped: {row.skipped}")
        return
    progress.line(f"{head} | fwd {fmt_ms(row.fwd_ms)} ms + bwd {fmt_ms(row.bwd_ms)} ms "
                  f"= {fmt_ms(row.total_ms)} ms | peak {fmt_bytes(row.peak_bytes)}")


def _fill_ratios(result: LayerResult) -> None:
    base = next((r for r in result.rows if r.row == A2A_EAGER and not r.skipped), None)
    if base is None:
        return
    for r in result.rows:
        if r.skipped:
            continue
        if base.total_ms and r.total_ms is not None:
            r.time_ratio = r.total_ms / base.total_ms
        if base.peak_bytes and r.peak_bytes is not None:
            r.peak_ratio = r.peak_bytes / base.peak_bytes
        if base.link and r.link:
            r.model_ratio = r.link["total_ms"] / base.link["total_ms"]


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Hide the deprecation warnings torch prints on every collective of the ring (they are not ours to fix here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        yield

