"""F that the recognizer refuses, compiled by the inner compiler (``relay_compile/runtime/compiled_experts.py``).

World 1 (no process group): the compiled forward and vjp of F against F itself and autograd over F (fp32,
1e-6), on hops of 0, 1 and more rows from either source, with one compilation of each entry point for all
of them. World 2 (gloo): layers with such experts through ``torch.compile(backend="relaymoe")`` train like
eager over three SGD steps, and the report says the experts were compiled.

Legend: S rows, H hidden, F expert FFN width, N sources, L = E_l experts per rank.
"""

from __future__ import annotations

import unittest
import unittest.mock

import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch import Tensor
from torch._dynamo.utils import counters
from torch.testing._internal.common_utils import run_tests

import relay_compile
from relay_compile.backend import compiled_reports
from relay_compile.passes.expert_block import NotAnFFN, recognize_expert_ffn
from relay_compile.runtime import compiled_experts
from relay_compile.runtime.compiled_experts import CompiledExpertFn, compile_expert_fn
from relay_compile.runtime.block_shape import OwnerOptions
from relay_compile.runtime.region_fn import RegionExpertFn
from relay_compile.runtime.specs import spec_state
from tests.models.unrecognized_experts import NormedDataDependentMoE, NormedScoresFirstMoE
from tests.passes.test_expert_block import FFN_EFH, MODULES_WITH_BIAS, H, Idiom, L, N, _expert_major
from tests.passes.test_idioms import Idioms

TOL = 1e-6
# Rows per local expert of the hops each test runs (one source's rows; the others' are zero).
HOPS = ([0, 0, 0], [0, 1, 0], [2, 0, 1], [3, 0, 4], [0, 0, 1], [5, 2, 2])


def normed_loop_with_bias(rows, counts, s0, s1, ln_w, ln_b, w1, b1, w2):
    """Per expert: LayerNorm, ``fc1`` with a bias, quick-GELU, ``fc2``; split sizes read from the counts inside
    F (``.item()``), rows regrouped by expert with repeat_interleave (data-dependent)."""
    x, perm, _ = _expert_major(rows, counts)
    counts_L = counts.sum(0)
    chunks, outs = torch.split(x, [counts_L[e].item() for e in range(L)]), []
    for e in range(L):
        h = nnf.linear(nnf.layer_norm(chunks[e], (H,), ln_w[e], ln_b[e]), w1[e], b1[e])
        outs.append((h * torch.sigmoid(1.702 * h)) @ w2[e].T)
    return torch.cat(outs)[torch.argsort(perm)]


def module_list_quick_gelu(rows, s00, s01, s02, s10, s11, s12, fc1_0, b1_0, fc2_0, fc1_1, b1_1, fc2_1, fc1_2, b1_2,
                           fc2_2):
    """``with_bias`` (ModuleList experts, per (source, expert) splits, fc1 with a bias) with a quick-GELU gate
    (``h * sigmoid(1.702 h)``): not an activation the grouped experts run."""
    sizes = [s00, s01, s02, s10, s11, s12]
    weights = [fc1_0, b1_0, fc2_0, fc1_1, b1_1, fc2_1, fc1_2, b1_2, fc2_2]
    chunks = torch.split(rows, sizes)
    outs = []
    for e in range(L):
        x_e = torch.cat([chunks[s * L + e] for s in range(N)])
        gate, up = nnf.linear(x_e, weights[3 * e], weights[3 * e + 1]).chunk(2, dim=-1)
        outs.append(nnf.linear(gate * torch.sigmoid(1.702 * gate) * up, weights[3 * e + 2]))
    return torch.cat(outs)


@torch._dynamo.disable
def _not_compilable(t: Tensor) -> Tensor:
    """A call Dynamo cannot trace (it would break the graph); a leaf of ``symbolic_trace``."""
    return t * 2


torch.fx.wrap("_not_compilable")

# A constant of F's own: ``symbolic_trace`` makes it a get_attr of F's graph module.
_GAIN_H = torch.linspace(0.5, 1.5, H)


def bf16_experts_with_a_constant(rows, counts, s0, s1, w1, w2):
    """torchtitan's casts (bf16 compute from fp32 weights, fp32 out), a constant gain, softplus; per-source splits
    read directly (``torch.split`` on the SymInts)."""
    parts, outs = torch.split(rows, [s0, s1]), []
    for s in range(N):
        x = (parts[s] * _GAIN_H).to(torch.bfloat16)
        h = nnf.softplus(x @ w1[s % L].to(torch.bfloat16).T)
        outs.append((h @ w2[s % L].to(torch.bfloat16).T).float())
    return torch.cat(outs)


