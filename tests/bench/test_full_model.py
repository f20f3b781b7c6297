"""``python -m relay_compile.bench.full_model --preset tiny``: rows, results.json, the ring rewrite, the budget.

Also the pieces with logic of their own: the budget chooser's candidates and the search's bracketing.
"""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path

import torch
from torch._dynamo.testing import CompileCounter

from relay_compile.bench.capacity import largest_fitting
from relay_compile.bench.full_model.budget import BudgetChooser
from relay_compile.bench.full_model.policies import A2A_EAGER, POLICIES, layer_runner
from tests.bench.standin_case import StandinTestCase

try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False

# The compiled a2a row adds a compilation (~20 s on 2 CPU cores) and nothing the other rows do not test.
ROWS = [p.name for p in POLICIES if p.name != "a2a compiled"]
PROBE_KEYS = {"tokens", "fits", "step_ms", "tokens_per_s", "peak_bytes", "resident_bytes", "memory_budget",
              "link_ms", "error"}


class TinyFullModelTest(StandinTestCase):
    def test_tiny_preset_trains_every_row_and_the_ring_rows_fit_more_tokens(self) -> None:
        from relay_compile.bench.full_model.__main__ import main

        with tempfile.TemporaryDirectory() as tmp:
            self.assertEqual(main(["--preset", "tiny", "--out", tmp, "--max-tokens", "1536", "--rows", *ROWS]), 0)
            out = Path(tmp)
            data = json.loads((out / "results.json").read_text())
            md = (out / "results.md").read_text()
            if HAVE_MATPLOTLIB:
                self.assertGreater((out / "full_model.png").stat().st_size, 10_000)

        rows = {r["row"]: r for r in data["rows"]}
        self.assertEqual(list(rows), ROWS)
        self.assertEqual(data["largest_tokens_per_rank"], {name: r["max_tokens"] for name, r in rows.items()})
        for name, row in rows.items():
            self.assertEqual(row["error"], "", name)
            self.assertIn(f"| {name} |", md)
            self.assertTrue(row["probes"], name)
            for probe in row["probes"]:
                self.assertEqual(set(probe), PROBE_KEYS, name)
                if probe["fits"]:
                    self.assertGreater(probe["tokens_per_s"], 0, name)
                    self.assertLessEqual(probe["peak_bytes"], data["settings"]["budget_bytes"], name)
            # The largest fitting length was measured and fits; one sequence more was tried and did not.
            fitting = [p["tokens"] for p in row["probes"] if p["fits"]]
            self.assertEqual(max(fitting), row["max_tokens"], name)
            step = data["config"]["seq_len"]
            self.assertTrue(row["limited_by_search"] or any(
                p["tokens"] == row["max_tokens"] + step and not p["fits"] for p in row["probes"]), name)
        for name in ("relaymoe", "relaymoe + budget", "relaymoe + full AC", "relaymoe + MoE AC"):
            self.assertGreaterEqual(rows[name]["regions_rewritten"], 1, name)
            self.assertEqual(rows[name]["regions_refused"], 0, name)
        self.assertGreater(rows["relaymoe"]["max_tokens"], rows[A2A_EAGER]["max_tokens"])
        # The checkpointing ring row compiles its own function (the ring inside the checkpoint): at the longest
        # length both rows trained, it keeps less.
        peaks = {name: {p["tokens"]: p["peak_bytes"] for p in rows[name]["probes"] if p["fits"]}
                 for name in ("relaymoe", "relaymoe + full AC")}
        longest = max(set(peaks["relaymoe"]) & set(peaks["relaymoe + full AC"]))
        self.assertLess(peaks["relaymoe + full AC"][longest], peaks["relaymoe"][longest])
        # Spending the budget: beyond the plain ring's largest length, the budget row recomputes more and fits.
        budget = rows["relaymoe + budget"]
        self.assertGreater(budget["max_tokens"], rows["relaymoe"]["max_tokens"])
        at_max = next(p for p in budget["probes"] if p["tokens"] == budget["max_tokens"] and p["fits"])
        self.assertLess(at_max["memory_budget"], 1.0)
        self.assertEqual([b["name"] for b in data["bars"]], [
            "largest tokens/rank vs a2a eager", "largest tokens/rank vs best a2a row",
            "tokens/s at a2a eager's largest length", "tokens/s where a2a needs full recompute"])
        self.assertAlmostEqual(data["bars"][0]["value"], budget["max_tokens"] / rows[A2A_EAGER]["max_tokens"])


