"""``kernels.gathered_grouped_mm``: a grouped GEMM whose rows are read at their indices, eager and Triton."""

from __future__ import annotations

import unittest

import torch

from relay_compile.kernels import swiglu_gemm
from relay_compile.kernels.gathered_grouped_mm import gathered_grouped_mm, gathered_grouped_mm_scatter_add_, reference
from relay_compile.kernels.swiglu_backward import reference as swiglu_backward_reference
from relay_compile.kernels.swiglu_backward import swiglu_backward_
from tests.triton_interpreter import run_interpreted

# Uneven experts, an empty one, and rows that fill no whole row tile of the kernel.
COUNTS = [5, 0, 37, 16, 1]


def _case(dtype: torch.dtype, counts=COUNTS, sources: int = 50, width_k: int = 40, width_n: int = 24,
          gather: bool = True, transposed: bool = False, device: str = "cpu"):
    """Source rows, the sorted rows' indices (None: the sources are the rows), weights ``(E, K, N)`` (a transposed
    view of ``(E, N, K)`` where ``transposed``), the int32 offsets."""
    gen = torch.Generator().manual_seed(0)
    rows = sum(counts)
    a = torch.randn(sources if gather else rows, width_k, generator=gen).to(dtype)
    idx = torch.randint(0, sources, (rows,), generator=gen) if gather else None
    if transposed:
        b = torch.randn(len(counts), width_n, width_k, generator=gen).to(dtype).transpose(-2, -1)
    else:
        b = torch.randn(len(counts), width_k, width_n, generator=gen).to(dtype)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return [t if t is None else t.to(device) for t in (a, idx, b, offsets)]


def _exact(a, idx, b, counts):
    rows = (a if idx is None else a[idx]).double()
    return torch.cat([r @ b[e].double() for e, r in enumerate(torch.split(rows, counts))])


