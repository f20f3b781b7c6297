"""What is alive at the peak of one ring forward+backward (H200, simulated EP, Qwen3 layer, bf16).

    python docs/bench/h200-memory/peak_breakdown.py OUT [--ep 8] [--tokens 65536] [--max-hop-rows 0 16384]

Per configuration: one warm-up step, then one step under the caching allocator's memory history; the peak
of allocated bytes above the level at entry, and the blocks alive at that moment grouped by the innermost
relay_compile frame that allocated them. Writes OUT/peak_breakdown.json and prints a table.
"""
import argparse
import collections
import json
import sys

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group


def site(frames):
    for f in frames:
        fn = f["filename"]
        if "relay_compile" in fn and "peak_breakdown" not in fn:
            return f"{fn.split('relay_compile/')[-1]}:{f['line']} {f['name']}"
    return "other: " + (f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']}" if frames else "?")


def breakdown(snapshot, dev):
    trace = snapshot["device_traces"][dev]
    alive, level, peak, peak_i = {}, 0, 0, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
            level += ev["size"]
        elif ev["action"] == "free_completed" and ev["addr"] in alive:
            level -= alive.pop(ev["addr"])["size"]
        if level > peak:
            peak, peak_i = level, i
    # replay to the peak
    alive = {}
    for ev in trace[: peak_i + 1]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            alive.pop(ev["addr"], None)
    groups = collections.Counter()
    for ev in alive.values():
        groups[site(ev.get("frames", []))] += ev["size"]
    return peak, site(trace[peak_i].get("frames", [])), groups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ep", type=int, nargs="+", default=[8])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--max-hop-rows", type=int, nargs="+", default=[0])
    ap.add_argument("--fp32", type=int, nargs="+", default=[1])
    args = ap.parse_args()
    results = []
    for ep in args.ep:
        cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=args.tokens)
        group = standin_group(ep)
        inp = make_inputs(cfg)
        for mhr in args.max_hop_rows:
            for fp32 in args.fp32:
                def step():
                    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, routing="expert",
                                 max_hop_rows=mhr or None, fp32_accumulation=bool(fp32))
                    y.backward(inp.grad_y_TH)
                    inp.clear_grads()
                step()
                torch.cuda.synchronize()
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
                step()
                torch.cuda.synchronize()
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                peak, at, groups = breakdown(snap, torch.cuda.current_device())
                row = {"ep": ep, "max_hop_rows": mhr, "fp32": fp32, "peak_mib": peak / 2**20, "peak_at": at,
                       "alive_mib": {k: v / 2**20 for k, v in groups.most_common()}}
                results.append(row)
                print(f"\n== EP={ep} max_hop_rows={mhr} fp32={fp32}: peak {peak / 2**20:.0f} MiB at {at}")
                for k, v in groups.most_common():
                    print(f"  {v / 2**20:9.1f} MiB  {k}")
                sys.stdout.flush()
    json.dump(results, open(f"{args.out}/peak_breakdown.json", "w"), indent=1)


main()
