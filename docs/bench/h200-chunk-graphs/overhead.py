"""Where the chunk graphs' extra GPU time goes (H200, one EP=64 backward chunk: 2 experts of ~4096 rows, Qwen3
shapes, bf16): GPU time per call by CUDA events, 50 calls after a warm-up.

    python docs/bench/h200-chunk-graphs/overhead.py

Rows: the fused backward as the ring runs it without graphs (host counts, fp32 weight gradients added into the
travelling sums by the GEMMs) and as the graph body runs it (device offsets only, bf16 weight-gradient partials),
then the pieces the graph path adds around it.
"""
import torch

from relay_compile.bench.measure import gpu_us_per_call
from relay_compile.experts import ffn_expert_fn

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
G, H, F = 2, 2048, 768
rows_G = [4030, 4162]
C = 8448  # bucket_rows(8192 rows) with room: what the padded program runs
n = sum(rows_G)
fn = ffn_expert_fn("swiglu")
w13 = torch.randn(G, 2 * F, H, device=dev, dtype=dt) * 0.02
w2 = torch.randn(G, H, F, device=dev, dtype=dt) * 0.02
x_TH = torch.randn(65536, H, device=dev, dtype=dt)
dy_TH = torch.randn(65536, H, device=dev, dtype=dt)
tok = torch.randint(0, 65536, (n,), device=dev)
tok_pad = torch.cat([tok, tok.new_zeros(C - n)])
score = torch.rand(n, device=dev, dtype=dt)
score_pad = torch.cat([score, score.new_zeros(C - n)])
offs = torch.tensor([rows_G[0], n], device=dev, dtype=torch.int32)
offs_pad = torch.tensor([rows_G[0], C], device=dev, dtype=torch.int32)
sums = [torch.zeros(G, 2 * F, H, device=dev), torch.zeros(G, H, F, device=dev)]
ds = torch.empty(n, device=dev)
x_Q, dy_Q, out_Q = (torch.empty(C, H, device=dev, dtype=dt) for _ in range(3))
ds_Q = torch.empty(C, device=dev)
w_static = [torch.empty_like(w13), torch.empty_like(w2)]
dh13_Q = torch.randn(C, 2 * F, device=dev, dtype=dt)


def eager():  # the ring's path without graphs
    fn.vjp_rows(x_TH, tok, offs, rows_G, [w13, w2], dy_TH, score, grad_dtype=torch.float32,
                grad_into=lambda: sums, d_score_out=ds)


def body():  # the graph body (offsets only, bf16 partials), on the arena
    dx, _, dws = fn.vjp_rows(x_Q, None, offs_pad, (), w_static, dy_Q, score_pad, d_score_out=ds_Q)
    out_Q.copy_(dx)
    return dws


def fills():
    torch.index_select(x_TH, 0, tok_pad, out=x_Q)
    torch.index_select(dy_TH, 0, tok_pad, out=dy_Q)
    w_static[0].copy_(w13)
    w_static[1].copy_(w2)


dws = body()


def adds():
    for s, g in zip(sums, dws):
        s.add_(g)


def dx_copy():
    out_Q.copy_(x_Q)


def wgrad_bf16():  # dw13 as the graph body computes it
    torch._grouped_mm(dh13_Q.t(), x_Q, offs=offs_pad)


def wgrad_fp32():  # dw13 as the ring without graphs computes it: into the fp32 sum, per expert
    for a, d, xe in zip(sums[0].unbind(0), dh13_Q[:n].t().split(rows_G, dim=1), x_Q[:n].split(rows_G)):
        torch.addmm(a, d, xe, out_dtype=torch.float32, out=a)


print(f"torch {torch.__version__}; chunk of {n} rows padded to {C}")
print("| piece | GPU us |")
print("|---|---:|")
for name, f in [("backward, ring without graphs (fp32 sums by the GEMMs)", eager),
                ("backward, graph body (offsets only, bf16 partials, dx copied out)", body),
                ("fills: x and dy gathers into the arena, weight copies", fills),
                ("bf16 partials added into the fp32 sums", adds),
                ("dx rows copied out (alone)", dx_copy),
                ("dw13: one bf16 K-grouped _grouped_mm (padded rows)", wgrad_bf16),
                ("dw13: fp32-out addmm per expert into the sum", wgrad_fp32)]:
    print(f"| {name} | {gpu_us_per_call(f):.1f} |")
