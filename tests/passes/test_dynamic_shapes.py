"""The matcher under dynamic shapes, on hand-built graphs: symbolic token counts are matched, never guessed.

Dynamo gives the token count T a symbol after T changes (automatic dynamic) or with ``dynamic=True``; K may
then be a node (``ids.size(1)``), and after a recompile ``x``, ``ids`` and ``scores`` may hold separate
symbols for one T. The matcher compares sizes with ``fx_nodes.same_size`` (``guard_or_false``: equal
statically, or by a guard on the graph when both sizes are backed) and reads constants with
``static_int`` (``is_concrete_int``). Those two torch helpers are private-ish
(``torch.fx.experimental.symbolic_shapes``): ``SizeHelpers`` pins the behaviour the matcher relies on, so a
torch that changes it fails here. No processes, no Dynamo.

Legend: T tokens, H hidden, K top-k, N ranks, E experts, E_l experts per rank.
"""

from __future__ import annotations

import operator
import unittest
from collections.abc import Callable

import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, statically_known_true

from relay_compile.passes import MoERegion, RefusedRegion, find_moe_regions
from relay_compile.passes.fx_nodes import same_size, static_int
from tests.passes.fx_graphs import (
    Dims,
    FakeGraph,
    Region,
    add_moe_region,
    graph_snapshot,
    items_of,
    score_column,
    send_splits,
)

D = Dims()  # T=6, H=8, F=4, K=2, N=2, E=4 (E_l=2)


def symbol(b: FakeGraph, name: str, hint: int) -> torch.SymInt:
    """A backed SymInt of its own (no duck sizing: two symbols of one hint stay two, as after a recompile)."""
    s = b.shape_env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
    return b.shape_env.create_symintnode(s, hint=hint)


def inputs_of(t_x: torch.SymInt | int, t_ids: torch.SymInt | int | None = None, k: torch.SymInt | int = D.K,
              experts: torch.SymInt | int = D.E) -> Callable[[Region], None]:
    """The ``inputs`` step: x (T_x, H), and with ``t_ids`` also ids and scores (T_ids, K) as graph inputs (the
    ``router`` step is then skipped); else the router's ids and scores inherit x's T."""

    def inputs(r: Region) -> None:
        b = r.b
        r.x = b.input("x", (t_x, D.H), r.dtype)
        r.gate = b.input("gate", (D.H, experts), r.dtype)
        r.w1 = b.input("w1", (D.H, D.F), r.dtype)
        r.w2 = b.input("w2", (D.F, D.H), r.dtype)
        if t_ids is not None:
            r.ids = b.input("ids", (t_ids, k), torch.int64)
            r.scores = b.input("scores", (t_ids, k), r.dtype)

    return inputs


def counts_by_size_nodes(r: Region) -> None:
    """The reference's counts exchange of ``zeros(gate.size(1))`` (E from a size node), with Dynamo's check
    ``sum(send_splits) == ids.size(0) * ids.size(1)`` (a symbolic T is not a constant of the graph)."""
    b, n = r.b, r.dims.N
    experts = b.method("size", r.gate, 1)
    ids_P = b.method("to", b.method("flatten", r.ids), torch.int64)
    r.counts_E = b.method("scatter_add_", b.fn(torch.zeros, experts, dtype=torch.int64), 0, ids_P,
                          b.fn(torch.ones_like, ids_P), name="counts_E")
    split = b.fn(operator.floordiv, experts, n)  # funcol's equal splits
    r.exchange, wait = b.a2a(r.counts_E, [split] * n, [split] * n, r.counts_group, names=("exchange", None))
    r.counts = b.method("view", wait, n, -1, name="counts")
    r.send_splits = send_splits(r)
    r.recv_splits = items_of(r, b.method("sum", r.counts, 1))
    pairs = b.fn(operator.mul, b.method("size", r.ids, 0), b.method("size", r.ids, 1))
    b.check(b.fn(operator.eq, b.fn(torch.sym_sum, r.send_splits), pairs))


