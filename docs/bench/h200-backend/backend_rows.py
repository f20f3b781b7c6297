"""Device run for issue 10: the relaymoe-backend row beside a2a eager and ring_moe direct, Qwen3 layer, EP 8 / 64."""
import dataclasses
import json
import sys
import time

import torch

from relay_compile.backend import compiled_reports
from relay_compile.bench.configs import QWEN3_30B, BenchOptions
from relay_compile.bench.measure import measure_layer
from relay_compile.bench.rows import A2A_EAGER, RowSpec, build_eager_a2a, compiled_a2a_builder, ring_builder

out = sys.argv[1]
opts = BenchOptions(repeats=10)
rows = [
    RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
    RowSpec(name="relaymoe backend", build=compiled_a2a_builder("relaymoe"), kind="ring", compiles=True),
    RowSpec(name="ring overlap", build=ring_builder(routing="expert", overlap=True), kind="ring"),
    RowSpec(name="ring sequential", build=ring_builder(routing="expert", overlap=False), kind="ring"),
]
results = {}
for ep in (8, 64):
    cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=65536)
    t0 = time.perf_counter()
    res = measure_layer(cfg, opts, rows)
    print(f"EP={ep} took {time.perf_counter() - t0:.1f} s")
    for r in compiled_reports()[-1:]:
        print(r.summary())
    results[ep] = dataclasses.asdict(res)
    for r in res.rows:
        print(f"  {r.row:20s} total {r.total_ms} ms  time x{r.time_ratio}  peak {r.peak_bytes}  a2a/peak {1 / r.peak_ratio if r.peak_ratio else None}  {r.skipped}")
json.dump({str(k): v for k, v in results.items()}, open(f"{out}/backend_rows.json", "w"), indent=1, default=str)
