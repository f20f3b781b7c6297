"""What F may take from outside as an expert weight (``roles.is_weight_source``), on hand-built graphs.

DTensor parameters reach F through ``to_local()``, which Dynamo writes two ways: ``call_method to_local`` (torch
2.13) and, through torch 2.11, a call of a function it makes on the fly named ``prim_to_local`` (seen on the H200
with torchtitan's experts: unrecognized, F then ran eagerly per hop with DTensor weights and the ring op failed).
"""

from __future__ import annotations

import unittest

import torch.fx as fx

from relay_compile.passes.roles import is_to_local, is_weight_source


def prim_to_local(x):  # the name torch 2.11's Dynamo gives its on-the-fly to_local function
    return x


def other_function(x):
    return x


class WeightSources(unittest.TestCase):
    def setUp(self) -> None:
        self.graph = fx.Graph()
        self.param = self.graph.placeholder("w1_EFD")

    def test_both_spellings_of_to_local_of_a_placeholder_are_weight_sources(self) -> None:
        method = self.graph.call_method("to_local", (self.param,))
        function = self.graph.call_function(prim_to_local, (self.param,))
        for n in (method, function):
            with self.subTest(n.format_node()):
                self.assertTrue(is_to_local(n))
                self.assertTrue(is_weight_source(n))

    def test_another_function_of_a_placeholder_or_to_local_of_a_computed_value_is_not(self) -> None:
        other = self.graph.call_function(other_function, (self.param,))
        self.assertFalse(is_weight_source(other))
        self.assertFalse(is_weight_source(self.graph.call_function(prim_to_local, (other,))))


if __name__ == "__main__":
    unittest.main()
