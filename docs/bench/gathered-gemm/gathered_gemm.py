"""Is a grouped GEMM that gathers its rows in its loads faster than a gather and the library's grouped GEMM? (issue 24)

At EP=8, 65536 tokens per rank, the forced ring's row gathers are 4.7 ms of an H100's 51 ms step (12.9 GB:
docs/BENCHMARKS.md, "Where the ring's last 5% goes"); every gathered buffer is written once and read once more by
a grouped GEMM. ``kernels.gathered_grouped_mm`` reads the rows at their indices instead. This times, at the first
hop's chunk shapes (routing as the ring sees it: pairs sorted by expert), GPU us per call of:

- ``gather + _grouped_mm``: ``index_select`` then ``torch._grouped_mm`` (what the ring runs today);
- ``_grouped_mm alone``: the library GEMM on rows already gathered (its floor);
- ``triton, gathered`` per tile config: the kernel, rows read at their indices;
- ``triton, rows``: the kernel on rows already gathered (against ``_grouped_mm alone``: the kernel's own speed);

for each GEMM of a hop that reads gathered rows (``h13 = x[tok] @ w13^T``, ``g = dy[tok] @ w2``) and one that
does not (``dx = dh13 @ w13``); the forward's first projection with SwiGLU in its epilogue (``act`` stored, not
``h13``) against the gather, ``_grouped_mm`` and ``swiglu_forward`` the ring runs; the products the ring adds into its fp32 sums (``y += s * act @ w2^T``, ``dx +=
dh13 @ w13``) as the library GEMM and ``scatter_add_rows`` against the kernel adding them in its epilogue
(fp32 atomics); and the fp32 weight gradients with their rows gathered in the loads
(``kernels.grouped_weight_grad``), beside the same on gathered rows.

    python docs/bench/gathered-gemm/gathered_gemm.py [--tokens 65536] [--chunks 4 2 1]
"""
import argparse

import torch

from relay_compile.bench.inputs import first_hop_chunks
from relay_compile.bench.measure import gpu_us_per_call
from relay_compile.kernels import gathered_grouped_mm as ggmm
from relay_compile.kernels import grouped_weight_grad as gwg
from relay_compile.kernels import scatter_add_rows as sar
from relay_compile.kernels import swiglu_gemm
from relay_compile.kernels.swiglu_backward import swiglu_backward_
from relay_compile.kernels.swiglu_forward import swiglu_forward

CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)
    (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
    (128, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 4),
    (256, 128, 64, 8, 8, 3),
    (128, 256, 32, 8, 8, 5),
    (64, 256, 64, 8, 4, 4),
    (128, 128, 128, 8, 8, 3),
]


SWIGLU_CONFIGS = [  # both halves' tiles, BLOCK_N columns of each; the last three spill nothing on Triton 3.6
    (128, 128, 64, 8, 8, 3),  # (offline-compile/triton-3.6.md: the default's backward spills 1.6 KB a thread)
    (128, 128, 32, 8, 8, 4),
    (128, 64, 64, 8, 8, 4),
    (64, 128, 64, 8, 8, 3),
]


