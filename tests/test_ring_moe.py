"""``ring_moe`` against the all-to-all reference layer on real gloo process groups.

Every rank runs the same cases; inputs depend on the rank, weights are slices of one seeded set, and the
expectation is ``a2a_moe`` run on the same group (itself checked against a dense loop in test_reference.py).
fp32 cases hold to 1e-5 relative: ring and a2a run the same per-pair math, only summation orders differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import unittest
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.utils._python_dispatch import TorchDispatchMode

from relay_compile import RingInputError, ring_moe, ring_moe_experts
from relay_compile.experts import GroupedFFN, expert_ffn
from relay_compile.reference import a2a_moe, dense_moe, moe_weights
from relay_compile.runtime import chunk_graphs, equal_groups
from relay_compile.runtime.programs import pipeline
from tests.distributed import DistributedTestCase

H, F, K = 16, 8, 3
# Router outputs the ring is tested under (``routed_inputs``): random and adversarial assignments.
ROUTER_CASES = ("random", "one_expert", "one_rank", "duplicates", "uneven", "halves")


def routed_inputs(case: str, rank: int, world: int, num_experts: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """``x (T, H)``, ``topk_ids (T, K)``, ``topk_scores (T, K)`` of one routing case on one rank."""
    gen = torch.Generator().manual_seed(seed * 97 + rank)
    tokens = 7 + 5 * rank if case == "uneven" else 12
    if case == "many":  # hops of 36-72 rows: chunk programs pad them to even row counts
        tokens = 47 + rank
    if case == "halves":  # equal counts within each half of the ranks: token routing's neighbours differ in sizes
        tokens = 12 if rank < world // 2 else 7
    x = torch.randn(tokens, H, generator=gen)
    scores = torch.rand(tokens, K, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(tokens)])
    if case == "one_expert":  # every token's first choice is the last expert: one hop gets all of them
        ids = torch.stack([torch.tensor([num_experts - 1, *range(K - 1)]) for _ in range(tokens)])
    elif case == "one_rank":  # only rank 0's experts: every other hop is empty
        e_l = num_experts // world
        ids = torch.randint(0, e_l, (tokens, K), generator=gen)
    elif case == "duplicates":  # all K slots on one expert: a token repeats inside one segment
        ids = torch.full((tokens, K), num_experts // 2)
    return x, ids, scores


def local_weights(rank: int, e_l: int, world: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    w = moe_weights(0, H, F, e_l * world, experts=range(rank * e_l, (rank + 1) * e_l), dtype=dtype)
    return [w["w1"], w["w2"], w["w3"]]


def plain_ffn(x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights) -> Tensor:
    """The FFN as an expert function without a fused ``vjp``: the ring differentiates it with autograd."""
    return expert_ffn(x_SH, counts_NL.sum(0), *weights)


def ring_with_plain_ffn(x, ids, scores, *weights, **kw) -> Tensor:
    return ring_moe_experts(x, ids, scores, weights, expert_fn=plain_ffn, experts_per_rank=weights[0].shape[0], **kw)


@contextlib.contextmanager
def projections_read() -> Iterator[list[bool]]:
    """Within: per fused backward chunk (``GroupedFFN.vjp_rows``), whether it was given saved projections."""
    given: list[bool] = []
    real = GroupedFFN.vjp_rows

    def spy(fn, *args, **kw):
        given.append(kw.get("projections") is not None)
        return real(fn, *args, **kw)

    with mock.patch.object(GroupedFFN, "vjp_rows", spy):
        yield given


def assert_close_rel(got: Tensor, want: Tensor, rel: float, msg: str = "") -> None:
    """Elementwise within ``rel`` of the tensor's scale: entries near zero carry the rounding of the large ones."""
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * scale, msg=(lambda m: f"{msg}: {m}") if msg else None)


