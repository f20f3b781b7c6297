"""``WeightGrads``: where a hop's weight-gradient contributions go (``runtime/weight_grads.py``), and the
fused SwiGLU backward writing into the accumulators it is given (``experts.GradSink``)."""

from __future__ import annotations

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

from relay_compile.experts import ffn_expert_fn
from relay_compile.routing import Chunk
from relay_compile.runtime.weight_grads import WeightGrads


def _chunk(lo: int, hi: int, whole: bool) -> Chunk:
    counts = torch.zeros(4, dtype=torch.int64)
    return Chunk(start=0, end=0, lo=lo, hi=hi, rows=(0,) * (hi - lo), offsets_G=counts[: hi - lo].int(),
                 counts_L=counts, whole=whole)


class WeightGradsSinks(TestCase):
    def setUp(self) -> None:
        self.weights = [torch.zeros(4, 3, 2, dtype=torch.bfloat16), torch.zeros(4, 2, 3, dtype=torch.bfloat16)]

    def test_first_whole_contribution_is_taken_as_it_is(self) -> None:
        dw = WeightGrads(self.weights, torch.float32)
        self.assertIsNone(dw.sink(_chunk(0, 4, whole=True)))
        grads = [torch.ones(4, 3, 2), torch.ones(4, 2, 3)]
        dw.add(grads, _chunk(0, 4, whole=True))
        self.assertIs(dw.result()[0], grads[0])

    def test_slices_of_experts_write_into_one_zeroed_accumulator_of_the_sum_dtype(self) -> None:
        dw = WeightGrads(self.weights, torch.float32)
        first = dw.sink(_chunk(0, 2, whole=False))
        second = dw.sink(_chunk(1, 4, whole=False))  # an expert split across chunks: slices overlap
        assert first is not None and second is not None
        first[0].add_(1.0)
        second[0].add_(2.0)
        w1, _ = dw.result()
        self.assertEqual(w1.dtype, torch.float32)
        self.assertEqual(w1[:, 0, 0], torch.tensor([1.0, 3.0, 2.0, 2.0]))
        # The slices are views of the result: no chunk owns a partial of its own.
        self.assertEqual(first[0].untyped_storage().data_ptr(), w1.untyped_storage().data_ptr())

    def test_incoming_sums_are_fetched_only_when_the_first_contribution_is_added(self) -> None:
        incoming = [torch.full((4, 3, 2), 5.0), torch.full((4, 2, 3), 7.0)]
        fetched: list[int] = []

        def arrive() -> list[torch.Tensor]:
            fetched.append(1)
            return incoming

        dw = WeightGrads(self.weights, torch.float32, into=arrive)
        self.assertEqual(fetched, [])
        sinks = dw.sink(_chunk(0, 4, whole=True))  # whole chunk: still the incoming sums, never a partial
        assert sinks is not None
        self.assertEqual(fetched, [1])
        self.assertIs(sinks[0], incoming[0])
        dw.add([torch.ones(1, 3, 2), None], _chunk(1, 2, whole=False))
        out = dw.result()
        self.assertEqual(fetched, [1])
        self.assertIs(out[0], incoming[0])
        self.assertEqual(out[0][:, 0, 0], torch.tensor([5.0, 6.0, 5.0, 5.0]))
        self.assertEqual(out[1], torch.full((4, 2, 3), 7.0))

    def test_a_hop_no_pair_reached_returns_the_incoming_sums_unchanged(self) -> None:
        incoming = [torch.full((4, 3, 2), 5.0), torch.full((4, 2, 3), 7.0)]
        out = WeightGrads(self.weights, torch.float32, into=lambda: incoming).result()
        self.assertIs(out[0], incoming[0])
        self.assertIs(out[1], incoming[1])


class FusedBackwardIntoAccumulators(TestCase):
    def test_swiglu_vjp_adds_weight_gradients_into_given_accumulators(self) -> None:
        # The same chunk twice: once returning fresh gradients, once adding into accumulators holding 1.0.
        torch.manual_seed(0)
        fn = ffn_expert_fn("swiglu", use_grouped_mm=False)
        e, h, f, t = 3, 8, 4, 10
        w1, w3 = torch.randn(e, f, h), torch.randn(e, f, h)
        w2 = torch.randn(e, h, f)
        packed = fn.pack([w1, w2, w3])
        x_TH, dy_TH, score_S = torch.randn(t, h), torch.randn(t, h), torch.rand(t)
        tok_S = torch.arange(t)
        rows = [4, 0, 6]
        offsets = torch.tensor(rows).cumsum(0).int()
        dx, ds, dws = fn.vjp_rows(x_TH, tok_S, offsets, rows, packed, dy_TH, score_S)
        accs = [torch.ones_like(p) for p in packed]
        dx2, ds2, none = fn.vjp_rows(x_TH, tok_S, offsets, rows, packed, dy_TH, score_S, grad_into=lambda: accs)
        self.assertEqual(none, [])
        self.assertEqual(dx2, dx)
        self.assertEqual(ds2, ds)
        for acc, dw in zip(accs, dws, strict=True):
            self.assertEqual(acc, dw + 1.0, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    run_tests()
