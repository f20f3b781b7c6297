"""Expert blocks with biases, recognized per idiom, and the recognized program against F itself (fp32 to 1e-6).

The idioms of ``test_expert_block`` with a bias on some projections: ``nn.Linear(bias=True)`` experts in a
``ModuleList`` (``linear(x, w, b)``), a loop over ``torch.split`` chunks adding ``b[e]`` of a stacked
``(E_l, F)`` bias after ``x @ w[e]``, and batched capacity-shaped ``(E_l, C, H)`` rows through ``bmm`` /
``einsum`` with a stacked ``(E_l, 1, F)`` bias (Tutel's layout, or ``b[:, None]`` of an ``(E_l, F)`` one).
Every test checks what was recognized, then the lowered program beside F on rows of each source (an expert
without rows among uneven counts): forward, autograd's gradients of x and of every weight and bias, and the
fused backward (``vjp_rows``: ``dx``, ``d_score``, weight and bias gradients, returned, added into gradient
sinks, and summed in a wider dtype); in one process. Then a biased ``ModuleList`` MoE layer through
``torch.compile(backend="relaymoe")`` at world 2: grouped, and three SGD steps equal to eager.

Legend: S rows, H hidden, F expert FFN width, N sources, L = E_l experts per rank, C capacity.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as nnf
from torch import Tensor
from torch.testing._internal.common_utils import run_tests

import relay_compile
from relay_compile.backend import compiled_reports
from relay_compile.passes.expert_block import NotAnFFN, recognize_expert_ffn
from relay_compile.passes.expert_lowering import LoweredFFN, capacity_probe_error, probe_error
from relay_compile.runtime.region_fn import ExpertFnBinding, RegionExpertFn
from relay_compile.runtime.specs import spec_state
from tests.models.megatron_style import MegatronStyleMoE
from tests.passes.test_expert_block import (
    MODULES_WITH_BIAS,
    F,
    H,
    Idiom,
    L,
    N,
    _expert_major,
    _stacked,
    with_bias,
)
from tests.passes.test_idioms import Idioms

C = 3  # capacity slots per (source, expert)


# --- idioms: F as codebases write it, with biases ----------------------------------------------------------


def module_list_gelu(rows, s00, s01, s02, s10, s11, s12, *weights):
    """DeepSpeed / fairseq ``nn.Linear(bias=True)`` experts: ``fc2(gelu(fc1(x)))`` per expert."""
    sizes = [s00, s01, s02, s10, s11, s12]
    chunks = torch.split(rows, sizes)
    outs = []
    for e in range(L):
        fc1_w, fc1_b, fc2_w, fc2_b = weights[4 * e: 4 * e + 4]
        x_e = torch.cat([chunks[s * L + e] for s in range(N)])
        outs.append(nnf.linear(nnf.gelu(nnf.linear(x_e, fc1_w, fc1_b)), fc2_w, fc2_b))
    per_source = [torch.split(o, [sizes[s * L + e] for s in range(N)]) for e, o in enumerate(outs)]
    return torch.cat([per_source[e][s] for s in range(N) for e in range(L)])


def _module_list(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` with one named argument per weight (``fx.symbolic_trace`` traces no ``*args``)."""

    def traced(rows, s00, s01, s02, s10, s11, s12, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11):
        return fn(rows, s00, s01, s02, s10, s11, s12, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)

    return traced


def loop_geglu_tanh_stacked_biases(rows, counts, s0, s1, w1, w2, w3, b1, b2, b3):
    """A loop over ``torch.split`` chunks: ``x_e @ w[e].T + b[e]`` on stacked ``(E_l, F)`` biases, every
    projection biased (``b + x @ w`` for the up one), tanh-GELU gate."""
    x, perm, _ = _expert_major(rows, counts)
    counts_L = counts.sum(0)
    chunks, outs = torch.split(x, [counts_L[e].item() for e in range(L)]), []
    for e in range(L):
        x_e = chunks[e]
        h = nnf.gelu(x_e @ w1[e].T + b1[e], approximate="tanh") * (b3[e] + x_e @ w3[e].T)
        outs.append(h @ w2[e].T + b2[e])
    return torch.cat(outs)[torch.argsort(perm)]


