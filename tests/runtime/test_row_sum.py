"""``runtime.row_sum.RowSum``: y/dx summed across hops in fp32, finished into bf16 in the sum's own memory."""

from __future__ import annotations

import unittest
import unittest.mock

import torch

from relay_compile.kernels.scatter_add_rows import reference, scatter_add_rows_
from relay_compile.memory import PeakMemory, install_counting_cpu_allocator
from relay_compile.runtime import row_sum
from relay_compile.runtime.row_sum import RowSum
from tests.test_memory import needs_build


def _adds(tokens: int, hidden: int, seed: int, hops: int = 3, rows: int = 40):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(hops):
        tok = torch.randint(0, max(tokens, 1), (rows if tokens else 0,), generator=gen)
        tok[: min(3, len(tok))] = tokens - 1  # the last row (the tail's last) met several times
        yield (tok, torch.randn(len(tok), hidden, generator=gen).bfloat16(),
               torch.rand(len(tok), 1, generator=gen))


class RowSumTest(unittest.TestCase):
    def test_two_block_sum_finishes_to_the_rounded_fp32_sum_for_every_length_and_narrowing_block(self) -> None:
        hidden = 6
        for tokens in (0, 1, 2, 3, 8, 101, 2049):
            for first in (1, 3, 1024):  # 1: the longest run of doubling blocks
                with self.subTest(tokens=tokens, first=first), unittest.mock.patch.object(row_sum, "NARROW_FIRST", first):
                    got = RowSum(torch.empty(tokens, hidden, dtype=torch.bfloat16), torch.float32)
                    want = torch.zeros(tokens, hidden)
                    for tok, rows, scale in _adds(tokens, hidden, seed=tokens):
                        got.add_(tok, rows, scale)
                        want.index_add_(0, tok, rows.float() * scale)
                    out = got.finish(torch.bfloat16)
                    self.assertTrue(torch.equal(out, want.bfloat16()))
                    self.assertIsNone(out._base)
                    # The result owns the first block's storage only: T H bf16 (one row more when T is odd).
                    self.assertLessEqual(out.untyped_storage().nbytes(), (tokens + tokens % 2) * hidden * 2)

    def test_a_sum_as_wide_as_its_rows_is_one_block(self) -> None:
        s = RowSum(torch.empty(10, 4), torch.float32)
        self.assertIsNone(s.tail_TH)
        tok, rows, scale = next(_adds(10, 4, seed=0))
        s.add_(tok, rows.float())
        self.assertTrue(torch.equal(s.finish(torch.float32), torch.zeros(10, 4).index_add_(0, tok, rows.float())))

    def test_an_arriving_sum_is_waited_for_at_its_first_add_only_and_added_into_in_place(self) -> None:
        arrived = torch.ones(4, 3)
        waits: list[int] = []

        def resolve() -> torch.Tensor:
            waits.append(1)
            return arrived

        total = RowSum.arriving(torch.float32, resolve)
        self.assertEqual((total.dtype, waits), (torch.float32, []))  # its dtype known before it arrives
        total.add_(torch.tensor([1, 3]), torch.full((2, 3), 2.0))
        total.add_(torch.tensor([1]), torch.full((1, 3), 1.0))
        self.assertEqual(waits, [1])
        self.assertTrue(torch.equal(arrived[:, 0], torch.tensor([1.0, 4.0, 1.0, 3.0])))

    def test_a_two_block_sum_refuses_to_finish_in_another_width(self) -> None:
        s = RowSum(torch.empty(10, 4, dtype=torch.bfloat16), torch.float32)
        with self.assertRaisesRegex(AssertionError, "half as wide as torch.float32, not torch.float32"):
            s.finish(torch.float32)

    def test_split_reference_keeps_an_inf_row_out_of_the_other_block(self) -> None:
        head, tail = torch.zeros(2, 3), torch.zeros(2, 3)
        tok = torch.tensor([3, 0])
        rows = torch.tensor([[float("inf")] * 3, [1.0] * 3]).bfloat16()
        reference(head, tok, rows, tail_TH=tail)
        self.assertTrue(torch.equal(head, torch.tensor([[1.0] * 3, [0.0] * 3])))
        self.assertTrue(torch.isinf(tail[1]).all() and not tail[0].any())
        same_dtype_head, same_dtype_tail = torch.zeros(2, 3), torch.zeros(2, 3)
        scatter_add_rows_(same_dtype_head, tok, rows.float(), tail_TH=same_dtype_tail)
        self.assertTrue(torch.equal(same_dtype_head, head) and torch.equal(same_dtype_tail, tail))

    @needs_build
    def test_finishing_holds_no_second_copy_of_the_sum(self) -> None:
        install_counting_cpu_allocator()  # before the sum is allocated: its tail's free is counted
        tokens, hidden = 4096, 64
        s = RowSum(torch.empty(tokens, hidden, dtype=torch.bfloat16), torch.float32)
        for tok, rows, scale in _adds(tokens, hidden, seed=1):
            s.add_(tok, rows, scale)
        with PeakMemory("cpu", "allocator") as mem:
            out = s.finish(torch.bfloat16)
        # Only the first block's temporary (1024 bf16 rows) is allocated; the tail (half the fp32 sum) is freed.
        self.assertLessEqual(mem.peak_bytes, row_sum.NARROW_FIRST * hidden * 2)
        self.assertEqual(mem.end_bytes, -tokens // 2 * hidden * 4)
        self.assertEqual(out.shape, (tokens, hidden))


@unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
class RowSumCudaTest(unittest.TestCase):
    def test_triton_kernel_adds_into_both_blocks(self) -> None:
        tokens, hidden = 4099, 2048 + 64
        got = RowSum(torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda"), torch.float32)
        want = torch.zeros(tokens, hidden, dtype=torch.float64, device="cuda")
        for tok, rows, scale in _adds(tokens, hidden, seed=2, rows=20_000):
            tok, rows, scale = tok.cuda(), rows.cuda(), scale.cuda()
            got.add_(tok, rows, scale)
            want.index_add_(0, tok, rows.double() * scale.double())
        torch.testing.assert_close(got.finish(torch.bfloat16).double(), want.bfloat16().double(), rtol=8e-3, atol=1e-2)


if __name__ == "__main__":
    unittest.main()