def _close_to_scale(got, want, rel: float = 2e-2) -> None:
    """Every element within ``rel`` of ``want``'s largest: sums of products in another order (a row's ``d_score``
    sums F of them) differ by their rounding, which an elementwise relative tolerance fails where they cancel."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), f"max abs error {err} against scale {want.abs().max()}"


def _exact_swiglu(h13):
    half = h13.shape[-1] // 2
    return torch.nn.functional.silu(h13[:, :half]) * h13[:, half:]


def _exact_swiglu_backward(h13, g, score):
    """``(score * act, [dh1, dh3], d_score)`` of exact projections, in fp32 (``kernels.swiglu_backward.reference``'s
    arithmetic), as float64."""
    act, dh1, dh3, d_score = swiglu_backward_reference(h13, g.double(), score.double())
    return act.double(), torch.cat([dh1, dh3], 1).double(), d_score.double()


class GatheredGroupedMM(unittest.TestCase):
    def test_reference_is_each_experts_product_of_the_gathered_rows(self) -> None:
        a, idx, b, offsets = _case(torch.float32)
        got = reference(a, idx, b, offsets, torch.full((sum(COUNTS), 24), float("nan")))
        torch.testing.assert_close(got.double(), _exact(a, idx, b, COUNTS), rtol=1e-5, atol=1e-5)

    def test_the_eager_epilogue_adds_only_the_rows_the_offsets_cover(self) -> None:
        # 12 rows, offsets ending at 5: the kernel writes and adds 5 (its contract), and so must its eager form;
        # the scores as a column of a (S, K) matrix (not contiguous).
        a, idx, b, _ = _case(torch.float32, [5, 0, 7])
        offsets = torch.tensor([3, 5, 5], dtype=torch.int32)
        tok = torch.arange(12) % 4
        scores_SK = torch.rand(12, 2)
        sum_TN = torch.zeros(4, 24)
        gathered_grouped_mm_scatter_add_(a, idx, b, offsets, sum_TN, tok, scores_SK[:, 1])
        rows = _exact(a, idx[:5], b[:2], [3, 2])
        want = torch.zeros(4, 24, dtype=torch.float64).index_add_(0, tok[:5], rows * scores_SK[:5, 1:].double())
        torch.testing.assert_close(sum_TN.double(), want, rtol=1e-5, atol=1e-5)

    def test_the_entry_point_takes_the_eager_form_on_cpu(self) -> None:
        a, idx, b, offsets = _case(torch.bfloat16, transposed=True)
        got = gathered_grouped_mm(a, idx, b, offsets)
        want = torch._grouped_mm(a[idx], b, offs=offsets)
        torch.testing.assert_close(got, want)

    @unittest.skipIf(torch.cuda.is_available(), "on CUDA the compiled kernel is tested (test_triton_kernel_on_cuda)")
    def test_kernel_under_the_interpreter_equals_the_exact_products(self) -> None:
        # Triton's interpreter runs the kernel's index math on the CPU (in numpy, which has no bf16: fp16 rows).
        script = """
            import torch
            from relay_compile.kernels import gathered_grouped_mm as k
            from tests.test_gathered_grouped_mm import COUNTS, _case, _exact
            for counts, gather, transposed, width_n in ((COUNTS, True, False, 24), ([70], False, True, 48),
                                                        ([0, 0, 3], True, True, 20), ([33, 40], True, False, 32)):
                a, idx, b, offsets = _case(torch.float16, counts, gather=gather, transposed=transposed,
                                           width_k=32 if width_n == 32 else 40, width_n=width_n)
                assert k.applies(a, b), "the kernel must run under the interpreter"
                out = torch.full((sum(counts) + 3, width_n), 7.0, dtype=torch.float16)
                rows_out = torch.full((sum(counts), a.shape[1]), 7.0, dtype=torch.float16)
                got = k.gathered_grouped_mm(a, idx, b, offsets, out[: sum(counts)], rows_out=rows_out)
                torch.testing.assert_close(got.double(), _exact(a, idx, b, counts), rtol=2e-3, atol=2e-2)
                assert bool((out[sum(counts):] == 7).all()), "rows past the offsets were written"
                assert torch.equal(rows_out, a if idx is None else a[idx]), "the rows read were not stored"
                # Offsets ending before the rows (the last expert's up to two short): neither output written there.
                short = offsets.clone()
                short[-1] -= min(2, counts[-1])
                end = int(short[-1])
                out.fill_(7.0)
                rows_out.fill_(7.0)
                k.gathered_grouped_mm(a, idx, b, short, out[: sum(counts)], rows_out=rows_out)
                assert bool((out[end:] == 7).all()) and bool((rows_out[end:] == 7).all()), "rows past the offsets"
                assert torch.equal(rows_out[:end], (a if idx is None else a[idx])[:end])
            print("ok")
        """
        run_interpreted(self, script)

    @unittest.skipIf(torch.cuda.is_available(), "on CUDA the compiled kernel is tested (test_triton_kernel_on_cuda)")
    def test_scatter_epilogue_under_the_interpreter_adds_what_the_product_and_scatter_add(self) -> None:
        script = """
            import torch
            from relay_compile.kernels import gathered_grouped_mm as k
            from relay_compile.kernels.scatter_add_rows import reference as scatter_add
            from tests.test_gathered_grouped_mm import COUNTS, _case
            gen = torch.Generator().manual_seed(1)
            a, idx, b, offsets = _case(torch.float16, transposed=True)
            rows = sum(COUNTS)
            tok = torch.randint(0, 30, (rows,), generator=gen)  # tokens met several times
            scale = torch.rand(rows, generator=gen)
            product = k.reference(a.float(), idx, b.float(), offsets, torch.empty(rows, 24))
            for two_blocks in (False, True):
                for s in (None, scale):
                    # Two blocks with a row between them, which must stay as it was.
                    sums = torch.randn(31, 24, generator=gen)
                    head, tail = (sums[:15], sums[16:]) if two_blocks else (sums[:30], None)
                    gap = sums[15].clone()
                    want_head, want_tail = head.clone(), None if tail is None else tail.clone()
                    k.gathered_grouped_mm_scatter_add_(a, idx, b, offsets, head, tok, s, tail_TN=tail)
                    scatter_add(want_head, tok, product, None if s is None else s[:, None], tail_TH=want_tail)
                    torch.testing.assert_close(head, want_head, rtol=2e-3, atol=2e-2)
                    if two_blocks:
                        torch.testing.assert_close(tail, want_tail, rtol=2e-3, atol=2e-2)
                        assert torch.equal(sums[15], gap), "a row between the blocks was written"
            print("ok")
        """
        run_interpreted(self, script)

    @unittest.skipIf(torch.cuda.is_available(), "on CUDA the compiled kernel is tested (test_triton_kernel_on_cuda)")
    def test_swiglu_epilogues_under_the_interpreter_equal_the_exact_forward_and_backward(self) -> None:
        # Halves of 24 and 16 columns (tiles of 16: one partial, one even), K of 40 (partial) and 32 (even).
        script = """
            import torch
            from relay_compile.kernels import gathered_grouped_mm as k
            from relay_compile.kernels import swiglu_gemm
            from tests.test_gathered_grouped_mm import COUNTS, _case, _exact, _exact_swiglu, _exact_swiglu_backward
            gen = torch.Generator().manual_seed(2)
            close = dict(rtol=1e-2, atol=1e-2)
            for counts, gather, ffn, width_k in ((COUNTS, True, 24, 40), ([0, 33, 40], True, 16, 32),
                                                  ([21], False, 16, 40)):
                a, idx, b, offsets = _case(torch.float16, counts, gather=gather, transposed=True, width_k=width_k,
                                           width_n=2 * ffn)
                rows = sum(counts)
                assert k.applies(a, b, "swiglu") and k.applies(a, b, "swiglu_backward"), "must run interpreted"
                h13 = _exact(a, idx, b, counts)
                saved = torch.full((rows, 2 * ffn), 7.0, dtype=torch.float16)
                got = swiglu_gemm.grouped_swiglu(a, idx, b, offsets, save_SU=saved)
                assert got.shape == (rows, ffn) and got.dtype == torch.float16
                torch.testing.assert_close(got.double(), _exact_swiglu(h13), **close)
                torch.testing.assert_close(saved.double(), h13, **close)  # the projections saved too
                assert torch.equal(swiglu_gemm.grouped_swiglu(a, idx, b, offsets), got)
                g = torch.randn(rows, ffn, generator=gen).half()
                score = torch.rand(rows, generator=gen)
                # Against the projections rounded to the rows' dtype, as the GEMM's output is in both forms.
                act, dh13, d_score = _exact_swiglu_backward(h13.half().double(), g, score)
                d_score_out = torch.full((rows,), float("nan"))
                g_inout = g.clone()
                rows_out = torch.full((rows, width_k), 7.0, dtype=torch.float16)
                got_dh13, got_ds = swiglu_gemm.grouped_swiglu_backward_(a, idx, b, offsets, g_inout, score,
                                                                        d_score_out, rows_out=rows_out)
                assert torch.equal(rows_out, a if idx is None else a[idx]), "the rows read were not stored"
                assert got_ds is d_score_out and got_dh13.shape == (rows, 2 * ffn)
                torch.testing.assert_close(got_dh13.double(), dh13, **close)
                torch.testing.assert_close(got_ds.double(), d_score, **close)
                torch.testing.assert_close(g_inout.double(), act, **close)  # g became score * act
                # Rows past the offsets (the last expert's up to two short): act, dh13 and g not written there,
                # d_score zero; the rows before them as computed with the whole offsets.
                short = offsets.clone()
                short[-1] -= min(2, counts[-1])
                end = int(short[-1])
                act_out = torch.full((rows, ffn), 7.0, dtype=torch.float16)
                saved_short = torch.full((rows, 2 * ffn), 7.0, dtype=torch.float16)
                assert swiglu_gemm.grouped_swiglu(a, idx, b, short, act_out, save_SU=saved_short) is act_out
                assert bool((act_out[end:] == 7).all()) and torch.equal(act_out[:end], got[:end])
                assert bool((saved_short[end:] == 7).all()) and torch.equal(saved_short[:end], saved[:end])
                g_inout, dh13_out = g.clone(), torch.full((rows, 2 * ffn), 7.0, dtype=torch.float16)
                dh13_short, ds_short = swiglu_gemm.grouped_swiglu_backward_(a, idx, b, short, g_inout, score,
                                                                            dh13_out=dh13_out)
                assert dh13_short is dh13_out and bool((dh13_out[end:] == 7).all())
                assert torch.equal(dh13_out[:end], got_dh13[:end]) and bool((ds_short[end:] == 0).all())
                assert torch.equal(g_inout[end:], g[end:]), "g past the offsets was written"
            print("ok")
        """
        run_interpreted(self, script)

    def test_the_swiglu_entry_points_take_the_two_kernel_forms_on_cpu(self) -> None:
        a, idx, b, offsets = _case(torch.bfloat16, transposed=True, width_n=32)
        got = swiglu_gemm.grouped_swiglu(a, idx, b, offsets)
        h13 = torch._grouped_mm(a[idx], b, offs=offsets)
        self.assertTrue(torch.equal(got, torch.nn.functional.silu(h13[:, :16]) * h13[:, 16:]))
        g, score = torch.randn(idx.shape[0], 16).bfloat16(), torch.rand(idx.shape[0])
        want_g, dh13 = g.clone(), h13.clone()
        want_ds = swiglu_backward_(dh13, want_g, score)
        got_dh13, got_ds = swiglu_gemm.grouped_swiglu_backward_(a, idx, b, offsets, g, score)
        for got_t, want_t in ((got_dh13, dh13), (got_ds, want_ds), (g, want_g)):
            self.assertTrue(torch.equal(got_t, want_t))

    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the device machine)")
    def test_triton_kernel_on_cuda(self) -> None:
        counts = [3000, 0, 129, 4096, 1]
        for transposed in (False, True):
            a, idx, b, offsets = _case(torch.bfloat16, counts, sources=6000, width_k=2048 + 64, width_n=768,
                                       transposed=transposed, device="cuda")
            rows_out = torch.empty(idx.shape[0], a.shape[1], device="cuda", dtype=a.dtype)
            got = gathered_grouped_mm(a, idx, b, offsets, rows_out=rows_out)
            want = torch._grouped_mm(a[idx], b, offs=offsets)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-1)
            self.assertTrue(torch.equal(rows_out, a[idx]))
            tok = torch.randint(0, 3000, (idx.shape[0],), device="cuda")
            scale = torch.rand(idx.shape[0], device="cuda")
            head, tail = torch.zeros(1500, 768, device="cuda"), torch.zeros(1500, 768, device="cuda")
            gathered_grouped_mm_scatter_add_(a, idx, b, offsets, head, tok, scale, tail_TN=tail)
            # The epilogue adds the fp32 products, unrounded: against them (``want`` rounds each to bf16 first,
            # about 0.1 at these magnitudes, more than the tolerance once a few land on one token and cancel).
            want32 = reference(a.float(), idx, b.float(), offsets, torch.empty(idx.shape[0], 768, device="cuda"))
            expect = torch.zeros(3000, 768, device="cuda").index_add_(0, tok, want32 * scale[:, None])
            torch.testing.assert_close(torch.cat([head, tail]), expect, rtol=2e-2, atol=2e-1)
            if transposed:  # the stacked w13 as the experts hold it: (E, 2F, K) viewed (E, K, 2F)
                saved = torch.empty(idx.shape[0], 768, device="cuda", dtype=a.dtype)
                act = swiglu_gemm.grouped_swiglu(a, idx, b, offsets, save_SU=saved)
                h13 = torch._grouped_mm(a[idx], b, offs=offsets)
                want = torch.nn.functional.silu(h13[:, :384]) * h13[:, 384:]
                _close_to_scale(act, want)
                _close_to_scale(saved, h13)
                g = torch.randn(idx.shape[0], 384, device="cuda", dtype=torch.bfloat16)
                score = torch.rand(idx.shape[0], device="cuda")
                g_want = g.clone()
                x_rows = torch.empty(idx.shape[0], a.shape[1], device="cuda", dtype=a.dtype)
                dh13, ds = swiglu_gemm.grouped_swiglu_backward_(a, idx, b, offsets, g, score, rows_out=x_rows)
                self.assertTrue(torch.equal(x_rows, a[idx]))
                want_ds = swiglu_backward_(h13, g_want, score)  # h13 becomes [dh1, dh3]
                for got_t, want_t in ((dh13, h13), (ds, want_ds), (g, g_want)):
                    _close_to_scale(got_t, want_t)

        # Partial tiles in K (2080) and in each SwiGLU half (400), the rows not gathered, offsets ending two short.
        a, _, b, offsets = _case(torch.bfloat16, counts, gather=False, width_k=2080, width_n=800, transposed=True,
                                 device="cuda")
        offsets[-1] -= 1 if counts[-1] < 2 else 2
        end = int(offsets[-1])
        rows_out = torch.full_like(a, 7.0)
        got = gathered_grouped_mm(a, None, b, offsets, rows_out=rows_out)
        torch.testing.assert_close(got[:end].float(), torch._grouped_mm(a, b, offs=offsets)[:end].float(),
                                   rtol=2e-2, atol=2e-1)
        self.assertTrue(torch.equal(rows_out[:end], a[:end]) and bool((rows_out[end:] == 7).all()))
        h13 = torch._grouped_mm(a, b, offs=offsets)[:end]
        act = swiglu_gemm.grouped_swiglu(a, None, b, offsets)
        _close_to_scale(act[:end], torch.nn.functional.silu(h13[:, :400]) * h13[:, 400:])
        g = torch.randn(a.shape[0], 400, device="cuda", dtype=torch.bfloat16)
        score = torch.rand(a.shape[0], device="cuda")
        g_want = g.clone()
        dh13, ds = swiglu_gemm.grouped_swiglu_backward_(a, None, b, offsets, g, score)
        want_ds = swiglu_backward_(h13, g_want[:end], score[:end])
        for got_t, want_t in ((dh13[:end], h13), (ds[:end], want_ds), (g[:end], g_want[:end])):
            _close_to_scale(got_t, want_t)
        self.assertTrue(torch.equal(g[end:], g_want[end:]))


class ExpertsReadRowsAtIndicesAndAddTheirRows(unittest.TestCase):
    """``gather_in_gemm`` / ``add_in_gemm`` on the grouped experts: the forward with its rows read at the tokens'
    indices equals it on gathered rows; the forward's output and the fused backward's ``dx`` added into fp32 sums by
    the GEMMs equal the returned rows scatter-added (the kernels under Triton's interpreter)."""

    @unittest.skipIf(torch.cuda.is_available(), "CPU check under the interpreter")
    def test_rows_at_indices_and_sums_added_equal_the_gathered_and_returned_rows(self) -> None:
        script = """
            import torch
            from relay_compile.experts import GroupedFFN
            from relay_compile.grouped_gemm import GatheredRows, SumTarget
            gen = torch.Generator().manual_seed(0)
            T, H, F, counts = 40, 32, 16, [9, 0, 30, 5]
            S, G = sum(counts), len(counts)
            x = torch.randn(T, H, generator=gen).half()
            dy = torch.randn(T, H, generator=gen).half()
            tok = torch.randint(0, T, (S,), generator=gen)
            score = torch.rand(S, generator=gen)
            offs = torch.tensor(counts).cumsum(0).to(torch.int32)
            close = dict(rtol=2e-2, atol=2e-2)
            for activation, first in (("swiglu", 2 * F), ("gelu", F)):
                ffn = GroupedFFN(activation)
                w = [(torch.randn(G, first, H, generator=gen) * H ** -0.5).half(),
                     (torch.randn(G, H, F, generator=gen) * F ** -0.5).half()]
                assert ffn.reads_at_indices(x, w) and ffn.adds_in_gemm(x, w)
                y = ffn.forward_rows(x[tok], offs, counts, w)
                torch.testing.assert_close(ffn.forward_rows(GatheredRows(x, tok), offs, counts, w).float(),
                                           y.float(), **close)
                # The projections saved for the backward, read at indices (SwiGLU: by its epilogue) or not.
                saved_a, saved_b = torch.zeros(S, first).half(), torch.zeros(S, first).half()
                ffn.forward_rows(x[tok], offs, counts, w, save_into=saved_a)
                ffn.forward_rows(GatheredRows(x, tok), offs, counts, w, save_into=saved_b)
                torch.testing.assert_close(saved_b.float(), saved_a.float(), **close)
                # Two blocks, as RowSum holds them: rows from 25 on in the tail.
                head, tail = torch.zeros(25, H), torch.zeros(T - 25, H)
                out = ffn.forward_rows(GatheredRows(x, tok), offs, counts, w,
                                       add_into=SumTarget(lambda: (head, tail), tok, score))
                assert out is None
                want = torch.zeros(T, H).index_add_(0, tok, y.float() * score[:, None])
                torch.testing.assert_close(torch.cat([head, tail]), want, **close)
                dx, ds, dws = ffn.vjp_rows(x, tok, offs, counts, w, dy, score, grad_dtype=torch.float32)
                # SwiGLU's backward in the recomputing GEMM's epilogue (the other activations ignore it).
                dx3, ds3, dws3 = ffn.vjp_rows(x, tok, offs, counts, w, dy, score, grad_dtype=torch.float32,
                                              activation_in_gemm=True)
                for a, b in zip([dx, ds, *dws], [dx3, ds3, *dws3], strict=True):
                    torch.testing.assert_close(b.float(), a.float(), **close)
                dx_sum = torch.zeros(T, H)
                dx_none, ds2, dws2 = ffn.vjp_rows(x, tok, offs, counts, w, dy, score, grad_dtype=torch.float32,
                                                  dx_into=SumTarget(lambda: (dx_sum, None), tok))
                assert dx_none is None
                torch.testing.assert_close(dx_sum, torch.zeros(T, H).index_add_(0, tok, dx.float()), **close)
                for a, b in zip([ds, *dws], [ds2, *dws2], strict=True):
                    torch.testing.assert_close(b.float(), a.float(), **close)
            print("ok")
        """
        run_interpreted(self, script, timeout=300)


class RingWithRowsReadAndSumsAddedByTheGEMMs(unittest.TestCase):
    """The expert ring (stand-in group of 4, one process) with the options ``gather_in_gemm`` and ``add_in_gemm``
    equals it without them, forward and backward, and the kernels ran (Triton's interpreter, fp16)."""

    @unittest.skipIf(torch.cuda.is_available(), "CPU check under the interpreter")
    def test_the_ring_is_unchanged_and_the_kernels_run(self) -> None:
        script = """
            import collections
            import torch
            from relay_compile import ring_moe
            from relay_compile.bench import destroy_standin_groups, standin_group
            from relay_compile.kernels import gathered_grouped_mm as k
            from relay_compile.reference import moe_weights
            T, H, F, K, WORLD, E_L = 48, 32, 16, 2, 4, 2
            launches, saves = collections.Counter(), collections.Counter()
            compiled = k._triton_kernel

            def counted():
                kernel = compiled()

                class Launch:
                    def __getitem__(self, grid):
                        def run(*args, **kwargs):
                            launches[("gather " if kwargs["GATHER"] else "") + kwargs["EPILOGUE"]] += 1
                            saves["save"] += kwargs["SAVE"]
                            return kernel[grid](*args, **kwargs)
                        return run
                return Launch()

            k._triton_kernel = counted

            def call(**options):
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(T, H, generator=gen).half().requires_grad_()
                ids = torch.randint(0, WORLD * E_L, (T, K), generator=gen)
                ids[: T // 2, 0] = 0  # a crowded expert beside the random ones
                scores = torch.rand(T, K, generator=gen).requires_grad_()
                w = moe_weights(0, H, F, E_L)
                weights = [w[name].half().requires_grad_() for name in ("w1", "w2", "w3")]
                y = ring_moe(x, ids, scores, *weights, group=standin_group(WORLD), routing="expert", ring="always",
                             **options)
                dy = torch.randn(y.shape, generator=gen).half()
                return [y.detach(), *torch.autograd.grad(y, [x, scores, *weights], dy)]

            want = call()
            assert not launches, launches
            both = {"gather_in_gemm": True, "add_in_gemm": True}
            for patch in ({"gather_in_gemm": True}, {"add_in_gemm": True}, both,
                          {"gather_in_gemm": True, "save_projections": True}):
                launches.clear()
                got = call(**patch)
                # 4 hops: the forward's first projection with SwiGLU in its epilogue, and the backward's first
                # GEMMs (g = dy @ w2; the recomputed first projection with SwiGLU's backward), all reading their
                # rows at the tokens' indices; and/or the forward's down projection and the backward's dx (added
                # into the sums).
                # (With saved projections the forward's kernel also stores them and the backward reads them.)
                in_gemm = ({"gather swiglu": 4} if "save_projections" in patch
                           else {"gather swiglu": 4, "gather store": 4, "gather swiglu_backward": 4})
                want_launches = {**(in_gemm if "gather_in_gemm" in patch else {}),
                                 **({"scatter": 8} if "add_in_gemm" in patch else {})}
                assert launches == want_launches, (patch, launches)
                assert saves["save"] == (4 if "save_projections" in patch else 0), (patch, saves)
                saves.clear()
                for a, b in zip(want, got, strict=True):
                    torch.testing.assert_close(b.float(), a.float(), rtol=5e-3, atol=5e-3 * a.abs().max().item())
            destroy_standin_groups()
            print("ok")
        """
        run_interpreted(self, script, timeout=300)


if __name__ == "__main__":
    unittest.main()
