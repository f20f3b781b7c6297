"""Chunk planning: expert-aligned chunks of a hop and their device tables (host logic, no process group)."""

from __future__ import annotations

import random
import unittest

import torch

from relay_compile.routing import PairRouting, plan_chunks, split_experts, split_owners


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


class SplitOwners(unittest.TestCase):
    """A grouped forward hop's chunks over a stack of owners (E_l = 2, N = 4, rows per expert below)."""

    rows_E = [1, 2, 0, 3, 4, 0, 5, 6]

    def routing(self) -> PairRouting:
        ids = torch.tensor([e for e, n in enumerate(self.rows_E) for _ in range(n)]).reshape(-1, 1)
        return PairRouting.build(ids, self.rows_E, 2)

    def test_consecutive_owners_are_one_range_and_lo_hi_index_the_stack(self) -> None:
        # Owners 1, 2: experts 2..5, sorted pairs [3, 10); one chunk over all four experts of the stack.
        self.assertEqual(split_owners(self.routing(), [1, 2], None), [(3, 10, 0, 4, (0, 3, 4, 0))])
        # Bounded: whole experts packed up to 4 rows, each chunk's experts numbered in the stack.
        self.assertEqual(split_owners(self.routing(), [1, 2], 4), [(3, 6, 0, 2, (0, 3)), (6, 10, 2, 4, (4, 0))])

    def test_a_stack_that_wraps_around_the_ring_is_two_ranges(self) -> None:
        # Owners 3, 0: experts 6, 7 (pairs [10, 21)) in slot 0, experts 0, 1 (pairs [0, 3)) in slot 1.
        self.assertEqual(split_owners(self.routing(), [3, 0], None),
                         [(10, 21, 0, 2, (5, 6)), (0, 3, 2, 4, (1, 2))])

    def test_empty_owners_give_no_chunks(self) -> None:
        rows_E = self.rows_E
        self.rows_E = [0, 0, 0, 0, 4, 0, 0, 0]
        try:
            self.assertEqual(split_owners(self.routing(), [0, 1], 3), [])
            self.assertEqual(split_owners(self.routing(), [1, 2], 3), [(0, 2, 2, 3, (2,)), (2, 4, 2, 3, (2,))])
        finally:
            self.rows_E = rows_E


class PlanChunks(unittest.TestCase):
    def test_a_hop_holding_several_owners_has_tables_as_long_as_its_experts(self) -> None:
        plans = plan_chunks([split_experts([1, 2], 0, None), [(3, 10, 0, 4, (0, 3, 4, 0))]], [2, 4],
                            torch.device("cpu"))
        self.assertEqual(plans[1][0].counts_L.tolist(), [0, 3, 4, 0])
        self.assertEqual(plans[1][0].offsets_G.tolist(), [0, 3, 7, 7])
        self.assertTrue(plans[1][0].whole and plans[0][0].whole)


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
