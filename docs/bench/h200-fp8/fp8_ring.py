"""Issue 27, FP8 hops on one H200 (torch 2.11): the Qwen3 layer on the stand-in EP group (simulated EP, rank 0 of N),
``ring_moe`` bf16 against ``ring_moe(fp8=True)`` (expert routing, ring forced) beside the all-to-all reference layer
eager; then the FP8 GEMM of one hop against TE's FP8 ``GroupedLinear`` (current scaling) on the same rows.

    python docs/bench/h200-fp8/fp8_ring.py --tokens 65536 --ep 8 64

Prints per EP: median ms of fwd+bwd over interleaved repeats (and the spread), peak above entry, weight bytes per
hop (the agreement's volumes), and each leaf's relative (Frobenius) error against the layer in fp32.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from relay_compile import ring_moe  # noqa: E402
from relay_compile.bench.configs import LayerConfig  # noqa: E402
from relay_compile.bench.inputs import make_inputs  # noqa: E402
from relay_compile.bench.measure import gpu_us_per_call  # noqa: E402
from relay_compile.bench.standin_group import standin_group  # noqa: E402
from relay_compile.fp8_gemm import scaled_grouped_linear  # noqa: E402
from relay_compile.kernels import fp8_quantize  # noqa: E402
from relay_compile.memory import PeakMemory  # noqa: E402
from relay_compile.reference import a2a_moe  # noqa: E402
from relay_compile.runtime import specs  # noqa: E402

NAMES = ("y", "dx", "d_scores", "dw1", "dw2", "dw3")


def step(fn, inp, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in inp.leaves()]
    y = fn(leaves[0], inp.topk_ids_TK, leaves[1], *leaves[2:], **kw)
    y.backward(inp.grad_y_TH.to(y.dtype))
    return [y.detach().float(), *(t.grad.float() for t in leaves)]


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def layer_rows(ep: int, tokens: int, repeats: int, group) -> None:
    cfg = LayerConfig(name="qwen3", hidden=2048, ffn=768, experts=128, top_k=8, tokens=tokens, ep=ep, dtype="bf16",
                      device="cuda")
    inp = make_inputs(cfg)
    # The truth: the same inputs and routing, in fp32.
    truth_inp = dataclasses.replace(inp, **{f: getattr(inp, f).float() for f in ("x_TH", "topk_scores_TK",
                                                                                 "grad_y_TH")},
                                    weights=[w.float() for w in inp.weights])
    truth = step(a2a_moe, truth_inp, group=group)
    del truth_inp
    rows = {
        "a2a eager": (a2a_moe, {"group": group}),
        "ring bf16": (ring_moe, {"group": group, "routing": "expert", "ring": "always"}),
        "ring fp8": (ring_moe, {"group": group, "routing": "expert", "ring": "always", "fp8": True}),
    }
    out = {}
    for name, (fn, kw) in rows.items():
        got = step(fn, inp, **kw)
        out[name] = {"err": [rel(g, t) for g, t in zip(got, truth)], "ms": []}
        if fn is ring_moe:
            out[name]["bytes"] = next(reversed(specs._FUNCTIONAL.values())).volumes["expert"]["forward"]
        del got
        for _ in range(2):
            step(fn, inp, **kw)
        torch.cuda.synchronize()
        with PeakMemory("cuda") as mem:
            step(fn, inp, **kw)
        out[name]["peak"] = mem.peak_bytes
    for _ in range(repeats):  # interleaved
        for name, (fn, kw) in rows.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(fn, inp, **kw)
            torch.cuda.synchronize()
            out[name]["ms"].append((time.perf_counter() - t0) * 1e3)
    print(f"\nQwen3 layer H=2048 F=768 E=128 K=8, {tokens} tokens/rank, EP={ep} (stand-in), bf16, H200; "
          f"median of {repeats} interleaved fwd+bwd")
    print("| row | ms | spread | peak MiB | weight bytes/hop (fwd) | err y, dx, ds, dw1, dw2, dw3 vs fp32 |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, r in out.items():
        med = statistics.median(r["ms"])
        spread = (max(r["ms"]) - min(r["ms"])) / med
        print(f"| {name} | {med:.2f} | {spread:.1%} | {r['peak'] / 2**20:.0f} | {r.get('bytes', '')} | "
              + ", ".join(f"{e:.2e}" for e in r["err"]) + " |")
    a2a, bf, f8 = (statistics.median(out[k]["ms"]) for k in rows)
    print(f"EP={ep}: fp8/bf16 ring time {f8 / bf:.3f}x (speedup {bf / f8:.3f}x); fp8 ring/a2a {f8 / a2a:.3f}x; "
          f"bf16 ring/a2a {bf / a2a:.3f}x; peak a2a/fp8 {out['a2a eager']['peak'] / out['ring fp8']['peak']:.2f}x; "
          f"bytes fp8/bf16 {out['ring fp8']['bytes'] / out['ring bf16']['bytes']:.3f}")


def kernel_and_te_check() -> None:
    """The Triton quantizer against its reference, and one hop's fc1 GEMM: ours (FP8 rows x FP8 experts) against
    TE GroupedLinear FP8 (current scaling), both against fp32."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, 2048, device="cuda", generator=gen).bfloat16()
    tok = torch.randperm(16384, device="cuda", generator=gen)[:8192]
    for gated in (False, True):
        q, s = fp8_quantize.quantize_rows(x, tok, gated=gated)
        qr, sr = fp8_quantize.reference(x, tok, gated=gated)
        print(f"quantize_rows gated={gated}: scales max rel diff {((s - sr).abs() / sr).max().item():.2e}, "
              f"fp8 bytes differing {(q.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item():.2e}")
    splits = [1024] * 16  # TE FP8 needs multiples of 16
    w = torch.randn(16, 1536, 2048, device="cuda", generator=gen) * 0.02
    xs = torch.randn(sum(splits), 2048, device="cuda", generator=gen)
    truth = torch.cat([c @ w[e].T for e, c in enumerate(xs.split(splits))])
    qw, sw = fp8_quantize.quantize_experts(w.bfloat16())
    offs = torch.tensor(splits, device="cuda").cumsum(0).int()
    ours = scaled_grouped_linear(*fp8_quantize.quantize_rows(xs.bfloat16()), qw, sw, offs, torch.bfloat16).float()
    bf16 = torch._grouped_mm(xs.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offs).float()
    print(f"fc1 GEMM vs fp32: relaymoe fp8 {rel(ours, truth):.3e}, bf16 grouped_mm {rel(bf16, truth):.3e}")
    gemm_times()
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe

        lin = te.GroupedLinear(16, 2048, 1536, bias=False, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            for e in range(16):
                getattr(lin, f"weight{e}").copy_(w[e])
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
            y_te = lin(xs.bfloat16(), splits).float()
        print(f"fc1 GEMM vs fp32: TE GroupedLinear FP8 current scaling {rel(y_te, truth):.3e}")
    except Exception as e:  # noqa: BLE001 -- a bench: report and go on
        print(f"TE FP8 check failed: {type(e).__name__}: {e}")


def gemm_times() -> None:
    """One EP=8 hop's GEMMs (65536 rows over 16 experts, uneven): bf16 ``_grouped_mm`` against FP8
    ``_scaled_grouped_mm``, and the row quantization that feeds it."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.distributions.Dirichlet(torch.ones(16)).sample() * 65536
    counts = counts.round().int()
    counts[-1] += 65536 - int(counts.sum())
    offs = counts.cuda().cumsum(0).int()
    for name, k, n in (("x @ w13^T", 2048, 1536), ("act @ w2^T", 768, 2048), ("dy @ w2", 2048, 768),
                       ("dh13 @ w13", 1536, 2048)):
        a = torch.randn(65536, k, device="cuda", generator=gen).bfloat16()
        b = (torch.randn(16, n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        qa, sa = fp8_quantize.quantize_rows(a)
        qb, sb = fp8_quantize.quantize_experts(b)
        t_bf16 = gpu_us_per_call(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs), 20) / 1e3
        t_fp8 = gpu_us_per_call(lambda: scaled_grouped_linear(qa, sa, qb, sb, offs, torch.bfloat16), 20) / 1e3
        t_q = gpu_us_per_call(lambda: fp8_quantize.quantize_rows(a), 20) / 1e3
        print(f"GEMM {name} (65536 x {k} -> {n}, 16 experts): bf16 {t_bf16:.3f} ms, fp8 {t_fp8:.3f} ms "
              f"({t_bf16 / t_fp8:.2f}x), quantize rows {t_q:.3f} ms", flush=True)
    w = (torch.randn(16, 1536, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    ms = gpu_us_per_call(lambda: fp8_quantize.quantize_experts(w), 5) / 1e3
    print(f"quantize_experts (16 x 1536 x 2048): {ms:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--ep", type=int, nargs="+", default=[8, 64])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    kernel_and_te_check()
    for ep in args.ep:
        group = standin_group(ep)
        layer_rows(ep, args.tokens, args.repeats, group)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
