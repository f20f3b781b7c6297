"""``kernels.swiglu_forward``: ``silu(h1) * h3`` of stacked projections, eager and Triton (CUDA, or Triton's
interpreter on the CPU)."""

from __future__ import annotations

import unittest
import unittest.mock

import torch
import torch.nn.functional as nnf

from relay_compile.kernels import swiglu_forward as k
from tests.triton_interpreter import run_interpreted


def _case(rows: int = 37, ffn: int = 40, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """Stacked projections as one GEMM leaves them: a row stride wider than 2F (a column slice of a wider
    buffer), extreme values in the first rows."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(rows, 2 * ffn + 6, generator=gen) * 4
    if rows:
        wide[0, :ffn] = torch.tensor([-88.0, 88.0, 0.0, -0.0] * (ffn // 4))  # silu's tails and zero
    return wide.to(dtype=dtype, device=device)[:, 3 : 3 + 2 * ffn]


def _exact(h13):
    ffn = h13.shape[-1] // 2
    h1, h3 = h13[:, :ffn].double(), h13[:, ffn:].double()
    return h1 * torch.sigmoid(h1) * h3


class SwiGLUForward(unittest.TestCase):
    def test_reference_is_the_eager_product_of_halves(self) -> None:
        h13 = _case()
        self.assertFalse(k.applies(h13))  # CPU, no interpreter: the eager form
        got = k.swiglu_forward(h13)
        self.assertTrue(torch.equal(got, nnf.silu(h13[:, :40]) * h13[:, 40:]))
        torch.testing.assert_close(got.double(), _exact(h13), rtol=2e-2, atol=1e-2)

    def test_projections_under_autograd_take_the_eager_form(self) -> None:
        h13 = _case(dtype=torch.float32).clone().requires_grad_()
        with unittest.mock.patch.object(k, "_interpreted", return_value=True):
            self.assertFalse(k.applies(h13))
            self.assertTrue(k.applies(h13.detach()))

    def test_kernel_under_the_interpreter_equals_the_eager_form(self) -> None:
        script = """
            import torch
            from relay_compile.kernels import swiglu_forward as k
            from tests.test_swiglu_forward import _case, _exact
            # fp16 and fp32 (numpy has no bf16: the interpreter's bf16 rounding is not CUDA's; CUDA runs bf16),
            # F not a multiple of the block, no rows.
            for dtype, rows, ffn in ((torch.float16, 37, 40), (torch.float32, 5, 24), (torch.float16, 0, 8)):
                h13 = _case(rows, ffn, dtype)
                assert k.applies(h13), "the kernel must run under the interpreter"
                got = k.swiglu_forward(h13)
                assert got.dtype == dtype and got.shape == (rows, ffn) and got.is_contiguous()
                # Equal to the eager form up to silu's last bits (the kernel's exp is not libm's).
                torch.testing.assert_close(got, k.reference(h13), rtol=2e-3 if dtype == torch.float16 else 1e-6,
                                           atol=1e-6)
                torch.testing.assert_close(got.double(), _exact(h13), rtol=2e-3, atol=1e-3)
            print("ok")
        """
        run_interpreted(self, script)

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
    def test_triton_kernel_on_cuda(self) -> None:
        h13 = _case(70_000, 768, device="cuda")
        self.assertTrue(k.applies(h13))
        got = k.swiglu_forward(h13)
        want = k.reference(h13)
        mismatched = (got != want).float().mean().item()
        self.assertLess(mismatched, 1e-2, "not the eager form's bits in more than 1% of elements")
        # A silu one bf16 step off can put the product two steps off (up to 1.56%).
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=0)


if __name__ == "__main__":
    unittest.main()
