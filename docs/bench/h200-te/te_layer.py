"""Issue 27 on one H200: a Megatron-style MoE layer whose experts are real Transformer Engine ``GroupedLinear``
(megatron-core's ``TEGroupedMLP``: fc1 -> SwiGLU -> fc2 over ``tokens_per_expert``), dispatched by all-to-all, on
the stand-in EP group (simulated EP, rank 0 of N), eager against ``torch.compile(backend="relaymoe")`` with
default options, beside the project's reference layer through the backend at the same shape.

    python docs/bench/h200-te/te_layer.py --tokens 65536 --ep 8            # H200, TE installed (run.sh)
    python docs/bench/h200-te/te_layer.py --cpu --tokens 64 --ep 2 --tiny  # CPU: the stand-in GroupedLinear

Prints one table: time (median of --repeats fwd+bwd after --warmup), peak above entry, and each leaf's relative
error (Frobenius) against the same layer in fp32 (TE GroupedLinear fp32, eager); the report's region status.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import relay_compile  # noqa: E402
from relay_compile.backend import compiled_reports  # noqa: E402
from relay_compile.bench.configs import LayerConfig  # noqa: E402
from relay_compile.bench.inputs import make_inputs  # noqa: E402
from relay_compile.bench.rows import compiled_a2a_builder  # noqa: E402
from relay_compile.bench.standin_group import standin_group  # noqa: E402
from relay_compile.memory import PeakMemory  # noqa: E402
from tests.models.megatron_style import MegatronStyleMoE  # noqa: E402


def grouped_linear_class(cpu: bool) -> type:
    if cpu:
        from tests.models.te_grouped_linear import GroupedLinear

        relay_compile.register_grouped_linear(GroupedLinear)
        return GroupedLinear
    import transformer_engine.pytorch as te

    return te.GroupedLinear


def build(args: argparse.Namespace, group, cls: type, dtype: torch.dtype, device: str) -> MegatronStyleMoE:
    kwargs = {} if args.cpu else {"params_dtype": dtype, "device": device}
    moe = MegatronStyleMoE(args.dim, args.ffn, args.experts, args.top_k, group, seed=0, grouped_linear=cls,
                           counts_exchange="all_to_all", **kwargs)  # the stand-in mirrors all-to-alls only
    moe = moe.to(device=device, dtype=dtype)
    # torch 2.11's Dynamo cannot proxy the stand-in group object: functional collectives take its name.
    moe.group = group.group_name
    return moe


def leaves(moe: MegatronStyleMoE, x: torch.Tensor, grad: torch.Tensor, fn=None) -> dict[str, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    y = (moe if fn is None else fn)(leaf)
    y.backward(grad.to(y.dtype))
    out = {"y": y.detach().float(), "x.grad": leaf.grad.float()}
    out |= {n: p.grad.float() for n, p in moe.named_parameters() if p.grad is not None}
    moe.zero_grad(set_to_none=True)
    return out


def errors(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: ((got[k] - truth[k]).norm() / truth[k].norm().clamp_min(1e-30)).item() for k in truth}


def timed(fn, x: torch.Tensor, grad: torch.Tensor, moe, args, device: str) -> tuple[float, int]:
    """Median ms of fwd+bwd over --repeats after --warmup, and the peak of one more step."""
    times = []
    for i in range(args.warmup + args.repeats):
        moe.zero_grad(set_to_none=True)
        leaf = x.detach().clone().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(leaf).backward(grad)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    moe.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    with PeakMemory(device) as mem:
        fn(leaf).backward(grad)
    moe.zero_grad(set_to_none=True)
    return statistics.median(times), mem.peak_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--tiny", action="store_true", help="H=32 F=16 E=8 K=2")
    p.add_argument("--out", default="")
    p.add_argument("--routing", default="auto")
    p.add_argument("--ring", default="", help="the backend option ring (default: its default)")
    args = p.parse_args()
    if args.tiny:
        args.dim, args.ffn, args.experts, args.top_k = 32, 16, 8, 2
    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    group = standin_group(args.ep)
    cls = grouped_linear_class(args.cpu)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, args.dim, generator=gen, device=device)
    grad = torch.randn(args.tokens, args.dim, generator=gen, device=device)
    rows: dict[str, dict] = {}

    truth_moe = build(args, group, cls, torch.float32, device)
    truth = leaves(truth_moe, x, grad)
    del truth_moe
    moe = build(args, group, cls, dtype, device)
    xd, gd = x.to(dtype), grad.to(dtype)
    eager_err = errors(leaves(moe, xd, gd), truth)
    ms, peak = timed(moe, xd, gd, moe, args, device)
    rows["TE layer, a2a eager"] = {"ms": ms, "peak": peak, "err": eager_err}
    print(f"[progress] TE layer eager: {ms:.2f} ms, peak {peak / 2**20:.0f} MiB", flush=True)

    torch._dynamo.reset()
    seen = len(compiled_reports())
    # Token routing under the stand-in computes N * Y_0 by design (bench/standin_group.py): its numbers are not
    # the layer's; --routing expert where that matters (CPU picks by bytes per hop, CUDA by the time model).
    options = ({} if args.routing == "auto" else {"routing": args.routing}) | ({"ring": args.ring} if args.ring else {})
    compiled = torch.compile(moe, backend="relaymoe", dynamic=False, options=options)
    ring_err = errors(leaves(moe, xd, gd, compiled), truth)
    print("[progress] TE layer relaymoe: compiled, first step done", flush=True)
    ms, peak = timed(compiled, xd, gd, moe, args, device)
    regions = [r for rep in compiled_reports()[seen:] for r in rep.regions]
    rows["TE layer, relaymoe"] = {"ms": ms, "peak": peak, "err": ring_err,
                                  "regions": [(r.status, r.reason[:200], r.experts[:120]) for r in regions]}

    print(f"[progress] TE layer relaymoe: {ms:.2f} ms, peak {peak / 2**20:.0f} MiB", flush=True)
    # The reference layer (relay_compile.reference.a2a_moe) through the backend at the same shape.
    cfg = LayerConfig(name="reference", hidden=args.dim, ffn=args.ffn, experts=args.experts, top_k=args.top_k,
                      tokens=args.tokens, ep=args.ep, dtype="fp32" if args.cpu else "bf16", device=device)
    inp = make_inputs(cfg)
    ref = compiled_a2a_builder("relaymoe")(cfg, group)  # the bench's backend row: default options
    ref_times = []
    for i in range(args.warmup + args.repeats):
        for t in inp.leaves():
            t.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        ref(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights).backward(inp.grad_y_TH)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            ref_times.append((time.perf_counter() - start) * 1e3)
    rows["reference layer, relaymoe"] = {"ms": statistics.median(ref_times)}

    print(f"TE GroupedLinear MoE layer, H={args.dim} F={args.ffn} E={args.experts} K={args.top_k}, "
          f"{args.tokens} tokens/rank, EP={args.ep} (stand-in), {dtype}, {device}")
    print("| row | ms | peak MiB | worst leaf rel err (vs fp32) | regions |")
    print("| --- | ---: | ---: | --- | --- |")
    for name, r in rows.items():
        err = r.get("err")
        worst = max(err, key=err.get) if err else ""
        print(f"| {name} | {r['ms']:.2f} | {r.get('peak', 0) / 2**20:.0f} | "
              f"{f'{worst} {err[worst]:.2e}' if err else ''} | {r.get('regions', '')} |")
    e, g = rows["TE layer, a2a eager"], rows["TE layer, relaymoe"]
    ratios = {k: g["err"][k] / max(e["err"][k], 1e-30) for k in e["err"]}
    worst = max(ratios, key=ratios.get)
    print(f"peak a2a/relaymoe: {e['peak'] / max(g['peak'], 1):.2f}x; time relaymoe/a2a: {g['ms'] / e['ms']:.3f}x; "
          f"TE relaymoe / reference relaymoe time: {g['ms'] / rows['reference layer, relaymoe']['ms']:.3f}x; "
          f"worst error ratio relaymoe/a2a: {worst} {ratios[worst]:.3f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "te_layer.json").write_text(json.dumps(rows, indent=1, default=str))
    for k in e["err"]:
        print(f"  {k}: a2a {e['err'][k]:.3e}  relaymoe {g['err'][k]:.3e}")


if __name__ == "__main__":
    main()
