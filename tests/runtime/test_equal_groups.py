"""Backward chunks padded to equal groups (``runtime.equal_groups``): which chunks, and their padded tables."""

from __future__ import annotations

import unittest

import torch

from relay_compile.routing import PairRouting, plan_chunks, split_experts
from relay_compile.runtime.equal_groups import MAX_PAD_DIVISOR, EqualGroups


def planned(rows_E: list[int], experts_per_hop: int):
    """A step's routing over experts with ``rows_E`` pairs each (one pair per token, K=1), and one chunk per hop."""
    ids = torch.tensor([e for e, n in enumerate(rows_E) for _ in range(n)]).reshape(-1, 1)
    routing = PairRouting.build(ids, rows_E, experts_per_hop)
    hops = range(len(rows_E) // experts_per_hop)
    chunks = plan_chunks([split_experts(routing.rows_per_expert(h), routing.starts_host[h * experts_per_hop], None)
                          for h in hops], experts_per_hop, torch.device("cpu"))
    scores = torch.arange(1, sum(rows_E) + 1, dtype=torch.float32)
    return routing, chunks, scores


class EqualGroupsPlan(unittest.TestCase):
    def test_near_equal_experts_are_padded_and_others_left_as_they_are(self) -> None:
        # Hop 0: 32 and 33 rows (1 padding row of 65: picked); hop 1: 3 and 5 (2 of 8: too many); hop 2: one
        # expert with rows, the other empty (padding would double it).
        routing, chunks, scores = planned([32, 33, 3, 5, 4, 0], 2)
        eq = EqualGroups.plan(chunks, routing.tokens_P, scores)
        assert eq is not None
        self.assertIsNone(eq.of(chunks[1][0]))
        self.assertIsNone(eq.of(chunks[2][0]))
        first = eq.of(chunks[0][0])
        assert first is not None
        self.assertEqual((first.start, first.end, first.groups, first.rows), (0, 66, 2, 33))
        self.assertEqual(first.offsets_G.tolist(), [33, 66])
        self.assertEqual(first.offsets_G.storage_offset() % 4, 0)
        pairs = routing.tokens_P.shape[0]
        # Expert 0's 32 pairs, one padding row (position P: token 0, score 0), then expert 1's 33.
        self.assertEqual(eq.pos_Q.tolist(), [*range(32), pairs, *range(32, 65)])
        self.assertEqual(eq.tok_Q[32].item(), 0)
        self.assertEqual(eq.score_Q[32].item(), 0.0)
        torch.testing.assert_close(eq.tok_Q[33:], routing.tokens_P[32:65])
        torch.testing.assert_close(eq.score_Q[:32], scores[:32])

    def test_only_real_pairs_score_gradients_reach_the_step_and_only_once_a_chunk_ran_padded(self) -> None:
        routing, chunks, scores = planned([32, 33], 2)
        eq = EqualGroups.plan(chunks, routing.tokens_P, scores)
        assert eq is not None
        ds_S1 = torch.full((66,), -1.0)
        eq.ds_Q.copy_(torch.arange(66, dtype=torch.float32))
        eq.scores_grad_into(ds_S1)  # no chunk looked up yet: nothing ran padded (a backward without remat)
        self.assertTrue((ds_S1 == -1).all())
        eq.of(chunks[0][0])
        eq.scores_grad_into(ds_S1)
        self.assertEqual(ds_S1[:65].tolist(), [*range(32), *range(33, 66)])

    def test_nothing_to_pad_gives_no_tables(self) -> None:
        routing, chunks, scores = planned([5, 0, 7, 0], 1)
        self.assertIsNone(EqualGroups.plan(chunks, routing.tokens_P, scores))
        self.assertGreater(MAX_PAD_DIVISOR, 1)


if __name__ == "__main__":
    unittest.main()
