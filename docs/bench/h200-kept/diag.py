"""Why a kept region is slower than eager all-to-all at EP=64 (issue 24): the reference layer a2a_moe eager,
under aot_eager and inductor, and through the relaymoe backend with inductor or aot_eager as inner compiler
(``relaymoe/INNER/traced``: with option split_reads off);
compile seconds (first call), interleaved fwd+bwd medians, GPU kernel time of one step.

    python docs/bench/h200-kept/diag.py --ep 64 --tokens 8192 [--rows ...] [--deadline S]
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.measure import quiet_warnings
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--repeats", type=int, default=7)
ap.add_argument("--deadline", type=float, default=520.0)
ap.add_argument("--census", action="store_true", help="print each row's host time by op")
ap.add_argument("--rows", nargs="*", default=["eager", "aot_eager", "relaymoe/aot_eager", "ring_moe default",
                                              "relaymoe/inductor", "inductor"])
args = ap.parse_args()
t_start = time.monotonic()
quiet_warnings().__enter__()  # a context manager: its filters for the whole script
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=args.tokens)
group = standin_group(args.ep)
inp = make_inputs(cfg)


def compiled(backend, options=None):
    def fn(x, ids, scores, w1, w2, w3):
        return a2a_moe(x, ids, scores, w1, w2, w3, group=group.group_name)
    kw = {} if options is None else {"options": options}
    c = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, **kw)

    def run(*a):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return c(*a)
    return run


def build(name):
    if name == "aot_eager+host_reads":  # the plain graph with the backend's host-read batching only
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func
        from relay_compile.passes.host_reads import batch_host_reads
        aot = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))

        def backend(gm, example_inputs):
            batch_host_reads(gm)
            return aot(gm, example_inputs)
        return compiled(backend)
    if name == "relaymoe/aot_eager, no agreement":  # what the kept region's agreement exchange costs
        from unittest import mock
        from relay_compile.runtime import ops
        run = compiled("relaymoe", {"inner_compiler": "aot_eager"})

        def unchecked(*a):
            with mock.patch.object(ops, "agree_kept", lambda *_, **__: None):
                return run(*a)
        return unchecked
    if name == "eager":
        return lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group)
    if name == "ring_moe default":
        return lambda x, i, s, *w: ring_moe(x, i, s, *w, group=group)
    if name.startswith("relaymoe/"):  # relaymoe/INNER[/traced]: traced, the split sizes read as Dynamo traced them
        inner, *traced = name.split("/")[1:]
        return compiled("relaymoe", {"inner_compiler": inner, **({"split_reads": False} if traced else {})})
    return compiled(name)


def step(fn):
    inp.clear_grads()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    y.backward(inp.grad_y_TH)


rows, compile_s = {}, {}
for name in args.rows:
    if time.monotonic() - t_start > args.deadline - (200 if "inductor" in name else 30):
        print(f"{name}: skipped (deadline)", flush=True)
        continue
    fn = build(name)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(fn)
    torch.cuda.synchronize()
    compile_s[name] = time.perf_counter() - t0
    step(fn)
    rows[name] = fn
    print(f"{name}: first call {compile_s[name]:.1f} s", flush=True)

times = {n: [] for n in rows}
for _ in range(args.repeats):
    for n, fn in rows.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(fn)
        torch.cuda.synchronize()
        times[n].append((time.perf_counter() - t0) * 1e3)

gpu_ms, peak = {}, {}
for n, fn in rows.items():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(fn)
        torch.cuda.synchronize()
    gpu_ms[n] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    if args.census:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(fn)
            torch.cuda.synchronize()
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        print(f"-- {n}: host self time by op (us): " + ", ".join(
            f"{e.key} {e.count}x {e.self_cpu_time_total:.0f}" for e in top), flush=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(fn)
    torch.cuda.synchronize()
    peak[n] = (torch.cuda.max_memory_allocated() - base) / 2**20

ref = statistics.median(times["eager"]) if "eager" in times else None
print(f"\nEP={args.ep} tokens={args.tokens} (median of {args.repeats} interleaved fwd+bwd)")
print("| row | first call s | ms | / eager | spread | GPU kernel ms | peak MiB |")
print("|---|---:|---:|---:|---:|---:|---:|")
for n in rows:
    m = statistics.median(times[n])
    spread = (max(times[n]) - min(times[n])) / m
    r = f"{m / ref:.3f}x" if ref else ""
    print(f"| {n} | {compile_s[n]:.1f} | {m:.2f} | {r} | {spread:.0%} | {gpu_ms[n]:.2f} | {peak[n]:.0f} |")