class ShapePolicyTest(unittest.TestCase):
    def test_static_shapes_compile_each_length_and_the_default_one_graph_for_every_length(self) -> None:
        policy = next(p for p in POLICIES if p.backend == "compiled")
        layer = torch.nn.Linear(4, 4)
        for static, frames in ((True, 2), (False, 1)):
            counter = CompileCounter()
            torch._dynamo.reset()
            run = layer_runner(policy, inner_compiler=counter, static_shapes=static)
            for tokens in (8, 12, 12):
                x = torch.randn(tokens, 4)
                torch.testing.assert_close(run(layer, x), layer(x))
            self.assertEqual(counter.frame_count, frames, f"static_shapes={static}")


class BudgetChooserTest(unittest.TestCase):
    def test_a_fraction_that_failed_is_skipped_at_larger_lengths_only(self) -> None:
        chooser = BudgetChooser(budget_bytes=1000, ladder=(1.0, 0.5, 0.0))
        chooser.record(1.0, 200, None, None)
        self.assertEqual(chooser.candidates(100), [1.0, 0.5, 0.0])
        self.assertEqual(chooser.candidates(200), [0.5, 0.0])

    def test_a_fraction_predicted_over_the_budget_is_skipped_but_the_smallest_is_always_tried(self) -> None:
        chooser = BudgetChooser(budget_bytes=1000, ladder=(1.0, 0.5, 0.0))
        chooser.record(1.0, 100, peak_bytes=600, resident_bytes=100)  # 5 bytes per token above 100 resident
        chooser.record(0.0, 100, peak_bytes=300, resident_bytes=100)  # 2 bytes per token
        self.assertEqual(chooser.predicted_peak(1.0, 180), 1000)
        self.assertEqual(chooser.candidates(180), [1.0, 0.5, 0.0])
        self.assertEqual(chooser.candidates(181), [0.5, 0.0])
        self.assertEqual(chooser.candidates(10_000), [0.5, 0.0])
        chooser.record(0.5, 400, None, None)
        self.assertEqual(chooser.candidates(10_000), [0.0])

    def test_a_step_over_the_budget_counts_as_a_failure(self) -> None:
        chooser = BudgetChooser(budget_bytes=1000, ladder=(1.0, 0.0))
        chooser.record(1.0, 300, peak_bytes=1001, resident_bytes=100)
        self.assertEqual(chooser.failed_at, {1.0: 300})
        self.assertEqual(chooser.slopes, {})


class LargestFittingTest(unittest.TestCase):
    def test_brackets_by_doubling_then_bisects_in_steps(self) -> None:
        tried: list[int] = []

        def fits(t: int) -> bool:
            tried.append(t)
            return t <= 700

        self.assertEqual(largest_fitting(fits, start=128, step=64, top=4096), (640, False))
        self.assertEqual(tried, [128, 256, 512, 1024, 768, 640, 704])

    def test_halves_when_the_start_does_not_fit_and_reports_the_search_limit(self) -> None:
        self.assertEqual(largest_fitting(lambda t: t <= 100, start=1024, step=64, top=4096), (64, False))
        self.assertEqual(largest_fitting(lambda t: False, start=1024, step=64, top=4096), (0, False))
        self.assertEqual(largest_fitting(lambda t: True, start=128, step=64, top=1000), (960, True))


if __name__ == "__main__":
    unittest.main()
