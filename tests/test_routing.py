"""Chunk planning: expert-aligned chunks of a hop and their device tables (host logic, no process group)."""

from __future__ import annotations

import random
import unittest

import torch

from relay_compile.routing import plan_chunks, split_experts


class SplitExperts(unittest.TestCase):
    def test_docstring_example(self) -> None:
        self.assertEqual(split_experts([3, 0, 2, 9], 0, 4), [
            (0, 3, 0, 2, (3, 0)), (3, 5, 2, 3, (2,)), (5, 8, 3, 4, (3,)), (8, 11, 3, 4, (3,)), (11, 14, 3, 4, (3,)),
        ])

    def test_whole_hop_empty_hop_and_exact_fit(self) -> None:
        self.assertEqual(split_experts([2, 0, 5], 10, None), [(10, 17, 0, 3, (2, 0, 5))])
        self.assertEqual(split_experts([0, 0], 10, 4), [])
        self.assertEqual(split_experts([2, 2], 0, 4), [(0, 4, 0, 2, (2, 2))])
        self.assertEqual(split_experts([4, 1], 0, 4), [(0, 4, 0, 1, (4,)), (4, 5, 1, 2, (1,))])

    def test_random_plans_cover_the_range_in_order_within_the_bound(self) -> None:
        rng = random.Random(0)
        for _ in range(500):
            rows_L = [rng.choice([0, 0, 1, 3, 7, 20]) for _ in range(rng.randint(1, 6))]
            base, bound = rng.randint(0, 50), rng.randint(1, 10)
            chunks = split_experts(rows_L, base, bound)
            pos = base
            for start, end, lo, hi, rows in chunks:
                self.assertEqual(start, pos, (rows_L, bound, chunks))
                self.assertTrue(0 < end - start <= bound, (rows_L, bound, chunks))
                self.assertEqual(sum(rows), end - start)
                self.assertEqual(len(rows), hi - lo)
                if hi - lo > 1:  # packed experts are whole
                    self.assertEqual(list(rows), rows_L[lo:hi])
                pos = end
            self.assertEqual(pos, base + sum(rows_L))
            # Every expert's rows appear exactly once across its chunks.
            per_expert = [0] * len(rows_L)
            for _, _, lo, _, rows in chunks:
                for i, r in enumerate(rows):
                    per_expert[lo + i] += r
            self.assertEqual(per_expert, rows_L)


class PlanChunks(unittest.TestCase):
    def test_device_tables_hold_offsets_and_counts_of_each_chunk(self) -> None:
        bounds = [split_experts([3, 0, 2, 9], 0, 4), [], split_experts([1, 1, 1, 1], 14, None)]
        plans = plan_chunks(bounds, 4, torch.device("cpu"))
        self.assertEqual([len(p) for p in plans], [5, 0, 1])
        first, last = plans[0][0], plans[2][0]
        self.assertEqual(first.offsets_G.tolist(), [3, 3])
        self.assertEqual(first.offsets_G.dtype, torch.int32)
        self.assertEqual(first.counts_L.tolist(), [3, 0, 0, 0])
        self.assertEqual(plans[0][2].counts_L.tolist(), [0, 0, 0, 3])
        self.assertFalse(first.whole)
        self.assertEqual((last.start, last.end, last.offsets_G.tolist(), last.whole), (14, 18, [1, 2, 3, 4], True))
        # Offsets start 16-byte aligned in the table (torch._grouped_mm reads them as a fresh tensor).
        for chunk in (c for p in plans for c in p):
            self.assertEqual(chunk.offsets_G.storage_offset() % 4, 0)


if __name__ == "__main__":
    unittest.main()
