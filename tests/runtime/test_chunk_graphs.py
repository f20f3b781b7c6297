"""Padded chunks and their static-shape programs (``runtime.chunk_graphs``), and the batched GEMMs of equal groups.

On the CPU the programs run eagerly through their static buffers (everything but the capture); the CUDA test
captures and replays them and compares with the ring without them. Multi-process equality with the all-to-all
layer is in tests/test_ring_moe.py (``chunk_graphs=True``).
"""

from __future__ import annotations

import unittest

import torch
import torch.nn.functional as nnf
from torch import Tensor
from torch.testing._internal.common_utils import TestCase, run_tests

from relay_compile import ring_moe
from relay_compile.bench.standin_group import standin_group
from relay_compile.experts import ffn_expert_fn
from relay_compile.grouped_gemm import uniform_rows
from relay_compile.routing import PairRouting, plan_chunks, split_experts
from relay_compile.runtime import chunk_graphs
from relay_compile.runtime.chunk_graphs import PaddedChunks, bucket_rows
from tests.bench.standin_case import StandinTestCase


def _experts_by_hand(x_SH: Tensor, rows_G: list[int], w13: Tensor, w2: Tensor) -> Tensor:
    """SwiGLU experts on rows sorted by expert, one expert at a time (the packed ``w13 = [w1; w3]``)."""
    ffn, outs, start = w2.shape[-1], [], 0
    for e, n in enumerate(rows_G):
        h = x_SH[start : start + n] @ w13[e].T
        outs.append((nnf.silu(h[:, :ffn]) * h[:, ffn:]) @ w2[e].T)
        start += n
    return torch.cat(outs)


class PaddingPlan(TestCase):
    def test_buckets_round_up_to_a_power_of_two_between_a_sixteenth_and_a_thirty_second(self) -> None:
        self.assertEqual([bucket_rows(n) for n in (1, 31, 32, 33, 4096, 4097, 4200)], [1, 31, 32, 34, 4096, 4352, 4352])
        for n in range(1, 5000, 7):
            self.assertGreaterEqual(bucket_rows(n), n)
            self.assertLessEqual(bucket_rows(n) - n, n // 16)

    def test_tables_pad_each_chunk_after_its_rows_with_token_zero_at_score_zero(self) -> None:
        # 2 owners of 2 local experts, 17 and 33 rows: padded to 17 and 34 rows (steps of 1 and 2 rows).
        ids_TK = torch.tensor([[0, 1]] * 8 + [[2, 3]] * 16 + [[2, 0]])
        counts = PairRouting.counts(ids_TK, 4).tolist()
        self.assertEqual(counts, [9, 8, 17, 16])
        routing = PairRouting.build(ids_TK, counts, 2)
        chunks = plan_chunks([split_experts(routing.rows_per_expert(o), routing.starts_host[2 * o], None)
                              for o in range(2)], 2, torch.device("cpu"))
        scores_S = torch.arange(1, 51, dtype=torch.float32)
        padded = PaddedChunks.plan(chunks, routing.tokens_P, scores_S)
        assert padded is not None
        pc0, pc1 = padded.of(chunks[0][0]), padded.of(chunks[1][0])
        assert pc0 is not None and pc1 is not None
        self.assertEqual((pc0.rows, pc0.start, pc0.first, pc0.real), (17, 0, 0, 17))
        self.assertEqual((pc1.rows, pc1.start, pc1.first, pc1.real), (34, 17, 17, 33))
        # Offsets: the last expert's group runs to the padded end.
        self.assertEqual(padded.offsets.tolist(), [9, 17, 17, 34])
        self.assertEqual(padded.offsets[pc1.offsets_at : pc1.offsets_at + 2].tolist(), [17, 34])
        torch.testing.assert_close(padded.tok_Q[:50], routing.tokens_P)
        torch.testing.assert_close(padded.score_Q[:50], scores_S)
        self.assertEqual(padded.tok_Q[50:].tolist(), [0])
        self.assertEqual(padded.score_Q[50:].tolist(), [0.0])

    def test_no_table_without_rows(self) -> None:
        empty = plan_chunks([[], []], 2, torch.device("cpu"))
        self.assertIsNone(PaddedChunks.plan(empty, torch.zeros(0, dtype=torch.int64), torch.zeros(0)))


class EqualGroups(TestCase):
    def test_uniform_rows(self) -> None:
        self.assertEqual([uniform_rows(c) for c in ([3, 3], [3], [3, 2], [0, 0], [], None)], [3, 3, 0, 0, 0, 0])

    def _check_equal_groups(self, device: str, dtype: torch.dtype, rel: float) -> None:
        torch.manual_seed(0)
        fn = ffn_expert_fn("swiglu")
        groups, rows, hidden, ffn = 3, 16, 32, 16

        def make(*shape: int) -> Tensor:
            return (torch.randn(*shape) * 0.5).to(device, dtype)

        def close(got: Tensor, want: Tensor) -> None:
            torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * want.abs().max().item())

        x, w13, w2 = make(groups * rows, hidden), make(groups, 2 * ffn, hidden), make(groups, hidden, ffn)
        offsets = torch.arange(1, groups + 1, dtype=torch.int32, device=device) * rows
        rows_G = [rows] * groups
        close(fn.forward_rows(x, offsets, rows_G, [w13, w2]), _experts_by_hand(x, rows_G, w13, w2))
        dy, score = make(groups * rows, hidden), torch.rand(groups * rows).to(device, dtype)
        leaves = [t.float().requires_grad_() for t in (x, w13, w2)]
        out = _experts_by_hand(leaves[0], rows_G, leaves[1], leaves[2])
        want = torch.autograd.grad(out, leaves, dy.float() * score.float()[:, None])
        dx, ds, (dw13, dw2) = fn.vjp_rows(x, None, offsets, rows_G, [w13, w2], dy, score, grad_dtype=torch.float32)
        close(ds, (dy.float() * out.detach()).sum(-1))
        close(dx, want[0])
        close(dw13, want[1])
        close(dw2, want[2])
        into = [torch.ones_like(w13, dtype=torch.float32), torch.ones_like(w2, dtype=torch.float32)]
        fn.vjp_rows(x, None, offsets, rows_G, [w13, w2], dy, score, grad_into=lambda: into)
        close(into[0], want[1] + 1)
        close(into[1], want[2] + 1)

    def test_equal_groups_match_the_experts_one_by_one_forward_and_backward(self) -> None:
        self._check_equal_groups("cpu", torch.float32, 1e-5)

    @unittest.skipUnless(torch.cuda.is_available(), "batched GEMMs run equal groups on CUDA only")
    def test_equal_groups_run_as_batched_gemms_on_cuda(self) -> None:
        self._check_equal_groups("cuda", torch.bfloat16, 2e-2)


