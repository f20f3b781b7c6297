"""``bench.inputs.first_hop_chunks``: the first hop's chunks that the kernel probes under docs/bench/ time."""

from __future__ import annotations

import unittest

import torch

from relay_compile.bench.inputs import first_hop_chunks


class FirstHopChunks(unittest.TestCase):
    def test_chunks_hold_rank_zeros_pairs_by_expert_in_runs_of_experts(self) -> None:
        tokens, experts, top_k, ep = 256, 16, 3, 4
        gen = torch.Generator().manual_seed(0)
        chunks = first_hop_chunks(tokens, experts, top_k, ep, 2, gen)
        ids = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(0)).topk(top_k, dim=1).indices
        per_rank = experts // ep
        want = [torch.nonzero((ids == e).any(1)).flatten() for e in range(per_rank)]  # tokens of each expert
        self.assertEqual([len(c) for _, c in chunks], [2, 2])
        got = [tok for tok_S, counts in chunks for tok in torch.split(tok_S, counts)]
        self.assertEqual(len(got), per_rank)
        for tok, expected in zip(got, want, strict=True):
            self.assertTrue(torch.equal(tok, expected))  # ascending tokens of that expert (a stable sort)


if __name__ == "__main__":
    unittest.main()
