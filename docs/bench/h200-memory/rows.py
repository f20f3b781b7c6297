"""Device run (issues 10/12): time and peak of the ring at its defaults (in-place gradient sums, auto hop bound)
beside whole and bounded hops, bf16 sums, a2a eager and the backend; Qwen3 layer, simulated EP 8 / 64, one run.

    python docs/bench/h200-memory/rows.py OUT_DIR [--ep 8 64] [--bounds 8192 16384 32768] [--backend] [--interleave]
"""
import argparse
import dataclasses
import json
import time

from relay_compile.bench.configs import QWEN3_30B, BenchOptions
from relay_compile.bench.measure import measure_layer
from relay_compile.bench.rows import A2A_EAGER, RowSpec, build_eager_a2a, compiled_a2a_builder, ring_builder

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--ep", type=int, nargs="+", default=[8, 64])
ap.add_argument("--bounds", type=int, nargs="*", default=[8192, 16384, 32768])
ap.add_argument("--backend", action="store_true")
ap.add_argument("--interleave", action="store_true", help="rows take their timed steps in turns (BenchOptions)")
ap.add_argument("--repeats", type=int, default=10)
ap.add_argument("--repeat-defaults", type=int, default=0,
                help="only a2a eager and this many copies of the default ring row (run-to-run spread within a run)")
args = ap.parse_args()
opts = BenchOptions(repeats=args.repeats, interleave=args.interleave)
results = {}
for ep in args.ep:
    rows = [
        RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
        RowSpec(name="ring overlap (defaults)", build=ring_builder(routing="expert"), kind="ring"),
        RowSpec(name="ring overlap whole hops", build=ring_builder(routing="expert", max_hop_rows=None), kind="ring"),
        *[RowSpec(name=f"ring overlap fp32 max_hop_rows={b}", build=ring_builder(routing="expert", max_hop_rows=b),
                  kind="ring") for b in args.bounds],
        RowSpec(name="ring sequential (defaults)", build=ring_builder(routing="expert", overlap=False), kind="ring",
                overlap=False),
        RowSpec(name="ring overlap bf16 sums", build=ring_builder(routing="expert", fp32_accumulation=False),
                kind="ring"),
    ]
    if args.repeat_defaults:
        rows = [rows[0]] + [RowSpec(name=f"ring overlap (defaults) #{i}", build=ring_builder(routing="expert"),
                                    kind="ring") for i in range(args.repeat_defaults)]
    if args.backend:
        rows.append(RowSpec(name="relaymoe backend", build=compiled_a2a_builder("relaymoe"), kind="ring",
                            compiles=True))
    cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=65536)
    t0 = time.perf_counter()
    res = measure_layer(cfg, opts, rows)
    print(f"EP={ep} took {time.perf_counter() - t0:.1f} s")
    results[ep] = dataclasses.asdict(res)
    for r in res.rows:
        inv = 1 / r.peak_ratio if r.peak_ratio else float("nan")
        print(f"  {r.row:40s} total {r.total_ms:8.2f} ms  time x{r.time_ratio:.3f}  peak {r.peak_bytes / 2**30:6.3f} GiB"
              f"  a2a/peak {inv:6.2f}  {r.skipped}", flush=True)
    json.dump({str(k): v for k, v in results.items()}, open(f"{args.out}/rows.json", "w"), indent=1, default=str)
