"""The expert function's fused backwards (SwiGLU, non-gated activations; with per-expert biases too) against
autograd, and SwiGLU's in-place pointwise kernel.

On the CPU (CI) the pointwise step runs its eager reference (in place, like the kernel); the CUDA test runs
the Triton kernel on the device machine (``python -m pytest tests/test_experts.py``) and is skipped elsewhere.
"""

from __future__ import annotations

import unittest

import torch
from torch import Tensor

from relay_compile.experts import (
    GATED,
    GroupedExperts,
    activation_fn,
    as_grouped,
    expert_ffn,
    expert_ffn_swiglu_vjp,
    ffn_expert_fn,
)
from relay_compile.grouped_gemm import expert_of_rows
from relay_compile.kernels.swiglu_backward import reference as swiglu_backward_reference
from relay_compile.kernels.swiglu_backward import swiglu_backward_


def _case(device: str, dtype: torch.dtype, counts: list[int], hidden: int = 32, ffn: int = 16):
    gen = torch.Generator().manual_seed(0)
    e, s = len(counts), sum(counts)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    x, dy = rand(s, hidden), rand(s, hidden)
    w1, w3, w2 = rand(e, ffn, hidden) * hidden**-0.5, rand(e, ffn, hidden) * hidden**-0.5, rand(e, hidden, ffn)
    score = torch.rand(s, generator=gen).to(device=device, dtype=dtype)
    return x, torch.tensor(counts, device=device), w1, w2, w3, dy, score


def _autograd_reference(x, counts, w1, w2, w3, dy, score) -> list[Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3, score)]
    out = expert_ffn(leaves[0], counts, leaves[1], leaves[2], leaves[3])
    return list(torch.autograd.grad(((out * leaves[4][:, None]) * dy).sum(), leaves))


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class FusedNonGatedBackward(unittest.TestCase):
    def test_every_non_gated_activation_has_a_fused_backward_equal_to_autograd(self) -> None:
        # Gathered rows (tokens in reverse order), an empty expert, both grouping paths; and the same chunk
        # adding its weight gradients into given accumulators (the ring's travelling sums) instead.
        for activation in ("silu", "gelu", "gelu_tanh", "relu", "relu2"):
            for grouped in (True, False):
                fn = ffn_expert_fn(activation, use_grouped_mm=grouped)
                self.assertTrue(fn.has_fused_backward)
                x, counts, w1, w2, _, dy, score = _case("cpu", torch.float32, [5, 0, 9, 2])
                tok = torch.arange(x.shape[0] - 1, -1, -1)
                offsets = torch.cumsum(counts, 0, dtype=torch.int32)
                dx, d_score, (dw1, dw2) = fn.vjp_rows(x.flip(0), tok, offsets, counts.tolist(), [w1, w2], dy.flip(0),
                                                      score)
                leaves = [t.clone().requires_grad_() for t in (x, w1, w2, score)]
                out = expert_ffn(leaves[0], counts, leaves[1], leaves[2], activation=activation)
                want = torch.autograd.grad(((out * leaves[3][:, None]) * dy).sum(), leaves)
                for name, got, ref in zip(("dx", "dw1", "dw2", "d_score"), (dx, dw1, dw2, d_score), want):
                    self.assertLess(_rel(got, ref), 1e-5, f"{name} {activation} grouped={grouped}")
                accs = [torch.ones_like(w1), torch.ones_like(w2)]
                _, _, none = fn.vjp_rows(x.flip(0), tok, offsets, counts.tolist(), [w1, w2], dy.flip(0), score,
                                         grad_into=lambda accs=accs: accs)
                self.assertEqual(none, [])
                for acc, ref in zip(accs, want[1:3], strict=False):
                    self.assertLess(_rel(acc - 1.0, ref), 1e-5, f"into {activation} grouped={grouped}")


