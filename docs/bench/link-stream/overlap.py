"""Whether the stand-in's transfers run beside the hops' kernels: two profiled steps of each row (by default the
forced ring on the plain stand-in and on ``standin_group(n, link_stream=True)``); per row, the copies' time, how
much of it overlaps a kernel of another stream, the other kernels' time, and the union of all device work (busy).
A copy is a DtoD memcpy, or a ``bounded_copy_kernel`` (``link_ctas``: copies by a few thread blocks; the trace
gives a kernel no byte count, so its MiB read 0). ``--places``: then, per row, the copies by stream and by the host
code that queued them (the pass, then this package's innermost frames, from a second profile with Python stacks,
which slows the host): count, MiB, time, the time beside another stream's kernel, and the time no other stream ran
anything (a copy the rest of the device waited for).

    python docs/bench/link-stream/overlap.py [--ep 8] [--tokens 65536] [--places] [--rows NAME ...] OUT
"""
import argparse
import collections
from pathlib import Path
from typing import Any

import torch

from relay_compile.bench.gpu_idle import launch_sites, profile_steps
from relay_compile.bench.measure import clear_grads, forward_backward, quiet_warnings
from relay_compile.bench.sweep import standin_rows

ap = argparse.ArgumentParser()
ap.add_argument("out", type=Path)
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=65536)
ap.add_argument("--places", action="store_true")
ap.add_argument("--rows", nargs="+", default=["ring auto", "ring auto, link stream"])
args = ap.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
STEPS = 2
Event = dict[str, Any]
Span = tuple[float, float]


def union(intervals: list[Span]) -> list[Span]:
    merged: list[Span] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap(a: Span, spans: list[Span]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def span(e: Event) -> Span:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def is_copy(e: Event) -> bool:
    return (e["cat"] == "gpu_memcpy" and "DtoD" in e["name"]) or (
        e["cat"] == "kernel" and "bounded_copy_kernel" in e["name"])


def device_work(events: list[Event]) -> tuple[list[Event], list[Event], list[Event]]:
    """Every device event, the copies, and the kernels that are not copies."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    copies = [e for e in device if is_copy(e)]
    return device, copies, [e for e in device if e["cat"] == "kernel" and not is_copy(e)]


def beside(copies: list[Event], work: list[Event]) -> dict[Any, list[Span]]:
    """Per copy stream, the merged spans of ``work`` on every other stream."""
    return {tid: union([span(w) for w in work if w.get("tid") != tid]) for tid in {c.get("tid") for c in copies}}


def totals(name: str, events: list[Event]) -> None:
    device, copies, kernels = device_work(events)
    kernels_beside = beside(copies, kernels)
    overlapped = sum(overlap(span(c), kernels_beside[c.get("tid")]) for c in copies)
    busy = sum(b - a for a, b in union([span(e) for e in device]))
    print(f"| {name} | {sum(float(c['dur']) for c in copies) / 1e3 / STEPS:.2f} ({len(copies) // STEPS}) | "
          f"{overlapped / 1e3 / STEPS:.2f} | {sorted({str(c.get('tid')) for c in copies})} | "
          f"{sum(float(k['dur']) for k in kernels) / 1e3 / STEPS:.2f} | {busy / 1e3 / STEPS:.2f} |")


def places(events: list[Event]) -> None:
    """Per (stream, pass and host frames): the copies' count, MiB, ms, ms beside another stream's kernel, ms alone."""
    device, copies, kernels = device_work(events)
    site = launch_sites(events)
    kernels_beside, anything_beside = beside(copies, kernels), beside(copies, device)
    rows: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for c in copies:
        _, _, frames = site(c)
        direction = "backward" if any("ring_moe_backward_op" in f for f in frames) else "forward"
        row = rows[(str(c.get("tid")), f"{direction}: " + (" > ".join(frames[-3:]) or "?"))]
        a, b = span(c)
        row[0] += 1
        row[1] += float(c.get("args", {}).get("bytes", 0)) / 2**20
        row[2] += b - a
        row[3] += overlap((a, b), kernels_beside[c.get("tid")])
        row[4] += (b - a) - overlap((a, b), anything_beside[c.get("tid")])
    print("| stream | host place | copies/step | MiB/step | ms/step | beside a kernel ms | alone ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (tid, place), (n, mib, ms, over, alone) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"| {tid} | {place} | {n / STEPS:.1f} | {mib / STEPS:.0f} | {ms / 1e3 / STEPS:.2f} | "
              f"{over / 1e3 / STEPS:.2f} | {alone / 1e3 / STEPS:.2f} |")


def profiled(name: str, fn: Any, stacks: bool) -> list[Event]:
    def step() -> None:
        clear_grads(fn, inp)
        forward_backward(fn, inp)

    stem = name.replace(" ", "_").replace(",", "")
    return profile_steps(step, STEPS, stacks, args.out / f"overlap_{stem}{'_stack' if stacks else ''}.json")


if __name__ == "__main__":
    with quiet_warnings():
        inp, fns = standin_rows(args.ep, args.tokens, args.rows)
        print("| row | copies ms/step (n) | copies beside a kernel ms/step | copy streams | kernels ms/step | "
              "busy ms/step |")
        print("|---|---:|---:|---|---:|---:|")
        for name, fn in fns.items():
            totals(name, profiled(name, fn, stacks=False))
        for name, fn in fns.items() if args.places else ():
            print(f"\n{name}: copies by stream and host place (a profile with Python stacks)")
            places(profiled(name, fn, stacks=True))
        print(torch.cuda.get_device_name())
