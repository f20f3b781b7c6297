"""A kept region's host time on the CPU, split sizes read as traced against read as tensors (passes.split_reads).

The reference layer ``a2a_moe`` on the stand-in group (rank 0 of EP ranks, tiny shapes: the step is host time)
through ``backend="relaymoe"`` with ``ring="never"`` (kept, as the cost model keeps small token counts on CUDA),
``/traced`` rows with option ``split_reads`` off; first-call seconds (compile), interleaved fwd+bwd medians, the
ratio to eager, and the largest difference of the output and weight gradients from eager's.

    OMP_NUM_THREADS=1 python docs/bench/split-reads/cpu_host.py --ep 64 [--rows ...] [--repeats 21]
"""
import argparse
import statistics
import time

import torch

from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.measure import quiet_warnings
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--repeats", type=int, default=21)
ap.add_argument("--rows", nargs="*", default=["eager", "relaymoe/aot_eager/traced", "relaymoe/aot_eager",
                                              "relaymoe/inductor/traced", "relaymoe/inductor"])
args = ap.parse_args()
quiet_warnings().__enter__()  # for the whole script
torch._inductor.config.force_disable_caches = True  # first-call seconds are a cold compile
cfg = QWEN3_30B.with_(device="cpu", dtype="bf16", ep=args.ep, tokens=256, hidden=32, ffn=16)
group = standin_group(args.ep)
inp = make_inputs(cfg)


def build(name: str):
    if name == "eager":
        return lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group)
    inner, *traced = name.split("/")[1:]
    options = {"inner_compiler": inner, "ring": "never", **({"split_reads": False} if traced else {})}
    compiled = torch.compile(lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group.group_name),
                             backend="relaymoe", fullgraph=True, dynamic=False, options=options)

    def run(*a):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return compiled(*a)
    return run


def step(fn) -> list[torch.Tensor]:
    inp.clear_grads()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    y.backward(inp.grad_y_TH)
    return [y.detach().clone(), *(w.grad.clone() for w in inp.weights)]


want = step(build("eager"))
rows, first, diff = {}, {}, {}
for name in args.rows:
    rows[name] = build(name)
    t0 = time.perf_counter()
    got = step(rows[name])
    first[name] = time.perf_counter() - t0
    diff[name] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
times = {n: [] for n in rows}
for _ in range(args.repeats):
    for n, fn in rows.items():
        t0 = time.perf_counter()
        step(fn)
        times[n].append((time.perf_counter() - t0) * 1e3)
ref = statistics.median(times["eager"]) if "eager" in times else None
print(f"EP={args.ep}, CPU, {torch.__version__}, median of {args.repeats} interleaved fwd+bwd")
print("| row | first call s | ms | / eager | max diff from eager |")
print("|---|---:|---:|---:|---:|")
for n in rows:
    m = statistics.median(times[n])
    print(f"| {n} | {first[n]:.1f} | {m:.2f} | {f'{m / ref:.3f}x' if ref else ''} | {diff[n]:.3g} |")
