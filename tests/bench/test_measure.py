"""``relay_compile.bench.measure.measure_layer``: rows side by side, extra rows, failing rows."""

from __future__ import annotations

import unittest

from relay_compile.bench.configs import BenchOptions, LayerConfig
from relay_compile.bench.measure import measure_layer, time_variants, variants_table
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


class Variants(unittest.TestCase):
    def test_variants_take_their_steps_in_turns_under_their_contexts_and_warmups_are_dropped(self) -> None:
        import contextlib
        from unittest import mock

        calls: list[str] = []

        @contextlib.contextmanager
        def under(name: str):
            calls.append(f"enter {name}")
            yield

        steps = iter(range(100))
        with mock.patch("relay_compile.bench.measure.time_step",
                        lambda fn, inp, device: (fn(), float(next(steps)))[1:] + (1.0,)):
            times = time_variants({"a": (lambda: calls.append("a"), lambda: under("a")),
                                   "b": (lambda: calls.append("b"), lambda: under("b"))}, None, "cpu", rounds=2,
                                  warmup=1)
        self.assertEqual(calls, ["enter a", "a", "enter b", "b"] * 3)
        self.assertEqual(times, {"a": [(2.0, 1.0), (4.0, 1.0)], "b": [(3.0, 1.0), (5.0, 1.0)]})
        table = variants_table(times, "a", {"a": 2**20, "b": 3 * 2**20})
        self.assertEqual(table[0], "| row | forward ms | backward ms | step ms | / a | spread | peak MiB |")
        # b: steps 4 and 6 (median 5.00), a: 3 and 5 (median 4.00); spread (6 - 4) / 5.
        self.assertEqual(table[3], "| b | 4.00 | 1.00 | 5.00 | 1.250x | 40.0% | 3 |")

