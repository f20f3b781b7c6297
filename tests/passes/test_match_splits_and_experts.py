"""The MoE region matcher on hand-built graphs, steps 5-7: split sizes and the counts exchange, what F reads,
what dies, and several regions in one graph (steps 1-4: ``test_match_refusals.py``, whose docstring says how
the graphs are built and checked).

Legend: T tokens, H hidden, K top-k, N ranks, E experts, E_l experts per rank, P = T * K pairs.
"""

from __future__ import annotations

import operator
import unittest
import unittest.mock
from collections.abc import Sequence

import torch
import torch.nn.functional as nnf
from torch import fx

from tests.passes.fx_graphs import (
    WAIT,
    Dims,
    FakeGraph,
    Region,
    add_moe_region,
    check_sends_all_pairs,
    exchange_counts,
    experts,
    inputs,
    items_of,
    local_counts,
    moe_graph,
    send_splits,
    slice_sums,
    summed_items,
)
from tests.passes.match_case import MatchTestCase

D = Dims()  # T=6, H=8, F=4, K=2, N=2, E=4 (E_l=2)


class SplitsExpertsAndLivenessRefusals(MatchTestCase):
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