def loop_relu2_in_out_down_bias(rows, counts, s0, s1, w1, w2, b2):
    """Weights stored (in, out) ``(E_l, H, F)``; squared ReLU as ``relu(h) * relu(h)``; only the down
    projection biased, ``h += b`` in place."""
    x, perm, _ = _expert_major(rows, counts)
    counts_L = counts.sum(0)
    chunks, outs = torch.split(x, [counts_L[e].item() for e in range(L)]), []
    for e in range(L):
        h = torch.relu(chunks[e] @ w1[e])
        y = torch.mm(h * h, w2[e])
        y += b2[e]
        outs.append(y)
    return torch.cat(outs)[torch.argsort(perm)]


def loop_swiglu_up_bias_only(rows, counts, s0, s1, w1, w2, w3, b3):
    """SwiGLU with a bias on the up projection only (the packed gate half of ``b13`` is zeros)."""
    x, perm, _ = _expert_major(rows, counts)
    counts_L = counts.sum(0)
    chunks, outs = torch.split(x, [counts_L[e].item() for e in range(L)]), []
    for e in range(L):
        h = nnf.silu(nnf.linear(chunks[e], w1[e])) * nnf.linear(chunks[e], w3[e], b3[e])
        outs.append(nnf.linear(h, w2[e]))
    return torch.cat(outs)[torch.argsort(perm)]


def capacity_bmm_relu(recv, w1, b1, w2, b2):
    """GShard / Tutel batched experts on capacity rows ``(N * E_l, C, H)``: ``bmm`` on ``(E_l, H, F)`` weights,
    ``(E_l, F)`` biases broadcast over every slot as ``b[:, None, :]`` / ``b.unsqueeze(1)``."""
    x_LRH = recv.reshape(N, L, C, H).transpose(0, 1).reshape(L, N * C, H)
    h_LRF = torch.relu(torch.bmm(x_LRH, w1) + b1[:, None, :])
    y_LRH = torch.bmm(h_LRF, w2) + b2.unsqueeze(1)
    return y_LRH.reshape(L, N, C, H).transpose(0, 1).reshape(N * L, C, H)


def capacity_einsum_swiglu_tutel_bias(recv, w1, b1, w2, b2, w3, b3):
    """``einsum('ecm,efm->ecf')`` on ``(E_l, F, H)`` weights, Tutel's ``(E_l, 1, F)`` biases added as they are."""
    x_LRH = recv.reshape(N, L, C, H).transpose(0, 1).reshape(L, N * C, H)
    gate = torch.einsum("ecm,efm->ecf", x_LRH, w1) + b1
    up = torch.add(torch.einsum("ecm,efm->ecf", x_LRH, w3), b3)
    y_LRH = torch.einsum("ecf,emf->ecm", nnf.silu(gate) * up, w2) + b2
    return y_LRH.reshape(L, N, C, H).transpose(0, 1).reshape(N * L, C, H)


def capacity_matmul_mt_gelu_tanh(recv, w1, w2):
    """Batched ``@`` with ``w.mT`` of ``(E_l, F, H)`` weights (no biases), tanh-GELU."""
    x_LRH = recv.reshape(N, L, C, H).transpose(0, 1).reshape(L, N * C, H)
    y_LRH = nnf.gelu(x_LRH @ w1.mT, approximate="tanh") @ w2.mT
    return y_LRH.reshape(L, N, C, H).transpose(0, 1).reshape(N * L, C, H)


def grouped_swiglu_gathered_biases(rows, counts, s0, s1, w1, w2, w3, b1, b2):
    """Grouped GEMMs over offsets (torchtitan / the reference layer) with stacked ``(E_l, F)`` biases expanded over
    the rows by each row's expert: ``b1[expert of each sorted row]`` after the gate GEMM, and ``b2`` added after
    the unpermute by the expert of each received row (``repeat_interleave`` of the counts, as the reference finds
    it; ``index_select`` form)."""
    x, perm, offs = _expert_major(rows, counts)
    counts_L = counts.sum(0)
    expert_of_sorted = torch.repeat_interleave(torch.arange(L), counts_L)
    h = nnf.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs) + b1[expert_of_sorted])
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)[torch.argsort(perm)]
    expert_of_row = torch.repeat_interleave(torch.arange(N * L) % L, counts.flatten())
    return out + b2.index_select(0, expert_of_row)


def grouped_gathered_bias_of_the_wrong_rows(rows, counts, s0, s1, w1, w2, b1):
    """Structurally a gathered bias, but by the experts reversed: only the probe can tell."""
    x, perm, offs = _expert_major(rows, counts)
    expert_of_sorted = torch.repeat_interleave(torch.arange(L), counts.sum(0)).flip(0)
    h = nnf.gelu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs) + b1[expert_of_sorted])
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)[torch.argsort(perm)]


