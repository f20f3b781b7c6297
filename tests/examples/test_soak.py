"""A short soak of ``examples/soak.py``: 120 steps under ``backend="relaymoe"`` with T and the ring routing
changing, RSS flat from step 100 and compilations within the shape classes.

Calls ``run`` of the example in this process (it spawns its own 2 gloo ranks); the full 1000-step soak is in
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import unittest

from tests.examples.scripts import load_example

SHORT = ["--steps", "120", "--every", "20", "--timeout", "240"]


class SoakExampleTest(unittest.TestCase):
    def test_a_short_soak_keeps_rss_flat_and_compilations_bounded(self) -> None:
        soak = load_example("soak")
        code, verdict, results = soak.run(SHORT)
        self.assertEqual(code, 0, verdict)
        self.assertIsNotNone(verdict)
        self.assertTrue(verdict.rss_ok and verdict.compile_ok, verdict)
        self.assertEqual(len(results), 2)
        for res in results:
            self.assertEqual([r.step for r in res.records], [20, 40, 60, 80, 100, 120])
            # Every graph was compiled by step 20 (each model saw every T by step 6): none later.
            self.assertEqual({r.graphs for r in res.records}, {res.records[0].graphs}, res.records)
            self.assertEqual({r.frames for r in res.records}, {res.records[0].frames}, res.records)
            self.assertEqual({r.specs for r in res.records}, {res.records[0].specs}, res.records)
            self.assertGreaterEqual(res.records[0].graphs, len(soak.RING_ROUTINGS))  # both models compiled
            self.assertLessEqual(res.records[0].graphs, verdict.bound)
            # Both layers' MoE blocks rewritten in every graph: the compiled runs really were RelayMoE rings.
            self.assertEqual(res.rewritten, soak.CFG["layers"] * res.records[0].graphs)
            self.assertLess(verdict.rss_growth[res.rank], 2.0)


if __name__ == "__main__":
    unittest.main()