def _biased_reference(activation: str, x: Tensor, rows: list[int], ws: list[Tensor]) -> Tensor:
    """Per expert, dense: ``act(x w1^T + b1) [* (x w3^T + b3)] w2^T + b2``; ``ws`` is ``(w1, w2[, w3], b1[, b3],
    b2)``."""
    gated = activation in GATED
    w1, w2, w3 = ws[0], ws[1], ws[2] if gated else None
    b1, b3, b2 = (ws[3], ws[4], ws[5]) if gated else (ws[2], None, ws[3])
    outs = []
    for e, x_e in enumerate(torch.split(x, rows)):
        h = activation_fn(activation)(x_e @ w1[e].T + b1[e])
        if w3 is not None and b3 is not None:
            h = h * (x_e @ w3[e].T + b3[e])
        outs.append(h @ w2[e].T + b2[e])
    return torch.cat(outs)


class BiasedExperts(unittest.TestCase):
    def test_each_row_is_given_its_experts_index_with_empty_experts_anywhere(self) -> None:
        rows = [0, 2, 0, 0, 3, 1, 0]
        offsets = torch.cumsum(torch.tensor(rows), 0, dtype=torch.int32)
        want = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
        torch.testing.assert_close(expert_of_rows(offsets, sum(rows)), want, rtol=0, atol=0)

    def test_biased_entry_points_on_an_expert_slice_equal_a_dense_reference_and_autograd(self) -> None:
        # A chunk holding experts [1, 4) of 4 (one empty), rows gathered by the function (reverse order) or given
        # (scores before the experts: tok_S=None), gradients returned or added into fp64 sinks.
        rows = [4, 0, 3]
        for activation in ("swiglu", "gelu", "relu2", "geglu"):
            for grouped in (True, False):
                what = f"{activation} grouped={grouped}"
                fn = ffn_expert_fn(activation, use_grouped_mm=grouped, biases=(True, True))
                x, counts, w1, w2, w3, dy, score = _case("cpu", torch.float32, rows)
                gen = torch.Generator().manual_seed(1)
                b1, b3, b2 = (torch.randn(4, n, generator=gen) for n in (w1.shape[1], w1.shape[1], w2.shape[1]))
                w1, w2, w3 = (torch.cat([torch.randn(1, *w.shape[1:]), w], 0) for w in (w1, w2, w3))
                ws = [w1, w2, w3, b1, b3, b2] if activation in GATED else [w1, w2, b1, b2]
                self.assertEqual(fn.num_packed(len(ws)), 4)
                packed = [w[1:4] for w in fn.pack(ws)]
                mine = [w[1:4] for w in ws]
                offsets = torch.cumsum(counts, 0, dtype=torch.int32)
                out = fn.forward_rows(x, offsets, rows, packed)
                self.assertLess(_rel(out, _biased_reference(activation, x, rows, mine)), 1e-6, what)
                self.assertEqual(fn.has_fused_backward, activation != "geglu", what)
                if not fn.has_fused_backward:
                    continue
                leaves = [t.clone().requires_grad_() for t in (x, *mine)]
                ref = _biased_reference(activation, leaves[0], rows, leaves[1:])
                want = torch.autograd.grad(ref, leaves, dy * score[:, None])
                want_ds = (dy * ref).sum(-1)
                tok = torch.arange(x.shape[0] - 1, -1, -1)
                dx, ds, dws = fn.vjp_rows(x.flip(0), tok, offsets, rows, packed, dy.flip(0), score)
                sinks = [torch.zeros_like(p, dtype=torch.float64) for p in packed]
                dx2, _, none = fn.vjp_rows(x, None, offsets, rows, packed, dy, score, torch.float64, lambda: sinks)
                self.assertEqual(none, [])
                for got_dws in (dws, [g.float() for g in sinks]):
                    for i, (g, w) in enumerate(zip(fn.unpack_grads(got_dws, mine), want[1:], strict=True)):
                        self.assertLess(_rel(g, w), 1e-6, f"{what} weight {i}")
                for got, ref_ in ((dx, want[0]), (dx2, want[0]), (ds, want_ds)):
                    self.assertLess(_rel(got, ref_), 1e-6, what)


