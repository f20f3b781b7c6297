"""``kernels.scatter_add_rows``: the fp32 y/dx accumulation of the ring, eager (CPU) and Triton (CUDA)."""

from __future__ import annotations

import unittest
import unittest.mock

import torch

from relay_compile.kernels import scatter_add_rows
from relay_compile.kernels.scatter_add_rows import scatter_add_rows_


def _case(device: str, rows: int = 300, hidden: int = 40, tokens: int = 17):
    gen = torch.Generator().manual_seed(0)
    tok = torch.randint(0, tokens, (rows,), generator=gen)
    tok[:5] = 3  # a token met by several rows
    values = torch.randn(rows, hidden, generator=gen).bfloat16()
    scale = torch.rand(rows, 1, generator=gen).bfloat16()
    base = torch.randn(tokens, hidden, generator=gen)
    return [t.to(device) for t in (base, tok, values, scale)]


def _exact(base, tok, values, scale):
    want = base.double().clone()
    want.index_add_(0, tok, values.double() * (1 if scale is None else scale.double()))
    return want


class ScatterAddRows(unittest.TestCase):
    def test_fp32_sum_of_bf16_rows_equals_the_exact_sum_to_fp32_rounding_in_blocks(self) -> None:
        base, tok, values, scale = _case("cpu")
        for s in (scale, None):
            with unittest.mock.patch.object(scatter_add_rows, "WIDENED_ROWS", 64):  # 5 blocks of rows
                got = base.clone()
                scatter_add_rows_(got, tok, values, s)
            torch.testing.assert_close(got.double(), _exact(base, tok, values, s), rtol=1e-6, atol=1e-6)

    def test_rows_of_the_sums_dtype_take_one_index_add(self) -> None:
        base, tok, values, scale = _case("cpu")
        got = base.bfloat16()
        scatter_add_rows_(got, tok, values, scale)
        want = base.bfloat16().index_add_(0, tok, values * scale)
        self.assertTrue(torch.equal(got, want))

    def test_empty_rows_change_nothing(self) -> None:
        base, tok, values, scale = _case("cpu")
        got = base.clone()
        scatter_add_rows_(got, tok[:0], values[:0], scale[:0])
        self.assertTrue(torch.equal(got, base))

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
    def test_triton_kernel_equals_the_exact_sum_on_cuda(self) -> None:
        base, tok, values, scale = _case("cuda", rows=70_000, hidden=2048 + 64, tokens=4096)
        self.assertIsNotNone(scatter_add_rows._triton_kernel())
        for s in (scale, None):
            got = base.clone()
            scatter_add_rows_(got, tok, values, s)
            torch.testing.assert_close(got.double(), _exact(base, tok, values, s), rtol=1e-5, atol=1e-4)


if __name__ == "__main__":
    unittest.main()
