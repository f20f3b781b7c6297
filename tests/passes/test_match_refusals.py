"""The MoE region matcher on hand-built graphs: the reference block is found, and each refusal reason is given.

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
import unittest
import unittest.mock
from collections.abc import Sequence

import torch
import torch.nn.functional as nnf
from torch import fx

from relay_compile.passes import MoERegion, RefusedRegion, find_moe_regions
from tests.passes.fx_graphs import (
    WAIT,
    Dims,
    FakeGraph,
    Region,
    add_moe_region,
    check_sends_all_pairs,
    exchange_counts,
    experts,
    graph_snapshot,
    inputs,
    items_of,
    local_counts,
    moe_graph,
    router,
    score_column,
    send_splits,
    slice_sums,
    summed_items,
)

D = Dims()  # T=6, H=8, F=4, K=2, N=2, E=4 (E_l=2)


class MatchRefusals(unittest.TestCase):
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
        reason = self.refusal(gm, r.dispatch)
        self.assertRegex(reason, r"^all_to_all dispatch has no partner in this graph \(no all_to_all with swapped "
                                 r"splits reads its result, nor is it the answer to one\)")
        self.assertIn("compile with torch._dynamo.config.capture_scalar_outputs=True", reason)

    def test_a_split_region_names_the_likely_break_from_dynamos_config_and_recorded_breaks(self) -> None:
        # The same graph under the two other configurations: scalar outputs captured already, then also
        # data-dependent output shapes; Dynamo's recorded graph-break reasons are quoted.
        gm, r = moe_graph(experts=None, combine=None, scatter=None, outputs=lambda r: [r.recv])
        breaks = {"graph_break": collections.Counter({"moe.py:42 in dispatch: Data dependent branch": 1})}
        with unittest.mock.patch.dict(torch._dynamo.utils.counters, breaks):
            with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=False):
                reason = self.refusal(gm, r.dispatch)
            self.assertIn("set torch._dynamo.config.capture_dynamic_output_shape_ops=True", reason)
            self.assertIn("Dynamo's latest graph breaks: moe.py:42 in dispatch: Data dependent branch", reason)
            with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
                reason = self.refusal(gm, r.dispatch)
            self.assertIn("inside the dispatcher: a Python branch on a received size", reason)
            self.assertNotIn("capture_dynamic_output_shape_ops=True", reason)

    def test_refuses_both_all_to_alls_when_the_combine_does_not_swap_the_splits(self) -> None:
        # all_to_all_single(out, recv_splits, send_splits, group) for the combine too (the dispatch's order).
        def combine(r: Region) -> None:
            r.combine, r.back = r.b.a2a(r.out, r.recv_splits, r.send_splits, r.group, names=("combine", "back"))

        gm, r = moe_graph(combine=combine)
        regions, refused = self.match(gm)
        self.assertEqual(regions, [])
        self.assertEqual([x.node for x in refused], [r.dispatch, r.combine])
        for x in refused:
            self.assertRegex(x.reason, rf"^all_to_all {x.node.name} has no partner in this graph")

    # --- step 3: the dispatch side -------------------------------------------------------------------------

    def test_refuses_scores_applied_before_the_experts(self) -> None:
        # tests.models.variants.a2a_moe_scores_first: send = x[order // K] * scores.flatten()[order][:, None];
        # y = zeros_like(x).index_add(0, order // K, back).
        def permute(r: Region) -> None:
            b = r.b
            r.order = b.fn(torch.argsort, b.method("flatten", r.ids), stable=True, name="order")
            rows = b.fn(operator.getitem, r.x, b.fn(operator.floordiv, r.order, D.K))
            r.send = b.fn(operator.mul, rows, score_column(r), name="send")

        def scatter(r: Region) -> None:
            token = r.b.fn(operator.floordiv, r.order, D.K)
            r.y = r.b.method("index_add", r.b.fn(torch.zeros_like, r.x), 0, token, r.back, name="y")

        gm, r = moe_graph(permute=permute, scatter=scatter)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "scores applied before the experts: the dispatch sends send, a product, not a row "
                                 "gather x[order // K]; the ring applies scores after F")

    def test_refuses_a_dispatch_that_does_not_send_a_row_gather_of_the_tokens(self) -> None:
        # send = torch.gather(x, 0, (order // K)[:, None].expand(-1, H)).
        def permute(r: Region) -> None:
            b = r.b
            r.order = b.fn(torch.argsort, b.method("flatten", r.ids), stable=True, name="order")
            token = b.fn(operator.getitem, b.fn(operator.floordiv, r.order, D.K), (slice(None), None))
            r.send = b.fn(torch.gather, r.x, 0, b.method("expand", token, -1, D.H), name="send")

        gm, r = moe_graph(permute=permute)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "the dispatch input send is not a row gather x[order // K] of the tokens")

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

    def test_refuses_a_combine_not_scattered_back_with_the_scores(self) -> None:
        # Un-sort with the inverse permutation, then weigh and sum over K:
        # y = (back[torch.argsort(order)].view(T, K, H) * scores[:, :, None]).sum(1).
        def scatter(r: Region) -> None:
            b = r.b
            unsorted = b.fn(operator.getitem, r.back, b.fn(torch.argsort, r.order))
            weights = b.fn(operator.getitem, r.scores, (slice(None), slice(None), None))
            weighted = b.fn(operator.mul, b.method("view", unsorted, D.T, D.K, D.H), weights)
            r.y = b.method("sum", weighted, 1, name="y")

        gm, r = moe_graph(scatter=scatter)
        reason = self.refusal(gm, r.combine)
        self.assertEqual(reason, "no scatter_add(zeros, order // K, back * topk_scores.flatten()[order]) after the "
                                 "combine (scores applied elsewhere, or another reduction)")

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

    # --- steps 2 and 5: groups, splits and the counts exchange ---------------------------------------------

    def test_refuses_a_combine_on_another_group_than_the_dispatch(self) -> None:
        # all_to_all_single(out, send_splits, recv_splits, other_group): the combine on another process group.
        def combine(r: Region) -> None:
            r.combine, r.back = r.b.a2a(r.out, r.send_splits, r.recv_splits, "ep_other", names=("combine", "back"))

        gm, r = moe_graph(combine=combine)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "group names of dispatch and combine are not one constant string")

    def test_refuses_a_counts_exchange_on_another_group_than_the_tokens(self) -> None:
        # The counts all-to-all on the world group, the tokens on the EP group.
        gm, r = moe_graph(counts_group="world")
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "counts exchange exchange runs on group 'world', the tokens on 'ep'")

    def test_refuses_split_lists_of_different_lengths(self) -> None:
        # A direct op call with an empty receive split list (funcol.all_to_all_single never emits one):
        # torch.ops._c10d_functional.all_to_all_single(send, [], send_splits, group), and the combine answers it
        # with (out, send_splits, []). The fake receive has 0 rows; the program is wrong at run time.
        def dispatch(r: Region) -> None:
            r.dispatch, r.recv = r.b.a2a(r.send, [], r.send_splits, r.group, names=("dispatch", "recv"))

        def combine(r: Region) -> None:
            r.combine, r.back = r.b.a2a(r.out, r.send_splits, [], r.group, names=("combine", "back"))

        gm, r = moe_graph(dispatch=dispatch, combine=combine)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "split lists of dispatch have lengths 0, 2")

    def test_refuses_receive_splits_that_are_not_host_reads(self) -> None:
        # Capacity-padded dispatch: all_to_all_single(send, [C] * N, [C] * N, group), C = T * K / N constant.
        capacity = [D.T * D.K // D.N] * D.N

        def dispatch(r: Region) -> None:
            r.dispatch, r.recv = r.b.a2a(r.send, capacity, capacity, r.group, names=("dispatch", "recv"))

        def combine(r: Region) -> None:
            r.combine, r.back = r.b.a2a(r.out, capacity, capacity, r.group, names=("combine", "back"))

        gm, r = moe_graph(counts=None, dispatch=dispatch, combine=combine)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "receive split 0 of dispatch (6) is not a host read (.item()) of the exchanged "
                                 "counts in this graph (compile with torch._dynamo.config.capture_scalar_outputs=True "
                                 "so .tolist() of the splits stays in the graph)")

    def test_refuses_receive_splits_adding_up_different_numbers_of_counts(self) -> None:
        # recv_splits = [counts[0].sum().item(), counts[1, 0].item() + counts[1, 1].item()].
        def counts(r: Region) -> None:
            exchange_counts(r)
            b = r.b
            first = b.item(b.fn(operator.getitem, b.method("sum", r.counts, 1), 0))
            parts = [b.item(b.fn(operator.getitem, r.counts, (1, e))) for e in range(D.E_l)]
            r.recv_splits = [first, b.fn(operator.add, *parts)]

        gm, r = moe_graph(counts=counts)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "receive splits of dispatch add up different numbers of SymInts {1, 2}")

    def test_refuses_receive_splits_not_read_from_one_counts_exchange(self) -> None:
        # No counts exchange: recv_splits = send_splits (symmetric routing assumed), read from the local counts.
        def counts(r: Region) -> None:
            r.counts_E = local_counts(r)
            r.send_splits = r.recv_splits = send_splits(r)
            check_sends_all_pairs(r)

        gm, r = moe_graph(counts=counts)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "receive splits of dispatch come from 0 integer collectives, not one counts exchange")

    def test_refuses_a_counts_exchange_with_unequal_splits(self) -> None:
        # Rank 0 of 2 hosts expert 0, rank 1 experts 1-3: all_to_all_single(counts_E, [1, 1], [1, 3], group);
        # send_splits = [counts_E[:1].sum().item(), counts_E[1:].sum().item()].
        def counts(r: Region) -> None:
            b = r.b
            r.counts_E = local_counts(r)
            r.exchange, wait = b.a2a(r.counts_E, [1, 1], [1, 3], r.group, names=("exchange", None))
            r.counts = b.method("view", wait, D.N, -1, name="counts")
            r.send_splits = slice_sums(r, r.counts_E, [0, 1, 4])
            r.recv_splits = items_of(r, b.method("sum", r.counts, 1))
            check_sends_all_pairs(r)

        gm, r = moe_graph(counts=counts)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "counts exchange exchange has splits [1, 3], not equal constants: experts are not "
                                 "placed contiguously (expert e on rank e // E_l)")

    def test_refuses_a_counts_exchange_not_of_e_l_counts_per_rank_pair(self) -> None:
        # 3 experts on 2 ranks (rank 0 hosts experts 0 and 1), counts all-gathered Megatron-style:
        # gathered = all_gather_into_tensor(counts_E, N, group).view(N, E); recv_splits from gathered[:, :2].
        dims = Dims(E=3)

        def counts(r: Region) -> None:
            b = r.b
            r.counts_E = local_counts(r)
            r.exchange = b.fn(torch.ops._c10d_functional.all_gather_into_tensor, r.counts_E, D.N, r.group,
                              name="exchange")
            gathered = b.method("view", b.fn(WAIT, r.exchange), D.N, dims.E)
            mine = b.method("sum", b.fn(operator.getitem, gathered, (slice(None), slice(0, 2))), 1)
            r.recv_splits = items_of(r, mine)
            r.send_splits = slice_sums(r, r.counts_E, [0, 2, 3])
            check_sends_all_pairs(r)

        gm, r = moe_graph(dims=dims, counts=counts)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "counts exchange exchange holds 6 counts, not E_l per rank pair")

    def test_refuses_per_expert_splits_that_read_the_counts_expert_major(self) -> None:
        # recv_splits[s] = sum(flat[e * N + s].item() for e in range(E_l)): the received (N * E_l,) counts read
        # as if they were (E_l, N).
        def counts(r: Region) -> None:
            b = r.b
            r.counts_E = local_counts(r)
            r.exchange, flat = b.a2a(r.counts_E, [D.E_l] * D.N, [D.E_l] * D.N, r.group, names=("exchange", "flat"))
            r.send_splits = send_splits(r)
            r.recv_splits = [
                summed_items(r, flat, [e * D.N + s for e in range(D.E_l)], name="flat_item") for s in range(D.N)
            ]
            check_sends_all_pairs(r)

        gm, r = moe_graph(counts=counts)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "receive split SymInt flat_item2 reads counts element 2, not (source 0, expert 1)")

    def test_refuses_splits_adding_up_neither_one_nor_e_l_counts(self) -> None:
        # Counts and dropped-token counts per expert in one all-to-all (one collective less):
        # both = torch.cat([counts_E.view(N, E_l), dropped_E.view(N, E_l)], 1).flatten(), exchanged in blocks of
        # 2 * E_l; recv_splits[s] = sum of the E_l counts of source s's block.
        def counts(r: Region) -> None:
            b = r.b
            r.counts_E = local_counts(r)
            dropped = b.fn(operator.sub, r.counts_E, b.method("clamp", r.counts_E, max=3))
            both = b.method("flatten", b.fn(torch.cat, [b.method("view", r.counts_E, D.N, D.E_l),
                                                        b.method("view", dropped, D.N, D.E_l)], 1))
            block = 2 * D.E_l
            r.exchange, received = b.a2a(both, [block] * D.N, [block] * D.N, r.group, names=("exchange", None))
            r.send_splits = send_splits(r)
            r.recv_splits = [summed_items(r, received, range(s * block, s * block + D.E_l)) for s in range(D.N)]
            check_sends_all_pairs(r)

        gm, r = moe_graph(counts=counts)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "receive splits of dispatch add up 2 SymInts each; expected 1 (per source) or E_l=4 "
                                 "(per source and expert)")

    def test_refuses_a_router_whose_expert_count_disagrees_with_the_counts_exchange(self) -> None:
        # Only per-rank totals exchanged (what the splits need): totals = counts_E.view(N, -1).sum(1);
        # all_to_all_single(totals, [1] * N, [1] * N, group); the router picks among E = 4 experts.
        def counts(r: Region) -> None:
            b = r.b
            r.counts_E = local_counts(r)
            totals = b.method("sum", b.method("view", r.counts_E, D.N, -1), 1)
            r.exchange, received = b.a2a(totals, [1] * D.N, [1] * D.N, r.group, names=("exchange", None))
            r.send_splits = items_of(r, totals)
            r.recv_splits = items_of(r, received)
            check_sends_all_pairs(r)

        gm, r = moe_graph(counts=counts)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "the router picks among 4 experts but the counts exchange exchange implies 1 per rank "
                                 "on 2 ranks")

    # --- step 6: what F reads ------------------------------------------------------------------------------

    def test_refuses_experts_that_read_the_tokens(self) -> None:
        # tests.models.variants.a2a_moe_experts_read_tokens: F(recv + x.mean(0)).
        def experts_read_x(r: Region) -> None:
            b = r.b
            shifted = b.fn(operator.add, r.recv, b.method("mean", r.x, 0))
            h = b.fn(nnf.silu, b.fn(operator.matmul, shifted, r.w1))
            r.out = b.fn(operator.matmul, h, r.w2, name="out")

        gm, r = moe_graph(experts=experts_read_x)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "F reads x (placeholder x), which also feeds the dispatch (tokens or routing); only "
                                 "expert weights may enter F from outside")

    def test_refuses_experts_that_read_a_non_tensor_input(self) -> None:
        # F scales by an int argument compiled dynamic (a SymInt placeholder): (silu(recv @ w1) @ w2) * alpha.
        def inputs_alpha(r: Region) -> None:
            inputs(r)
            r.extra["alpha"] = r.b.int_input("alpha", 3)

        def experts_alpha(r: Region) -> None:
            experts(r)
            r.out = r.b.fn(operator.mul, r.out, r.extra["alpha"], name="scaled")

        gm, r = moe_graph(inputs=inputs_alpha, experts=experts_alpha)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "F reads alpha (placeholder alpha), which is neither a tensor nor a split size of the "
                                 "receive")

    def test_refuses_experts_that_read_another_collective(self) -> None:
        # Tensor-parallel experts: out = wait_tensor(all_reduce(silu(recv @ w1) @ w2, "sum", tp_group)).
        def experts_tp(r: Region) -> None:
            experts(r)
            reduced = r.b.fn(torch.ops._c10d_functional.all_reduce, r.out, "sum", "tp")
            r.out = r.b.fn(WAIT, reduced, name="reduced")

        gm, r = moe_graph(experts=experts_tp)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "F reads reduced (call_function _c10d_functional::wait_tensor), a collective that is "
                                 "neither the token receive nor the counts exchange")

    def test_refuses_an_in_place_write_into_the_experts_values_from_outside(self) -> None:
        # h = recv @ w1; act = h.relu_(); out = h @ w2; return y, act (the in-place result kept as an output).
        def experts_relu_(r: Region) -> None:
            b = r.b
            h = b.fn(operator.matmul, r.recv, r.w1, name="h")
            r.extra["act"] = b.method("relu_", h, name="act")
            r.out = b.fn(operator.matmul, h, r.w2, name="out")

        gm, r = moe_graph(experts=experts_relu_, outputs=lambda r: [r.y, r.extra["act"]])
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "act (call_method relu_) writes into F's h from outside the region")

    # --- step 7: what dies ---------------------------------------------------------------------------------

    def test_refuses_a_region_whose_receive_is_used_outside_it(self) -> None:
        # An auxiliary statistic of the received rows returned with y: return y, recv.pow(2).mean().
        def outputs(r: Region) -> Sequence[fx.Node]:
            return [r.y, r.b.method("mean", r.b.method("pow", r.recv, 2), name="aux")]

        gm, r = moe_graph(outputs=outputs)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "the dispatch dispatch stays alive after the rewrite (a value of the region is used "
                                 "outside it; users: recv)")

    def test_refuses_experts_whose_values_are_used_outside_the_region(self) -> None:
        # F adds a per-expert bias, finding each received row's expert from the counts as the reference does
        # (repeat_interleave(arange(N * E_l) % E_l, counts.flatten())); counts (a view in F) also feeds the
        # load statistics returned with y: return y, counts.sum(0).
        def inputs_bias(r: Region) -> None:
            inputs(r)
            r.extra["bias"] = r.b.input("bias", (D.E_l, D.H))

        def experts_bias(r: Region) -> None:
            b = r.b
            experts(r)
            block_expert = b.fn(operator.mod, b.fn(torch.arange, D.N * D.E_l), D.E_l)
            rows = b.fn(torch.sym_sum, r.recv_splits)
            expert_of_row = b.fn(torch.repeat_interleave, block_expert, b.method("flatten", r.counts),
                                 output_size=rows)
            bias_rows = b.fn(operator.getitem, r.extra["bias"], expert_of_row)
            r.out = b.fn(operator.add, r.out, bias_rows, name="out_biased")

        def outputs(r: Region) -> Sequence[fx.Node]:
            return [r.y, r.b.method("sum", r.counts, 0, name="load")]

        gm, r = moe_graph(inputs=inputs_bias, experts=experts_bias, outputs=outputs)
        reason = self.refusal(gm, r.dispatch)
        self.assertEqual(reason, "F's counts is used outside the region")

    # --- several regions -----------------------------------------------------------------------------------

    def test_refuses_a_region_sharing_dying_nodes_with_an_earlier_one(self) -> None:
        # Two blocks in a row (x1 = moe0(x0); y = moe1(x1)) and a check across them:
        # torch._check(sum(recv_splits_0) == sum(recv_splits_1)) dies with either region.
        b = FakeGraph()
        first = add_moe_region(b)
        second = add_moe_region(b, x=first.y)
        rows = [b.fn(torch.sym_sum, r.recv_splits, name=f"rows{i}") for i, r in enumerate((first, second))]
        b.check(b.fn(operator.eq, *rows, name="same_rows"))
        gm = b.module([second.y])
        regions, refused = self.match(gm)
        self.assertEqual([region.dispatch for region in regions], [first.dispatch])
        self.assertEqual(len(refused), 1)
        self.assertIs(refused[0].node, second.dispatch)
        self.assertEqual(refused[0].reason, "shares ['_assert_scalar_default_10', 'rows0', 'rows1', 'same_rows'] with "
                                            "an earlier region")


if __name__ == "__main__":
    unittest.main()