class FusedSwiGLUBackward(unittest.TestCase):
    def test_fused_backward_equals_autograd_with_empty_experts(self) -> None:
        for grouped in (True, False):
            x, counts, w1, w2, w3, dy, score = _case("cpu", torch.float32, [5, 0, 9, 2])
            dx, d_score, (dw1, dw2, dw3) = expert_ffn_swiglu_vjp(
                x, counts, w1, w2, w3, dy, score, use_grouped_mm=grouped
            )
            want = _autograd_reference(x, counts, w1, w2, w3, dy, score)
            for name, got, ref in zip(("dx", "dw1", "dw2", "dw3", "d_score"), (dx, dw1, dw2, dw3, d_score), want):
                self.assertLess(_rel(got, ref), 1e-5, f"{name} grouped={grouped}")

    def test_packed_entry_points_on_an_expert_slice_equal_the_ffn_and_autograd(self) -> None:
        # The hop loop's path: weights packed once ([w13, w2]), a chunk holding experts [1, 3) of 4.
        for grouped in (True, False):
            fn = ffn_expert_fn("swiglu", use_grouped_mm=grouped)
            x, counts, w1, w2, w3, dy, score = _case("cpu", torch.float32, [4, 0, 3])
            w1_all, w2_all, w3_all = (torch.cat([torch.randn(1, *w.shape[1:]), w], 0) for w in (w1, w2, w3))
            packed = [w[1:4] for w in fn.pack([w1_all, w2_all, w3_all])]
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            out = fn.forward_rows(x, offsets, counts.tolist(), packed)
            self.assertLess(_rel(out, expert_ffn(x, counts, w1, w2, w3)), 1e-6, f"forward grouped={grouped}")
            # Rows gathered by the function itself: tokens 0..S-1 of a larger (T, H) in reverse order.
            tok = torch.arange(x.shape[0] - 1, -1, -1)
            x_T = torch.cat([x.flip(0), torch.randn(2, x.shape[1])])
            dy_T = torch.cat([dy.flip(0), torch.randn(2, x.shape[1])])
            dx, d_score, dws = fn.vjp_rows(x_T, tok, offsets, counts.tolist(), packed, dy_T, score)
            dw1, dw2, dw3 = fn.unpack_grads(dws, [w1, w2, w3])
            want = _autograd_reference(x, counts, w1, w2, w3, dy, score)
            for name, got, ref in zip(("dx", "dw1", "dw2", "dw3", "d_score"), (dx, dw1, dw2, dw3, d_score), want):
                self.assertLess(_rel(got, ref), 1e-5, f"{name} grouped={grouped}")

    def test_fp32_weight_gradients_of_bf16_rows_are_not_rounded_to_bf16(self) -> None:
        # The ring's fp32 sums: the weight-gradient GEMMs return their fp32 accumulators; rounded to bf16 they
        # are the bf16 gradients (up to one bf16 step: the summation order may differ).
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        for device in devices:
            fn = ffn_expert_fn("swiglu")
            x, counts, w1, w2, w3, dy, score = _case(device, torch.bfloat16, [40, 0, 70, 18], 64, 32)
            packed = fn.pack([w1, w2, w3])
            offsets, rows = torch.cumsum(counts, 0, dtype=torch.int32), counts.tolist()
            tok = torch.arange(x.shape[0], device=device)
            *_, dws_bf16 = fn.vjp_rows(x, tok, offsets, rows, packed, dy, score)
            *_, dws_fp32 = fn.vjp_rows(x, tok, offsets, rows, packed, dy, score, grad_dtype=torch.float32)
            self.assertEqual([g.dtype for g in dws_fp32], [torch.float32] * 2)
            for got32, got16 in zip(dws_fp32, dws_bf16):
                nonzero = got32 != 0
                carries_fp32_bits = (got32 != got32.bfloat16().float())[nonzero].float().mean().item()
                self.assertGreater(carries_fp32_bits, 0.9, device)  # not bf16 values widened
                step = got32.abs() * 2**-7 + 1e-30  # one bf16 step at that magnitude
                self.assertTrue(bool(((got32 - got16.float()).abs() <= step).all()), device)

    def test_saved_projections_replace_the_recompute_bit_for_bit_and_stay_unwritten(self) -> None:
        # The forward's h13 saved into a slice (save_into), the backward reading it (projections): the same
        # results as recomputing it, bit for bit on the CPU; the saved rows are read, never overwritten.
        for activation, weights_of in (("swiglu", lambda w1, w2, w3: [w1, w2, w3]),
                                       ("gelu", lambda w1, w2, w3: [w1, w2])):
            fn = ffn_expert_fn(activation)
            x, counts, w1, w2, w3, dy, score = _case("cpu", torch.float32, [4, 0, 3, 6])
            packed = fn.pack(weights_of(w1, w2, w3))
            offsets, rows = torch.cumsum(counts, 0, dtype=torch.int32), counts.tolist()
            saved = torch.full((x.shape[0] + 2, packed[0].shape[1]), float("nan"))
            out = fn.forward_rows(x, offsets, rows, packed, save_into=saved[1:-1])
            torch.testing.assert_close(out, fn.forward_rows(x, offsets, rows, packed), rtol=0, atol=0)
            self.assertTrue(saved[[0, -1]].isnan().all() and not saved[1:-1].isnan().any(), activation)
            kept = saved.clone()
            tok = torch.arange(x.shape[0])
            got = fn.vjp_rows(x, tok, offsets, rows, packed, dy, score, projections=saved[1:-1])
            want = fn.vjp_rows(x, tok, offsets, rows, packed, dy, score)
            for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0, msg=activation)
            torch.testing.assert_close(saved, kept, rtol=0, atol=0, equal_nan=True, msg=activation)

    def test_a_padding_row_adds_exact_zeros_whatever_projections_it_reads(self) -> None:
        # Equal groups beside saved projections (segment_compute._padded_projections): each expert padded to
        # equal rows, a padding row (token 0, score 0) reading another pair's saved projections. It adds exact
        # zeros (its dx row is 0; the weight and bias gradients are those of the real rows), for gated and plain
        # activations with biases; projections_writable (a padded chunk's own gather) gives the same results
        # bit for bit and overwrites only that copy.
        for activation in ("swiglu", "gelu"):
            fn = ffn_expert_fn(activation, biases=(True, True))
            x, counts, w1, w2, w3, dy, score = _case("cpu", torch.float32, [4, 2])
            gen = torch.Generator().manual_seed(2)
            b1, b3, b2 = (torch.randn(2, n, generator=gen) for n in (w1.shape[1], w1.shape[1], w2.shape[1]))
            packed = fn.pack([w1, w2, w3, b1, b3, b2] if activation in GATED else [w1, w2, b1, b2])
            offsets, rows = torch.cumsum(counts, 0, dtype=torch.int32), counts.tolist()
            saved = torch.empty(x.shape[0], packed[0].shape[1])
            fn.forward_rows(x, offsets, rows, packed, save_into=saved)
            want = fn.vjp_rows(x, torch.arange(6), offsets, rows, packed, dy, score, projections=saved)
            # Expert 1 padded from 2 rows to 4: pairs 0-3, 4, 5, then two padding rows (pos P: pair P - 1's row).
            pos_Q = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])
            tok_Q = torch.cat([torch.arange(6), torch.zeros(2, dtype=torch.int64)])
            score_Q = torch.cat([score, score.new_zeros(2)])
            padded_offsets = torch.tensor([4, 8], dtype=torch.int32)
            gathered = torch.index_select(saved, 0, pos_Q.clamp(max=5))
            for writable in (False, True):
                own = gathered.clone()
                got = fn.vjp_rows(x, tok_Q, padded_offsets, [4, 4], packed, dy, score_Q, projections=own,
                                  projections_writable=writable)
                what = f"{activation} writable={writable}"
                self.assertTrue(bool((got[0][6:] == 0).all()), what)
                torch.testing.assert_close(got[0][:6], want[0], rtol=1e-6, atol=1e-6, msg=what)
                torch.testing.assert_close(got[1][:6], want[1], rtol=1e-6, atol=1e-6, msg=what)
                for g, w in zip(got[2], want[2], strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=what)
                if not writable:
                    first = got
                    torch.testing.assert_close(own, gathered, rtol=0, atol=0, msg=what)  # read only
                else:
                    for g, f in zip([got[0], got[1], *got[2]], [first[0], first[1], *first[2]], strict=True):
                        torch.testing.assert_close(g, f, rtol=0, atol=0, msg=what)
                    self.assertEqual(activation == "swiglu", not torch.equal(own, gathered), what)

    def test_grouped_expert_functions_are_told_apart_from_others_as_the_protocol_tells_them(self) -> None:
        from relay_compile.runtime.fp8_experts import fp8_experts

        fns = [ffn_expert_fn("swiglu"), ffn_expert_fn("gelu"), fp8_experts(ffn_expert_fn("swiglu")),
               lambda x, counts, splits, weights: x, expert_ffn]
        for fn in fns:
            self.assertIs(as_grouped(fn), fn if isinstance(fn, GroupedExperts) else None, fn)
        self.assertIsNotNone(as_grouped(fns[0]))
        self.assertIsNone(as_grouped(fns[3]))

    def test_the_eager_pointwise_backward_in_blocks_of_rows_equals_the_reference(self) -> None:
        # CPU runs the eager form a block of rows at a time (bounded temporaries): the rows of a partial last
        # block and of a chunk of exactly one block come out as the whole-chunk reference computes them.
        for rows in (1100, 512, 0):
            x, counts, w1, w2, w3, dy, score = _case("cpu", torch.float32, [rows], 48, 24)
            h13, g = x.contiguous(), dy[:, :24].contiguous()
            act_scaled, dh1, dh3, d_score = swiglu_backward_reference(h13, g, score)
            # Written into a slice of a wider buffer (the ring's per-pair score gradients), the rest untouched.
            ds_P = torch.full((rows + 7,), -1.0)
            out = ds_P[3 : 3 + rows]
            d_score_blocks = swiglu_backward_(h13, g, score, d_score_out=out)
            self.assertIs(d_score_blocks, out)
            self.assertEqual(ds_P[:3].tolist() + ds_P[3 + rows :].tolist(), [-1.0] * 7)
            for got, want in ((g, act_scaled), (h13[:, :24], dh1), (h13[:, 24:], dh3), (d_score_blocks, d_score)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
    def test_triton_pointwise_and_fused_backward_on_cuda_bf16(self) -> None:
        x, counts, w1, w2, w3, dy, score = _case("cuda", torch.bfloat16, [500, 0, 1000, 548], 256, 128)
        h13, g = x.contiguous(), dy[:, :128].contiguous()
        act_scaled, dh1, dh3, d_score = swiglu_backward_reference(h13, g, score)
        ds_P = torch.full((2048 + 5,), -1.0, device="cuda")
        # in place: h13 -> [dh1, dh3], g -> score * act, d_score into its slice of ds_P
        out = ds_P[5:]
        d_score_triton = swiglu_backward_(h13, g, score, d_score_out=out)
        self.assertIs(d_score_triton, out)
        self.assertEqual(ds_P[:5].tolist(), [-1.0] * 5)
        for got, want in ((g, act_scaled), (h13[:, :128], dh1), (h13[:, 128:], dh3), (d_score_triton, d_score)):
            self.assertLess(_rel(got, want), 2e-3)
        dx, d_score, (dw1, dw2, dw3) = expert_ffn_swiglu_vjp(x, counts, w1, w2, w3, dy, score)
        want = _autograd_reference(x, counts, w1, w2, w3, dy, score)
        for got, ref in zip((dx, dw1, dw2, dw3, d_score), want):
            self.assertLess(_rel(got, ref), 2e-2)  # bf16 rounding of differently ordered sums


if __name__ == "__main__":
    unittest.main()
