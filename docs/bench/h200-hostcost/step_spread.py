"""Per-step spread of the ring at EP=64 (H200, simulated EP, Qwen3 layer, defaults) and what the Python garbage
collector does meanwhile: is the run-to-run spread of identical rows (docs/bench/h200-memory/raw-ep64-spread)
the collector's?

    python docs/bench/h200-hostcost/step_spread.py OUT [--ep 64] [--steps 30] [--tag NAME]

For each mode (automatic collection as Python does it; disabled during steps as torchtitan's ``gc_freq`` and
Megatron's ``manual_gc`` do, collected between blocks of steps), ``--steps`` steps of ring_moe and of the a2a
layer: per step the forward and backward time (CUDA events), the host time of the backward call, and the
collections of each generation and their time, and two probes after the step (a fixed piece of Python work, a
fixed GPU matmul loop). Writes OUT/step_spread[_TAG].json and prints a table.
"""
import argparse
import gc
import json
import statistics
import sys
import threading
import time

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--tag", default="")
ap.add_argument("--modes", nargs="+", default=["gc auto", "gc off in steps"])
args = ap.parse_args()
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=65536)
group = standin_group(args.ep)
inp = make_inputs(cfg)
collections: list[tuple[int, float]] = []
_start = [0.0]


def on_gc(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        collections.append((info["generation"], (time.perf_counter() - _start[0]) * 1e3))


gc.callbacks.append(on_gc)
LAYERS = {
    "ring": lambda: ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group,
                             routing="expert"),
    "a2a": lambda: a2a_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group),
}


PROBE_A = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)


def probes():
    """A fixed piece of Python work (ms) and a fixed GPU workload (ms): is a slow step the host's or the GPU's?"""
    t0 = time.perf_counter()
    sum(i * i for i in range(20000))
    py_ms = (time.perf_counter() - t0) * 1e3
    e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    e[0].record()
    for _ in range(10):
        PROBE_A @ PROBE_A
    e[1].record()
    e[1].synchronize()
    return py_ms, e[0].elapsed_time(e[1])


def other_threads() -> list[str]:
    """Where every other Python thread is right now (innermost frame): a thread that runs Python takes the GIL
    from the one launching the ring's kernels."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    return [f"{names.get(ident, ident)}: {f.f_code.co_filename.split('/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
            for ident, f in sys._current_frames().items() if ident != me]


def step(layer):
    inp.clear_grads()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    e[0].record()
    y = LAYERS[layer]()
    e[1].record()
    h0 = time.perf_counter()
    y.backward(inp.grad_y_TH)
    host_bwd = (time.perf_counter() - h0) * 1e3
    e[2].record()
    e[2].synchronize()
    return e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2]), host_bwd


results = {}
for mode in args.modes:
    for layer in ("a2a", "ring"):
        for _ in range(3):
            step(layer)
        gc.collect()
        if mode == "gc off in steps":
            gc.disable()
        collections.clear()
        steps = []
        for i in range(args.steps):
            n0 = len(collections)
            fwd, bwd, host = step(layer)
            py_ms, mm_ms = probes()
            steps.append({"fwd": fwd, "bwd": bwd, "host_bwd": host, "gcs": collections[n0:], "py_ms": py_ms,
                          "mm_ms": mm_ms, "threads": other_threads()})
        gc.enable()
        tot = [s["fwd"] + s["bwd"] for s in steps]
        gens = [g for s in steps for g, _ in s["gcs"]]
        gc_ms = sum(ms for s in steps for _, ms in s["gcs"])
        print(f"{mode:16s} {layer:5s} total median {statistics.median(tot):7.2f} ms  min {min(tot):7.2f}  max "
              f"{max(tot):7.2f}  bwd host median {statistics.median(s['host_bwd'] for s in steps):6.2f} ms  "
              f"collections gen0/1/2 {gens.count(0)}/{gens.count(1)}/{gens.count(2)} ({gc_ms:.1f} ms)", flush=True)
        print("    per step total:", " ".join(f"{t:.0f}" for t in tot), flush=True)
        print("    python probe ms:", " ".join(f"{st['py_ms']:.1f}" for st in steps), flush=True)
        print("    matmul probe ms:", " ".join(f"{st['mm_ms']:.1f}" for st in steps), flush=True)
        results[f"{mode} / {layer}"] = steps
print("objects tracked by gc:", len(gc.get_objects()))
print("Python threads:", [(t.name, t.daemon) for t in threading.enumerate()])
seen: dict[str, int] = {}
for steps in results.values():
    for st in steps:
        for where in st["threads"]:
            seen[where] = seen.get(where, 0) + 1
for where, n in sorted(seen.items(), key=lambda kv: -kv[1])[:15]:
    print(f"  other thread seen after {n} steps at {where}")
json.dump(results, open(f"{args.out}/step_spread{'_' + args.tag if args.tag else ''}.json", "w"), indent=1)