def k_by_size_node(r: Region) -> None:
    """``order // ids.size(1)``, as Dynamo traces ``top_k = topk_ids.shape[1]`` under ``dynamic=True``."""
    b = r.b
    r.order = b.fn(torch.argsort, b.method("flatten", r.ids), stable=True, name="order")
    r.send = b.fn(operator.getitem, r.x, b.fn(operator.floordiv, r.order, b.method("size", r.ids, 1)), name="send")


def scatter_k_by_size_node(r: Region) -> None:
    """The combine's ``order // scores.size(1)``: a second size node of K."""
    b = r.b
    weighted = b.fn(operator.mul, r.back, score_column(r), name="weighted")
    token = b.fn(operator.floordiv, r.order, b.method("size", r.scores, 1))
    r.y = b.method("index_add", b.fn(torch.zeros_like, r.x), 0, token, weighted, name="y")


class DynamicShapes(unittest.TestCase):
    def match(self, b: FakeGraph, r: Region) -> tuple[list[MoERegion], list[RefusedRegion]]:
        gm = b.module([r.y])
        before = graph_snapshot(gm)
        found = find_moe_regions(gm)
        self.assertEqual(graph_snapshot(gm), before, "find_moe_regions mutated the graph")
        return found

    def refusal(self, b: FakeGraph, r: Region) -> str:
        """The one reason the block is refused for, at its dispatch."""
        regions, refused = self.match(b, r)
        self.assertEqual(regions, [])
        self.assertEqual([x.node for x in refused], [r.dispatch], [x.reason for x in refused])
        return refused[0].reason

    def test_finds_the_block_with_a_symbolic_token_count_and_reports_its_hint(self) -> None:
        # a2a_moe under torch.compile(dynamic=True), or after T changed (automatic dynamic): T is a symbol,
        # K and E size nodes.
        b = FakeGraph()
        r = add_moe_region(b, inputs=inputs_of(symbol(b, "t", 6)), counts=counts_by_size_nodes,
                           permute=k_by_size_node)
        regions, refused = self.match(b, r)
        self.assertEqual([x.reason for x in refused], [])
        (region,) = regions
        self.assertEqual((region.x, region.topk_ids, region.output), (r.x, r.ids, r.y))
        self.assertEqual((region.top_k, region.experts_per_rank), (D.K, D.E_l))
        shape = region.block_shape()
        self.assertEqual((shape.tokens, shape.hidden, shape.top_k), (6, D.H, D.K))  # T's hint
        self.assertEqual(b.shape_env.guards, [], "one symbol for T: nothing to guard")

    def test_a_symbolic_k_is_compared_with_the_ids_width_by_its_symbol(self) -> None:
        # dynamic=True with a K that Dynamo did not specialize: ids (T, s_K), order // ids.size(1).
        b = FakeGraph()
        t, k = symbol(b, "t", 6), symbol(b, "k", 2)
        r = add_moe_region(b, inputs=inputs_of(t, t, k), router=None, counts=counts_by_size_nodes,
                           permute=k_by_size_node, scatter=scatter_k_by_size_node)
        regions, refused = self.match(b, r)
        self.assertEqual([x.reason for x in refused], [])
        self.assertEqual([x.top_k for x in regions], [2])  # the hint, for the report
        self.assertEqual(b.shape_env.guards, [])

    def test_tokens_and_ids_of_separate_symbols_match_under_a_guard_that_they_are_equal(self) -> None:
        # After a recompile Dynamo may give x, ids and scores a symbol each for one T. The ring returns x's
        # shape, so the rewrite holds only while they are equal: the match guards it (Dynamo recompiles a call
        # where they differ).
        b = FakeGraph()
        t_x, t_ids = symbol(b, "t_x", 6), symbol(b, "t_ids", 6)
        r = add_moe_region(b, inputs=inputs_of(t_x, t_ids), router=None, counts=counts_by_size_nodes)
        self.assertFalse(statically_known_true(t_x == t_ids))
        regions, refused = self.match(b, r)
        self.assertEqual(([x.reason for x in refused], len(regions)), ([], 1))
        self.assertTrue(statically_known_true(t_x == t_ids), "the match did not guard x's T == ids' T")

    def test_refuses_tokens_whose_symbolic_count_differs_from_the_ids(self) -> None:
        # x has more rows than ids (eager gathers the first T_ids of them): the ring would return x's shape.
        b = FakeGraph()
        t_x, t_ids = symbol(b, "t_x", 7), symbol(b, "t_ids", 6)
        r = add_moe_region(b, inputs=inputs_of(t_x, t_ids), router=None, counts=counts_by_size_nodes)
        self.assertEqual(self.refusal(b, r), f"tokens x have shape ({t_x}, {D.H}), not (T={t_ids}, H)")

    def test_refuses_unbacked_token_counts_not_known_equal_without_raising(self) -> None:
        # Tokens from a data-dependent op (a boolean mask): an unbacked T; ``bool(t_x == t_ids)`` would raise.
        b = FakeGraph()
        t_x, t_ids = b.shape_env.create_unbacked_symint(), b.shape_env.create_unbacked_symint()
        r = add_moe_region(b, inputs=inputs_of(t_x, t_ids), router=None, counts=counts_by_size_nodes)
        self.assertEqual(self.refusal(b, r), f"tokens x have shape ({t_x}, {D.H}), not (T={t_ids}, H)")

    def test_refuses_a_counts_exchange_of_symbolic_size(self) -> None:
        # A router gate (H, E) with a dynamic E: E_l is baked into the ring's spec, so the counts' size must be a
        # constant, never this call's hint.
        b = FakeGraph()
        r = add_moe_region(b, inputs=inputs_of(D.T, experts=symbol(b, "e", D.E)), counts=counts_by_size_nodes)
        reason = self.refusal(b, r)
        self.assertRegex(reason, r"^counts exchange exchange has symbolic shape \(.*s\d+.*\): the ring needs the "
                                 r"number of experts as a constant")