def bias_shared_by_all_experts(rows, counts, s0, s1, w1, w2, b1):
    """One ``(F,)`` bias added to the grouped GEMM's rows of every expert: not a per-expert bias."""
    x, perm, offs = _expert_major(rows, counts)
    h = nnf.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs) + b1)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)[torch.argsort(perm)]


# --- harness ---------------------------------------------------------------------------------------------


MODULES_GELU_BIAS = tuple(s for _ in range(L) for s in ((F, H), (F,), (H, F), (H,)))
GEGLU_BIASES = ((L, F, H), (L, H, F), (L, F, H), (L, F), (L, H), (L, F))
RELU2_IN_OUT = ((L, H, F), (L, F, H), (L, H))
SWIGLU_UP_BIAS = ((L, F, H), (L, H, F), (L, F, H), (L, F))
CAPACITY_BMM = ((L, H, F), (L, F), (L, F, H), (L, H))
CAPACITY_TUTEL = ((L, F, H), (L, 1, F), (L, H, F), (L, 1, H), (L, F, H), (L, 1, F))


def _biased(shapes: Sequence[tuple[int, ...]], seed: int) -> list[Tensor]:
    """Weights and biases scaled by ``1/sqrt(last dim)``: biases of order 0.3-0.5, so they matter."""
    return _stacked(*shapes, seed=seed)


def _record(gm: fx.GraphModule, *args: object) -> None:
    """``meta["val"]`` of every node from a run on ``args`` (the values Dynamo's graphs carry)."""
    env = iter(args)

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            n.meta["val"] = value = next(env) if n.op == "placeholder" else super().run_node(n)
            return value

    Recorder(gm).run(*args)


