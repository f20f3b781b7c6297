"""Device run (issue 10, session 7): the ring with its grouped forward (defaults) beside a2a eager and the backend;
Qwen3 layer, simulated EP 64 / 8, 65536 tokens per rank, steps interleaved (one step of every row per round).

    python docs/bench/h200-grouped-forward/rows.py OUT_DIR [--ep 64 8] [--repeats 10]
"""
import argparse
import dataclasses
import json
import time

from relay_compile.bench.configs import QWEN3_30B, BenchOptions
from relay_compile.bench.measure import measure_layer
from relay_compile.bench.results import layer_table
from relay_compile.bench.rows import A2A_EAGER, RowSpec, build_eager_a2a, compiled_a2a_builder, ring_builder

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--ep", type=int, nargs="+", default=[64, 8])
ap.add_argument("--repeats", type=int, default=10)
args = ap.parse_args()
opts = BenchOptions(repeats=args.repeats, interleave=True)
results = {}
for ep in args.ep:
    rows = [
        RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
        # "ring overlap": the name measure_layer checks against a2a eager (forward, the check column of rows.json).
        RowSpec(name="ring overlap", build=ring_builder(routing="expert"), kind="ring"),
        RowSpec(name="ring sequential", build=ring_builder(routing="expert", overlap=False), kind="ring",
                overlap=False),
        RowSpec(name="relaymoe backend (defaults)", build=compiled_a2a_builder("relaymoe"), kind="ring",
                compiles=True),
    ]
    cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=65536)
    t0 = time.perf_counter()
    res = measure_layer(cfg, opts, rows)
    print(f"EP={ep} took {time.perf_counter() - t0:.1f} s")
    results[ep] = dataclasses.asdict(res)
    print(layer_table(res, opts), flush=True)
    json.dump({str(k): v for k, v in results.items()}, open(f"{args.out}/rows.json", "w"), indent=1, default=str)
