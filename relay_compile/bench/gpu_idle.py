"""Where the GPU waits on the host: idle gaps of a profiled step, each put on the host code that ended it.

A step whose kernels sum to less than its wall time leaves the GPU idle somewhere: after a host sync (the
host then has to queue work again before the GPU sees any), or wherever the host falls behind (launch-bound
hops). ``idle_gaps`` reads a Kineto chrome trace (``torch.profiler``, CPU + CUDA activities): the GPU is busy
wherever any kernel, copy or fill runs on any of its streams (one device); every idle interval of at least
``min_us`` becomes a ``Gap``, put on the launch that ended it (the runtime or driver call with the first kernel's
correlation id): the ``cpu_op`` chain around that launch and, where the trace has Python stacks
(``with_stack=True``), the innermost frames of this package. ``runtime_calls`` counts the CUDA runtime and
driver calls of the trace (launches, event records, syncs): the host's side of a hop pass.

    python -m relay_compile.bench.gpu_idle --ep 8 --tokens 65536 --rows "a2a eager" "ring expert" [--stack]

A profiler with stacks slows the host (every Python call is recorded), so gap sizes come from a run without
``--stack`` and their places from one with it.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Trace categories: device work, the host calls that queue it, and host calls that wait for the device.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
# A stream, event or device sync (torch's blocking copies are a cudaMemcpyAsync and a stream sync).
SYNC_CALLS = ("Synchronize",)
# How close to the device going idle a sync must have been waiting, to be what left it idle.
SYNC_SLACK_US = 20.0
PACKAGE = "relay_compile/"


@dataclass(frozen=True, kw_only=True)
class Gap:
    """One interval in which no device work ran: ``start_us`` (trace clock) for ``dur_us``, ended by
    ``next_kernel``, queued by ``launch`` inside ``ops`` (outermost first) and ``frames`` (this package's
    innermost Python frames, outermost first; empty without stacks); ``after_sync``: the host waited for the
    device (that call) just before the gap."""

    start_us: float
    dur_us: float
    next_kernel: str
    launch: str
    ops: tuple[str, ...]
    frames: tuple[str, ...]
    after_sync: str | None

    def place(self, depth: int = 2) -> str:
        """Where the host was: the innermost ``depth`` package frames, else the op chain, else the launch."""
        if self.frames:
            return " > ".join(self.frames[-depth:])
        return " > ".join(self.ops[-depth:]) or self.launch


@dataclass(frozen=True)
class _Span:
    start: float
    end: float
    name: str


class _Nesting:
    """Host spans of one category on one thread (properly nested, as a thread's calls are), to answer which of them
    enclose a time point: each span's parent is found once, so a query walks one chain."""

    def __init__(self, spans: Iterable[_Span]) -> None:
        self.spans = sorted(spans, key=lambda s: (s.start, -s.end))
        self.starts = [s.start for s in self.spans]
        self.parent: list[int] = []
        open_: list[int] = []
        for i, s in enumerate(self.spans):
            while open_ and self.spans[open_[-1]].end < s.start:
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(i)

    def around(self, t: float) -> list[str]:
        """Names of the spans that contain ``t``, outermost first."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.spans[i].end < t:  # the last span to start ended before t: its enclosing ones
            i = self.parent[i]
        out = []
        while i >= 0:
            out.append(self.spans[i].name)
            i = self.parent[i]
        return out[::-1]


def _busy(events: Sequence[dict[str, Any]]) -> list[tuple[float, float, dict[str, Any]]]:
    """Device work merged into busy intervals: (start, end, the event that opened it), by start. One device: the
    one with the most work (a trace's device events carry the device as their ``pid``)."""
    work = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    if not work:
        return []
    device = collections.Counter(e.get("pid") for e in work).most_common(1)[0][0]
    work = sorted((e for e in work if e.get("pid") == device), key=lambda e: e["ts"])
    merged: list[tuple[float, float, dict[str, Any]]] = []
    for e in work:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end), merged[-1][2])
        else:
            merged.append((start, end, e))
    return merged


