"""Where the GPU time of one forward+backward goes, a2a eager beside the ring forced (issue 24): kernel time by
class and the heaviest kernels, one profiled step after warm-ups (stand-in group, Qwen3 layer, bf16).

    python docs/bench/h100-kernel-split/kernel_split.py [--ep 8 64] [--tokens 16384] [--options k=v ...] [--backend]

Classes (by kernel name): gemm (cuBLAS/CUTLASS/nvjet/grouped mm), copy (memcpy and copy kernels: under the
stand-in group, every transfer is one), gather/scatter (index, scatter, gather, our Triton scatter-add),
other Triton (our fused kernels), elementwise/reduce (the rest). Sums are kernel durations (overlap counted twice).
"""
import argparse
import collections
import json
import re

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

CLASSES = (
    ("gemm", re.compile(r"gemm|cutlass|nvjet|sm90|sm100|grouped_mm|wgmma|Gemm", re.I)),
    ("copy", re.compile(r"Memcpy|copy|Memset", re.I)),
    ("gather/scatter", re.compile(r"index|scatter|gather|take", re.I)),
    ("other triton", re.compile(r"^triton|_kernel$")),
)


def _class(name: str) -> str:
    return next((c for c, pat in CLASSES if pat.search(name)), "elementwise/reduce")


def _value(text: str):
    """An option's value as JSON reads it (true, 5, 0.5), else the string itself (expert)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, nargs="+", default=[8, 64])
ap.add_argument("--tokens", type=int, nargs="+", default=[16384])
ap.add_argument("--options", nargs="*", default=[], help="ring_moe options for a second ring row, k=v")
ap.add_argument("--top", type=int, default=12)
ap.add_argument("--backend", action="store_true", help="also torch.compile(a2a_moe, backend='relaymoe')")
args = ap.parse_args()

for ep in args.ep:
    group = standin_group(ep)
    for tokens in args.tokens:
        inp = make_inputs(QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=tokens))
        rows = {
            "a2a eager": lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group),
            "ring expert": lambda x, i, s, *w: ring_moe(x, i, s, *w, group=group, ring="always", routing="expert",
                                                    save_projections=False),
        }
        if args.options:
            opts = {k: _value(v) for k, v in (o.split("=", 1) for o in args.options)}
            rows["ring " + " ".join(args.options)] = lambda x, i, s, *w: ring_moe(
                x, i, s, *w, group=group, ring="always", routing="expert", **opts)
        if args.backend:
            rows["relaymoe backend"] = torch.compile(
                lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group.group_name), backend="relaymoe", fullgraph=True)
        for name, fn in rows.items():
            def step():
                inp.clear_grads()
                fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights).backward(inp.grad_y_TH)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            by_class: collections.Counter = collections.Counter()
            by_kernel: collections.Counter = collections.Counter()
            calls: collections.Counter = collections.Counter()
            for e in prof.events():
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                us = e.time_range.end - e.time_range.start
                by_class[_class(e.name)] += us
                by_kernel[e.name[:90]] += us
                calls[e.name[:90]] += 1
            total = sum(by_class.values())
            cells = "  ".join(f"{c} {by_class[c] / 1e3:6.2f}" for c, _ in CLASSES + (("elementwise/reduce", 0),))
            print(f"EP={ep} tokens={tokens} {name:<14} kernels {total / 1e3:6.2f} ms | {cells}")
            for k, us in by_kernel.most_common(args.top):
                print(f"    {us / 1e3:7.3f} ms {calls[k]:5d}x  {k}")
        del inp
        torch.cuda.empty_cache()
