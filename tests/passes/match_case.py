"""The test case of the matcher's unit tests: ``find_moe_regions`` run on a hand-built graph, checked pure."""

from __future__ import annotations

import unittest

from torch import fx

from relay_compile.passes import MoERegion, RefusedRegion, find_moe_regions
from tests.passes.fx_graphs import graph_snapshot


class MatchTestCase(unittest.TestCase):
    def match(self, gm: fx.GraphModule) -> tuple[list[MoERegion], list[RefusedRegion]]:
        before = graph_snapshot(gm)
        code = gm.code
        found = find_moe_regions(gm)
        self.assertEqual(graph_snapshot(gm), before, "find_moe_regions mutated the graph")
        self.assertEqual(gm.code, code)
        return found

    def refusal(self, gm: fx.GraphModule, node: fx.Node) -> str:
        """The one reason ``gm`` is refused for, at ``node`` (a token all-to-all); no region found."""
        regions, refused = self.match(gm)
        self.assertEqual([r.describe() for r in regions], [])
        self.assertEqual(len(refused), 1, [r.reason for r in refused])
        self.assertIs(refused[0].node, node)
        return refused[0].reason
