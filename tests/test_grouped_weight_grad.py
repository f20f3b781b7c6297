"""``kernels.grouped_weight_grad``: the fp32 weight gradients of rows sorted by expert, eager and Triton."""

from __future__ import annotations

import unittest

import torch

from relay_compile.grouped_gemm import grouped_weight_grad
from relay_compile.kernels.grouped_weight_grad import reference
from tests.triton_interpreter import run_interpreted

# Uneven experts, an empty one and rows that fill no whole block of the kernel.
COUNTS = [5, 0, 37, 16, 1]


def _case(dtype: torch.dtype, device: str = "cpu", counts=COUNTS, width_o: int = 24, width_i: int = 40):
    gen = torch.Generator().manual_seed(0)
    rows = sum(counts)
    dy = torch.randn(rows, width_o, generator=gen).to(dtype)
    x = torch.randn(rows, width_i, generator=gen).to(dtype)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    base = torch.randn(len(counts), width_o, width_i, generator=gen)
    return [t.to(device) for t in (dy, x, offsets, base)]


def _exact(dy, x, counts):
    parts = torch.split(dy.double(), counts), torch.split(x.double(), counts)
    return torch.stack([d.t() @ r for d, r in zip(*parts, strict=True)])


class GroupedWeightGrad(unittest.TestCase):
    def test_reference_writes_or_adds_each_experts_product(self) -> None:
        dy, x, offsets, base = _case(torch.bfloat16)
        want = _exact(dy, x, COUNTS)
        got = torch.full_like(base, float("nan"))
        reference(dy, x, offsets, got, accumulate=False)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        got = base.clone()
        reference(dy, x, offsets, got, accumulate=True)
        torch.testing.assert_close(got.double(), base.double() + want, rtol=1e-6, atol=1e-5)
        self.assertTrue(torch.equal(got[1], base[1]))  # the empty expert adds nothing

    @unittest.skipIf(torch.cuda.is_available(), "on CUDA the compiled kernel is tested (test_triton_kernel_on_cuda)")
    def test_kernel_under_the_interpreter_equals_the_exact_products(self) -> None:
        # Triton's interpreter runs the kernel's index math on the CPU (in numpy, which has no bf16: fp16 rows).
        script = """
            import torch
            from relay_compile.kernels import grouped_weight_grad as k
            from tests.test_grouped_weight_grad import COUNTS, _case, _exact
            for counts in (COUNTS, [0, 0, 3], [70]):
                dy, x, offsets, base = _case(torch.float16, counts=counts, width_o=33, width_i=20)
                assert k.applies(dy, x, base.dtype, base), "the kernel must run under the interpreter"
                want = _exact(dy, x, counts)
                got = torch.full_like(base, float("nan"))
                k.grouped_weight_grad_(dy, x, offsets, got, accumulate=False)
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
                got = base.clone()
                k.grouped_weight_grad_(dy, x, offsets, got, accumulate=True)
                torch.testing.assert_close(got.double(), base.double() + want, rtol=1e-5, atol=1e-4)
            print("ok")
        """
        run_interpreted(self, script)

    def test_fp32_sums_over_offsets_need_the_host_counts_where_the_kernel_does_not_run(self) -> None:
        # On the CPU the offsets alone do not give fp32 sums: the loop over experts needs the host counts.
        dy, x, offsets, base = _case(torch.bfloat16)
        with self.assertRaises(AssertionError):
            grouped_weight_grad(dy, x, offsets, None, torch.float32)
        got = grouped_weight_grad(dy, x, offsets, COUNTS, torch.float32)
        torch.testing.assert_close(got.double(), _exact(dy, x, COUNTS), rtol=1e-6, atol=1e-5)

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
    def test_triton_kernel_on_cuda(self) -> None:
        counts = [3000, 0, 129, 4096, 1]
        dy, x, offsets, base = _case(torch.bfloat16, "cuda", counts, width_o=1536, width_i=2048 + 64)
        want = _exact(dy, x, counts)
        got = grouped_weight_grad(dy, x, offsets, None, torch.float32)  # no host counts: the kernel ran
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-2)
        acc = base.clone()
        grouped_weight_grad(dy, x, offsets, None, into_EOI=acc)
        torch.testing.assert_close(acc.double(), base.double() + want, rtol=1e-4, atol=1e-2)


if __name__ == "__main__":
    unittest.main()
