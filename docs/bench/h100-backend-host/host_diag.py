"""Why does the backend's ring issue a step ~1.4x slower than the same ring called eagerly, on a GPU (issue 24,
EP=64 16384: 23.4 against 16.7 ms of host per step, the same kernels, the same Python calls)? On the CPU the two
run alike (this script with ``--device cpu``). One process, in this order:

1. a launch probe (2000 tiny kernel launches, and a pure-Python loop), then eager ring steps;
2. the backend compiled (``--inner``) and its steps;
3. the probe and the eager steps again (a process-wide effect of compiling shows here), the compiled steps again;
4. the compile workers shut down (``torch._inductor.async_compile.shutdown_compile_workers``), both again;
5. every object alive moved out of the collector's reach (``gc.freeze``), both again.

Each step row: host per step (no sync) and to the device's end, median of 10 after 3 warm-ups. The threads alive
are listed before and after compiling; the time the cyclic garbage collector ran during the measured steps is
summed per generation (``gc.callbacks``).

    python docs/bench/h100-backend-host/host_diag.py [--ep 64] [--tokens 16384] [--inner inductor]
"""
import argparse
import gc
import os
import statistics
import threading
import time

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--inner", default="inductor")
ap.add_argument("--device", default="cuda")
args = ap.parse_args()
cuda = args.device == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
group = standin_group(args.ep)
shape = {"dtype": "bf16"} if cuda else {"dtype": "bf16", "hidden": 64, "ffn": 32}
inp = make_inputs(QWEN3_30B.with_(device=args.device, ep=args.ep, tokens=args.tokens, **shape))
compiled = torch.compile(lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group.group_name), backend="relaymoe",
                         fullgraph=True, options={"inner_compiler": args.inner})


def eager(x):
    return ring_moe(x, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, ring="always",
                    routing="expert")


def backend(x):
    return compiled(x, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)


GC_MS = [0.0, 0.0, 0.0]
_gc_start = [0.0]


def _gc_timer(phase, info):
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        GC_MS[info["generation"]] += (time.perf_counter() - _gc_start[0]) * 1e3


gc.callbacks.append(_gc_timer)


def steps(name, fn):
    def one():
        inp.clear_grads()
        fn(inp.x_TH.detach().requires_grad_()).backward(inp.grad_y_TH)
    for _ in range(3):
        one()
    sync()
    walls, synced = [], []
    GC_MS[:] = [0.0, 0.0, 0.0]
    for _ in range(10):
        t = time.perf_counter()
        one()
        walls.append((time.perf_counter() - t) * 1e3)
        sync()
        synced.append((time.perf_counter() - t) * 1e3)
    print(f"  {name:<34} host per step {statistics.median(walls):7.2f} ms, to the device's end "
          f"{statistics.median(synced):7.2f} ms; gc in 10 steps: "
          f"{' / '.join(f'{m:.1f}' for m in GC_MS)} ms (generations 0/1/2), {len(gc.get_objects())} objects tracked",
          flush=True)


def probe(when):
    t_ = torch.zeros(8, device=args.device)
    sync()
    t = time.perf_counter()
    for _ in range(2000):
        t_.add_(1)
    launch = (time.perf_counter() - t) / 2000 * 1e6
    sync()
    t = time.perf_counter()
    s = 0
    for i in range(200000):
        s += i
    py = (time.perf_counter() - t) * 1e3
    print(f"  probe {when:<28} {launch:6.2f} us per add_ launch, python loop {py:6.2f} ms", flush=True)


def threads(when):
    names = sorted(t.name for t in threading.enumerate())
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    print(f"  threads {when}: {tasks} OS threads; Python: {names}", flush=True)


print(f"EP={args.ep} tokens={args.tokens} inner={args.inner} {torch.cuda.get_device_name() if cuda else 'cpu'}")
threads("before compiling")
probe("before compiling")
steps("eager ring, before compiling", eager)
steps("backend", backend)
threads("after compiling")
probe("after compiling")
steps("eager ring, after compiling", eager)
steps("backend, again", backend)
import torch._inductor.async_compile as async_compile  # noqa: E402

async_compile.shutdown_compile_workers()
time.sleep(1)
threads("after shutting the workers down")
probe("after shutting the workers down")
steps("eager ring, workers shut down", eager)
steps("backend, workers shut down", backend)
gc.collect()
gc.freeze()
steps("eager ring, gc frozen", eager)
steps("backend, gc frozen", backend)