class SizeHelpers(unittest.TestCase):
    """What ``same_size`` / ``static_int`` rely on in ``torch.fx.experimental.symbolic_shapes``."""

    def setUp(self) -> None:
        self.b = FakeGraph()
        self.env = self.b.shape_env

    def test_ints_and_constant_symbols_are_static_and_symbols_are_not_guessed_from_their_hint(self) -> None:
        s = symbol(self.b, "s", 4)
        self.assertEqual((static_int(3), static_int(s * 0 + 2)), (3, 2))
        self.assertIsNone(static_int(s))
        self.assertIsNone(static_int(True))
        self.assertIsNone(static_int(self.env.create_unbacked_symint()))
        self.assertEqual(len(self.env.guards), 0, "reading a size added a guard")

    def test_same_size_is_static_where_it_can_be_and_never_raises_on_unbacked_sizes(self) -> None:
        s, u, v = symbol(self.b, "s", 4), self.env.create_unbacked_symint(), self.env.create_unbacked_symint()
        self.assertTrue(same_size(s, s) and same_size(2 * s, s + s) and same_size(u, u) and same_size(3, 3))
        self.assertFalse(same_size(u, v))  # unknown: unequal, no error, no guard
        self.assertFalse(same_size(3, True))  # bools are not sizes
        self.assertEqual(len(self.env.guards), 0)

    def test_two_backed_sizes_equal_at_this_call_are_guarded_equal(self) -> None:
        s, t, w = symbol(self.b, "s", 4), symbol(self.b, "t", 4), symbol(self.b, "w", 5)
        self.assertTrue(same_size(s, t))
        self.assertTrue(statically_known_true(s == t), "same_size(s, t) did not guard s == t")
        self.assertFalse(same_size(s, w))


if __name__ == "__main__":
    unittest.main()
