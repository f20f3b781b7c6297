"""``bench.numerics``: leaf values, relative errors and the table, on one process (no ring)."""

from __future__ import annotations

import unittest

import torch

from relay_compile.bench.numerics import BlockInputs, block_errors, errors_table, leaf_values, relative_errors
from relay_compile.reference import a2a_moe


def _inputs() -> BlockInputs:
    gen = torch.Generator().manual_seed(0)
    return BlockInputs(
        x_TH=torch.randn(6, 8, generator=gen), topk_ids_TK=torch.randint(0, 2, (6, 2), generator=gen),
        topk_scores_TK=torch.rand(6, 2, generator=gen),
        weights=[torch.randn(2, 4, 8, generator=gen), torch.randn(2, 8, 4, generator=gen),
                 torch.randn(2, 4, 8, generator=gen)],
        grad_y_TH=torch.randn(6, 8, generator=gen),
    )


class Numerics(unittest.TestCase):
    def test_relative_error_is_the_largest_difference_over_the_largest_truth(self) -> None:
        truth = {"y": torch.tensor([1.0, -4.0]), "dx": torch.zeros(2)}
        got = {"y": torch.tensor([1.5, -4.0]), "dx": torch.tensor([0.0, 0.25])}
        errors = relative_errors(got, truth)
        self.assertEqual(errors, {"y": 0.5 / 4.0, "dx": 0.25, "y rms": errors["y rms"], "dx rms": errors["dx rms"]})
        # rms: sqrt(mean(diff^2)) / sqrt(mean(truth^2)); the truth all zeros: the error itself.
        self.assertAlmostEqual(errors["y rms"], (0.25 / 2) ** 0.5 / (17 / 2) ** 0.5)
        self.assertAlmostEqual(errors["dx rms"], (0.0625 / 2) ** 0.5)

    def test_every_leaf_has_a_value_and_fp32_matches_itself_exactly(self) -> None:
        values = leaf_values(a2a_moe, _inputs())
        self.assertEqual(list(values), ["y", "dx", "d_scores", "d_w1", "d_w2", "d_w3"])
        errors = block_errors({"a2a": (a2a_moe, {})}, _inputs(), a2a_moe)
        self.assertEqual(errors["a2a"], dict.fromkeys([*values, *(f"{leaf} rms" for leaf in values)], 0.0))

    def test_bf16_errors_are_about_bf16_roundings_and_the_table_gives_ratios(self) -> None:
        errors = block_errors({"a2a": (a2a_moe, {}), "again": (a2a_moe, {})}, _inputs().to(torch.bfloat16), a2a_moe)
        for leaf, err in errors["a2a"].items():
            self.assertTrue(1e-4 < err < 5e-2, (leaf, err))
        table = errors_table(errors, "a2a")
        self.assertIn("| leaf | a2a | again |", table)
        self.assertIn("(1.00x)", table)