NORMED = ((L, H), (L, H), FFN_EFH[0], (L, FFN_EFH[0][1]), FFN_EFH[1])


def hop_inputs(idiom: Idiom, rows_L: list[int], src: int, seed: int) -> tuple[Tensor, Tensor, list[int], list[Tensor]]:
    """``(x_SH, counts_NL, splits_N, weights)`` of one hop: rows of source ``src`` only, as the ring calls F."""
    g = torch.Generator().manual_seed(seed)
    counts_NL = torch.zeros(N, L, dtype=torch.int64)
    counts_NL[src] = torch.tensor(rows_L)
    splits_N = counts_NL.sum(1).tolist()
    weights = [torch.randn(s, generator=g) / s[-1] ** 0.5 for s in idiom.weight_shapes]
    return torch.randn(sum(rows_L), H, generator=g), counts_NL, splits_N, weights


def autograd_vjp(eager: RegionExpertFn, x: Tensor, counts_NL: Tensor, splits_N: list[int], weights: list[Tensor],
                 dy: Tensor, score: Tensor) -> list[Tensor]:
    """The truth: ``dx, d_score, d_weights`` of ``score * F(x)`` by autograd over F."""
    leaves = [t.clone().requires_grad_() for t in (x, *weights)]
    out = eager(leaves[0], counts_NL, splits_N, leaves[1:])
    grads = torch.autograd.grad(out, leaves, dy * score[:, None], allow_unused=True)
    return [grads[0], (dy * out.detach()).sum(-1),
            *(torch.zeros_like(t) if g is None else g for g, t in zip(grads[1:], weights))]


class CompiledFEqualsF(unittest.TestCase):
    def setUp(self) -> None:
        # Each test compiles its F afresh (the cache is per process, and tests count compilations).
        patcher = unittest.mock.patch.dict(compiled_experts._COMPILED, clear=True)
        patcher.start()
        self.addCleanup(patcher.stop)

    def compiled(self, idiom: Idiom) -> tuple[RegionExpertFn, CompiledExpertFn]:
        eager = RegionExpertFn(idiom.gm, idiom.binding)
        x, counts_NL, splits_N, weights = hop_inputs(idiom, [2, 0, 3], src=0, seed=0)
        counters.clear()
        compiled = compile_expert_fn(eager, "aot_eager", [(x, counts_NL, splits_N)], weights, TOL)
        # The probe compiled the forward and the vjp: one graph each.
        self.assertEqual(counters["stats"]["unique_graphs"], 2)
        return eager, compiled

    def check_hops(self, idiom: Idiom) -> None:
        with self.assertRaises(NotAnFFN):  # the premise: the recognizer refuses this F
            recognize_expert_ffn(idiom.gm, idiom.binding, L)
        eager, compiled = self.compiled(idiom)
        for i, rows_L in enumerate(HOPS):
            src = i % N
            x, counts_NL, splits_N, weights = hop_inputs(idiom, rows_L, src, seed=i + 1)
            what = f"hop {i}: {sum(rows_L)} rows from source {src}"
            torch.testing.assert_close(compiled(x, counts_NL, splits_N, weights),
                                       eager(x, counts_NL, splits_N, weights), rtol=TOL, atol=TOL, msg=what)
            g = torch.Generator().manual_seed(100 + i)
            dy, score = torch.randn(x.shape, generator=g), torch.rand(x.shape[0], generator=g)
            dx, d_score, d_weights = compiled.vjp(x, counts_NL, splits_N, weights, dy, score)
            want = autograd_vjp(eager, x, counts_NL, splits_N, weights, dy, score)
            for name, got, w in zip(["dx", "d_score", *(f"d_w{j}" for j in range(len(weights)))],
                                    [dx, d_score, *d_weights], want, strict=True):
                torch.testing.assert_close(got, w, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{what} {n}: {m}")
        # Under autograd (scores before F, remat off) the compiled forward is differentiated by the compiled vjp.
        x, counts_NL, splits_N, weights = hop_inputs(idiom, [1, 0, 2], src=1, seed=50)
        leaves = [t.clone().requires_grad_() for t in (x, *weights)]
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(51))
        got = torch.autograd.grad(compiled(leaves[0], counts_NL, splits_N, leaves[1:]), leaves, dy)
        want = autograd_vjp(eager, x, counts_NL, splits_N, weights, dy, torch.ones(x.shape[0]))
        for j, (g_, w) in enumerate(zip(got, [want[0], *want[2:]], strict=True)):
            torch.testing.assert_close(g_, w, rtol=TOL, atol=TOL, msg=lambda m, j=j: f"autograd input {j}: {m}")
        # Every hop, whatever its size or source, ran the two graphs compiled first, and none fell back.
        self.assertEqual(counters["stats"]["unique_graphs"], 2)
        self.assertIsNone(compiled.failure)

    def test_a_per_expert_layer_norm_with_bias_and_quick_gelu_reading_counts_compiles_once_for_all_hops(self):
        self.check_hops(Idiom(normed_loop_with_bias, NORMED, per_pair=False))

    def test_module_list_experts_with_quick_gelu_on_per_source_expert_splits_compile_once_for_all_hops(self):
        self.check_hops(Idiom(module_list_quick_gelu, MODULES_WITH_BIAS, per_pair=True))

    def test_bf16_compute_from_fp32_weights_with_a_constant_of_its_own_compiles_once_for_all_hops(self):
        self.check_hops(Idiom(bf16_experts_with_a_constant, FFN_EFH, per_pair=False))

    def test_one_compilation_per_f_identity(self) -> None:
        idiom = Idiom(module_list_quick_gelu, MODULES_WITH_BIAS, per_pair=True)
        _, first = self.compiled(idiom)
        x, counts_NL, splits_N, weights = hop_inputs(idiom, [1, 1, 1], src=1, seed=3)
        again = compile_expert_fn(RegionExpertFn(idiom.gm, idiom.binding), "aot_eager", [(x, counts_NL, splits_N)],
                                  weights, TOL)
        self.assertIs(again, first)
        self.assertEqual(counters["stats"]["unique_graphs"], 2)

    def test_an_f_that_does_not_compile_whole_raises_and_names_why(self) -> None:
        def f(rows, counts, s0, s1, w1, w2):
            return _not_compilable(rows) @ w1[0].T @ w2[0].T

        idiom = Idiom(f, FFN_EFH, per_pair=False)
        x, counts_NL, splits_N, weights = hop_inputs(idiom, [1, 0, 2], src=0, seed=4)
        with self.assertRaisesRegex(Exception, "disable"):
            compile_expert_fn(RegionExpertFn(idiom.gm, idiom.binding), "aot_eager", [(x, counts_NL, splits_N)],
                              weights, TOL)

    def test_the_eager_inner_compiler_does_not_compile(self) -> None:
        idiom = Idiom(module_list_quick_gelu, MODULES_WITH_BIAS, per_pair=True)
        with self.assertRaisesRegex(ValueError, r"'eager' does not compile; use one of \('inductor', 'aot_eager'\)"):
            CompiledExpertFn(RegionExpertFn(idiom.gm, idiom.binding), "eager")


