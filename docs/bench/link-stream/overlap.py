"""Whether the link stream's copies run beside the hops' kernels (``standin_group(n, link_stream=True)``): two
profiled steps of the forced ring on each stand-in; per row, the copies' time, how much of it overlaps a kernel
of another stream, the kernels' time, and the union of all device work (busy). ``--places``: then, per row, the
copies by stream and by the host code that queued them (the pass, then this package's innermost frames, from a
second profile with Python stacks): count, MiB, time, the time beside another stream's kernel, and the time no other stream ran
anything (a copy the rest of the device waited for).

    python docs/bench/link-stream/overlap.py [--ep 8] [--tokens 65536] [--places] [--rows NAME ...] OUT
"""
import argparse
import collections
from pathlib import Path

import torch

from relay_compile.bench.gpu_idle import LAUNCH_CATEGORIES, _frame, _Nesting, _Span, profile_steps
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


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def places(events: list[dict], copies: list[dict], device: list[dict]) -> None:
    """Per (stream, host place): the copies' count, MiB, ms, ms beside another stream's kernel, ms alone."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    frames: dict[tuple, list[_Span]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e:
            frames[(e.get("pid"), e.get("tid"))].append(_Span(float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                                                              e["name"]))
    nesting = {k: _Nesting(v) for k, v in frames.items()}
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    rows: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for c in copies:
        launch = launches.get(c.get("args", {}).get("correlation"))
        place = "?"
        if launch is not None:
            chain = nesting.get((launch.get("pid"), launch.get("tid")))
            named = [f for f in map(_frame, chain.around(float(launch["ts"])) if chain else []) if f]
            direction = "backward" if any("ring_moe_backward_op" in f for f in named) else "forward"
            place = f"{direction}: " + (" > ".join(named[-3:]) or "?")
        others = union([span(d) for d in device if d.get("tid") != c.get("tid")])
        kernels = union([span(d) for d in device if d.get("tid") != c.get("tid") and d["cat"] == "kernel"])
        a, b = span(c)
        row = rows[(str(c.get("tid")), place)]
        row[0] += 1
        row[1] += float(c.get("args", {}).get("bytes", 0)) / 2**20
        row[2] += b - a
        row[3] += overlap((a, b), kernels)
        row[4] += (b - a) - overlap((a, b), others)
    print("| stream | host place | copies/step | MiB/step | ms/step | beside a kernel ms | alone ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (tid, place), (n, mib, ms, beside, alone) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"| {tid} | {place} | {n / STEPS:.1f} | {mib / STEPS:.0f} | {ms / 1e3 / STEPS:.2f} | "
              f"{beside / 1e3 / STEPS:.2f} | {alone / 1e3 / STEPS:.2f} |")


with quiet_warnings():
    inp, fns = standin_rows(args.ep, args.tokens, args.rows)
    print("| row | copies ms/step (n) | copies beside a kernel ms/step | copy streams | kernels ms/step | busy ms/step |")
    print("|---|---:|---:|---|---:|---:|")
    for name, fn in fns.items():
        def step() -> None:
            clear_grads(fn, inp)
            forward_backward(fn, inp)

        step()
        events = profile_steps(step, STEPS, False, args.out / f"overlap_{name.replace(' ', '_').replace(',', '')}.json")
        device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        copies = [e for e in device if e["cat"] == "gpu_memcpy" and "DtoD" in e["name"]]
        kernels = [e for e in device if e["cat"] == "kernel"]
        spans = lambda es: [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in es]  # noqa: E731
        others = {tid: union(spans([k for k in kernels if k.get("tid") != tid]))  # per copy stream, merged once
                  for tid in {c.get("tid") for c in copies}}
        beside = sum(overlap(spans([c])[0], others[c.get("tid")]) for c in copies)
        busy = sum(b - a for a, b in union(spans(device)))
        print(f"| {name} | {sum(float(c['dur']) for c in copies) / 1e3 / STEPS:.2f} ({len(copies) // STEPS}) | "
              f"{beside / 1e3 / STEPS:.2f} | {sorted({str(c.get('tid')) for c in copies})} | "
              f"{sum(float(k['dur']) for k in kernels) / 1e3 / STEPS:.2f} | {busy / 1e3 / STEPS:.2f} |")
    if args.places:
        for name, fn in fns.items():
            def step() -> None:
                clear_grads(fn, inp)
                forward_backward(fn, inp)

            path = args.out / f"overlap_{name.replace(' ', '_').replace(',', '')}_stack.json"
            events = profile_steps(step, STEPS, True, path)
            device = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
            print(f"\n{name}: copies by stream and host place (a profile with Python stacks)")
            places(events, [e for e in device if e["cat"] == "gpu_memcpy" and "DtoD" in e["name"]], device)
    print(torch.cuda.get_device_name())
