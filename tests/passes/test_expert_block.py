"""Expert blocks recognized per idiom, and the recognized program against F itself (fp32 to 1e-6).

Each idiom is F as a codebase writes it, with F's contract as the region cut gives it: ``(rows, counts,
splits..., *weights) -> out`` on rows grouped by source then local expert. ``symbolic_trace`` gives the graph
with the targets Dynamo emits for these calls (functions, tensor methods, ``getattr`` for ``.T``); a run on
example inputs records ``meta["val"]``. Every test checks what was recognized, then runs the lowered program
(``LoweredFFN``) beside F on other inputs, forward and gradients. No processes.

Legend: S rows, H hidden, F expert FFN width, N sources, L = E_l experts per rank.
"""

from __future__ import annotations

import operator
import unittest
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn.functional as nnf
from torch import Tensor

from relay_compile.passes.expert_block import NotAnFFN, recognize_expert_ffn
from relay_compile.passes.expert_lowering import LoweredFFN, probe_error
from relay_compile.runtime.region_fn import ExpertFnBinding, RegionExpertFn

H, F, L, N = 8, 4, 3, 2  # torch._grouped_mm wants rows of 16-byte multiples


# --- idioms: F as codebases write it ---------------------------------------------------------------------


def _expert_major(rows_RH: Tensor, counts_NL: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The reference layer's permute: argsort of each row's expert (rows arrive source-major)."""
    block_expert = torch.arange(counts_NL.numel()) % counts_NL.shape[1]
    expert_of_row = torch.repeat_interleave(block_expert, counts_NL.flatten())
    perm = torch.argsort(expert_of_row, stable=True)
    return rows_RH[perm], perm, torch.cumsum(counts_NL.sum(0), 0, dtype=torch.int32)


def grouped_swiglu_efh(rows, counts, s0, s1, w1, w2, w3):
    """Reference / torchtitan layout: w1, w3 (L, F, H), w2 (L, H, F); one grouped GEMM per projection."""
    x, perm, offs = _expert_major(rows, counts)
    h = nnf.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    unpermuted = out.new_empty(out.shape)
    unpermuted.index_put_((perm,), out)  # torchtitan's `unpermuted[perm] = out` (made a setitem after tracing)
    return unpermuted


def grouped_swiglu_efh_cast(cast: str) -> Callable[..., Tensor]:
    """torchtitan's ``GroupedExperts``: rows and weights cast by the tensor method ``cast`` before grouped GEMMs,
    the output cast back (``type_as``). ``"bfloat16"`` on fp32 parameters computes in bf16; ``"float"`` on fp32
    ones is torchtitan's ``.bfloat16()`` on bf16 parameters: no cast at all."""

    def fn(rows, counts, s0, s1, w1, w2, w3):
        x, perm, offs = _expert_major(rows, counts)
        x_c = getattr(x, cast)()
        h = nnf.silu(torch._grouped_mm(x_c, getattr(w1, cast)().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x_c, getattr(w3, cast)().transpose(-2, -1), offs=offs)
        out = torch._grouped_mm(h, getattr(w2, cast)().transpose(-2, -1), offs=offs).type_as(rows)
        return out[torch.argsort(perm)]

    return fn


def grouped_geglu_ehf(rows, counts, s0, s1, w1, w2, w3):
    """Weights stored (in, out): w1, w3 (L, H, F), w2 (L, F, H); exact-GELU gate."""
    x, perm, offs = _expert_major(rows, counts)
    h = nnf.gelu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
    return torch._grouped_mm(h, w2, offs=offs)[torch.argsort(perm)]


def loop_over_split_stacked(rows, counts, s0, s1, w1, w2, w3):
    """A loop over ``torch.split`` chunks with ``x_e @ w[e].T`` on stacked weights (the reference's loop)."""
    x, perm, _ = _expert_major(rows, counts)
    counts_L = counts.sum(0)
    sizes = [counts_L[e].item() for e in range(L)]
    chunks, outs = torch.split(x, sizes), []
    for e in range(L):
        x_e = chunks[e]
        h = nnf.silu(x_e @ w1[e].T) * (x_e @ w3[e].T)
        outs.append(h @ w2[e].T)
    return torch.cat(outs)[torch.argsort(perm)]


def module_list_fused_fc1(rows, s00, s01, s02, s10, s11, s12, fc1_0, fc2_0, fc1_1, fc2_1, fc1_2, fc2_2):
    """Megatron: (source, expert) chunks, regrouped per expert, fc1 (2F, H) chunked [gate, up], fc2 (H, F)."""
    sizes, weights = [s00, s01, s02, s10, s11, s12], [fc1_0, fc2_0, fc1_1, fc2_1, fc1_2, fc2_2]
    chunks = torch.split(rows, sizes)
    out_chunks = [None] * (N * L)
    for e in range(L):
        fc1, fc2 = weights[2 * e], weights[2 * e + 1]
        x_e = torch.cat([chunks[s * L + e] for s in range(N)])
        gate_up = nnf.linear(x_e, fc1).chunk(2, dim=-1)
        y_e = nnf.linear(nnf.silu(gate_up[0]) * gate_up[1], fc2)
        parts = torch.split(y_e, [sizes[s * L + e] for s in range(N)])
        for s in range(N):
            out_chunks[s * L + e] = parts[s]
    return torch.cat(out_chunks)


def _non_gated(act: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def fn(rows, counts, s0, s1, w1, w2):
        x, perm, offs = _expert_major(rows, counts)
        h = act(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)[torch.argsort(perm)]
    return fn


def _gelu_tanh(h: Tensor) -> Tensor:
    return nnf.gelu(h, approximate="tanh")


def _relu2(h: Tensor) -> Tensor:
    return torch.relu(h) ** 2


def loop_mm_relu_times_relu(rows, counts, s0, s1, w1, w2):
    """A loop over ``torch.split`` chunks with ``torch.mm(x_e, w[e].t())``; squared ReLU as ``relu(h) * relu(h)``."""
    x, perm, _ = _expert_major(rows, counts)
    counts_L = counts.sum(0)
    chunks, outs = torch.split(x, [counts_L[e].item() for e in range(L)]), []
    for e in range(L):
        h = nnf.relu(torch.mm(chunks[e], w1[e].t()))
        outs.append((h * h).mm(w2[e].t()))
    return torch.cat(outs)[torch.argsort(perm)]


def with_bias(rows, s00, s01, s02, s10, s11, s12, fc1_0, b1_0, fc2_0, fc1_1, b1_1, fc2_1, fc1_2, b1_2, fc2_2):
    """ModuleList experts whose fc1 (fused gate and up) has a bias."""
    sizes = [s00, s01, s02, s10, s11, s12]
    weights = [fc1_0, b1_0, fc2_0, fc1_1, b1_1, fc2_1, fc1_2, b1_2, fc2_2]
    chunks = torch.split(rows, sizes)
    outs = []
    for e in range(L):
        x_e = torch.cat([chunks[s * L + e] for s in range(N)])
        gate_up = nnf.linear(x_e, weights[3 * e], weights[3 * e + 1]).chunk(2, dim=-1)
        outs.append(nnf.linear(nnf.silu(gate_up[0]) * gate_up[1], weights[3 * e + 2]))
    return torch.cat(outs)


def experts_in_reverse_order(rows, counts, s0, s1, w1, w2, w3):
    """Structurally an FFN, but the group boundaries come from the counts of the experts reversed: rows meet
    other experts' weights. Only the probe can tell (the row moves are not proven structurally)."""
    x, perm, _ = _expert_major(rows, counts)
    offs = torch.cumsum(counts.sum(0).flip(0), 0, dtype=torch.int32)
    h = nnf.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)[torch.argsort(perm)]


# --- harness ---------------------------------------------------------------------------------------------


def _stacked(*shapes: tuple[int, ...], seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) / s[-1] ** 0.5 for s in shapes]


SWIGLU_EFH = ((L, F, H), (L, H, F), (L, F, H))
GEGLU_EHF = ((L, H, F), (L, F, H), (L, H, F))
FFN_EFH = ((L, F, H), (L, H, F))
MODULES = tuple(s for _ in range(L) for s in ((2 * F, H), (H, F)))
MODULES_WITH_BIAS = tuple(s for _ in range(L) for s in ((2 * F, H), (2 * F,), (H, F)))


class Idiom:
    """F traced, with ``meta["val"]`` from a run, and its binding (rows, counts or (s, e) splits, weights)."""

    def __init__(self, fn: Callable[..., Tensor], weight_shapes: tuple[tuple[int, ...], ...], per_pair: bool):
        self.per_pair, self.weight_shapes = per_pair, weight_shapes
        self.gm = fx.symbolic_trace(fn)
        for n in list(self.gm.graph.nodes):
            # Proxies have no __setitem__: Dynamo's `buf[idx] = val` is traced as index_put_, then restored.
            if n.op == "call_method" and n.target == "index_put_":
                buf, (idx,), val = n.args
                with self.gm.graph.inserting_before(n):
                    setitem = self.gm.graph.call_function(operator.setitem, (buf, idx, val))
                n.replace_all_uses_with(setitem)
                self.gm.graph.erase_node(n)
        self.gm.recompile()
        first = 1 + (N * L if per_pair else 1 + N)
        self.binding = ExpertFnBinding(
            rows=0,
            counts=None if per_pair else 1,
            counts_shape=None if per_pair else (N, L),
            split_kind="source_expert" if per_pair else "source",
            splits=tuple(tuple(1 + s * L + e for e in range(L)) for s in range(N)) if per_pair
            else tuple((2 + s,) for s in range(N)),
            weights=tuple(range(first, first + len(weight_shapes))),
        )
        self._record_values(*self.inputs(seed=0)[0])

    def inputs(self, seed: int, src: int | None = None) -> tuple[list[object], tuple[Tensor, Tensor, list[int]]]:
        """F's arguments for rows from every source (``src`` None) or one, and (x, counts_NL, splits_N)."""
        g = torch.Generator().manual_seed(seed)
        counts_NL = torch.randint(0, 4, (N, L), generator=g)
        counts_NL[:, 1] = 0  # an expert without rows
        if src is not None:
            counts_NL[[s for s in range(N) if s != src]] = 0
        x = torch.randn(int(counts_NL.sum()), H, generator=g)
        splits_N = counts_NL.sum(1).tolist()
        weights = _stacked(*self.weight_shapes, seed=seed + 1)
        sizes = counts_NL.flatten().tolist() if self.per_pair else [counts_NL, *splits_N]
        return [x, *sizes, *weights], (x, counts_NL, splits_N)

    def _record_values(self, *args: object) -> None:
        env = iter(args)

        class Recorder(fx.Interpreter):
            def run_node(self, n: fx.Node) -> object:
                value = next(env) if n.op == "placeholder" else super().run_node(n)
                n.meta["val"] = value
                return value

            def placeholder(self, target, args, kwargs):  # values come from run_node
                raise AssertionError

        Recorder(self.gm).run(*args)

    def weights_of(self, args: list[object]) -> list[Tensor]:
        return [a for a in args[-len(self.weight_shapes):] if isinstance(a, Tensor)]


class RecognizedIdiomsEqualF(unittest.TestCase):
    def assert_close_to_scale(self, got: Tensor, want: Tensor) -> None:
        """fp32 to 1e-6 of the tensor's scale (sums in another order differ by rounding, most near zero)."""
        self.assertEqual(got.shape, want.shape)
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0
        self.assertLessEqual(err, 1e-6)
    def check(self, idiom: Idiom, activation: str, describe: str) -> LoweredFFN:
        plan = recognize_expert_ffn(idiom.gm, idiom.binding, L)
        self.assertEqual(plan.activation, activation)
        self.assertEqual(plan.describe(), describe)
        eager = RegionExpertFn(idiom.gm, idiom.binding)
        lowered = LoweredFFN(plan, L, eager.digest())
        for src in range(N):  # the ring's calls: rows of one source, sorted by local expert
            args, (x, counts_NL, splits_N) = idiom.inputs(seed=10 + src, src=src)
            weights = [w.requires_grad_() for w in idiom.weights_of(args)]
            x.requires_grad_()
            want = eager(x, counts_NL, splits_N, weights)
            got = lowered(x, counts_NL, splits_N, weights)
            self.assert_close_to_scale(got, want)
            dy = torch.randn_like(want)
            grads_want = torch.autograd.grad(want, [x, *weights], dy)
            grads_got = torch.autograd.grad(got, [x, *weights], dy)
            for g, w in zip(grads_got, grads_want, strict=True):
                self.assert_close_to_scale(g, w)
        # The packed layout round-trips the gradients into the caller's layout.
        weights = idiom.weights_of(idiom.inputs(seed=3)[0])
        unpacked = lowered.unpack_grads(lowered.pack(weights), weights)
        for u, w in zip(unpacked, weights, strict=True):
            torch.testing.assert_close(u, w, rtol=0, atol=0)
        return lowered

    def test_grouped_mm_swiglu_on_efh_weights_with_a_setitem_unpermute(self) -> None:
        lowered = self.check(
            Idiom(grouped_swiglu_efh, SWIGLU_EFH, per_pair=False), "swiglu",
            "swiglu experts, gate weights[0] stacked (out_in), up weights[2] stacked (out_in), "
            "down weights[1] stacked (out_in)",
        )
        self.assertTrue(lowered.has_fused_backward)
        # The ring's chunk backward with ``activation_in_gemm`` (``gather_in_gemm``; the kernels' eager forms here)
        # equals it without, rows read at the chunk's tokens.
        gen = torch.Generator().manual_seed(5)
        weights = lowered.pack([torch.randn(s, generator=gen) for s in SWIGLU_EFH])
        counts = [3, 0, 5]
        tok = torch.randint(0, 6, (sum(counts),), generator=gen)
        x, dy, score = torch.randn(6, H, generator=gen), torch.randn(6, H, generator=gen), torch.rand(8, generator=gen)
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        want = lowered.vjp_rows(x, tok, offsets, counts, weights, dy, score, grad_dtype=torch.float32)
        got = lowered.vjp_rows(x, tok, offsets, counts, weights, dy, score, grad_dtype=torch.float32,
                               activation_in_gemm=True)
        for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
            self.assert_close_to_scale(g, w)

    def test_casts_to_the_dtype_weights_and_rows_already_have_are_no_casts(self) -> None:
        # torchtitan's experts on bf16 parameters: recognized as computing in the weights' own dtype (no
        # "computed in"), so the lowered program keeps the fused backward.
        lowered = self.check(
            Idiom(grouped_swiglu_efh_cast("float"), SWIGLU_EFH, per_pair=False), "swiglu",
            "swiglu experts, gate weights[0] stacked (out_in), up weights[2] stacked (out_in), "
            "down weights[1] stacked (out_in)",
        )
        self.assertTrue(lowered.has_fused_backward)

    def test_grouped_mm_geglu_on_weights_stored_in_by_out(self) -> None:
        self.check(
            Idiom(grouped_geglu_ehf, GEGLU_EHF, per_pair=False), "geglu",
            "geglu experts, gate weights[0] stacked (in_out), up weights[2] stacked (in_out), "
            "down weights[1] stacked (in_out)",
        )

    def test_a_loop_over_split_chunks_with_stacked_weights_reads_them_in_place(self) -> None:
        self.check(
            Idiom(loop_over_split_stacked, SWIGLU_EFH, per_pair=False), "swiglu",
            "swiglu experts, gate weights[0] stacked (out_in), up weights[2] stacked (out_in), "
            "down weights[1] stacked (out_in)",
        )

    def test_a_module_list_of_linear_experts_with_a_fused_fc1(self) -> None:
        per_expert = ", ".join(f"weights[{2 * e}]" for e in range(L))
        down = ", ".join(f"weights[{2 * e + 1}]" for e in range(L))
        self.check(
            Idiom(module_list_fused_fc1, MODULES, per_pair=True), "swiglu",
            f"swiglu experts, gate+up per expert {per_expert} (out_in), down per expert {down} (out_in)",
        )

    def test_non_gated_activations(self) -> None:
        for act, name in ((nnf.gelu, "gelu"), (_gelu_tanh, "gelu_tanh"), (nnf.silu, "silu"), (torch.relu, "relu"),
                          (_relu2, "relu2")):
            with self.subTest(name):
                self.check(
                    Idiom(_non_gated(act), FFN_EFH, per_pair=False), name,
                    f"{name} experts, gate weights[0] stacked (out_in), down weights[1] stacked (out_in)",
                )


    def test_silu_written_as_h_times_sigmoid_of_h(self) -> None:
        self.check(
            Idiom(_non_gated(lambda h: h * torch.sigmoid(h)), FFN_EFH, per_pair=False), "silu",
            "silu experts, gate weights[0] stacked (out_in), down weights[1] stacked (out_in)",
        )

    def test_mm_and_squared_relu_as_a_product_of_two_relus(self) -> None:
        self.check(
            Idiom(loop_mm_relu_times_relu, FFN_EFH, per_pair=False), "relu2",
            "relu2 experts, gate weights[0] stacked (out_in), down weights[1] stacked (out_in)",
        )


class ExpertsComputedInAnotherDtype(RecognizedIdiomsEqualF):
    def test_bf16_experts_on_fp32_rows_and_weights_run_the_fused_backward_on_the_cast_weights(self) -> None:
        # torchtitan on fp32 parameters: the packed weights are bf16 (cast once per step), the fused backward
        # runs on them with the chunk's rows cast, and its gradients match autograd through F's casts to bf16
        # rounding; unpack_grads returns them in fp32.
        f16 = 2 * F  # bf16 rows of F columns must be 16-byte multiples for torch._grouped_mm
        idiom = Idiom(grouped_swiglu_efh_cast("bfloat16"), ((L, f16, H), (L, H, f16), (L, f16, H)), per_pair=False)
        plan = recognize_expert_ffn(idiom.gm, idiom.binding, L)
        self.assertEqual(plan.compute_dtype, torch.bfloat16)
        eager = RegionExpertFn(idiom.gm, idiom.binding)
        lowered = LoweredFFN(plan, L, eager.digest())
        self.assertTrue(lowered.has_fused_backward)
        for src in range(N):
            args, (x_SH, counts_NL, splits_N) = idiom.inputs(seed=20 + src, src=src)
            weights = [w.requires_grad_() for w in idiom.weights_of(args)]
            g = torch.Generator().manual_seed(src)
            score_S, dy_SH = torch.rand(x_SH.shape[0], generator=g), torch.randn(x_SH.shape, generator=g)
            x_SH.requires_grad_()
            want = eager(x_SH, counts_NL, splits_N, weights) * score_S[:, None]
            want_dx, *want_dws = torch.autograd.grad(want, [x_SH, *weights], dy_SH)
            want_ds = (dy_SH * want / score_S[:, None]).sum(-1)
            packed = lowered.pack([w.detach() for w in weights])
            self.assertEqual({p.dtype for p in packed}, {torch.bfloat16})
            counts_L = counts_NL.sum(0)
            dx_SH, ds_S, dws = lowered.vjp_rows(
                x_SH.detach(), torch.arange(x_SH.shape[0]), torch.cumsum(counts_L, 0, dtype=torch.int32),
                counts_L.tolist(), packed, dy_SH, score_S)
            self.assertEqual(dx_SH.dtype, torch.float32)
            got_dws = lowered.unpack_grads(dws, weights)
            self.assertEqual([d.dtype for d in got_dws], [torch.float32] * 3)
            for got, ref in ((dx_SH, want_dx), (ds_S, want_ds), *zip(got_dws, want_dws, strict=True)):
                self.assertEqual(got.shape, ref.shape)
                if ref.numel():
                    err = ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    self.assertLessEqual(err, 2e-2)


class UnrecognizedIdiomsSayWhy(unittest.TestCase):
    def test_adding_rows_to_rows_is_not_a_bias(self) -> None:
        # A residual inside the experts (biases: tests/passes/test_expert_block_bias.py).
        def residual(rows, counts, s0, s1, w1, w2):
            return _non_gated(nnf.silu)(rows, counts, s0, s1, w1, w2) + rows

        idiom = Idiom(residual, FFN_EFH, per_pair=False)
        with self.assertRaisesRegex(NotAnFFN, "add.* adds something other than a bias to rows"):
            recognize_expert_ffn(idiom.gm, idiom.binding, L)

    def test_the_probe_catches_rows_grouped_by_the_wrong_experts(self) -> None:
        idiom = Idiom(experts_in_reverse_order, SWIGLU_EFH, per_pair=False)
        plan = recognize_expert_ffn(idiom.gm, idiom.binding, L)  # structurally it is an FFN
        eager = RegionExpertFn(idiom.gm, idiom.binding)
        weights = idiom.weights_of(idiom.inputs(seed=0)[0])
        rows_like = torch.empty(0, H)
        self.assertGreater(probe_error(eager, LoweredFFN(plan, L, eager.digest()), rows_like, weights, N), 1e-2)
        # The same probe passes the correct idiom.
        good = Idiom(grouped_swiglu_efh, SWIGLU_EFH, per_pair=False)
        good_eager = RegionExpertFn(good.gm, good.binding)
        good_plan = recognize_expert_ffn(good.gm, good.binding, L)
        self.assertLess(probe_error(good_eager, LoweredFFN(good_plan, L, "x"), rows_like, weights, N), 1e-6)

    def test_scaling_rows_by_a_constant_is_not_an_ffn(self) -> None:
        def scaled(rows, counts, s0, s1, w1, w2):
            return _non_gated(nnf.silu)(rows, counts, s0, s1, w1, w2) * 2.0

        idiom = Idiom(scaled, FFN_EFH, per_pair=False)
        with self.assertRaisesRegex(NotAnFFN, "scales rows by something other than rows"):
            recognize_expert_ffn(idiom.gm, idiom.binding, L)


if __name__ == "__main__":
    unittest.main()