class CompiledExpertsTrainLikeEager(Idioms):
    def test_unrecognized_experts_are_compiled_and_layers_train_like_eager(self) -> None:
        self.init_pg()
        group = dist.group.WORLD
        for build, what in [
            (lambda: NormedDataDependentMoE(16, 8, 8, 2, group, seed=3), "normed experts, data-dependent dispatch"),
            (lambda: NormedScoresFirstMoE(16, 8, 8, 2, group, seed=4), "normed experts, scores before them"),
        ]:
            seen = len(compiled_reports())
            # Grouped experts would hold (2, 3) owners per hop here; a compiled F holds one (no grouped entry
            # points), and the report predicts with that.
            with unittest.mock.patch("relay_compile.report.owner_options", return_value=OwnerOptions((2, 3))):
                self.check_rewritten_and_equal_to_eager(build, what)
            (region,) = [r for g in compiled_reports()[seen:] for r in g.regions]
            self.assertTrue(region.experts.startswith("compiled (aot_eager): "), f"{what}: {region.experts}")
            self.assertEqual(region.owners_per_hop, [1, 1], f"{what}: {region.decision}")
            fn = spec_state(region.ring_op).spec.expert_fn
            self.assertIsInstance(fn, CompiledExpertFn, what)
            self.assertIsNone(fn.failure, what)  # every hop ran the compiled graphs
        # explain says it too.
        x_TH = torch.randn(12, 16, generator=torch.Generator().manual_seed(self.rank))
        (report,) = relay_compile.explain(NormedDataDependentMoE(16, 8, 8, 2, group, seed=3), x_TH,
                                          inner_compiler="aot_eager")
        self.assertIn("experts compiled (aot_eager): forward and vjp per hop", report.summary())


if __name__ == "__main__":
    run_tests()
