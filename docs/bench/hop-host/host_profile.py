"""Where the ring's host time goes, per function, on the device: cProfile over forward + backward steps of the
forced expert ring (stand-in EP, Qwen3 layer, bf16), after warm-ups; the host time per step with and without
the profiler beside the device time. Prints the functions with the most own time and the package's with the
most cumulative time, per hop pass.

    python docs/bench/hop-host/host_profile.py [--ep 64] [--tokens 4096] [--steps 5] [--top 40]
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

from relay_compile.bench.measure import forward_backward, quiet_warnings
from relay_compile.bench.sweep import standin_rows

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--top", type=int, default=40)
args = ap.parse_args()


def main() -> None:
    inp, rows = standin_rows(args.ep, args.tokens, ["ring expert"])

    def step():
        inp.clear_grads()
        forward_backward(rows["ring expert"], inp)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    print(f"EP={args.ep} tokens={args.tokens}: host {sorted(host)[len(host) // 2]:.2f} ms per step, "
          f"to the device's end {sorted(wall)[len(wall) // 2]:.2f} ms (medians of {args.steps})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats(key)
        stats.print_stats(args.top if key == "tottime" else "relay_compile", args.top)
        print(f"\n== by {key}, {args.steps} steps ==")
        print("\n".join(line[:200] for line in out.getvalue().splitlines() if line.strip())[:20000])


with quiet_warnings():
    main()
