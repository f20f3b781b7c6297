"""Whether the link stream's copies run beside the hops' kernels (``standin_group(n, link_stream=True)``): two
profiled steps of the forced ring on each stand-in; per row, the copies' time, how much of it overlaps a kernel
of another stream, the kernels' time, and the union of all device work (busy).

    python docs/bench/link-stream/overlap.py [--ep 8] [--tokens 65536] OUT
"""
import argparse
from pathlib import Path

import torch

from relay_compile.bench.gpu_idle import profile_steps
from relay_compile.bench.measure import clear_grads, forward_backward, quiet_warnings
from relay_compile.bench.sweep import standin_rows

ap = argparse.ArgumentParser()
ap.add_argument("out", type=Path)
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=65536)
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


with quiet_warnings():
    inp, fns = standin_rows(args.ep, args.tokens, ["ring auto", "ring auto, link stream"])
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
    print(torch.cuda.get_device_name())
