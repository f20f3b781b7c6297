"""The fp32 grouped weight-gradient kernel on the H200 (issue 24, "a cheaper hop"): correctness, GPU and host time
per call against one fp32-output ``addmm`` per expert (what the ring ran before), at the ring's hop shapes and a
few tile configurations; then ring steps with the kernel on and off, interleaved, beside a2a eager.

    python docs/bench/h200-hop-host/kernel_ab.py [--rounds 5]
"""
import argparse
import statistics
import time

import torch

from relay_compile import grouped_gemm, ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.kernels import grouped_weight_grad as k
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--skip-kernel", action="store_true")
args = ap.parse_args()
dev = "cuda"


def busy():
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(40):
        big @ big


def timed(fn, n=30):
    """(host us per call with the GPU kept busy, GPU us per call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    busy()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    e[0].record()
    for _ in range(n):
        fn()
    e[1].record()
    e[1].synchronize()
    return host, e[0].elapsed_time(e[1]) / n * 1e3


CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
           (128, 128, 32, 4, 4), (256, 128, 64, 8, 3)]
if not args.skip_kernel:
    print("| experts | rows/expert | O x I | addmm loop host us | GPU us | kernel config | host us | GPU us | max rel err |")
    print("|---:|---:|---|---:|---:|---|---:|---:|---:|")
    for experts, per in ((16, 1024), (16, 4096), (2, 1024), (2, 8192)):
        for o, i in ((1536, 2048), (2048, 768)):
            g = torch.Generator(device=dev).manual_seed(0)
            counts = [per + (j % 3 - 1) * per // 32 for j in range(experts)]  # uneven, near-balanced
            rows = sum(counts)
            dy = torch.randn(rows, o, device=dev, dtype=torch.bfloat16, generator=g)
            x = torch.randn(rows, i, device=dev, dtype=torch.bfloat16, generator=g)
            offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
            acc = torch.zeros(experts, o, i, device=dev)
            want = torch.zeros_like(acc)
            k.reference(dy, x, offs, want, accumulate=False)

            def loop():
                for d_OS, x_e, into in grouped_gemm._per_expert(dy, x, counts, acc):
                    grouped_gemm.addmm_widened(d_OS, x_e, into)

            lh, lg = timed(loop)
            for cfg in CONFIGS:
                k._CONFIG = cfg
                got = torch.empty_like(acc)
                k.grouped_weight_grad_(dy, x, offs, got, accumulate=False)
                err = ((got - want).abs().max() / want.abs().max()).item()
                kh, kg = timed(lambda: k.grouped_weight_grad_(dy, x, offs, acc, accumulate=True))
                print(f"| {experts} | {per} | {o}x{i} | {lh:.1f} | {lg:.1f} | {cfg} | {kh:.1f} | {kg:.1f} | {err:.1e} |",
                      flush=True)
    k._CONFIG = CONFIGS[0]

applies = k.applies
print("\n| EP | tokens | path | wall ms (median) | host fwd+bwd ms | spread |")
print("|---:|---:|---|---:|---:|---:|")
for ep in (8, 64):
    group = standin_group(ep)
    for tokens in (16384, 65536):
        cfg = QWEN3_30B.with_(device=dev, dtype="bf16", ep=ep, tokens=tokens)
        inp = make_inputs(cfg)

        def step(path):
            inp.clear_grads()
            layer = a2a_moe if path == "a2a" else ring_moe
            k.applies = applies if path == "ring+kernel" else (lambda *a: False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            kw = {} if path == "a2a" else {"ring": "always"}  # the ring even where auto keeps the all-to-all
            y = layer(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, **kw)
            y.backward(inp.grad_y_TH)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3

        paths = ("a2a", "ring", "ring+kernel")
        for p in paths:
            step(p), step(p)
        res = {p: [] for p in paths}
        for _ in range(args.rounds):
            for p in paths:
                res[p].append(step(p))
        for p in paths:
            walls = [w for w, _ in res[p]]
            med = statistics.median(walls)
            host = statistics.median(h for _, h in res[p])
            print(f"| {ep} | {tokens} | {p} | {med:.1f} | {host:.1f} | {(max(walls) - min(walls)) / med:.0%} |", flush=True)
        del inp
        torch.cuda.empty_cache()
k.applies = applies
