"""``python -m relay_compile.bench --preset tiny``: every kind of measurement, written to results.json/.md/.png."""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path

from relay_compile.bench.rows import A2A_EAGER
from tests.bench.standin_case import StandinTestCase

try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


class TinyPresetTest(StandinTestCase):
    def test_tiny_preset_writes_every_row_with_ratios_and_the_ring_peak_is_below_a2a(self) -> None:
        from relay_compile.bench.__main__ import main

        with tempfile.TemporaryDirectory() as tmp:
            self.assertEqual(main(["--preset", "tiny", "--out", tmp, "--repeats", "2", "--warmup", "1"]), 0)
            out = Path(tmp)
            data = json.loads((out / "results.json").read_text())
            md = (out / "results.md").read_text()
            if HAVE_MATPLOTLIB:
                self.assertTrue((out / "memory_timeline.png").stat().st_size > 10_000)

        sections = {s["title"]: s["layers"] for s in data["sections"]}
        main_rows = {r["row"]: r for r in sections["Tiny layer, all rows"][0]["rows"]}
        expected = {A2A_EAGER, "a2a inductor", "ring sequential", "ring overlap", "ring overlap, hops <= 256 rows",
                    "ring overlap, no grouped GEMM", "ring token routing"}
        self.assertLessEqual(expected, set(main_rows))
        self.assertIn("torch.compile rows are off", main_rows["a2a inductor"]["skipped"])
        a2a = main_rows[A2A_EAGER]
        self.assertEqual((a2a["time_ratio"], a2a["peak_ratio"]), (1.0, 1.0))
        for name in expected - {A2A_EAGER, "a2a inductor"}:
            row = main_rows[name]
            self.assertEqual(row["skipped"], "", name)
            self.assertAlmostEqual(row["time_ratio"], row["total_ms"] / a2a["total_ms"], msg=name)
            self.assertAlmostEqual(row["peak_ratio"], row["peak_bytes"] / a2a["peak_bytes"], msg=name)
            self.assertIsNotNone(row["model_ratio"], name)
            self.assertLess(row["peak_bytes"], a2a["peak_bytes"], f"{name} peak is not below a2a's")
            self.assertIn(f"| {name} |", md)
        self.assertIn("max |diff| / max |y|", sections["Tiny layer, all rows"][0]["check"])

        ablation = [r["row"] for r in sections["Ablation (paper Figure 17)"][0]["rows"]]
        self.assertEqual(ablation[:4], [A2A_EAGER, "ring sequential, no grouped GEMM",
                                        "ring overlap, no grouped GEMM", "ring overlap + grouped GEMM"])
        capacity = {c["row"]: c["max_tokens"] for c in data["capacity"]}
        self.assertGreater(capacity["ring overlap"], capacity[A2A_EAGER])
        self.assertGreater(capacity[A2A_EAGER], 0)
        timelines = {t["row"]: t for t in data["timelines"]}
        self.assertLess(timelines["ring overlap"]["peak_bytes"], timelines[A2A_EAGER]["peak_bytes"])
        self.assertIsNotNone(timelines[A2A_EAGER]["backward_starts_ms"])


if __name__ == "__main__":
    unittest.main()
