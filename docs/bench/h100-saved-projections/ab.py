"""Saved projections A/B (issue 24): a2a eager, the expert ring recomputing its first projections per backward
hop, the expert ring reading them saved by its forward (``--graphs``: and the ring with chunk graphs); per (EP,
tokens) wall (median of interleaved repeats), spread, peak above the resident inputs, and the max error of each
ring's outputs/gradients against a2a relative to a2a's scale. Stand-in group, Qwen3 layer, bf16.

    python docs/bench/h100-saved-projections/ab.py [--ep 8 64] [--tokens 4096 16384 65536] [--repeats 5]
"""
import argparse
import contextlib
import statistics
from unittest import mock

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
from relay_compile.runtime import agreement

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, nargs="+", default=[8, 64])
ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--graphs", action="store_true", help="also the ring with chunk_graphs=True")
ap.add_argument("--device-exchange", action="store_true",
                help="also the saved ring whose backward exchange runs on the compute stream (as before "
                     "this change: it waits for the work queued there)")
args = ap.parse_args()


@contextlib.contextmanager
def device_exchange():
    """The backward's exchange as before: from the device's counts, on the compute stream."""
    real = agreement._exchange
    with mock.patch.object(agreement, "_exchange", lambda *a, **kw: real(*a[:5])):
        yield

print(f"{'EP':>3} {'tokens':>7} {'row':<18} {'ms':>8} {'/a2a':>6} {'spread':>6} {'peak MiB':>9} {'a2a/peak':>8} {'max rel err':>11}")
for ep in args.ep:
    group = standin_group(ep)
    for tokens in args.tokens:
        inp = make_inputs(QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=tokens))
        ring = dict(group=group, ring="always", routing="expert")
        rows = {
            "a2a eager": lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group),
            "ring recompute": lambda x, i, s, *w: ring_moe(x, i, s, *w, save_projections=False, **ring),
            "ring saved": lambda x, i, s, *w: ring_moe(x, i, s, *w, save_projections=True, **ring),
        }
        if args.device_exchange:  # step() runs its forward and backward under device_exchange()
            rows["ring saved dev-xchg"] = rows["ring saved"]
        if args.graphs:  # chunk graphs (CUDA graphs per chunk shape): less host work, no saved projections
            rows["ring graphs"] = lambda x, i, s, *w: ring_moe(x, i, s, *w, chunk_graphs=True, **ring)

        def step(name, keep=False):
            fn = rows[name]
            inp.clear_grads()
            leaves = [t.detach().requires_grad_() for t in (inp.x_TH, inp.topk_scores_TK)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with device_exchange() if name.endswith("dev-xchg") else contextlib.nullcontext():
                y = fn(leaves[0], inp.topk_ids_TK, leaves[1], *inp.weights)
                y.backward(inp.grad_y_TH)
            end.record()
            end.synchronize()
            out = [y.detach(), leaves[0].grad, leaves[1].grad, *[w.grad for w in inp.weights]] if keep else None
            return start.elapsed_time(end), out

        walls = {k: [] for k in rows}
        for _ in range(2):
            for k in rows:
                step(k)
        for _ in range(args.repeats):
            for k in rows:
                walls[k].append(step(k)[0])
        results, peak = {}, {}
        for k in rows:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _, results[k] = step(k, keep=True)
            peak[k] = (torch.cuda.max_memory_allocated() - resident) / 2**20
        base = statistics.median(walls["a2a eager"])
        for k in rows:
            w = statistics.median(walls[k])
            err = max(((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
                      for g, r in zip(results[k], results["a2a eager"]))
            print(f"{ep:>3} {tokens:>7} {k:<18} {w:8.2f} {w / base:6.3f} {(max(walls[k]) - min(walls[k])) / w:6.1%} "
                  f"{peak[k]:9.0f} {peak['a2a eager'] / peak[k]:8.2f} {err:11.2e}", flush=True)
        del inp, results
        torch.cuda.empty_cache()
