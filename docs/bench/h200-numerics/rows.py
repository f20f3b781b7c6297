"""Device run for issue 12: time and peak of the ring with fp32 sums (default) beside bf16 sums and the
backend, Qwen3 layer, simulated EP 8 / 64, in one run beside a2a eager.

    python docs/bench/h200-numerics/rows.py OUT_DIR
"""
import dataclasses
import json
import sys
import time

from relay_compile.bench.configs import QWEN3_30B, BenchOptions
from relay_compile.bench.measure import measure_layer
from relay_compile.bench.rows import A2A_EAGER, RowSpec, build_eager_a2a, compiled_a2a_builder, ring_builder

out = sys.argv[1]
opts = BenchOptions(repeats=10)
rows = [
    RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
    RowSpec(name="ring overlap (fp32 sums)", build=ring_builder(routing="expert"), kind="ring"),
    RowSpec(name="ring overlap (bf16 sums)", build=ring_builder(routing="expert", fp32_accumulation=False),
            kind="ring"),
    RowSpec(name="ring sequential (fp32 sums)", build=ring_builder(routing="expert", overlap=False), kind="ring",
            overlap=False),
    RowSpec(name="relaymoe backend", build=compiled_a2a_builder("relaymoe"), kind="ring", compiles=True),
]
results = {}
for ep in (8, 64):
    cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=65536)
    t0 = time.perf_counter()
    res = measure_layer(cfg, opts, rows)
    print(f"EP={ep} took {time.perf_counter() - t0:.1f} s")
    results[ep] = dataclasses.asdict(res)
    for r in res.rows:
        inv = 1 / r.peak_ratio if r.peak_ratio else float("nan")
        print(f"  {r.row:42s} total {r.total_ms:8.2f} ms  time x{r.time_ratio:.3f}  peak {r.peak_bytes / 2**30:6.3f} GiB"
              f"  a2a/peak {inv:6.2f}  {r.skipped}")
json.dump({str(k): v for k, v in results.items()}, open(f"{out}/rows.json", "w"), indent=1, default=str)
