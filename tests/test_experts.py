"""The expert function's fused SwiGLU backward against autograd, and its fused pointwise kernel on CUDA.

On the CPU (CI) the pointwise part runs eagerly: the same function the CUDA path compiles. The CUDA test runs
on the device machine (``python -m pytest tests/test_experts.py``) and is skipped elsewhere.
"""

from __future__ import annotations

import unittest

import torch
from torch import Tensor

from relay_compile.experts import expert_ffn, expert_ffn_swiglu_vjp, pointwise, swiglu_backward_pointwise


def _case(device: str, dtype: torch.dtype, counts: list[int], hidden: int = 32, ffn: int = 16):
    gen = torch.Generator().manual_seed(0)
    e, s = len(counts), sum(counts)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    x, dy = rand(s, hidden), rand(s, hidden)
    w1, w3, w2 = rand(e, ffn, hidden) * hidden**-0.5, rand(e, ffn, hidden) * hidden**-0.5, rand(e, hidden, ffn)
    score = torch.rand(s, generator=gen).to(device=device, dtype=dtype)
    return x, torch.tensor(counts, device=device), w1, w2, w3, dy, score


def _autograd_reference(x, counts, w1, w2, w3, dy, score) -> list[Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, score)]
    out = expert_ffn(leaves[0], counts, leaves[1], leaves[2], leaves[3])
    return list(torch.autograd.grad(((out * leaves[4][:, None]) * dy).sum(), leaves))


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class FusedSwiGLUBackward(unittest.TestCase):
    def test_fused_backward_equals_autograd_with_empty_experts(self) -> None:
        for grouped in (True, False):
            x, counts, w1, w2, w3, dy, score = _case("cpu", torch.float32, [5, 0, 9, 2])
            dx, d_score, (dw1, dw2, dw3) = expert_ffn_swiglu_vjp(
                x, counts, w1, w2, w3, dy, score, use_grouped_mm=grouped
            )
            want = _autograd_reference(x, counts, w1, w2, w3, dy, score)
            for name, got, ref in zip(("dx", "dw1", "dw2", "dw3", "d_score"), (dx, dw1, dw2, dw3, d_score), want):
                self.assertLess(_rel(got, ref), 1e-5, f"{name} grouped={grouped}")

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
    def test_compiled_pointwise_and_fused_backward_on_cuda_bf16(self) -> None:
        x, counts, w1, w2, w3, dy, score = _case("cuda", torch.bfloat16, [500, 0, 1000, 548], 256, 128)
        h1, h3, g = x[:, :128].contiguous(), dy[:, :128].contiguous(), x[:, 128:].contiguous()
        eager = swiglu_backward_pointwise(h1, h3, g, score)
        fused = pointwise(swiglu_backward_pointwise, h1, h3, g, score)
        for a, b in zip(fused, eager):
            self.assertLess(_rel(a, b), 2e-3)
        dx, d_score, (dw1, dw2, dw3) = expert_ffn_swiglu_vjp(x, counts, w1, w2, w3, dy, score)
        want = _autograd_reference(x, counts, w1, w2, w3, dy, score)
        for got, ref in zip((dx, dw1, dw2, dw3, d_score), want):
            self.assertLess(_rel(got, ref), 2e-2)  # bf16 rounding of differently ordered sums


if __name__ == "__main__":
    unittest.main()