def _step(x: Tensor, ids: Tensor, scores: Tensor, weights: list[Tensor], group, grad_y: Tensor, **kw) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, scores, *weights)]
    y = ring_moe(leaves[0], ids, leaves[1], *leaves[2:], group=group, **kw)
    return [y.detach(), *torch.autograd.grad(y, leaves, grad_y)]


def _random_ids(tokens: int, top_k: int, experts: int, gen: torch.Generator) -> Tensor:
    """Distinct random experts per token: chunks of varying rows, so several programs and their reuse."""
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


class StaticProgramsOnTheStandinGroup(StandinTestCase):
    """EP=8 on the stand-in group (peers are copies of this rank): chunk graphs on against off, several steps.
    (The stand-in world is torn down after the class: later tests must not find torch.distributed running.)"""

    def _compare(self, device: str, dtype: torch.dtype, tokens: int, hidden: int, ffn: int, rel: float) -> None:
        chunk_graphs.clear()
        group = standin_group(8)
        gen = torch.Generator().manual_seed(0)
        e_l, top_k = 2, 4
        weights = [(torch.randn(e_l, ffn, hidden, generator=gen) * 0.2).to(device, dtype),
                   (torch.randn(e_l, hidden, ffn, generator=gen) * 0.2).to(device, dtype),
                   (torch.randn(e_l, ffn, hidden, generator=gen) * 0.2).to(device, dtype)]
        for step in range(3):  # new routing and values each step: the programs are reused with new inputs
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            ids = _random_ids(tokens, top_k, 8 * e_l, gen).to(device)
            scores = torch.rand(tokens, top_k, generator=gen).to(device, dtype)
            grad_y = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            want = _step(x, ids, scores, weights, group, grad_y, chunk_graphs=False)
            got = _step(x, ids, scores, weights, group, grad_y, chunk_graphs=True)
            for name, g, w in zip(("y", "dx", "d_scores", "dw1", "dw2", "dw3"), got, want, strict=True):
                scale = w.abs().max().item()
                torch.testing.assert_close(g.float(), w.float(), rtol=rel, atol=rel * scale, msg=f"{step} {name}")
        self.assertTrue(chunk_graphs._CACHE.programs)
        self.assertGreater(chunk_graphs.held_bytes(), 0)

    def test_padded_chunks_through_static_buffers_match_the_ring_without_them(self) -> None:
        self._compare("cpu", torch.float32, tokens=203, hidden=16, ffn=8, rel=1e-5)  # chunks of ~100 rows pad

    @unittest.skipUnless(torch.cuda.is_available(), "captures CUDA graphs")
    def test_captured_graphs_replay_the_chunks_across_steps(self) -> None:
        self._compare("cuda", torch.bfloat16, tokens=4093, hidden=256, ffn=128, rel=2e-2)
        captured = [p for p in chunk_graphs._CACHE.programs.values() if p.graph is not None]
        self.assertTrue(captured, "no chunk program was captured")
        self.assertGreater(chunk_graphs.pool_bytes(), 0)


if __name__ == "__main__":
    run_tests()
