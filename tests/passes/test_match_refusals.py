"""The MoE region matcher on hand-built graphs, steps 1-4: the reference block is found; pairing, dispatch-side
and combine-side refusals give their reasons (steps 5-7: ``test_match_splits_and_experts.py``).

Every graph is the reference all-to-all block (``tests/passes/fx_graphs.py``: Dynamo's targets, fake values in
``meta["val"]``, unbacked SymInts for ``.item()``) with one step replaced; the comment of each test names the
user code that gives Dynamo that graph. Each test checks the reason's text, which node is refused, and that
``find_moe_regions`` left the graph as it was. No processes, no Dynamo: milliseconds per test.

Two checks of the matcher are asserts, not refusals, because no graph reaches them: the tokens' dtype (the
dispatch moves ``x[order // K]``, of ``x``'s dtype, and only floating-point all-to-alls are token all-to-alls),
and that F reads the token receive (F's backward slice meets the dispatch through the receive, or through a
collective it refuses first). The "stays alive after the rewrite" reason always names the dispatch: it dies
only once the receive, F, the combine and its result all do.

Legend: T tokens, H hidden, K top-k, N ranks, E experts, E_l experts per rank, P = T * K pairs.
"""

from __future__ import annotations

import collections
import operator
import traceback
import types
import unittest
import unittest.mock
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn.functional as nnf

from tests.passes.fx_graphs import (
    Dims,
    Region,
    inputs,
    moe_graph,
    router,
    score_column,
)
from tests.passes.match_case import MatchTestCase

D = Dims()  # T=6, H=8, F=4, K=2, N=2, E=4 (E_l=2)