def forward_backward(fn, x: Tensor, ids: Tensor, scores: Tensor, weights: list[Tensor], grad_seed: int, **kw):
    """Output and gradients to ``(x, scores, *weights)`` of ``fn``, for a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, scores, *weights)]
    y = fn(leaves[0], ids, leaves[1], *leaves[2:], **kw)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y.dtype)
    return [y.detach(), *torch.autograd.grad(y, leaves, grad_y)]


class RingMoEMatchesAllToAll(DistributedTestCase):
    e_l = 2

    def assert_matches_a2a(self, case: str, ring=ring_moe, **ring_kw) -> None:
        world = dist.get_world_size()
        x, ids, scores = routed_inputs(case, self.rank, world, self.e_l * world, seed=len(case))
        weights = local_weights(self.rank, self.e_l, world)
        want = forward_backward(a2a_moe, x, ids, scores, weights, self.rank)
        got = forward_backward(ring, x, ids, scores, weights, self.rank, **ring_kw)
        for name, g, w in zip(("y", "dx", "d_scores", "dw1", "dw2", "dw3"), got, want, strict=True):
            assert_close_rel(g, w, 1e-5, f"{case} {ring_kw} {name}")

    def test_both_routings_match_a2a_for_every_routing_case_overlap_on_and_off(self) -> None:
        self.init_pg()
        for routing in ("expert", "token"):
            for case in ROUTER_CASES:
                for overlap in (True, False):
                    self.assert_matches_a2a(case, routing=routing, overlap=overlap)

    def test_bounded_hops_replay_sgd_steps_and_bf16_match_a2a(self) -> None:
        self.init_pg()
        for routing in ("expert", "token"):
            for case in ("random", "one_expert", "one_rank"):
                # Chunks pack whole experts up to 5 rows and cut larger ones (one_expert: 12 rows) in pieces.
                self.assert_matches_a2a(case, routing=routing, max_hop_rows=5)
                self.assert_matches_a2a(case, routing=routing, remat=False, max_hop_rows=7)
                # Any expert function: differentiated by autograd per chunk instead of the FFN's fused vjp.
                self.assert_matches_a2a(case, ring=ring_with_plain_ffn, routing=routing, max_hop_rows=5)
        self.check_sgd_steps_track_a2a()
        self.check_bf16_matches_a2a_to_bf16_rounding()

    def test_padded_chunks_through_chunk_programs_match_a2a(self) -> None:
        # chunk_graphs=True on the CPU: padded chunks run their static-shape programs eagerly (no capture).
        self.init_pg()
        before = chunk_graphs.runs()
        for case in (*ROUTER_CASES, "many"):
            for overlap in (True, False):
                self.assert_matches_a2a(case, routing="expert", overlap=overlap, chunk_graphs=True)
        self.assertGreater(chunk_graphs.runs(), before, "no chunk ran through a program")
        self.assert_matches_a2a("many", routing="expert", chunk_graphs=True, max_hop_rows=33)
        self.assert_matches_a2a("many", routing="expert", chunk_graphs=True, remat=False)
        self.assert_matches_a2a("random", routing="token", chunk_graphs=True)

    def test_backward_chunks_padded_to_equal_groups_match_a2a(self) -> None:
        # CUDA pads a backward chunk's experts to equal rows (runtime.equal_groups); here on the CPU, every chunk
        # of two or more experts padded however unequal (the divisor 1 allows as many padding rows as rows).
        self.init_pg()
        planned = []
        real_plan = equal_groups.EqualGroups.plan

        def plan(*args):
            planned.append(real_plan(*args))
            return planned[-1]

        with mock.patch.object(equal_groups, "applies", return_value=True), \
                mock.patch.object(equal_groups, "MAX_PAD_DIVISOR", 1), \
                mock.patch.object(equal_groups.EqualGroups, "plan", plan):
            for case in ROUTER_CASES:
                for overlap in (True, False):
                    self.assert_matches_a2a(case, routing="expert", overlap=overlap)
                self.assert_matches_a2a(case, routing="expert", max_hop_rows=5)
            self.assert_matches_a2a("random", routing="expert", remat=False)  # runs no chunk padded
            self.check_bf16_matches_a2a_to_bf16_rounding()
            self.assertTrue(any(p is not None and p.used for p in planned), "no backward chunk ran padded")
            # Beside saved projections: a padded chunk reads its rows' projections (gathered into its padded
            # layout; padding rows take a real pair's, times score 0) instead of recomputing them.
            planned.clear()
            writable: list[bool] = []  # per chunk given projections: they are its own copy (a padded gather)
            with projections_read() as given:
                spied = GroupedFFN.vjp_rows

                def vjp_rows(fn, *args, **kw):
                    writable.append(kw.get("projections_writable", False))
                    return spied(fn, *args, **kw)

                with mock.patch.object(GroupedFFN, "vjp_rows", vjp_rows):
                    for case in ROUTER_CASES:
                        self.assert_matches_a2a(case, routing="expert", save_projections=True)
                    self.assert_matches_a2a("random", routing="expert", save_projections=True, max_hop_rows=5)
            self.assertTrue(given and all(given), "a backward chunk recomputed its projections")
            self.assertTrue(any(writable) and not all(writable), writable)  # padded chunks' only
        self.assertTrue(any(p is not None and p.used for p in planned), "no chunk ran padded beside projections")

    def test_saved_projections_match_a2a_and_replace_the_recompute(self) -> None:
        # save_projections=True: the forward keeps every pair's first projection and the backward reads it
        # (vjp_rows gets them) instead of recomputing it; the same results as a2a. A rank that cannot save (its
        # option False) makes no rank save; token routing has nothing to save.
        self.init_pg()
        with projections_read() as given:
            for case in ROUTER_CASES:
                for overlap in (True, False):
                    self.assert_matches_a2a(case, routing="expert", overlap=overlap, save_projections=True)
                self.assert_matches_a2a(case, routing="expert", max_hop_rows=5, save_projections=True)
            self.assertTrue(given and all(given), "a backward chunk recomputed its projections")
            given.clear()
            self.assert_matches_a2a("random", routing="expert", remat=False, save_projections=True)
            self.assert_matches_a2a("random", routing="expert", save_projections=self.rank == 0)
            self.assert_matches_a2a("random", routing="token", save_projections=True)
            self.assertFalse(any(given), "projections read where not every rank saved them")
            self.check_sgd_steps_track_a2a(save_projections=True)
        self.assertTrue(any(given), "the expert ring's steps read no saved projections")
        self.check_every_rank_that_chose_to_save_saves()

    def check_every_rank_that_chose_to_save_saves(self) -> None:
        # save_projections="auto": each rank decides before the call (saving_op at its own shapes, here: patched to
        # save) and holds the buffer; the group's agreement (the cost model on "CUDA") then saves wherever the
        # expert ring runs, although at these tiny shapes the model itself would not (the saved ring's peak is above
        # the all-to-all's): deciding again could only leave every rank's buffer unused.
        from relay_compile.runtime import decision

        real_execution = decision.decide

        def on_cuda(asked, ring, cuda, *args):
            return real_execution(asked, ring, True, *args)

        with projections_read() as given, mock.patch("relay_compile.ring_moe.call_saves", return_value=True), \
                mock.patch.object(decision, "decide", on_cuda):
            forced = functools.partial(ring_moe, ring="always")
            self.assert_matches_a2a("random", forced, routing="expert", save_projections="auto")
        self.assertTrue(given and all(given), "a rank's saving op was not given its projections back")

    def check_sgd_steps_track_a2a(self, **ring_kw) -> None:
        # Weights updated from the ring's gradients stay with those updated from a2a's, step after step.
        world = dist.get_world_size()
        for routing in ("expert", "token"):
            w_ring = local_weights(self.rank, self.e_l, world)
            w_a2a = [w.clone() for w in w_ring]
            for step in range(3):
                x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=step)
                got = forward_backward(ring_moe, x, ids, scores, w_ring, step, routing=routing, **ring_kw)
                want = forward_backward(a2a_moe, x, ids, scores, w_a2a, step)
                assert_close_rel(got[0], want[0], 1e-5, f"{routing} step {step}")
                w_ring = [w - 0.1 * g for w, g in zip(w_ring, got[3:])]
                w_a2a = [w - 0.1 * g for w, g in zip(w_a2a, want[3:])]
            for a, b in zip(w_ring, w_a2a):
                assert_close_rel(a, b, 1e-5, routing)

    def check_bf16_matches_a2a_to_bf16_rounding(self) -> None:
        # Weight gradients: the ring sums per-source bf16 partials where a2a sums inside one GEMM.
        world = dist.get_world_size()
        x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=5)
        weights = local_weights(self.rank, self.e_l, world, torch.bfloat16)
        x, scores = x.bfloat16(), scores.bfloat16()
        want = forward_backward(a2a_moe, x, ids, scores, weights, 0)
        for routing in ("expert", "token"):
            got = forward_backward(ring_moe, x, ids, scores, weights, 0, routing=routing)
            for g, w in zip(got, want):
                self.assertEqual(g.dtype, torch.bfloat16)
                assert_close_rel(g, w, 2e-2, routing)

    def test_bad_inputs_raise_on_every_rank_without_hanging(self) -> None:
        self.init_pg()
        self.check_bad_expert_ids_on_one_rank()
        self.check_weights_of_different_shapes_across_ranks()

    def check_bad_expert_ids_on_one_rank(self) -> None:
        world = dist.get_world_size()
        x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=1)
        weights = local_weights(self.rank, self.e_l, world)
        if self.rank == world - 1:
            ids[0, 0] = self.e_l * world
        for routing in ("expert", "token"):
            mine = "outside" if self.rank == world - 1 else "another rank"
            with self.assertRaisesRegex(RingInputError, mine):
                ring_moe(x, ids, scores, *weights, routing=routing)
        # The group is still usable: nothing was left posted.
        ids[0, 0] = 0
        ring_moe(x, ids, scores, *weights, routing="expert")

    def check_weights_of_different_shapes_across_ranks(self) -> None:
        world = dist.get_world_size()
        x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=1)
        wide = F + 4 * (self.rank == 0)
        w = moe_weights(0, H, wide, self.e_l * world, experts=range(self.rank * self.e_l, (self.rank + 1) * self.e_l))
        with self.assertRaisesRegex(ValueError, "weight shapes .* differ from rank"):
            ring_moe(x, ids, scores, w["w1"], w["w2"], w["w3"], routing="expert", max_hop_rows=3)


class RingMoEOnOneProcess(TestCase):
    """World size 1 (no process group): one hop, no communication; and the ops under torch.compile."""

    def test_matches_the_dense_loop_without_a_process_group_for_every_routing_case_and_scores_placement(self) -> None:
        weights = local_weights(0, 4, 1)
        for case in ROUTER_CASES:
            x, ids, scores = routed_inputs(case, 0, 1, 4, seed=3)
            for scores_applied in ("after", "before"):
                want = forward_backward(dense_moe, x, ids, scores, weights, 0, scores_applied=scores_applied)
                for routing in ("expert", "token"):
                    got = forward_backward(ring_moe, x, ids, scores, weights, 0, routing=routing, max_hop_rows=5,
                                           scores_applied=scores_applied)
                    for name, g, w in zip(("y", "dx", "d_scores", "dw1", "dw2", "dw3"), got, want, strict=True):
                        assert_close_rel(g, w, 1e-5, f"{case} {routing} scores {scores_applied} {name}")

    def test_saved_projections_are_the_only_buffer_of_their_size_forward_and_backward(self) -> None:
        # The saving op's projections (T*K, 2F) are made once; autograd hands their (non-differentiable) output
        # no zero gradient of that size in the backward, and the backward makes none either.
        weights = local_weights(0, 4, 1)
        x, ids, scores = routed_inputs("random", 0, 1, 4, seed=4)
        size = ids.numel() * 2 * F
        made: list[str] = []

        class Allocations(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                made.extend(str(func) for o in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(o, Tensor) and o.numel() == size)
                return out

        leaves = [t.clone().requires_grad_() for t in (x, scores, *weights)]
        with Allocations():
            y = ring_moe(leaves[0], ids, leaves[1], *leaves[2:], routing="expert", save_projections=True,
                         max_hop_rows=None)
            y.sum().backward()
        self.assertEqual(made, ["relaymoe.ring_moe_saving.default"])

    def test_compiles_into_one_graph_with_aot_autograd_and_matches_eager(self) -> None:
        weights = local_weights(0, 4, 1)
        x, ids, scores = routed_inputs("random", 0, 1, 4, seed=4)

        def block(x, ids, scores, w1, w2, w3):
            return torch.relu(ring_moe(x * 2, ids, scores, w1, w2, w3)) - x

        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        for g, w in zip(forward_backward(compiled, x, ids, scores, weights, 0),
                        forward_backward(block, x, ids, scores, weights, 0), strict=True):
            assert_close_rel(g, w, 1e-6)

        def saving(x, ids, scores, w1, w2, w3):  # the saving op traced: its projections go to the backward only
            return torch.relu(ring_moe(x * 2, ids, scores, w1, w2, w3, save_projections=True)) - x

        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm.code)
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(saving, backend=capture, fullgraph=True)
        for g, w in zip(forward_backward(compiled, x, ids, scores, weights, 0),
                        forward_backward(block, x, ids, scores, weights, 0), strict=True):
            assert_close_rel(g, w, 1e-6)
        self.assertIn("relaymoe.ring_moe_saving", graphs[0])

    def test_any_expert_function_compiles_with_its_spec_registered_while_tracing(self) -> None:
        # A spec no eager call registered first: registering it as a traced side effect would come only after
        # the compiled graph's first run, which looks it up.
        weights = local_weights(0, 4, 1)
        x, ids, scores = routed_inputs("random", 0, 1, 4, seed=5)
        for name in ("compiled_fresh_name", None):
            def block(x, ids, scores, w1, w2, w3, name=name):
                return ring_moe_experts(x, ids, scores, [w1, w2, w3], expert_fn=plain_ffn, experts_per_rank=4,
                                        name=name, routing="token", max_hop_rows=7)

            compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
            for g, w in zip(forward_backward(compiled, x, ids, scores, weights, 0),
                            forward_backward(block, x, ids, scores, weights, 0), strict=True):
                assert_close_rel(g, w, 1e-6, f"name={name}")

    def test_bad_arguments_name_the_argument(self) -> None:
        w1, w2, w3 = local_weights(0, 4, 1)
        x, ids, scores = routed_inputs("random", 0, 1, 4, seed=4)
        cases = [
            (dict(x=x[None]), r"x must be \(T, H\)"),
            (dict(ids=ids.float()), "topk_ids must hold integer expert ids"),
            (dict(scores=scores[:, :1]), "topk_scores must have topk_ids' shape"),
            (dict(w2=w2.transpose(1, 2)), r"w2 must be \(E_local, H, F\)"),
            (dict(w3=None), "w3 is needed by swiglu"),
            (dict(w1=w1.double()), "w1 is torch.float64 on cpu but x is torch.float32"),
            (dict(routing="ring"), r"routing='ring' is not one of \('auto', 'expert', 'token'\)"),
            (dict(max_hop_rows=0), "max_hop_rows must be a positive row count"),
            (dict(scores_applied="inside"), r"scores_applied='inside' is not one of \('after', 'before'\)"),
        ]
        for change, message in cases:
            args = dict(x=x, ids=ids, scores=scores, w1=w1, w2=w2, w3=w3, routing="auto", max_hop_rows=None,
                        scores_applied="after") | change
            with self.assertRaisesRegex(ValueError, message):
                ring_moe(args["x"], args["ids"], args["scores"], args["w1"], args["w2"], args["w3"],
                         routing=args["routing"], max_hop_rows=args["max_hop_rows"],
                         scores_applied=args["scores_applied"])
        ids_bad = ids.clone()
        ids_bad[3, 1] = 4
        with self.assertRaisesRegex(RingInputError, r"expert ids outside \[0, 4\) on rank 0"):
            ring_moe(x, ids_bad, scores, w1, w2, w3)

    def test_a_group_that_is_not_one_is_named(self) -> None:
        w1, w2, w3 = local_weights(0, 4, 1)
        x, ids, scores = routed_inputs("random", 0, 1, 4, seed=4)
        with self.assertRaisesRegex(ValueError, r"group='' names no process group; pass None"):
            ring_moe(x, ids, scores, w1, w2, w3, group="")
        # What dist.new_group returns on ranks outside the new group (GroupMember.NON_GROUP_MEMBER).
        with self.assertRaisesRegex(ValueError, r"group=-100 is not a process group .* only on the group's ranks"):
            ring_moe(x, ids, scores, w1, w2, w3, group=dist.GroupMember.NON_GROUP_MEMBER)


class RingMoEMatchesAllToAllWorld4(RingMoEMatchesAllToAll):
    e_l = 1

    @unittest.skip("one expert per rank: a chunk has one expert, nothing to pad to equal groups")
    def test_backward_chunks_padded_to_equal_groups_match_a2a(self) -> None:
        pass

    def test_grouped_forward_and_backward_match_a2a_for_every_routing_case(self) -> None:
        # Two owners per forward and per backward hop (the rules keep one at these tiny shapes: forced here; the
        # rules themselves are tests/runtime/test_ring_options.py's): stacks of distinct ranks' weights, wrapping
        # around on rank 2; backward: gradient stacks trailing them and each slot returned to its owner.
        self.init_pg()
        with mock.patch.object(pipeline, "owners_per_hop", return_value=2) as rule, \
                mock.patch.object(pipeline, "backward_owners_per_hop", return_value=2) as backward_rule:
            for case in ROUTER_CASES:
                for overlap in (True, False):
                    self.assert_matches_a2a(case, routing="expert", overlap=overlap)
            self.assert_matches_a2a("random", routing="expert", max_hop_rows=2)
            self.assert_matches_a2a("random", routing="expert", remat=False)
            # Saved projections under owner stacks (wrapping on rank 2): every chunk reads its rows.
            with projections_read() as given:
                for case in ("random", "one_expert", "uneven"):
                    self.assert_matches_a2a(case, routing="expert", save_projections=True)
                    self.assert_matches_a2a(case, routing="expert", save_projections=True, max_hop_rows=2)
            self.assertTrue(given and all(given))
        self.assertTrue(rule.called and backward_rule.called)
        self.check_a_call_holds_the_owners_its_decision_chose()

    def test_token_routing_with_two_sources_per_hop_matches_a2a_for_every_routing_case(self) -> None:
        # Two sources' tokens per forward and per backward hop (the rules keep one at these tiny shapes: forced
        # here): stacks of neighbours' partitions of different sizes ("uneven", "halves"), wrapping around on
        # rank 2; their y (dx, d_scores) sums trail the stacks and each slot returns to its source.
        self.init_pg()
        with mock.patch.object(pipeline, "token_partitions_per_hop", return_value=2) as rule, \
                mock.patch.object(pipeline, "token_backward_partitions_per_hop", return_value=2) as backward_rule:
            for case in ROUTER_CASES:
                for overlap in (True, False):
                    self.assert_matches_a2a(case, routing="token", overlap=overlap)
            self.assert_matches_a2a("uneven", routing="token", max_hop_rows=2)
            self.assert_matches_a2a("halves", routing="token", remat=False)
            self.assert_matches_a2a("random", ring=ring_with_plain_ffn, routing="token")
        self.assertTrue(rule.called and backward_rule.called)

    def check_a_call_holds_the_owners_its_decision_chose(self) -> None:
        # Where the rules' ring would lose, the cost model may choose a larger stack (cost_model.choose, "beyond
        # the rules'"); the op then holds the choice's owners per hop, not the rules' (one at these shapes). The
        # decision (the model on "CUDA") is patched to choose two per forward and per backward hop.
        from relay_compile.runtime import decision, ops

        real_choose, real_execution, real_program_for = decision.choose, decision.decide, ops.program_for
        held: list[tuple[str, int]] = []

        def widened(shape, **kw):
            return dataclasses.replace(real_choose(shape, **{**kw, "ring": "always", "routing": "expert"}),
                                       owners=(2, 2))

        def on_cuda(asked, ring, cuda, *args):
            return real_execution(asked, ring, True, *args)

        def program_for(spec, direction, routing, size, num_weights, owners=1):
            held.append((direction, owners))
            return real_program_for(spec, direction, routing, size, num_weights, owners)

        with mock.patch.object(decision, "decide", on_cuda), mock.patch.object(decision, "choose", widened), \
                mock.patch.object(ops, "program_for", program_for):
            for case in ROUTER_CASES:
                self.assert_matches_a2a(case, routing="expert")
        self.assertEqual(sorted(set(held)), [("backward", 2), ("forward", 2)])

    @property
    def world_size(self) -> int:
        return 4


if __name__ == "__main__":
    run_tests()
