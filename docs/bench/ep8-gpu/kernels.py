"""Where the GPU time of the EP=8 ring goes at 65536 tokens per rank (issue 24's 0.7x bar): per-kernel GPU time of
one forward + backward, the ring forced (recomputing and with saved projections) beside a2a eager.

    python docs/bench/ep8-gpu/kernels.py [--ep 8] [--tokens 65536] [--top 25] [--rows "a2a eager" "ring expert" ...]
"""
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile.bench.measure import forward_backward, quiet_warnings
from relay_compile.bench.sweep import standin_rows

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=65536)
ap.add_argument("--top", type=int, default=25)
ap.add_argument("--rows", nargs="+", default=["a2a eager", "ring expert", "ring expert saved"])
args = ap.parse_args()


def step(fn):
    inp.clear_grads()
    forward_backward(fn, inp)


with quiet_warnings():
    inp, rows = standin_rows(args.ep, args.tokens, args.rows)
    for name, fn in rows.items():
        for _ in range(2):
            step(fn)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(fn)
            torch.cuda.synchronize()
        kernels = collections.Counter()
        counts = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                key = e.name[:90]
                kernels[key] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                counts[key] += 1
        total = sum(kernels.values())
        print(f"\n== {name}: EP={args.ep} tokens={args.tokens}: GPU {total / 1e3:.2f} ms in "
              f"{sum(counts.values())} kernels")
        for key, us in kernels.most_common(args.top):
            print(f"  {us / 1e3:8.2f} ms {100 * us / total:5.1f}% {counts[key]:5d}x  {key}")
