"""Is a ring step host-bound or GPU-bound? Per (EP, tokens): wall, host and GPU-busy time of one forward+backward
of a2a eager and of the ring forced (issue 24, deliverable 3). Stand-in group, Qwen3 layer, bf16.

    python docs/bench/h200-hop-host/host_gpu.py [--ep 8 64] [--tokens 16384 65536] [--repeats 5] [--options k=v ...]

- wall: CUDA events around the step (median of ``--repeats`` after two warm-ups, rows interleaved).
- host: ``perf_counter`` from the call until ``backward`` returns, without a sync: the time the CPU spends
  issuing the step (it includes the waits of the step's own host syncs).
- gpu busy: the union of the step's kernel and copy intervals on the device (``torch.profiler``, one step).
- peak: above what was allocated before the step (one more step).
Rows: a2a eager, the ring, the ring with one owner per backward hop (``backward_owners_per_hop`` patched), and
one ring per ``--owners FWD/BWD`` with both rules patched.
A step is host-bound where host ~ wall and gpu busy < wall.
"""
import argparse
import statistics
import time
import unittest.mock

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
from relay_compile.runtime.programs import pipeline



def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, nargs="+", default=[8, 64])
ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--options", nargs="*", default=[], help="ring_moe options for the ring row, k=v")
ap.add_argument("--owners", nargs="*", default=[], help="more ring rows with owners per hop forced, FWD/BWD (e.g. 2/1)")
args = ap.parse_args()
ring_opts = {"ring": "always", "routing": "expert"} | {k: _value(v) for k, v in (o.split("=", 1) for o in args.options)}


def busy_ms(prof) -> float:
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    total, cur_s, cur_e = 0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    total += 0 if cur_e is None else cur_e - cur_s
    return total / 1e3


print(f"{'EP':>3} {'tokens':>7} {'row':<16} {'wall ms':>8} {'host ms':>8} {'gpu ms':>8} {'/a2a':>6}  spread  peak")
for ep in args.ep:
    group = standin_group(ep)
    for tokens in args.tokens:
        cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=tokens)
        inp = make_inputs(cfg)
        ring = lambda x, i, s, *w: ring_moe(x, i, s, *w, group=group, **ring_opts)  # noqa: E731
        rows = {
            "a2a eager": lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group),
            "ring": ring,
            "ring 1-owner bwd": ring,  # the ring before the grouped backward (``step`` patches the rule)
        } | {f"ring g={pair}": ring for pair in args.owners}

        def step(name) -> tuple[float, float]:
            if name.endswith("1-owner bwd"):
                with unittest.mock.patch.object(pipeline, "backward_owners_per_hop", return_value=1):
                    return _step(rows[name])
            if name.startswith("ring g="):
                fwd, bwd = map(int, name.removeprefix("ring g=").split("/"))
                with unittest.mock.patch.object(pipeline, "owners_per_hop", return_value=fwd), \
                        unittest.mock.patch.object(pipeline, "backward_owners_per_hop", return_value=bwd):
                    return _step(rows[name])
            return _step(rows[name])

        def _step(fn) -> tuple[float, float]:
            inp.clear_grads()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights).backward(inp.grad_y_TH)
            end.record()
            host = (time.perf_counter() - t0) * 1e3
            end.synchronize()
            return start.elapsed_time(end), host

        walls = {k: [] for k in rows}
        hosts = {k: [] for k in rows}
        for _ in range(2):
            for k in rows:
                step(k)
        for _ in range(args.repeats):
            for k in rows:
                w, h = step(k)
                walls[k].append(w)
                hosts[k].append(h)
        gpu, peak = {}, {}
        for k in rows:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(k)
            gpu[k] = busy_ms(prof)
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(k)
            peak[k] = (torch.cuda.max_memory_allocated() - resident) / 2**20
        base = statistics.median(walls["a2a eager"])
        for k in rows:
            w = statistics.median(walls[k])
            spread = (max(walls[k]) - min(walls[k])) / w
            print(f"{ep:>3} {tokens:>7} {k:<16} {w:8.2f} {statistics.median(hosts[k]):8.2f} {gpu[k]:8.2f} "
                  f"{w / base:6.3f}  {spread:4.0%} {peak[k]:9.0f} MiB", flush=True)
        del inp
        torch.cuda.empty_cache()
