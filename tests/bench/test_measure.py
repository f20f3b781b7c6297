"""``relay_compile.bench.measure.measure_layer``: rows side by side, extra rows, failing rows."""

from __future__ import annotations

import unittest

from relay_compile.bench.configs import BenchOptions, LayerConfig
from relay_compile.bench.measure import measure_layer
from relay_compile.bench.rows import A2A_EAGER, RowSpec, build_eager_a2a
from tests.bench.standin_case import StandinTestCase


class MeasureLayerTest(StandinTestCase):
    def test_an_extra_row_joins_the_table_and_a_failing_row_keeps_its_place(self) -> None:
        cfg = LayerConfig(name="x", hidden=16, ffn=8, experts=8, top_k=2, tokens=64, ep=2, dtype="fp32", device="cpu")

        def broken(cfg, group):
            raise RuntimeError("backend exploded")

        rows = [RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
                RowSpec(name="broken", build=broken, kind="ring")]
        extra = RowSpec(name="again", build=build_eager_a2a, kind="a2a")
        res = measure_layer(cfg, BenchOptions(warmup=0, repeats=1), rows, extra_rows=[extra])
        self.assertEqual([r.row for r in res.rows], [A2A_EAGER, "broken", "again"])
        self.assertIn("backend exploded", res.row("broken").skipped)
        self.assertIsNotNone(res.row("again").time_ratio)

    def test_interleaved_rows_take_their_timed_steps_in_turns_and_a_row_failing_midway_is_skipped(self) -> None:
        cfg = LayerConfig(name="x", hidden=16, ffn=8, experts=8, top_k=2, tokens=64, ep=2, dtype="fp32", device="cpu")
        calls: list[str] = []

        def recording(name: str, fail_at: int | None = None):
            def build(cfg, group):
                a2a = build_eager_a2a(cfg, group)

                def run(*args):
                    calls.append(name)
                    if fail_at is not None and calls.count(name) == fail_at:
                        raise RuntimeError(f"{name} fell over")
                    return a2a(*args)

                return run

            return build

        rows = [RowSpec(name=A2A_EAGER, build=recording("a"), kind="a2a"),
                RowSpec(name="b", build=recording("b"), kind="a2a"),
                RowSpec(name="c", build=recording("c", fail_at=3), kind="a2a")]
        res = measure_layer(cfg, BenchOptions(warmup=1, repeats=3, interleave=True), rows)
        # Warm-ups row by row, then rounds of one step per row (c fails in round 2 and leaves), then the peaks.
        self.assertEqual(calls, ["a", "b", "c"] + ["a", "b", "c"] + ["a", "b", "c"] + ["a", "b"] + ["a", "b"])
        self.assertIn("c fell over", res.row("c").skipped)
        self.assertIsNotNone(res.row("b").time_ratio)
        self.assertIsNotNone(res.row("b").peak_bytes)


if __name__ == "__main__":
    unittest.main()
