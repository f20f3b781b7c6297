"""Host time per call of the hop loop's device kernels at tiny shapes (host-bound: what a launch costs the host),
beside one aten launch: the Triton kernels (scatter-add of rows, SwiGLU forward and backward, fp32 grouped
weight gradients) against their eager forms. Medians of 7 repeats of 200 calls, the GPU kept busy ahead.

    python docs/bench/hop-host/launch.py
"""
import statistics
import time

import torch

from relay_compile.kernels import grouped_weight_grad as gwg
from relay_compile.kernels import scatter_add_rows as sar
from relay_compile.kernels import swiglu_backward as sb
from relay_compile.kernels import swiglu_forward as sf


def host_us(fn, calls=200, repeats=7):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        torch.cuda._sleep(50_000_000)  # keep the GPU busy: the host never waits on it
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


dev = "cuda"
rows, hidden, ffn = 64, 256, 128
sum_TH = torch.zeros(512, hidden, device=dev)
tok = torch.randint(0, 512, (rows,), device=dev)
rows_SH = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
scale = torch.rand(rows, 1, device=dev)
h13 = torch.randn(rows, 2 * ffn, device=dev, dtype=torch.bfloat16)
g = torch.randn(rows, ffn, device=dev, dtype=torch.bfloat16)
score = torch.rand(rows, device=dev)
x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
offs = torch.tensor([rows // 2, rows], device=dev, dtype=torch.int32)
dw = torch.zeros(2, ffn, hidden, device=dev)
a, b = torch.randn(4, device=dev), torch.randn(4, device=dev)
cases = {
    "aten add (one launch)": lambda: torch.add(a, b),
    "aten index_add_ fp32": lambda: sum_TH.index_add_(0, tok, scale * rows_SH.float()),
    "scatter_add_rows_ (Triton)": lambda: sar.scatter_add_rows_(sum_TH, tok, rows_SH, scale),
    "swiglu forward eager (silu, mul)": lambda: sf.reference(h13),
    "swiglu_forward (Triton)": lambda: sf.swiglu_forward(h13),
    "swiglu_backward_ (Triton)": lambda: sb.swiglu_backward_(h13, g, score),
    "grouped_weight_grad_ (Triton)": lambda: gwg.grouped_weight_grad_(g, x, offs, dw, accumulate=True),
}
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
for name, fn in cases.items():
    print(f"| {name} | {host_us(fn):.1f} us host per call |")