def _frame(name: str) -> str | None:
    """``relay_compile/runtime/ops.py(160): _run`` -> ``runtime/ops.py:_run``; None outside this package."""
    at = name.find(PACKAGE)
    if at < 0 or "): " not in name:
        return None
    path, func = name[at + len(PACKAGE):].split("): ", 1)
    return f"{path.split('(')[0]}:{func}"


def launch_sites(events: Sequence[dict[str, Any]]) -> Callable[[dict[str, Any]], tuple[str, list[str], list[str]]]:
    """Where the host queued each device event of the trace: a function of the event giving the launch's name (the
    runtime or driver call with its correlation id; ``"?"`` if none), the ``cpu_op`` chain around the launch and
    this package's Python frames around it (outermost first; empty without stacks)."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    by_thread: dict[tuple[Any, Any, str], list[_Span]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function") and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"), e["cat"])].append(
                _Span(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
    nesting = {key: _Nesting(spans) for key, spans in by_thread.items()}

    def site(device_event: dict[str, Any]) -> tuple[str, list[str], list[str]]:
        launch = launches.get(device_event.get("args", {}).get("correlation"))
        if launch is None:
            return "?", [], []
        at, thread = float(launch["ts"]), (launch.get("pid"), launch.get("tid"))
        ops = nesting[(*thread, "cpu_op")].around(at) if (*thread, "cpu_op") in nesting else []
        py = nesting[(*thread, "python_function")].around(at) if (*thread, "python_function") in nesting else []
        return launch["name"], ops, [f for f in map(_frame, py) if f is not None]

    return site


def idle_gaps(events: Sequence[dict[str, Any]], min_us: float = 10.0) -> list[Gap]:
    """The trace's device idle intervals of at least ``min_us`` between its first and last device work, in order."""
    site = launch_sites(events)
    syncs: list[tuple[float, float, str]] = []  # (end, start, name)
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "dur" in e and any(s in e["name"] + "\0" for s in SYNC_CALLS):
            syncs.append((float(e["ts"]) + float(e["dur"]), float(e["ts"]), e["name"]))
    syncs.sort()
    sync_ends = [t for t, _, _ in syncs]
    busy = _busy(events)
    gaps = []
    for (_, prev_end, _), (start, _, first) in zip(busy, busy[1:]):
        if start - prev_end < min_us:
            continue
        launch, ops, frames = site(first)
        # A sync that was waiting when the device went idle and returned inside the gap: the host waited for the
        # device, then had to queue work anew.
        after = None
        for end, began, name in syncs[bisect.bisect_left(sync_ends, prev_end - SYNC_SLACK_US):]:
            if end > start:
                break
            if began <= prev_end + SYNC_SLACK_US:
                after = name
                break
        gaps.append(Gap(start_us=prev_end, dur_us=start - prev_end, next_kernel=first["name"], launch=launch,
                        ops=tuple(ops), frames=tuple(frames), after_sync=after))
    return gaps


