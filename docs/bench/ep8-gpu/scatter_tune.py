"""The ring's fp32 scatter-add of rows (``kernels.scatter_add_rows``) at the EP=8, 65536-token hop shapes: GPU time
per call for columns per program x warps, then the forced ring at that size with the current and the fastest
configuration beside a2a eager (interleaved rounds), and the ring with SwiGLU's forward pointwise step eager
(``kernels.swiglu_forward`` off) for its A/B.

    python docs/bench/ep8-gpu/scatter_tune.py [--rounds 5]
"""
import argparse
import itertools
import statistics

import torch

from relay_compile.bench.measure import gpu_us_per_call, quiet_warnings, time_step
from relay_compile.bench.sweep import standin_rows
from relay_compile.kernels import scatter_add_rows as sar
from relay_compile.kernels import swiglu_forward

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
tokens, hidden = 65536, 2048
gen = torch.Generator(device="cuda").manual_seed(0)
sum_TH = torch.zeros(tokens, hidden, device="cuda", dtype=torch.float32)


best = {}
for rows in (16384, 32768):
    tok_S = torch.randint(0, tokens, (rows,), device="cuda", generator=gen)
    rows_SH = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale_S1 = torch.rand(rows, 1, device="cuda", generator=gen)
    want = sum_TH.clone().zero_()
    sar.reference(want, tok_S, rows_SH, scale_S1)
    print(f"rows {rows}: bytes read {rows * hidden * 2 / 1e6:.0f} MB, fp32 adds {rows * hidden * 4 / 1e6:.0f} MB")
    for block_h, warps in itertools.product((512, 1024, 2048), (2, 4, 8, 16)):
        sar._BLOCK_H, sar._NUM_WARPS = block_h, warps
        got = torch.zeros_like(sum_TH)
        sar.scatter_add_rows_(got, tok_S, rows_SH, scale_S1)
        err = (got - want).abs().max().item()
        us = gpu_us_per_call(lambda: sar.scatter_add_rows_(sum_TH, tok_S, rows_SH, scale_S1), calls=20)
        best.setdefault(rows, []).append((us, block_h, warps))
        print(f"  BLOCK_H {block_h:5d} warps {warps:2d}: {us:8.1f} us  ({rows * hidden * 6 / us / 1e6:.2f} TB/s of"
              f" rows + sums)  max err {err:.1e}")
sar._BLOCK_H, sar._NUM_WARPS = 1024, 4  # the configuration before this tuning
fastest = min(((b, w) for _, b, w in best[16384]),
              key=lambda cfg: sum(us for r in best for us, b, w in best[r] if (b, w) == cfg))
print(f"fastest over both sizes: BLOCK_H {fastest[0]} warps {fastest[1]}")

inp, fns = standin_rows(8, 65536, ["a2a eager", "ring expert"])
ring = fns["ring expert"]


def with_config(block_h, warps):
    def run(*a):
        sar._BLOCK_H, sar._NUM_WARPS = block_h, warps
        return ring(*a)
    return run


def eager_swiglu(*a):
    applies = swiglu_forward.applies
    swiglu_forward.applies = lambda h: False
    try:
        return with_config(1024, 4)(*a)
    finally:
        swiglu_forward.applies = applies


rows_ = {"a2a eager": fns["a2a eager"],
         "ring (1024, 4)": with_config(1024, 4), f"ring {fastest}": with_config(*fastest),
         "ring (1024, 4), swiglu forward eager": eager_swiglu}
times = {n: [] for n in rows_}
with quiet_warnings():
    for round_ in range(2 + args.rounds):  # two warm-up rounds, then interleaved fwd+bwd
        for n, fn in rows_.items():
            ms = sum(time_step(fn, inp, "cuda"))
            if round_ >= 2:
                times[n].append(ms)
ref = statistics.median(times["a2a eager"])
for n, ts in times.items():
    m = statistics.median(ts)
    print(f"| {n} | {m:.2f} ms | {m / ref:.3f}x | spread {(max(ts) - min(ts)) / m:.0%} |")