def tflops(rows: int, k: int, n: int, us: float) -> float:
    return 2 * rows * k * n / us / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 2, 1])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--configs", type=int, default=len(CONFIGS),
                    help="the first N tile configs only (the products' and the adds'; SwiGLU's all run)")
    args = ap.parse_args()
    T, H, F = args.tokens, args.hidden, args.ffn
    configs = CONFIGS[: args.configs]
    bf = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x_TH = torch.randn(T, H, device="cuda", dtype=bf, generator=gen)
    dy_TH = torch.randn(T, H, device="cuda", dtype=bf, generator=gen)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; T={T} H={H} F={F} E=128 K=8 EP=8, first hop;"
          f" GPU us per call ({args.calls} calls), TFLOPS of the GEMM")
    print("| chunks | rows | experts | GEMM | form | us | TFLOPS | max rel err |")
    print("|---:|---:|---:|---|---|---:|---:|---:|")
    for chunks in args.chunks:
        tok_S, counts = first_hop_chunks(T, 128, 8, 8, chunks, gen)[0]
        S, G = tok_S.numel(), len(counts)
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        w13 = torch.randn(G, 2 * F, H, device="cuda", dtype=bf, generator=gen) * H ** -0.5
        w2 = torch.randn(G, H, F, device="cuda", dtype=bf, generator=gen) * F ** -0.5
        dh13 = torch.randn(S, 2 * F, device="cuda", dtype=bf, generator=gen)
        gemms = {  # name: (source rows, gathered?, weights (G, K, N))
            "h13 = x[tok] @ w13^T": (x_TH, True, w13.transpose(-2, -1)),
            "g = dy[tok] @ w2": (dy_TH, True, w2),
            "dx = dh13 @ w13": (dh13, False, w13),
        }
        for name, (src, gathered, b) in gemms.items():
            k, n = b.shape[1], b.shape[2]
            idx = tok_S if gathered else None
            rows = torch.index_select(src, 0, tok_S) if gathered else src
            want = torch._grouped_mm(rows, b, offs=offs).float()
            scale = want.abs().max().item()

            def row(form, fn, check=None):
                us = gpu_us_per_call(fn, calls=args.calls)
                err = f"{(check().float() - want).abs().max().item() / scale:.1e}" if check else ""
                print(f"| {chunks} | {S} | {G} | {name} | {form} | {us:.1f} | {tflops(S, k, n, us):.0f} | {err} |",
                      flush=True)

            if gathered:
                row("gather + _grouped_mm", lambda: torch._grouped_mm(torch.index_select(src, 0, tok_S), b, offs=offs))
            row("_grouped_mm alone", lambda: torch._grouped_mm(rows, b, offs=offs))
            out = torch.empty(S, n, device="cuda", dtype=bf)
            for cfg in configs:
                try:
                    fn = lambda cfg=cfg: ggmm.gathered_grouped_mm(src, idx, b, offs, out, config=cfg)  # noqa: E731
                    row(f"triton{', gathered' if gathered else ''} {cfg}", fn, fn)
                except Exception as e:  # a config the GPU cannot hold (shared memory)
                    print(f"| {chunks} | {S} | {G} | {name} | triton {cfg} | failed: {type(e).__name__} | | |")
            if gathered:
                row("triton, rows (default config)", lambda: ggmm.gathered_grouped_mm(rows, None, b, offs, out))
                # The backward's form: read at the indices, the rows stored for the weight gradient (rows_out).
                kept = torch.empty_like(rows)
                row("triton, gathered, rows stored (default config)",
                    lambda: ggmm.gathered_grouped_mm(src, idx, b, offs, out, rows_out=kept))
                print(f"| {chunks} | {S} | {G} | {name} | rows stored equal the gathered rows: "
                      f"{torch.equal(kept, rows)} | | | |", flush=True)
                del kept
            del rows, want, out
        # SwiGLU in the first projection's epilogue: act = silu(h1) * h3 of x[tok] @ w13^T, never writing h13.
        b13 = w13.transpose(-2, -1)
        want_act = swiglu_forward(torch._grouped_mm(torch.index_select(x_TH, 0, tok_S), b13, offs=offs)).float()
        name, act_scale = "act = swiglu(x[tok] @ w13^T)", want_act.abs().max().item()
        us = gpu_us_per_call(lambda: swiglu_forward(torch._grouped_mm(torch.index_select(x_TH, 0, tok_S), b13,
                                                                      offs=offs)), calls=args.calls)
        print(f"| {chunks} | {S} | {G} | {name} | gather + _grouped_mm + swiglu_forward | {us:.1f} | "
              f"{tflops(S, H, 2 * F, us):.0f} | |", flush=True)
        us = gpu_us_per_call(lambda: swiglu_forward(ggmm.gathered_grouped_mm(x_TH, tok_S, b13, offs)),
                             calls=args.calls)
        print(f"| {chunks} | {S} | {G} | {name} | triton gathered + swiglu_forward | {us:.1f} | "
              f"{tflops(S, H, 2 * F, us):.0f} | |", flush=True)
        for cfg in SWIGLU_CONFIGS:
            try:
                fn = lambda cfg=cfg: swiglu_gemm.grouped_swiglu(x_TH, tok_S, b13, offs, config=cfg)  # noqa: E731
                us = gpu_us_per_call(fn, calls=args.calls)
                err = (fn().float() - want_act).abs().max().item() / act_scale
                print(f"| {chunks} | {S} | {G} | {name} | triton, swiglu epilogue {cfg} | {us:.1f} | "
                      f"{tflops(S, H, 2 * F, us):.0f} | {err:.1e} |", flush=True)
            except Exception as e:  # a config the GPU cannot hold (shared memory)
                print(f"| {chunks} | {S} | {G} | {name} | triton, swiglu epilogue {cfg} | failed: "
                      f"{type(e).__name__} | | |")
        del want_act
        # The backward's recomputed first projection with SwiGLU's backward in its epilogue, x read at the tokens'
        # indices and its rows stored for dw13, against the gather, _grouped_mm and the in-place pointwise kernel.
        name = "dh13, g <- swiglu_bwd(x_rows @ w13^T, g)"
        x_rows = torch.index_select(x_TH, 0, tok_S)
        g0 = torch.randn(S, F, device="cuda", dtype=bf, generator=gen)
        sc = torch.rand(S, device="cuda", generator=gen)
        g1 = g0.clone()

        def unfused_bwd():
            g1.copy_(g0)
            swiglu_backward_(torch._grouped_mm(torch.index_select(x_TH, 0, tok_S), b13, offs=offs), g1, sc)

        copy_us = gpu_us_per_call(lambda: g1.copy_(g0), calls=args.calls)
        us = gpu_us_per_call(unfused_bwd, calls=args.calls) - copy_us
        print(f"| {chunks} | {S} | {G} | {name} | gather + _grouped_mm + swiglu_backward_ | {us:.1f} | "
              f"{tflops(S, H, 2 * F, us):.0f} | |", flush=True)
        x_kept = torch.empty_like(x_rows)

        def rows_then_pointwise():  # the reads at indices without the fusion: the product tile, then the kernel
            g1.copy_(g0)
            swiglu_backward_(ggmm.gathered_grouped_mm(x_TH, tok_S, b13, offs, rows_out=x_kept), g1, sc)

        us = gpu_us_per_call(rows_then_pointwise, calls=args.calls) - copy_us
        print(f"| {chunks} | {S} | {G} | {name} | triton gathered, rows stored + swiglu_backward_ | {us:.1f} | "
              f"{tflops(S, H, 2 * F, us):.0f} | |", flush=True)
        h13 = torch._grouped_mm(x_rows, b13, offs=offs)
        g1.copy_(g0)
        want_ds = swiglu_backward_(h13, g1, sc)
        for cfg in SWIGLU_CONFIGS:
            try:
                def fused_bwd(cfg=cfg):  # x read at tok, its rows stored (the ring's backward under the option)
                    g1.copy_(g0)
                    return swiglu_gemm.grouped_swiglu_backward_(x_TH, tok_S, b13, offs, g1, sc, config=cfg,
                                                                rows_out=x_kept)

                us = gpu_us_per_call(fused_bwd, calls=args.calls) - copy_us
                dh13, ds = fused_bwd()
                err = max((dh13.float() - h13.float()).abs().max().item() / h13.float().abs().max().item(),
                          (ds - want_ds).abs().max().item() / want_ds.abs().max().item())
                print(f"| {chunks} | {S} | {G} | {name} | triton, swiglu_backward epilogue {cfg} | {us:.1f} | "
                      f"{tflops(S, H, 2 * F, us):.0f} | {err:.1e} |", flush=True)
            except Exception as e:  # a config the GPU cannot hold (shared memory, registers)
                print(f"| {chunks} | {S} | {G} | {name} | triton, swiglu_backward epilogue {cfg} | failed: "
                      f"{type(e).__name__} | | |")
        del x_rows, x_kept, g0, g1, h13
        # The products that the ring adds into its fp32 (T, H) sums: y += score * (act @ w2^T), dx += dh13 @ w13.
        sum_TH = torch.zeros(T, H, device="cuda")
        act = torch.randn(S, F, device="cuda", dtype=bf, generator=gen)
        score = torch.rand(S, device="cuda", generator=gen)
        for name, (rows, b, scale) in {"y += s * act @ w2^T": (act, w2.transpose(-2, -1), score),
                                       "dx += dh13 @ w13": (dh13, w13, None)}.items():
            k, n = b.shape[1], b.shape[2]

            def unfused(rows=rows, b=b, scale=scale):
                # As the ring's forward adds bf16 rows into its fp32 sum: the scores scaled in the scatter-add.
                out = torch._grouped_mm(rows, b, offs=offs)
                sar.scatter_add_rows_(sum_TH, tok_S, out, None if scale is None else scale[:, None])

            us = gpu_us_per_call(unfused, calls=args.calls)
            print(f"| {chunks} | {S} | {G} | {name} | _grouped_mm + scatter_add_rows | {us:.1f} | "
                  f"{tflops(S, k, n, us):.0f} | |", flush=True)
            for cfg in configs:
                try:
                    fn = lambda cfg=cfg, rows=rows, b=b, scale=scale: ggmm.gathered_grouped_mm_scatter_add_(  # noqa
                        rows, None, b, offs, sum_TH, tok_S, scale, config=cfg)
                    us = gpu_us_per_call(fn, calls=args.calls)
                    print(f"| {chunks} | {S} | {G} | {name} | triton, scatter epilogue {cfg} | {us:.1f} | "
                          f"{tflops(S, k, n, us):.0f} | |", flush=True)
                except Exception as e:  # a config the GPU cannot hold (shared memory)
                    print(f"| {chunks} | {S} | {G} | {name} | triton, scatter epilogue {cfg} | failed: "
                          f"{type(e).__name__} | | |")
            a_sum, b_sum = torch.zeros(T, H, device="cuda"), torch.zeros(T, H, device="cuda")
            out = torch._grouped_mm(rows, b, offs=offs).float()
            b_sum.index_add_(0, tok_S, out if scale is None else out * scale[:, None])
            ggmm.gathered_grouped_mm_scatter_add_(rows, None, b, offs, a_sum, tok_S, scale)
            err = ((a_sum - b_sum).abs().max() / b_sum.abs().max()).item()
            print(f"| {chunks} | {S} | {G} | {name} | scatter epilogue vs product + index_add: max rel err "
                  f"{err:.1e} | | | |", flush=True)
            del a_sum, b_sum, out
        del sum_TH, act
        # Weight gradients, fp32 sums added into: dw2 = dy[tok]^T act, dw13 = dh13^T x[tok].
        act = torch.randn(S, F, device="cuda", dtype=bf, generator=gen)
        acc2 = torch.zeros(G, H, F, device="cuda")
        acc13 = torch.zeros(G, 2 * F, H, device="cuda")
        dy_S = torch.index_select(dy_TH, 0, tok_S)
        x_S = torch.index_select(x_TH, 0, tok_S)
        for name, fn in {
            "dw2, dy gathered first": lambda: gwg.grouped_weight_grad_(torch.index_select(dy_TH, 0, tok_S), act, offs,
                                                                       acc2, accumulate=True),
            "dw2, dy rows given": lambda: gwg.grouped_weight_grad_(dy_S, act, offs, acc2, accumulate=True),
            "dw2, dy read at tok": lambda: gwg.grouped_weight_grad_(dy_TH, act, offs, acc2, accumulate=True,
                                                                    dy_idx_S=tok_S),
            "dw13, x gathered first": lambda: gwg.grouped_weight_grad_(dh13, torch.index_select(x_TH, 0, tok_S),
                                                                       offs, acc13, accumulate=True),
            "dw13, x rows given": lambda: gwg.grouped_weight_grad_(dh13, x_S, offs, acc13, accumulate=True),
            "dw13, x read at tok": lambda: gwg.grouped_weight_grad_(dh13, x_TH, offs, acc13, accumulate=True,
                                                                    x_idx_S=tok_S),
        }.items():
            us = gpu_us_per_call(fn, calls=args.calls)
            width = F if name.startswith("dw2") else 2 * F
            print(f"| {chunks} | {S} | {G} | weight grad | {name} | {us:.1f} | {tflops(S, H, width, us):.0f} | |",
                  flush=True)
        got, want = torch.zeros_like(acc2), torch.zeros_like(acc2)
        gwg.grouped_weight_grad_(dy_TH, act, offs, got, accumulate=False, dy_idx_S=tok_S)
        gwg.grouped_weight_grad_(dy_S, act, offs, want, accumulate=False)
        print(f"| {chunks} | {S} | {G} | weight grad | dw2 read at tok vs given: max abs diff "
              f"{(got - want).abs().max().item():.1e} | | | |")
        del act, acc2, acc13, dy_S, x_S, dh13, w13, w2


if __name__ == "__main__":
    main()
