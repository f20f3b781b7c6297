"""Host time per call of the GEMMs of one EP=64 chunk (2 experts, ~4096 rows each, Qwen3 shapes, bf16 on the
H200): ``torch._grouped_mm`` over offsets against ``torch.bmm`` on the same rows viewed ``(G, C, H)``, and the
fp32 weight-gradient sums per expert (``addmm`` with an output dtype) against one ``baddbmm`` with an output
dtype. Host time = wall time of N calls issued back to back, measured with the GPU kept busy first (so launches
never wait), divided by N; GPU time by CUDA events on a drained queue.

    python docs/bench/h200-uniform/gemm_host.py
"""
import time

import torch

from relay_compile.bench.measure import gpu_us_per_call

torch.manual_seed(0)
dev = "cuda"
G, C, H, F = 2, 4096, 2048, 768
x = torch.randn(G * C, H, device=dev, dtype=torch.bfloat16)
w13 = torch.randn(G, 2 * F, H, device=dev, dtype=torch.bfloat16)
dy = torch.randn(G * C, 2 * F, device=dev, dtype=torch.bfloat16)
offs = torch.tensor([C * (i + 1) for i in range(G)], device=dev, dtype=torch.int32)
acc = torch.zeros(G, 2 * F, H, device=dev, dtype=torch.float32)
busy = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def grouped():
    torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)


def batched():
    torch.bmm(x.view(G, C, H), w13.transpose(-2, -1)).view(G * C, 2 * F)


def wgrad_per_expert():
    for d, xe, a in zip(dy.t().split([C] * G, dim=1), x.split([C] * G), acc.unbind(0)):
        torch.addmm(a, d, xe, out_dtype=torch.float32, out=a)


def wgrad_batched():
    torch.baddbmm(acc, dy.view(G, C, 2 * F).transpose(1, 2), x.view(G, C, H), out_dtype=torch.float32, out=acc)


def host_us(fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    for _ in range(40):
        busy @ busy  # ~40 ms of queued GPU work: the calls below never wait for the GPU
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


ref = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs).float()
got = torch.bmm(x.view(G, C, H), w13.transpose(-2, -1)).view(G * C, 2 * F).float()
print(f"torch {torch.__version__}; bmm vs grouped_mm max |diff| {float((ref - got).abs().max()):.3g}")
acc.zero_()
wgrad_per_expert()
a1 = acc.clone()
acc.zero_()
wgrad_batched()
print(f"baddbmm(out_dtype=fp32) vs addmm per expert max |diff| {float((a1 - acc).abs().max()):.3g}")
print("| call | host us | GPU us |")
print("|---|---:|---:|")
for name, fn in [("_grouped_mm, 2 groups", grouped), ("bmm (G, C, H)", batched),
                 ("2x addmm fp32-out (per expert)", wgrad_per_expert), ("baddbmm fp32-out", wgrad_batched)]:
    hs = sorted(host_us(fn) for _ in range(5))
    print(f"| {name} | {hs[2]:.1f} (min {hs[0]:.1f}) | {gpu_us_per_call(fn, warmup=0):.1f} |")
