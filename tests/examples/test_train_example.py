"""The training example runs end to end: eager all-to-all and relaymoe train to the same losses, and it draws its
memory figure.

Calls ``main`` of ``examples/train_moe.py`` in this process (it spawns its own gloo ranks) with tiny settings:
world 2, 3 steps, one layer. The example judges the ranks by what they reported, not by their exit status, and
writes its results as JSON, which this test checks beside the returned status.
"""

from __future__ import annotations

import json
import tempfile
import unittest
from pathlib import Path

import torch

from tests.examples.scripts import load_example
from tests.test_memory import needs_build

LAYERS = 1
TINY = [
    "--world", "2", "--steps", "3", "--layers", str(LAYERS), "--experts", "4", "--top-k", "2",
    "--batch", "2", "--seq-len", "32", "--timeout", "240", "--lockstep",
]


class TrainExampleTest(unittest.TestCase):
    def test_eager_a2a_and_relaymoe_train_to_the_same_losses_and_the_memory_figure_is_written(self) -> None:
        train_moe = load_example("train_moe")
        with tempfile.TemporaryDirectory() as tmp:
            plot, report = Path(tmp) / "memory.png", Path(tmp) / "report.json"
            code = train_moe.main([*TINY, "--plot", str(plot), "--report-json", str(report)])
            self.assertTrue(report.exists(), "the example wrote no report (see its output above)")
            result = json.loads(report.read_text())
            self.assertEqual(code, 0, result)
            self.assertEqual(len(result["losses"]["a2a"]), 3)
            self.assertTrue(result["loss_ok"], result)
            self.assertLessEqual(result["max_rel_diff"], result["rtol"])
            # Every rank's model graph had its MoE block rewritten: the compiled run really was RelayMoE.
            self.assertEqual(result["regions_rewritten"], [LAYERS, LAYERS])
            self.assertLessEqual(result["block_max_rel_err"], 1e-5)
            self.assertTrue(all(row["a2a"] > 0 and row["relaymoe"] > 0 for row in result["block_peak"]), result)
            self.assertTrue(plot.exists() and plot.stat().st_size > 10_000)

    def test_simulated_ep_runs_rank_0_of_a_stand_in_group_in_this_process_and_leaves_no_group(self) -> None:
        train_moe = load_example("train_moe")
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            # Also with a partitioner budget: the backend option travels through the example and still trains alike.
            code = train_moe.main([*TINY[2:], "--simulate-ep", "4", "--activation-memory-budget", "0.5", "--plot", "",
                                   "--report-json", str(report)])
            result = json.loads(report.read_text())
        self.assertEqual(code, 0, result)
        self.assertEqual(result["world"], 4)
        self.assertTrue(result["loss_ok"], result)
        self.assertEqual(result["regions_rewritten"], [LAYERS])  # one rank: rank 0 of the simulated group
        self.assertEqual(result["args"]["routing"], "expert")  # auto would pick token routing at this size
        self.assertFalse(torch.distributed.is_initialized())  # the stand-in world is torn down

    @needs_build  # per-rank peaks on CPU: the counting allocator
    def test_rank_threads_train_every_rank_real_with_token_routing_and_per_rank_peaks(self) -> None:
        train_moe = load_example("train_moe")
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            code = train_moe.main([*TINY[2:], "--rank-threads", "2", "--routing", "token", "--plot", "",
                                   "--report-json", str(report)])
            result = json.loads(report.read_text())
        self.assertEqual(code, 0, result)
        self.assertTrue(result["loss_ok"], result)
        self.assertEqual(len(result["regions_rewritten"]), 2)
        self.assertTrue(all(n >= LAYERS for n in result["regions_rewritten"]), result)
        self.assertTrue(all(row["relaymoe"] > 0 and row["a2a"] > 0 for row in result["step_peak"]), result)
        self.assertFalse(torch.distributed.is_initialized())


if __name__ == "__main__":
    unittest.main()
