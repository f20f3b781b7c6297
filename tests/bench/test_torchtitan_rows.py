"""torchtitan's MoE rows on CPU, tiny shape, bf16: its mesh code on the stand-in world, the rows' numerics against
the reference layer, ``measure_layer`` over them, and the compile-time measurement. One process (rank 0 of 4).

Legend: T tokens per rank, H hidden, K top-k, N EP size.
"""

from __future__ import annotations

import unittest

import torch
import torch.distributed as dist

from relay_compile.backend import compiled_reports
from relay_compile.bench import standin_group, standin_world
from relay_compile.bench.compile_time import measure_compile_time
from relay_compile.bench.configs import QWEN3_30B, BenchOptions
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.measure import measure_layer
from relay_compile.bench.rows import A2A_EAGER, RowSkipped, RowSpec, build_eager_a2a, compiled_a2a_builder, ring_builder
from relay_compile.bench.torchtitan_rows import (
    TITAN_EAGER,
    TITAN_RELAYMOE,
    expert_params,
    titan_builder,
    torchtitan_available,
    torchtitan_rows,
)
from relay_compile.reference import a2a_moe
from tests.bench.standin_case import StandinTestCase

# 256 tokens: enough that routing="auto" takes expert routing (the stand-in's token routing computes another function).
CFG = QWEN3_30B.with_(name="tiny", device="cpu", dtype="bf16", hidden=64, ffn=32, experts=16, top_k=4, tokens=256,
                      ep=4)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


class StandinWorld(StandinTestCase):
    def test_the_world_takes_the_asked_size_and_a_later_size_replaces_it(self) -> None:
        world = standin_world(4)
        self.assertEqual(dist.get_world_size(), 4)
        self.assertIs(dist.group.WORLD, world)
        self.assertEqual(standin_group(4).size(), 4)  # a group of every rank of the world
        standin_world(8)
        self.assertEqual(dist.get_world_size(), 8)
        self.assertEqual(standin_group(2).size(), 2)

    def test_a_size_out_of_range_says_the_range(self) -> None:
        with self.assertRaisesRegex(ValueError, r"size must be in \[1, 4096\]"):
            standin_world(0)


@unittest.skipUnless(torchtitan_available(), "torchtitan, spmd_types or triton not installed")
class TorchtitanRows(StandinTestCase):
    def setUp(self) -> None:
        super().setUp()
        standin_world(CFG.ep)

    def test_torchtitan_eager_is_the_reference_layer_and_through_the_backend_its_experts_are_grouped(self) -> None:
        inp = make_inputs(CFG)
        args = (inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
        want = a2a_moe(*args, group=standin_group(CFG.ep))
        want.backward(inp.grad_y_TH)
        want_grads = [w.grad.clone() for w in inp.weights]
        torch._dynamo.reset()  # a graph another test compiled for this code would be reused, with no new report
        n_reports = len(compiled_reports())
        for name, build in ((TITAN_EAGER, titan_builder()), (TITAN_RELAYMOE, titan_builder("relaymoe"))):
            with self.subTest(name):
                inp.clear_grads()
                fn = build(CFG, None)
                got = fn(*args)
                got.backward(inp.grad_y_TH)
                # Eager: the same bf16 GEMMs on the same rows, so the same bits; the ring sums hops in fp32.
                self.assertLessEqual(rel_err(got, want), 0.0 if name == TITAN_EAGER else 1e-2)
                for p, w in zip(expert_params(fn.layer), want_grads, strict=True):
                    self.assertLessEqual(rel_err(p.grad.to_local(), w), 2e-2)
                fn.clear_grads()
                self.assertTrue(all(p.grad is None for p in expert_params(fn.layer)))
        summaries = [r.summary() for r in compiled_reports()[n_reports:]]
        self.assertEqual(len(summaries), 1, summaries)
        self.assertIn("rewritten, EP=4, routing auto -> expert", summaries[0])
        # bf16 parameters: .bfloat16() casts nothing, the experts are lowered onto the grouped kernels.
        self.assertIn("experts grouped: swiglu experts", summaries[0])

    def test_measure_layer_measures_every_row_with_ratios(self) -> None:
        rows = [RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"), *torchtitan_rows(),
                RowSpec(name="ring overlap", build=ring_builder(routing="expert"), kind="ring")]
        res = measure_layer(CFG, BenchOptions(warmup=1, repeats=1), rows)
        self.assertEqual([r.row for r in res.rows], [A2A_EAGER, TITAN_EAGER, TITAN_RELAYMOE, "ring overlap"])
        for r in res.rows:
            self.assertEqual(r.skipped, "", r.row)
            self.assertGreater(r.peak_bytes, 0, r.row)
            self.assertIsNotNone(r.time_ratio, r.row)

    def test_a_world_of_another_size_skips_the_rows_and_says_what_to_call(self) -> None:
        standin_world(2)
        with self.assertRaisesRegex(RowSkipped, r"standin_world\(4\)"):
            titan_builder()(CFG, None)

    def test_compile_time_is_measured_per_row_and_a_failing_row_keeps_its_place(self) -> None:
        def broken(cfg, group):
            raise RuntimeError("no such layer")

        rows = [RowSpec(name="a2a relaymoe backend", build=compiled_a2a_builder("relaymoe"), kind="ring"),
                *torchtitan_rows(eager=False), RowSpec(name="broken", build=broken, kind="a2a")]
        times = measure_compile_time(CFG, rows, steps=1)
        self.assertEqual([t.row for t in times], ["a2a relaymoe backend", TITAN_RELAYMOE, "broken"])
        for t in times[:2]:
            self.assertEqual(t.skipped, "", t.row)
            self.assertGreater(t.first_call_s, t.step_s)
            self.assertAlmostEqual(t.compile_s, t.first_call_s - t.step_s)
        self.assertIn("no such layer", times[2].skipped)


if __name__ == "__main__":
    unittest.main()
