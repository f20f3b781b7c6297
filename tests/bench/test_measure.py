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


if __name__ == "__main__":
    unittest.main()
