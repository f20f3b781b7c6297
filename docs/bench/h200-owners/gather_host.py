"""Host time of one row gather, ``x[tok]`` (advanced indexing, ``aten::index``) against ``torch.index_select``
(issue 24, deliverable 3: the ring gathers a hop's rows one to three times per chunk).

    OMP_NUM_THREADS=1 python docs/bench/h200-owners/gather_host.py [--device cuda] [--calls 2000]

Host time: the calls issued back to back, timed on the host without a sync inside the loop (the GPU runs
behind; one sync after, outside the timing). GPU time per call: ``bench.measure.gpu_us_per_call``. Rows as a
ring chunk has them (Qwen3: H=2048, bf16; T=16384 tokens, 2048 and 8192 gathered rows). Both return the same
tensor (checked).
"""
import argparse
import time

import torch

from relay_compile.bench.measure import gpu_us_per_call

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--calls", type=int, default=2000)
args = ap.parse_args()
dev = torch.device(args.device)
torch.manual_seed(0)
x = torch.randn(16384, 2048, dtype=torch.bfloat16, device=dev)


def host_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


print(f"device {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), torch {torch.__version__}")
print("| rows | x[tok] host us | index_select host us | x[tok] GPU us | index_select GPU us |")
print("| ---: | ---: | ---: | ---: | ---: |")
calls = args.calls if dev.type == "cuda" else max(20, args.calls // 50)
for rows in (2048, 8192):
    tok = torch.randint(0, x.shape[0], (rows,), device=dev)
    assert torch.equal(x[tok], torch.index_select(x, 0, tok))
    fns = (lambda: x[tok], lambda: torch.index_select(x, 0, tok))
    host = [host_us(fn, calls) for fn in fns]
    gpu = [gpu_us_per_call(fn, calls) if dev.type == "cuda" else None for fn in fns]
    cells = [f"{v:.1f}" for v in host] + ["-" if v is None else f"{v:.1f}" for v in gpu]
    print(f"| {rows} | " + " | ".join(cells) + " |")