class DispatchAndCombineRefusals(MatchTestCase):
    # --- the pattern ---------------------------------------------------------------------------------------

    def test_finds_the_reference_block_and_refuses_nothing(self) -> None:
        # relay_compile.reference.a2a_moe (abridged), compiled with capture_scalar_outputs=True.
        gm, r = moe_graph()
        regions, refused = self.match(gm)
        self.assertEqual(refused, [])
        self.assertEqual(len(regions), 1)
        (region,) = regions
        self.assertIs(region.x, r.x)
        self.assertIs(region.topk_ids, r.ids)
        self.assertIs(region.topk_scores, r.scores)
        self.assertEqual(region.weights, (r.w1, r.w2))
        self.assertEqual(region.experts_per_rank, D.E_l)
        self.assertEqual(region.top_k, D.K)
        self.assertEqual(region.group_size, D.N)
        self.assertEqual(region.group_name, "ep")
        self.assertIs(region.order, r.order)
        self.assertIs(region.output, r.y)
        self.assertEqual((region.dispatch, region.combine, region.recv, region.back), (r.dispatch, r.combine,
                                                                                      r.recv, r.back))
        self.assertIs(region.counts_exchange, r.exchange)
        self.assertEqual(region.binding.split_kind, "source")
        self.assertIsNone(region.binding.counts)  # this F does not read the counts
        self.assertFalse({r.x, r.ids, r.scores, r.w1, r.w2} & region.nodes)
        self.assertTrue({r.dispatch, r.combine, r.exchange, r.y, *r.recv_splits} <= region.nodes)

    # --- step 2: pairing -----------------------------------------------------------------------------------

    def test_refuses_a_dispatch_whose_combine_is_across_a_graph_break(self) -> None:
        # torch._dynamo.graph_break() after the dispatch (tests.models.variants.a2a_moe_graph_break): the first
        # graph ends with the receive.
        gm, r = moe_graph(experts=None, combine=None, scatter=None, outputs=lambda r: [r.recv])
        breaks = {"graph_break": collections.Counter({"moe.py:40 in dispatch: Tensor.tolist": 1})}
        with torch._dynamo.config.patch(capture_scalar_outputs=False), \
                unittest.mock.patch.dict(torch._dynamo.utils.counters, breaks):  # the hint depends on both
            reason = self.refusal(gm, r.dispatch)
        self.assertRegex(reason, r"^all_to_all dispatch has no partner in this graph \(no all_to_all with swapped "
                                 r"splits reads its result, nor is it the answer to one\)")
        self.assertIn("probably split by a graph break", reason)
        self.assertIn("compile with torch._dynamo.config.capture_scalar_outputs=True", reason)

    def test_a_lone_all_to_all_without_any_recorded_graph_break_is_not_blamed_on_one(self) -> None:
        # The same graph where Dynamo recorded no break: the block is whole, so the cause is something else.
        gm, r = moe_graph(experts=None, combine=None, scatter=None, outputs=lambda r: [r.recv])
        with unittest.mock.patch.dict(torch._dynamo.utils.counters, {"graph_break": collections.Counter()}), \
                unittest.mock.patch.object(torch._dynamo.utils, "graph_break_reasons", []):
            reason = self.refusal(gm, r.dispatch)
        self.assertIn("Dynamo counted no graph break: unless TORCH_LOGS=graph_breaks shows one", reason)
        self.assertNotIn("split by a graph break", reason)

    def test_a_split_region_names_the_likely_break_from_dynamos_config_and_recorded_breaks(self) -> None:
        # The same graph under the two other configurations: scalar outputs captured already, then also
        # data-dependent output shapes; Dynamo's recorded graph-break reasons are quoted.
        gm, r = moe_graph(experts=None, combine=None, scatter=None, outputs=lambda r: [r.recv])
        breaks = {"graph_break": collections.Counter({"moe.py:42 in dispatch: Data dependent branch": 1})}
        # Recorded breaks without a location (the counters' keys) are quoted where Dynamo kept no GraphCompileReason.
        with unittest.mock.patch.dict(torch._dynamo.utils.counters, breaks), \
                unittest.mock.patch.object(torch._dynamo.utils, "graph_break_reasons", []):
            with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=False):
                reason = self.refusal(gm, r.dispatch)
            self.assertIn("set torch._dynamo.config.capture_dynamic_output_shape_ops=True", reason)
            self.assertIn("Dynamo's latest graph breaks: moe.py:42 in dispatch: Data dependent branch", reason)
            with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
                reason = self.refusal(gm, r.dispatch)
            self.assertIn("inside the dispatcher: a Python branch on a received size", reason)
            self.assertNotIn("capture_dynamic_output_shape_ops=True", reason)

    def test_a_split_region_names_dynamos_latest_break_with_its_line_and_the_smallest_edit(self) -> None:
        # Dynamo's GraphCompileReason records (torch._dynamo.utils.graph_break_reasons) carry the user's frame.
        gm, r = moe_graph(experts=None, combine=None, scatter=None, outputs=lambda r: [r.recv])
        record = types.SimpleNamespace(reason="Data-dependent branching\n  Explanation: ...",
                                       user_stack=[traceback.FrameSummary("model.py", 7, "dispatch")])
        with unittest.mock.patch.object(torch._dynamo.utils, "graph_break_reasons", [record]):
            reason = self.refusal(gm, r.dispatch)
        self.assertIn("Dynamo's latest graph breaks: model.py:7: Data-dependent branching (edit: write the condition "
                      "with torch.fx.experimental.symbolic_shapes.guard_or_false", reason)

    def test_refuses_both_all_to_alls_when_the_combine_does_not_swap_the_splits(self) -> None:
        # all_to_all_single(out, recv_splits, send_splits, group) for the combine too (the dispatch's order).
        def combine(r: Region) -> None:
            r.combine, r.back = r.b.a2a(r.out, r.recv_splits, r.send_splits, r.group, names=("combine", "back"))

        gm, r = moe_graph(combine=combine)
        regions, refused = self.match(gm)
        self.assertEqual(regions, [])
        self.assertEqual([x.node for x in refused], [r.dispatch, r.combine])
        for x, other in zip(refused, (r.combine, r.dispatch)):
            self.assertRegex(x.reason, rf"^all_to_all {x.node.name} has no partner in this graph")
            self.assertIn(f"{other.name} answers it, but with splits that are not its swapped ones", x.reason)
            self.assertNotIn("graph break", x.reason)

    # --- step 1: collectives inside a user autograd.Function ---------------------------------------------

    @staticmethod
    def function_steps(**kwargs: bool) -> dict[str, Callable[[Region], None]]:
        """Dispatch and combine as Megatron's ``_AllToAll.apply`` (``FakeGraph.function_a2a``); ``kwargs`` shape
        the dispatch's forward body."""
        def dispatch(r: Region) -> None:
            r.dispatch, r.recv = r.b.function_a2a(r.send, r.recv_splits, r.send_splits, r.group,
                                                  names=("dispatch", "recv"), **kwargs)

        def combine(r: Region) -> None:
            r.combine, r.back = r.b.function_a2a(r.out, r.send_splits, r.recv_splits, r.group,
                                                 names=("combine", "back"))

        return {"dispatch": dispatch, "combine": combine}

    def test_finds_a_region_whose_all_to_alls_are_autograd_functions(self) -> None:
        gm, r = moe_graph(**self.function_steps())
        regions, refused = self.match(gm)
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertEqual((region.dispatch, region.recv, region.combine, region.back),
                         (r.dispatch, r.recv, r.combine, r.back))
        # The applies die with the region, and so do the get_attr nodes of their bodies.
        bodies = {a for n in (r.dispatch, r.combine) for a in n.args[:2]}
        self.assertLessEqual({r.dispatch, r.combine, *bodies}, region.nodes)

    def test_refuses_an_autograd_function_whose_forward_is_not_one_all_to_all_of_its_inputs(self) -> None:
        cases = {
            "twice": "the autograd.Function dispatch (autograd_function_apply) runs 2 all-to-alls in its forward; "
                     "one is understood",
            "split_inside": "the autograd.Function dispatch (autograd_function_apply) computes mul inside its "
                            "forward and passes it to its all-to-all all_to_all_single; only values it takes as "
                            "inputs are understood",
        }
        for kwarg, reason in cases.items():
            gm, r = moe_graph(**self.function_steps(**{kwarg: True}))
            regions, refused = self.match(gm)
            self.assertEqual(regions, [])
            self.assertIn((r.dispatch, reason), [(x.node, x.reason) for x in refused], kwarg)

    # --- step 3: the dispatch side -------------------------------------------------------------------------

    @staticmethod
    def scores_first(r: Region) -> None:
        """send = (x[order // K].float() * scores.flatten()[order][:, None]).to(x.dtype) (torchtitan's
        ``score_before_experts``; tests.models.variants.a2a_moe_scores_first without the casts)."""
        b = r.b
        r.order = b.fn(torch.argsort, b.method("flatten", r.ids), stable=True, name="order")
        rows = b.method("float", b.fn(operator.getitem, r.x, b.fn(operator.floordiv, r.order, D.K)))
        r.send = b.method("to", b.fn(operator.mul, rows, score_column(r)), torch.float32, name="send")

    def test_finds_scores_applied_before_the_experts_with_an_unweighted_combine(self) -> None:
        # y = zeros_like(x).index_add(0, order // K, back).
        def scatter(r: Region) -> None:
            token = r.b.fn(operator.floordiv, r.order, D.K)
            r.y = r.b.method("index_add", r.b.fn(torch.zeros_like, r.x), 0, token, r.back, name="y")

        gm, r = moe_graph(permute=self.scores_first, scatter=scatter)
        regions, refused = self.match(gm)
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertEqual(region.scores_applied, "before")
        self.assertEqual((region.x, region.topk_scores, region.output), (r.x, r.scores, r.y))
        self.assertIn(r.send, region.nodes)
        self.assertNotIn(r.scores, region.nodes)

    def test_refuses_scores_applied_both_before_and_after_the_experts(self) -> None:
        gm, r = moe_graph(permute=self.scores_first)  # the reference's weighted combine
        reason = self.refusal(gm, r.combine)
        self.assertEqual(reason, "the dispatch applies the scores before the experts, but no scatter_add(zeros, "
                                 "order // K, back) of the unweighted rows follows the combine (scores applied both "
                                 "before and after the experts, or another reduction)")

    def test_refuses_a_dispatch_that_does_not_send_a_row_gather_of_the_tokens(self) -> None:
        # send = torch.gather(x, 0, (order // K)[:, None].expand(-1, H)).
        def permute(r: Region) -> None:
            b = r.b
            r.order = b.fn(torch.argsort, b.method("flatten", r.ids), stable=True, name="order")
            token = b.fn(operator.getitem, b.fn(operator.floordiv, r.order, D.K), (slice(None), None))
            r.send = b.fn(torch.gather, r.x, 0, b.method("expand", token, -1, D.H), name="send")

        gm, r = moe_graph(permute=permute)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "the dispatch input send is not a row gather x[order // K] of the tokens, nor one "
                                 "times topk_scores.flatten()[order]")

    def test_refuses_a_send_gather_not_indexed_by_order_floordiv_k(self) -> None:
        # send = x.repeat_interleave(K, dim=0)[order]: the pair rows gathered from the expanded tokens.
        def permute(r: Region) -> None:
            b = r.b
            r.order = b.fn(torch.argsort, b.method("flatten", r.ids), stable=True, name="order")
            expanded = b.method("repeat_interleave", r.x, D.K, dim=0)
            r.send = b.fn(operator.getitem, expanded, r.order, name="send")

        gm, r = moe_graph(permute=permute)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "the send gather send indexes by order, not order // K")

    def test_refuses_pairs_not_sorted_by_the_flattened_expert_ids(self) -> None:
        # order = torch.argsort(ids.flatten() // E_l, stable=True): pairs sorted by owner rank only.
        def permute(r: Region) -> None:
            b = r.b
            owner = b.fn(operator.floordiv, b.method("flatten", r.ids), D.E_l)
            r.order = b.fn(torch.argsort, owner, stable=True, name="order")
            r.send = b.fn(operator.getitem, r.x, b.fn(operator.floordiv, r.order, D.K), name="send")

        gm, r = moe_graph(permute=permute)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "order is not argsort / sort of the flattened top-k expert ids")

    def test_refuses_top_k_ids_that_are_not_tokens_by_k(self) -> None:
        # The router runs on the (B, S, H) activations: ids and scores are (B, S, K), the tokens (B*S, H).
        def router_bsh(r: Region) -> None:
            b = r.b
            x_BSH = b.method("view", r.x, 2, D.T // 2, D.H)
            probs = b.fn(torch.softmax, b.fn(operator.matmul, x_BSH, r.gate), dim=-1)
            topk = b.fn(torch.topk, probs, D.K, dim=-1)
            r.scores = b.fn(operator.getitem, topk, 0, name="scores")
            r.ids = b.fn(operator.getitem, topk, 1, name="ids")

        gm, r = moe_graph(router=router_bsh)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "top-k ids ids have shape (2, 3, 2), not (T, K=2)")

    def test_refuses_tokens_that_are_not_a_matrix(self) -> None:
        # Tokens (T, 2, H/2) (two halves of the hidden state) dispatched as they are; the router and the
        # experts flatten them: F = (silu(recv.flatten(1) @ w1) @ w2).view(-1, 2, H/2).
        def three_d_inputs(r: Region) -> None:
            r.x = r.b.input("x", (D.T, 2, D.H // 2))
            inputs(r)

        def router_flat(r: Region) -> None:
            x_TH = r.x
            r.x = r.b.method("view", x_TH, D.T, D.H)
            router(r)
            r.x = x_TH

        def experts_flat(r: Region) -> None:
            b = r.b
            h = b.fn(nnf.silu, b.fn(operator.matmul, b.method("flatten", r.recv, 1), r.w1))
            r.out = b.method("view", b.fn(operator.matmul, h, r.w2), -1, 2, D.H // 2, name="out")

        def scatter_3d(r: Region) -> None:
            b = r.b
            scores_P = b.fn(operator.getitem, b.method("flatten", r.scores), r.order)
            column = b.fn(operator.getitem, scores_P, (slice(None), None, None))
            weighted = b.fn(operator.mul, r.back, column)
            token = b.fn(operator.floordiv, r.order, D.K)
            r.y = b.method("index_add", b.fn(torch.zeros_like, r.x), 0, token, weighted, name="y")

        gm, r = moe_graph(inputs=three_d_inputs, router=router_flat, experts=experts_flat, scatter=scatter_3d)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "tokens x have shape (6, 2, 4), not (T=6, H)")

    def test_refuses_top_k_ids_of_a_floating_point_type(self) -> None:
        # ids = torch.topk(probs, K)[1].to(probs.dtype) (kept in the scores' dtype, cast back to int64 only to
        # count the pairs per expert).
        def float_router(r: Region) -> None:
            router(r)
            r.ids = r.b.method("to", r.ids, torch.float32, name="ids_f")

        gm, r = moe_graph(router=float_router)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "top-k ids ids_f have dtype torch.float32, not an integer type")

    # --- step 4: the combine side --------------------------------------------------------------------------

    def test_refuses_a_combine_scatter_not_indexed_by_order_floordiv_k(self) -> None:
        # Un-sort the pairs, then sum over K: y = zeros(P, H).index_add(0, order, weighted).view(T, K, H).sum(1).
        def scatter(r: Region) -> None:
            b = r.b
            weighted = b.fn(operator.mul, r.back, score_column(r), name="weighted")
            pairs = b.method("index_add", b.fn(torch.zeros, D.T * D.K, D.H), 0, r.order, weighted, name="y_P")
            r.y = b.method("sum", b.method("view", pairs, D.T, D.K, D.H), 1, name="y")

        gm, r = moe_graph(scatter=scatter)
        reason = self.refusal(gm, r.combine)
        self.assertEqual(reason, "the combine scatter y_P does not index by order // K")

    def test_refuses_a_combine_scatter_into_something_other_than_fresh_zeros(self) -> None:
        # The residual fused into the combine: y = x.index_add(0, order // K, weighted) (x + moe(x)).
        def scatter(r: Region) -> None:
            b = r.b
            weighted = b.fn(operator.mul, r.back, score_column(r), name="weighted")
            r.y = b.method("index_add", r.x, 0, b.fn(operator.floordiv, r.order, D.K), weighted, name="y")

        gm, r = moe_graph(scatter=scatter)
        reason = self.refusal(gm, r.combine)
        self.assertEqual(reason, "the combine scatter y adds into x, not fresh zeros")

    def test_an_in_place_scatter_whose_buffer_is_returned_is_matched_with_the_buffer_as_an_alias(self) -> None:
        # y = torch.zeros_like(x); y.index_add_(0, order // K, weighted); return y (Dynamo returns the zeros
        # node, the scatter's result has no user): reads of y after the scatter take the ring's result.
        def scatter(r: Region) -> None:
            b = r.b
            weighted = b.fn(operator.mul, r.back, score_column(r), name="weighted")
            r.y = b.fn(torch.zeros_like, r.x, name="y")
            r.extra["added"] = b.method("index_add_", r.y, 0, b.fn(operator.floordiv, r.order, D.K), weighted,
                                        name="y_added")

        gm, r = moe_graph(scatter=scatter)
        regions, refused = self.match(gm)
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertIs(region.output, r.extra["added"])
        self.assertEqual(region.output_aliases, (r.y,))
        self.assertTrue({r.y, r.extra["added"]} <= region.nodes)

    def test_refuses_an_in_place_scatter_whose_buffer_is_read_before_it(self) -> None:
        # y = torch.zeros_like(x); before = y.sum(); y.index_add_(...); return y, before: the read before the
        # scatter sees zeros, which the ring's result cannot stand for.
        def scatter(r: Region) -> None:
            b = r.b
            weighted = b.fn(operator.mul, r.back, score_column(r), name="weighted")
            r.y = b.fn(torch.zeros_like, r.x, name="y")
            r.extra["before"] = b.method("sum", r.y, name="before")
            b.method("index_add_", r.y, 0, b.fn(operator.floordiv, r.order, D.K), weighted, name="y_added")

        gm, r = moe_graph(scatter=scatter, outputs=lambda r: [r.y, r.extra["before"]])
        reason = self.refusal(gm, r.combine)
        self.assertEqual(reason, "y_added scatters in place into y, which before also read(s) before the scatter or "
                                 "write(s) into; only reads after it can take the ring's result")

    def test_an_unpermuted_combine_summed_over_k_is_found_and_a_mean_over_k_is_refused(self) -> None:
        # transformers' AllToAllEP: buf = empty_like(back); buf[order] = back, or buf = back[argsort(order)];
        # then y = (buf.view(T, K, H) * scores.unsqueeze(-1)).sum(1): the scatter_add's math, found as a region.
        def unpermute(r: Region, form: str) -> fx.Node:
            b = r.b
            if form == "gather":
                return b.fn(operator.getitem, r.back, b.fn(torch.argsort, r.order))
            buf = b.fn(torch.empty_like, r.back)
            b.fn(operator.setitem, buf, r.order, r.back)
            return buf

        def combine(reduce: str, form: str) -> Callable[[Region], None]:
            def scatter(r: Region) -> None:
                b = r.b
                weights = b.method("unsqueeze", r.scores, -1)
                weighted = b.fn(operator.mul, b.method("view", unpermute(r, form), D.T, D.K, D.H), weights)
                r.y = b.method(reduce, weighted, 1, name="y")
            return scatter

        for form in ("setitem", "gather"):
            gm, r = moe_graph(scatter=combine("sum", form))
            regions, refused = self.match(gm)
            self.assertEqual((len(regions), refused), (1, []), form)
            self.assertIs(regions[0].output, r.y)
            self.assertIs(regions[0].topk_scores, r.scores)
            gm, r = moe_graph(scatter=combine("mean", form))
            self.assertEqual(self.refusal(gm, r.combine), (
                "no scatter_add(zeros, order // K, back * topk_scores.flatten()[order]) after the combine, nor "
                "buf[order] = back; (buf.view(T, K, H) * topk_scores.unsqueeze(-1)).sum(1) (scores applied elsewhere, "
                "or another reduction)"), form)

    def test_refuses_top_k_scores_not_of_the_ids_shape(self) -> None:
        # The router hands back scores as (B, S, K) (ids stay (T, K)): scores = topk[0].view(B, S, K).
        def router_bsk(r: Region) -> None:
            router(r)
            r.scores = r.b.method("view", r.scores, 2, D.T // 2, D.K, name="scores_BSK")

        gm, r = moe_graph(router=router_bsk)
        reason = self.refusal(gm, r.combine)
        self.assertEqual(reason, "top-k scores scores_BSK are not floating point of the ids' shape")

    def test_refuses_a_block_output_of_another_dtype_than_the_tokens(self) -> None:
        # bf16 tokens, combine accumulated in fp32:
        # y = torch.zeros(T, H, dtype=torch.float32).index_add(0, order // K, back.float() * scores_P[:, None]).
        def scatter(r: Region) -> None:
            b = r.b
            weighted = b.fn(operator.mul, b.method("float", r.back), score_column(r), name="weighted")
            zeros = b.fn(torch.zeros, D.T, D.H, dtype=torch.float32)
            r.y = b.method("index_add", zeros, 0, b.fn(operator.floordiv, r.order, D.K), weighted, name="y")

        gm, r = moe_graph(dtype=torch.bfloat16, scatter=scatter)
        reason = self.refusal(gm, r.combine)
        self.assertEqual(reason, "the block output y is torch.float32[6, 8], the tokens torch.bfloat16[6, 8]; the ring "
                                 "returns the tokens' type")