def device_span_us(events: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(first device work's start to last's end, time some device work ran) in microseconds."""
    busy = _busy(events)
    if not busy:
        return 0.0, 0.0
    return busy[-1][1] - busy[0][0], sum(end - start for start, end, _ in busy)


def runtime_calls(events: Sequence[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """CUDA runtime and driver calls by name: (count, host microseconds), most time first."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "dur" in e:
            out[e["name"]].append(float(e["dur"]))
    return dict(sorted(((k, (len(v), sum(v))) for k, v in out.items()), key=lambda kv: -kv[1][1]))


def by_place(gaps: Iterable[Gap], depth: int = 2) -> list[tuple[str, int, float]]:
    """Gaps summed by ``Gap.place`` (a sync before them marked): (place, count, microseconds), most first."""
    acc: dict[str, list[float]] = collections.defaultdict(list)
    for g in gaps:
        acc[("after " + g.after_sync + ": " if g.after_sync else "") + g.place(depth)].append(g.dur_us)
    return sorted(((k, len(v), sum(v)) for k, v in acc.items()), key=lambda r: -r[2])


def report(events: Sequence[dict[str, Any]], *, steps: int, min_us: float, top: int, depth: int) -> str:
    """A text table of one trace: span, busy time, the gaps by place and the runtime calls, per step."""
    span, busy = device_span_us(events)
    gaps = idle_gaps(events, min_us)
    lines = [f"device span {span / steps / 1e3:.2f} ms/step, busy {busy / steps / 1e3:.2f} ms/step, idle >= "
             f"{min_us:g} us: {sum(g.dur_us for g in gaps) / steps / 1e3:.2f} ms/step in {len(gaps) / steps:.1f} gaps",
             "| gaps' place (host code that queued the next work) | gaps/step | us/step |", "|---|---:|---:|"]
    lines += [f"| {place} | {n / steps:.1f} | {us / steps:.0f} |" for place, n, us in by_place(gaps, depth)[:top]]
    lines += ["| runtime/driver call | calls/step | host us/step |", "|---|---:|---:|"]
    lines += [f"| {name} | {n / steps:.1f} | {us / steps:.0f} |"
              for name, (n, us) in list(runtime_calls(events).items())[:top]]
    return "\n".join(lines)


def profile_steps(step: Callable[[], None], steps: int, with_stack: bool, path: Path) -> list[dict[str, Any]]:
    """``steps`` calls of ``step`` under the CUDA profiler (after one outside it); the chrome trace's events."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def host_syncs(step: Callable[[], None]) -> list[tuple[str, int]]:
    """The stream syncs and blocking copies of one call of ``step`` that ``torch.cuda.set_sync_debug_mode``
    reports (not event or device syncs: the trace's ``*Synchronize`` calls count those): (where, count), most
    first; where is the Python line that called the syncing op (for ops autograd runs, the ``backward()`` line)."""
    import warnings

    import torch

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    where = collections.Counter(f"{Path(w.filename).as_posix().split(PACKAGE)[-1]}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return where.most_common()


def main(argv: Sequence[str] | None = None) -> None:
    from relay_compile.bench.measure import quiet_warnings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--rows", nargs="+", default=["a2a eager", "ring expert"], help="rows of the sweep (bench.sweep)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stack", action="store_true", help="record Python stacks (slower host: places, not sizes)")
    ap.add_argument("--min-us", type=float, default=10.0)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--trace-dir", type=Path, default=Path("/tmp"))
    args = ap.parse_args(argv)
    with quiet_warnings():
        _rows(args)


def _rows(args: argparse.Namespace) -> None:
    """Each row of ``args.rows``: its unprofiled step time, syncs, and the report of its profiled steps."""
    import torch

    from relay_compile.bench.measure import clear_grads, forward_backward
    from relay_compile.bench.sweep import standin_rows

    inp, fns = standin_rows(args.ep, args.tokens, args.rows)
    for name, fn in fns.items():

        def step() -> None:
            clear_grads(fn, inp)
            forward_backward(fn, inp)

        for _ in range(2):  # warm-ups (a compiled row compiles here)
            step()
        wall = []
        for _ in range(5):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            wall.append(start.elapsed_time(end))
        syncs = host_syncs(step)
        events = profile_steps(step, args.steps, args.stack, args.trace_dir / f"gpu_idle_{name.replace(' ', '_')}.json")
        print(f"\n## {name}: EP={args.ep} tokens={args.tokens} {torch.cuda.get_device_name()}, step "
              f"{statistics.median(wall):.2f} ms unprofiled (median of 5), {args.steps} steps profiled"
              f"{' with stacks' if args.stack else ''}")
        print(f"stream syncs and blocking copies in one step: {sum(n for _, n in syncs)}: "
              + ", ".join(f"{w} x{n}" for w, n in syncs[:args.top]))
        print(report(events, steps=args.steps, min_us=args.min_us, top=args.top, depth=args.depth))


if __name__ == "__main__":
    main()