def _scale_err(got: Tensor, want: Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0


class _Checks(unittest.TestCase):
    def assert_close_to_scale(self, got: Tensor, want: Tensor, what: str = "") -> None:
        """fp32 to 1e-6 of the tensor's scale (sums in another order differ by rounding, most near zero)."""
        self.assertEqual(got.shape, want.shape, what)
        self.assertLessEqual(_scale_err(got, want), 1e-6, what)

    def recognized(self, gm: fx.GraphModule, binding: ExpertFnBinding, activation: str, describe: str) -> LoweredFFN:
        plan = recognize_expert_ffn(gm, binding, L)
        self.assertEqual(plan.activation, activation)
        self.assertEqual(plan.describe(), describe)
        lowered = LoweredFFN(plan, L, RegionExpertFn(gm, binding).digest())
        self.assertEqual(len(lowered.pack([torch.zeros(s) for s in self._shapes])), lowered.num_packed(0))
        return lowered

    def check(self, idiom: Idiom, activation: str, describe: str) -> None:
        """Forward and autograd's gradients through F and the lowered program, then the fused backward."""
        self._shapes = idiom.weight_shapes
        lowered = self.recognized(idiom.gm, idiom.binding, activation, describe)
        eager = RegionExpertFn(idiom.gm, idiom.binding)
        for src in range(N):  # the ring's calls: rows of one source, sorted by local expert
            args, (x, counts_NL, splits_N) = idiom.inputs(seed=10 + src, src=src)
            weights = _biased(idiom.weight_shapes, seed=20 + src)
            self.assertGreater((counts_NL.sum(0) == 0).sum().item(), 0, "an expert without rows")
            x.requires_grad_()
            leaves = [w.requires_grad_() for w in weights]
            want = eager(x, counts_NL, splits_N, leaves)
            got = lowered(x, counts_NL, splits_N, leaves)
            self.assert_close_to_scale(got, want, "forward")
            dy = torch.randn_like(want)
            grads_want = torch.autograd.grad(want, [x, *leaves], dy)
            grads_got = torch.autograd.grad(got, [x, *leaves], dy)
            for i, (g, w) in enumerate(zip(grads_got, grads_want, strict=True)):
                self.assert_close_to_scale(g, w, f"autograd through the lowered forward, input {i}")
            if lowered.has_fused_backward:
                def f(x_SH: Tensor, ws: list[Tensor], counts_NL=counts_NL, splits_N=splits_N) -> Tensor:
                    return eager(x_SH, counts_NL, splits_N, ws)

                self.check_fused_backward(lowered, f, x.detach(), counts_NL.sum(0), weights)
        # The packed layout round-trips the gradients (weights and biases) into the caller's layout.
        weights = _biased(idiom.weight_shapes, seed=3)
        for u, w in zip(lowered.unpack_grads(lowered.pack(weights), weights), weights, strict=True):
            torch.testing.assert_close(u, w, rtol=0, atol=0)

    def check_fused_backward(self, lowered: LoweredFFN, f: Callable[[Tensor, list[Tensor]], Tensor], x_SH: Tensor,
                             counts_L: Tensor, weights: list[Tensor]) -> None:
        """``vjp_rows`` of ``score * F`` on rows ``x_SH`` sorted by expert (``counts_L`` rows each; ``f``: F on
        them): its gradients returned, added into sinks, and summed in fp64, against autograd through F."""
        g = torch.Generator().manual_seed(5)
        score_S, dy_SH = torch.rand(x_SH.shape[0], generator=g), torch.randn(x_SH.shape, generator=g)
        weights = [w.detach() for w in weights]  # what circulates needs no gradient
        leaves = [w.clone().requires_grad_() for w in weights]
        x_leaf = x_SH.clone().requires_grad_()
        out = f(x_leaf, leaves)
        want_dx, *want_dws = torch.autograd.grad(out * score_S[:, None], [x_leaf, *leaves], dy_SH)
        want_ds = (dy_SH * out).sum(-1)
        packed = lowered.pack(weights)
        rows = (x_SH, torch.arange(x_SH.shape[0]), torch.cumsum(counts_L, 0, dtype=torch.int32), counts_L.tolist())
        dx, ds, dws = lowered.vjp_rows(*rows, packed, dy_SH, score_S)
        sinks = [torch.zeros_like(p, dtype=torch.float64) for p in packed]
        dx2, ds2, none = lowered.vjp_rows(*rows, packed, dy_SH, score_S, grad_dtype=torch.float64,
                                          grad_into=lambda: sinks)
        self.assertEqual(none, [])
        wide = lowered.vjp_rows(*rows, packed, dy_SH, score_S, grad_dtype=torch.float64)[2]
        self.assertEqual([w.dtype for w in wide], [torch.float64] * len(packed))
        for what, got in (("returned", dws), ("sinks", sinks), ("fp64 sums", wide)):
            unpacked = lowered.unpack_grads([d.float() for d in got], weights)
            for i, (d, w) in enumerate(zip(unpacked, want_dws, strict=True)):
                self.assert_close_to_scale(d, w, f"fused backward ({what}), weight {i}")
        for d in (dx, dx2):
            self.assert_close_to_scale(d, want_dx, "fused backward dx")
        for d in (ds, ds2):
            self.assert_close_to_scale(d, want_ds, "fused backward d_score")


class BiasedIdiomsEqualF(_Checks):
    def test_a_module_list_of_linear_experts_with_biases(self) -> None:
        idiom = Idiom(_module_list(module_list_gelu), MODULES_GELU_BIAS, per_pair=True)
        at = [[f"weights[{4 * e + i}]" for e in range(L)] for i in range(4)]
        self.check(idiom, "gelu", (
            f"gelu experts with bias (gate, down), gate per expert {', '.join(at[0])} (out_in), down per expert "
            f"{', '.join(at[2])} (out_in), gate bias per expert {', '.join(at[1])}, down bias per expert "
            f"{', '.join(at[3])}"))

    def test_a_module_list_with_a_fused_fc1_and_its_bias(self) -> None:
        idiom = Idiom(with_bias, MODULES_WITH_BIAS, per_pair=True)
        self.check(idiom, "swiglu", (
            "swiglu experts with bias (gate+up), gate+up per expert weights[0], weights[3], weights[6] (out_in), "
            "down per expert weights[2], weights[5], weights[8] (out_in), gate+up bias per expert weights[1], "
            "weights[4], weights[7]"))

    def test_a_loop_over_split_chunks_with_stacked_biases_on_every_projection(self) -> None:
        idiom = Idiom(loop_geglu_tanh_stacked_biases, GEGLU_BIASES, per_pair=False)
        self.check(idiom, "geglu_tanh", (
            "geglu_tanh experts with bias (gate, up, down), gate weights[0] stacked (out_in), up weights[2] stacked "
            "(out_in), down weights[1] stacked (out_in), gate bias weights[3] stacked, up bias weights[5] stacked, "
            "down bias weights[4] stacked"))

    def test_in_out_weights_squared_relu_and_an_in_place_down_bias(self) -> None:
        idiom = Idiom(loop_relu2_in_out_down_bias, RELU2_IN_OUT, per_pair=False)
        self.check(idiom, "relu2", (
            "relu2 experts with bias (down), gate weights[0] stacked (in_out), down weights[1] stacked (in_out), "
            "down bias weights[2] stacked"))

    def test_grouped_gemms_with_stacked_biases_gathered_by_each_rows_expert(self) -> None:
        idiom = Idiom(grouped_swiglu_gathered_biases, ((L, F, H), (L, H, F), (L, F, H), (L, F), (L, H)), per_pair=False)
        self.check(idiom, "swiglu", (
            "swiglu experts with bias (gate, down), gate weights[0] stacked (out_in), up weights[2] stacked (out_in), "
            "down weights[1] stacked (out_in), gate bias weights[3] stacked, down bias weights[4] stacked"))

    def test_a_bias_on_the_up_projection_only(self) -> None:
        idiom = Idiom(loop_swiglu_up_bias_only, SWIGLU_UP_BIAS, per_pair=False)
        self.check(idiom, "swiglu", (
            "swiglu experts with bias (up), gate weights[0] stacked (out_in), up weights[2] stacked (out_in), "
            "down weights[1] stacked (out_in), up bias weights[3] stacked"))


class CapacityIdiomsEqualF(_Checks):
    """Batched experts on the whole receive ``(N * E_l, C, H)``: F's shapes are the receive's, so the lowered
    program runs on the rows regrouped by expert (``(E_l, N, C)`` order, every expert ``N * C`` rows)."""

    def check_capacity(self, fn: Callable[..., Tensor], shapes: tuple[tuple[int, ...], ...], activation: str,
                       describe: str) -> None:
        self._shapes = shapes
        gm = fx.symbolic_trace(fn)
        args = [torch.randn(N * L, C, H), *_biased(shapes, seed=1)]
        _record(gm, *args)
        binding = ExpertFnBinding(rows=0, counts=None, counts_shape=None, split_kind="source", splits=(),
                                  weights=tuple(range(1, 1 + len(shapes))))
        lowered = self.recognized(gm, binding, activation, describe)
        self.assertLessEqual(capacity_probe_error(gm, binding, lowered, args[0], args[1:], N), 1e-6)
        recv = torch.randn(N * L, C, H, generator=torch.Generator().manual_seed(2)).requires_grad_()
        leaves = [w.requires_grad_() for w in _biased(shapes, seed=4)]
        want = fn(recv, *leaves)
        x_SH = recv.reshape(N, L, C, H).transpose(0, 1).reshape(-1, H)
        rows_L = torch.full((L,), N * C)
        got_SH = lowered.forward_rows(x_SH, torch.cumsum(rows_L, 0, dtype=torch.int32), rows_L.tolist(),
                                      lowered.pack(leaves))
        got = got_SH.reshape(L, N, C, H).transpose(0, 1).reshape(N * L, C, H)
        self.assert_close_to_scale(got, want, "forward")
        dy = torch.randn_like(want)
        for i, (g, w) in enumerate(zip(torch.autograd.grad(got, [recv, *leaves], dy),
                                       torch.autograd.grad(want, [recv, *leaves], dy), strict=True)):
            self.assert_close_to_scale(g, w, f"gradient of input {i}")

        def f(x_SH: Tensor, ws: list[Tensor]) -> Tensor:  # F on rows grouped by expert
            out = fn(x_SH.reshape(L, N, C, H).transpose(0, 1).reshape(N * L, C, H), *ws)
            return out.reshape(N, L, C, H).transpose(0, 1).reshape(-1, H)

        self.check_fused_backward(lowered, f, x_SH.detach(), rows_L, [w.detach() for w in leaves])

    def test_bmm_on_capacity_rows_with_stacked_biases_broadcast_over_slots(self) -> None:
        self.check_capacity(capacity_bmm_relu, CAPACITY_BMM, "relu", (
            "relu experts with bias (gate, down), gate weights[0] stacked (in_out), down weights[2] stacked "
            "(in_out), gate bias weights[1] stacked, down bias weights[3] stacked"))

    def test_einsum_on_capacity_rows_with_tutel_shaped_biases(self) -> None:
        self.check_capacity(capacity_einsum_swiglu_tutel_bias, CAPACITY_TUTEL, "swiglu", (
            "swiglu experts with bias (gate, up, down), gate weights[0] stacked (out_in), up weights[4] stacked "
            "(out_in), down weights[2] stacked (out_in), gate bias weights[1] stacked, up bias weights[5] stacked, "
            "down bias weights[3] stacked"))

    def test_batched_matmul_with_mt_of_stacked_weights(self) -> None:
        self.check_capacity(capacity_matmul_mt_gelu_tanh, ((L, F, H), (L, H, F)), "gelu_tanh", (
            "gelu_tanh experts, gate weights[0] stacked (out_in), down weights[1] stacked (out_in)"))


def a_weight_row_as_a_bias(rows, s00, s01, s02, s10, s11, s12, fc1_0, fc2_0, fc1_1, fc2_1, fc1_2, fc2_2):
    """``fc1(x) + fc2.weight[0]``: a row of the down weight added as the first projection's bias."""
    sizes, weights = [s00, s01, s02, s10, s11, s12], [fc1_0, fc2_0, fc1_1, fc2_1, fc1_2, fc2_2]
    chunks, outs = torch.split(rows, sizes), []
    for e in range(L):
        x_e = torch.cat([chunks[s * L + e] for s in range(N)])
        outs.append(nnf.linear(nnf.relu(nnf.linear(x_e, weights[2 * e]) + weights[2 * e + 1][0]), weights[2 * e + 1]))
    return torch.cat(outs)


class BiasesThatAreNotPerExpertSayWhy(unittest.TestCase):
    def test_the_probe_catches_biases_gathered_for_the_wrong_rows(self) -> None:
        idiom = Idiom(grouped_gathered_bias_of_the_wrong_rows, ((L, F, H), (L, H, F), (L, F)), per_pair=False)
        plan = recognize_expert_ffn(idiom.gm, idiom.binding, L)  # structurally an FFN with a gathered bias
        eager = RegionExpertFn(idiom.gm, idiom.binding)
        weights = _biased(idiom.weight_shapes, seed=0)
        self.assertGreater(probe_error(eager, LoweredFFN(plan, L, "x"), torch.empty(0, H), weights, N), 1e-2)

    def test_a_weight_that_is_also_a_bias_is_refused(self) -> None:
        # Forward equality (the probe) would pass; the two gradients of one tensor would not be summed.
        idiom = Idiom(a_weight_row_as_a_bias, tuple(s for _ in range(L) for s in ((H, H), (H, H))), per_pair=True)
        with self.assertRaisesRegex(NotAnFFN, "a weight of F plays two roles in the FFN"):
            recognize_expert_ffn(idiom.gm, idiom.binding, L)

    def test_a_bias_shared_by_every_experts_rows_is_refused(self) -> None:
        idiom = Idiom(bias_shared_by_all_experts, ((L, F, H), (L, H, F), (F,)), per_pair=False)
        with self.assertRaisesRegex(NotAnFFN, r"add.* adds a \[4\] tensor to rows \[.*\]: not one bias row per expert"):
            recognize_expert_ffn(idiom.gm, idiom.binding, L)


class BiasedExpertsTrainLikeEager(Idioms):
    """``torch.compile(backend="relaymoe")`` at world 2 over gloo: ``ModuleList`` experts of ``nn.Linear(bias=True)``
    (Megatron's ``add_bias_linear``) take the grouped path and train like the layer run eagerly."""

    def test_a_module_list_moe_with_biased_linears_takes_the_grouped_path_and_trains_like_eager(self) -> None:
        self.init_pg()
        # Expert routing in chunks of a few experts (bias slices, gradients added into the travelling sums), then
        # token routing with the forward differentiated by autograd (remat off).
        for settings in ({"routing": "expert", "max_hop_rows": 3}, {"routing": "token", "remat": False}):
            seen = len(compiled_reports())
            with relay_compile.config.patch(**settings):
                self.check_rewritten_and_equal_to_eager(
                    lambda: MegatronStyleMoE(16, 8, 8, 2, dist.group.WORLD, seed=6, bias=True),
                    f"biased ModuleList experts, {settings}",
                    experts="grouped: swiglu experts with bias (gate+up, down), gate+up per expert")
            (region,) = [r for g in compiled_reports()[seen:] for r in g.regions]
            fn = spec_state(region.ring_op).spec.expert_fn
            self.assertIsInstance(fn, LoweredFFN)
            self.assertEqual(fn.num_packed(4 * 4), 4)  # [w13, w2, b13, b2] of the 4 local experts' 16 tensors


if __name__ == "__main__":
    run_tests()
