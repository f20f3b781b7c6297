"""Memory over time of one forward+backward (paper Figures 4 and 7): ``record_timeline`` -> ``Timeline``.

The events come from ``relay_compile.memory.memory_events`` (CUDA: the caching allocator's memory history, whose
snapshot is also written for pytorch.org/memory_viz; CPU: profiler events). A marker allocation between forward
and backward shows where backward starts; its two events are removed from the series.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relay_compile.bench.configs import LayerConfig, MiB
from relay_compile.bench.inputs import LayerInputs, make_inputs
from relay_compile.bench.measure import forward_backward, free_cached
from relay_compile.bench.progress import Progress, fmt_bytes
from relay_compile.bench.rows import LayerFn, RowSpec
from relay_compile.bench.standin_group import standin_group
from relay_compile.memory import MemoryEvents, memory_events

# A marker allocation between forward and backward: an odd size no tensor of the layer has (512-aligned so the
# CUDA caching allocator keeps it exact). Its two events are removed from the series.
BACKWARD_MARKER_BYTES = 512 * 10007


@dataclass(kw_only=True)
class Timeline:
    """Allocated bytes above the level at the start, over one forward+backward (a step function)."""

    row: str
    times_ms: list[float]
    bytes: list[int]
    backward_starts_ms: float | None
    peak_bytes: int
    snapshot_file: str = ""


def _downsample(times: list[float], levels: list[int], points: int = 4000) -> tuple[list[float], list[int]]:
    """At most ``points`` points; each bin keeps its maximum, so peaks survive."""
    if len(times) <= points:
        return times, levels
    t0, t1 = times[0], times[-1]
    width = (t1 - t0) / points or 1.0
    out_t: list[float] = []
    out_b: list[int] = []
    i = 0
    for k in range(points):
        end = t0 + (k + 1) * width
        best = None
        while i < len(times) and (times[i] <= end or k == points - 1):
            best = levels[i] if best is None else max(best, levels[i])
            i += 1
        if best is not None:
            out_t.append(t0 + k * width)
            out_b.append(best)
    return out_t, out_b


def _marked_step(fn: LayerFn, inp: LayerInputs, device: str) -> None:
    """One forward+backward with the marker allocated and freed between them."""
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    marker = torch.empty(BACKWARD_MARKER_BYTES, dtype=torch.uint8, device=device)
    del marker
    y.backward(inp.grad_y_TH)
    del y


def levels_without_marker(events: MemoryEvents) -> tuple[list[float], list[int], float | None]:
    """Running level (ms, bytes above the start) of ``events``, the marker's pair removed; the marker's time (ms)."""
    marker_at = None
    times, levels, level = [], [], 0
    skip_free = False
    for t_ns, d in zip(events.times_ns, events.nbytes, strict=True):
        t = t_ns / 1e6
        if marker_at is None and d == BACKWARD_MARKER_BYTES:
            marker_at, skip_free = t, True
            continue
        if skip_free and d == -BACKWARD_MARKER_BYTES:
            skip_free = False
            continue
        level += d
        times.append(t)
        levels.append(level)
    return times, levels, marker_at


def strip_frames(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The snapshot without Python/C++ stack frames (memory_viz still draws it), for a small file."""
    snap = dict(snapshot)
    snap["device_traces"] = [[{k: v for k, v in e.items() if k != "frames"} for e in trace]
                             for trace in snapshot.get("device_traces", [])]
    segs = []
    for seg in snapshot.get("segments", []):
        seg = dict(seg)
        seg["blocks"] = [{k: v for k, v in b.items() if k != "frames"} for b in seg.get("blocks", [])]
        segs.append(seg)
    snap["segments"] = segs
    return snap


def record_timeline(
    cfg: LayerConfig, spec: RowSpec, out_dir: Path | None, *, max_file_bytes: int = 12 * MiB,
    weights: list[Tensor] | None = None, progress: Progress | None = None,
) -> Timeline:
    """Memory over one forward+backward of ``spec`` (after one warm-up step).

    ``relay_compile.memory.memory_events``: on CUDA from the memory history, whose snapshot goes to
    ``out_dir/memory_<row>.pickle`` (open it at pytorch.org/memory_viz; stack frames are dropped when the file
    would exceed ``max_file_bytes``); on the CPU from profiler events, no snapshot file.
    """
    progress = progress or Progress()
    group = standin_group(cfg.ep)
    inp = make_inputs(cfg, weights)
    fn = spec.build(cfg, group)
    forward_backward(fn, inp)  # warm-up: first-call allocations (specs, workspaces) stay out of the picture
    inp.clear_grads()
    free_cached(cfg.device)
    snapshot_file = ""
    events = memory_events(_marked_step, fn, inp, cfg.device, device=cfg.device, cuda_source="history")
    times, levels, marker = levels_without_marker(events)
    if events.snapshot is not None and out_dir is not None:
        slug = "a2a" if spec.kind == "a2a" else "ring"
        path = out_dir / f"memory_{slug}.pickle"
        data = pickle.dumps(events.snapshot)
        if len(data) > max_file_bytes:
            data = pickle.dumps(strip_frames(events.snapshot))
        path.write_bytes(data)
        snapshot_file = path.name
    times, levels = [0.0, *times], [0, *levels]
    peak = max(levels)
    ds_t, ds_b = _downsample(times, levels)
    inp.clear_grads()
    del inp
    free_cached(cfg.device)
    progress.line(f"memory timeline {cfg.name} EP={cfg.ep} T={cfg.tokens} | {spec.name:<34} | "
                  f"{len(times)} events, peak {fmt_bytes(peak)}" + (f" -> {snapshot_file}" if snapshot_file else ""))
    return Timeline(row=spec.name, times_ms=ds_t, bytes=ds_b, backward_starts_ms=marker, peak_bytes=peak,
                    snapshot_file=snapshot_file)
