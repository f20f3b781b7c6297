"""Row gathers on the H200: ``x[tok]`` (aten::index) against ``x.index_select(0, tok)``, host time per call and
GPU time per call, at the ring's per-hop shapes (EP=64: ~8192 rows of H=2048 bf16 out of 65536 tokens).

    python docs/bench/h200-hostcost/gather_ab.py
"""
import time

import torch

x = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16)
for rows in (8192, 65536):
    tok = torch.randint(0, 65536, (rows,), device="cuda").sort().values
    for name, fn in (("x[tok]", lambda: x[tok]), ("index_select", lambda: x.index_select(0, tok))):
        assert torch.equal(fn(), x[tok])
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        # host: launches with the GPU kept busy far ahead (a big matmul queued first)
        big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(30):
            big @ big
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        e[0].record()
        for _ in range(200):
            fn()
        e[1].record()
        e[1].synchronize()
        gpu_us = e[0].elapsed_time(e[1]) / 200 * 1e3
        print(f"rows {rows:6d} {name:13s} host {host_us:6.1f} us/call  gpu {gpu_us:7.1f} us/call")
