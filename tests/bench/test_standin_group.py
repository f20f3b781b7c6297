"""The stand-in EP group: its collectives follow the copies model, and MoE layers under it compute what the
module docstring of ``relay_compile.bench.standin_group`` says (dense with tied partitions; token routing N times
this rank's own pairs), eager and compiled (``relay_compile.bench.rows.compiled_a2a_builder``).
"""

from __future__ import annotations

import collections
import sys
import unittest
import unittest.mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

import relay_compile.bench.rows as bench_rows
from relay_compile import ring_moe
from relay_compile.bench import StandinError, StandinGroup, destroy_standin_groups, standin_group
from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.rows import compiled_a2a_builder
from relay_compile.reference import a2a_moe, dense_moe, moe_weights
from relay_compile.routing import per_hop_bytes
from relay_compile.runtime.cost_model import ring_traffic
from relay_compile.runtime.hop_compute import ExpertRoutingStep
from relay_compile.runtime.programs import pipeline
from tests.bench.standin_case import StandinTestCase


class StandinGroupCollectivesFollowTheCopiesModel(StandinTestCase):
    def test_a_ring_shift_receives_the_tensor_just_sent(self) -> None:
        group = standin_group(4)
        sent, got = torch.arange(6.0), torch.zeros(6)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, sent, 1, group, 7),
            dist.P2POp(dist.irecv, got, 3, group, 7),
        ])
        for w in works:
            w.wait()
        self.assertTrue(torch.equal(got, sent))

    def test_a_receive_from_src_mirrors_the_send_to_minus_src_and_matches_tags(self) -> None:
        group = standin_group(4)
        to_2, to_1 = torch.full((3,), 2.0), torch.full((3,), 1.0)
        got_from_2, got_from_3 = torch.zeros(3), torch.zeros(3)
        w_recv = dist.irecv(got_from_2, 2, group, tag=5)  # posted before its send: completes when it arrives
        self.assertFalse(w_recv.is_completed())
        dist.isend(to_1, 1, group, tag=5)
        dist.isend(to_2, 2, group, tag=5)
        self.assertTrue(w_recv.is_completed())
        dist.irecv(got_from_3, 3, group, tag=5).wait()  # mirrors the send to (0 - 3) mod 4 = 1
        self.assertTrue(torch.equal(got_from_2, to_2))
        self.assertTrue(torch.equal(got_from_3, to_1))

    def test_waiting_on_a_receive_that_no_send_mirrors_fails_loudly(self) -> None:
        group = standin_group(4)
        work = dist.irecv(torch.zeros(2), 1, group, tag=99)
        with self.assertRaisesRegex(StandinError, "before this rank posted the send it mirrors"):
            work.wait()
        self.assertEqual(group.drop_pending(), 1)

    def test_all_to_all_chunk_s_is_the_input_chunk_for_minus_s_including_functional_collectives(self) -> None:
        group = standin_group(4)
        x = torch.arange(10.0)
        in_splits = [1, 2, 3, 4]
        out_splits = [in_splits[(-s) % 4] for s in range(4)]  # [1, 4, 3, 2]
        want = torch.cat([x.split(in_splits)[(-s) % 4] for s in range(4)])
        out = torch.empty(10)
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        self.assertTrue(torch.equal(out, want))
        got = funcol.wait_tensor(funcol.all_to_all_single(x, out_splits, in_splits, group))
        self.assertTrue(torch.equal(got, want))

    def test_all_to_all_splits_that_break_the_mirror_rule_are_refused(self) -> None:
        group = standin_group(4)
        with self.assertRaisesRegex(StandinError, "do not mirror input splits"):
            dist.all_to_all_single(torch.empty(10), torch.zeros(10), [1, 2, 3, 4], [1, 2, 3, 4], group=group)

    def test_gathers_repeat_this_rank_and_reductions_combine_n_copies(self) -> None:
        group = standin_group(3)
        row = torch.tensor([1, 2], dtype=torch.int64)
        out = torch.empty(6, dtype=torch.int64)
        dist.all_gather_into_tensor(out, row, group=group)
        self.assertEqual(out.tolist(), [1, 2, 1, 2, 1, 2])
        t = torch.tensor([2.0, -1.0])
        dist.all_reduce(t, group=group)
        self.assertEqual(t.tolist(), [6.0, -3.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        self.assertEqual(t.tolist(), [6.0, -3.0])
        summed = funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", group))
        self.assertEqual(summed.tolist(), [3.0, 3.0])

    def test_each_size_gets_its_own_cached_group_and_names_are_never_reused(self) -> None:
        g4, g8 = standin_group(4), standin_group(8)
        self.assertIsInstance(g4, StandinGroup)
        self.assertIs(standin_group(4), g4)
        self.assertEqual((dist.get_world_size(g4), dist.get_rank(g4), dist.get_world_size(g8)), (4, 0, 8))
        names = {g4.group_name, g8.group_name}
        destroy_standin_groups()
        self.assertFalse(dist.is_initialized())
        self.assertTrue(names.isdisjoint({standin_group(4).group_name, standin_group(8).group_name}))
        with self.assertRaisesRegex(ValueError, "size must be in"):
            standin_group(0)


H, F, K, T = 16, 8, 3, 24


def _inputs(world: int, e_l: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(world * e_l, generator=gen)[:K] for _ in range(T)])
    scores = torch.rand(T, K, generator=gen)
    w = moe_weights(seed, H, F, e_l)
    return x, ids, scores, [w["w1"], w["w2"], w["w3"]]


def _forward_backward(fn, x: Tensor, ids: Tensor, scores: Tensor, weights: list[Tensor], **kw) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, scores, *weights)]
    y = fn(leaves[0], ids, leaves[1], *leaves[2:], **kw)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return [y.detach(), *torch.autograd.grad(y, leaves, grad_y)]


def _dense_tied(world: int):
    """Dense reference where every partition's weights are this rank's: ``W[e] = W_local[e mod E_l]``."""

    def fn(x, ids, scores, w1, w2, w3):
        return dense_moe(x, ids, scores, w1.repeat(world, 1, 1), w2.repeat(world, 1, 1), w3.repeat(world, 1, 1))

    return fn


def _counting(calls: collections.Counter, name: str):
    original = getattr(ExpertRoutingStep, name)

    def counted(self, *args):
        calls[name] += 1
        return original(self, *args)

    return counted


class MoEUnderTheStandinGroup(StandinTestCase):
    def assert_all_close(self, got: list[Tensor], want: list[Tensor], what: str) -> None:
        names = ["y", "dx", "d_scores", "dw1", "dw2", "dw3"]
        for name, g, w in zip(names, got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(),
                                       msg=lambda m, n=name: f"{what}, {n}: {m}")

    def test_a2a_and_expert_routing_ring_equal_the_dense_layer_with_tied_partitions(self) -> None:
        for world, e_l in ((2, 2), (4, 2), (8, 1)):
            group = standin_group(world)
            x, ids, scores, weights = _inputs(world, e_l, seed=world)
            dense = _forward_backward(_dense_tied(world), x, ids, scores, weights)
            a2a = _forward_backward(a2a_moe, x, ids, scores, weights, group=group)
            self.assert_all_close(a2a, dense, f"a2a_moe at N={world}")
            for options in ({"overlap": True}, {"overlap": False}, {"max_hop_rows": 5}):
                ring = _forward_backward(ring_moe, x, ids, scores, weights, group=group, routing="expert", **options)
                self.assert_all_close(ring, a2a, f"ring_moe(expert, {options}) at N={world}")

    def test_grouped_forward_meets_every_owner_once_for_random_and_lopsided_routing(self) -> None:
        # g owners per forward hop (the rule, ring_options.owners_per_hop, is tested on its own: at these tiny
        # shapes it keeps one), N/g forward computes, the first stack gathered. Routing: random; every pair on one
        # expert of owner N/2 (one stack holds them all, the other hops are empty); only this rank's own experts
        # (the last slot of the first stack). (Stacks that wrap around the ring are other ranks': tests/test_ring_moe.py's
        # world of 4, and test_routing.py's SplitOwners.)
        for world, e_l, g in ((4, 2, 2), (6, 1, 2), (8, 1, 4), (16, 1, 8)):
            group = standin_group(world)
            x, ids, scores, weights = _inputs(world, e_l, seed=world)
            for case, case_ids in (("random", ids), ("one stack", torch.full_like(ids, world // 2 * e_l)),
                                   ("own experts", ids % e_l)):
                dense = _forward_backward(_dense_tied(world), x, case_ids, scores, weights)
                calls = collections.Counter()
                spies = {name: _counting(calls, name) for name in ("forward_hop", "forward_group")}
                with unittest.mock.patch.multiple(ExpertRoutingStep, **spies), \
                        unittest.mock.patch.object(pipeline, "owners_per_hop", return_value=g):
                    ring = _forward_backward(ring_moe, x, case_ids, scores, weights, group=group, routing="expert")
                self.assert_all_close(ring, dense, f"grouped forward, {case}, N={world}")
                self.assertEqual((calls["forward_hop"], calls["forward_group"]), (0, world // g), case)

    def test_the_time_model_counts_the_bytes_the_expert_ring_sends(self) -> None:
        # cost_model.ring_traffic: every partition but the own one visits once each way, and all N gradient sums
        # travel, whatever the owners per hop (a stack gathers the same partitions sooner, then moves g per pass).
        # Counted at the stand-in's sends, forward and backward (bf16 weights, fp32 sums). Before, the model
        # counted one partition per hop pass: at g / g_b = 4 / 4 fewer than half the bytes sent.
        world, e_l = 8, 2
        group = standin_group(world)
        x, ids, scores, weights = _inputs(world, e_l, seed=3)
        bf16 = [w.to(torch.bfloat16) for w in weights]
        w_bytes = sum(w.numel() * w.element_size() for w in bf16)
        volumes = per_hop_bytes("expert", tokens=T, hidden=H, top_k=K, experts_per_rank=e_l,
                                expert_bytes=w_bytes // e_l, elem_bytes=2, expert_grad_bytes=2 * w_bytes // e_l,
                                sum_elem_bytes=4)
        sent = collections.Counter()
        send = StandinGroup.send

        def counted(self, tensors, dst, tag=0):
            sent["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
            return send(self, tensors, dst, tag)

        for g, g_b in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)):
            sent.clear()
            spies = {name: _counting(sent, name) for name in ("forward_group", "backward_group_into")}
            with unittest.mock.patch.object(StandinGroup, "send", counted), \
                    unittest.mock.patch.multiple(ExpertRoutingStep, **spies), \
                    unittest.mock.patch.object(pipeline, "owners_per_hop", return_value=g), \
                    unittest.mock.patch.object(pipeline, "backward_owners_per_hop", return_value=g_b):
                _forward_backward(ring_moe, x.bfloat16(), ids, scores.bfloat16(), bf16, group=group, routing="expert")
            # The stacks ran: N / g grouped forward passes, N / g_b - 1 grouped backward passes after the first.
            self.assertEqual((sent["forward_group"], sent["backward_group_into"]),
                             (world // g if g > 1 else 0, world // g_b - 1 if g_b > 1 else 0), (g, g_b))
            traffic = ring_traffic("expert", world, g, g_b, volumes)
            # Beyond the model: the failure status, one int64 beside each backward transfer.
            status = sent["bytes"] - traffic.total
            self.assertTrue(0 <= status <= 8 * 2 * world and status % 8 == 0, (g, g_b, status))
            # What no compute hides and what the hop passes carry add up to the total (the link model's terms).
            self.assertEqual(traffic.exposed + traffic.forward_transfers * traffic.forward_hop
                             + traffic.backward_transfers * traffic.backward_hop, traffic.total, (g, g_b))

    def test_grouped_backward_sums_every_owners_gradients_for_random_and_lopsided_routing(self) -> None:
        # g owners per backward hop (the rule, ring_options.backward_owners_per_hop, is tested on its own), alone
        # or beside a grouped forward: N/g stacks, the first gathered, and every owner's g returned sums add up to
        # the dense gradients. Routing as the grouped forward's test.
        for world, e_l, g, g_f in ((4, 2, 2, 1), (6, 1, 2, 2), (8, 1, 4, 2), (16, 1, 8, 4), (8, 2, 2, 4)):
            group = standin_group(world)
            x, ids, scores, weights = _inputs(world, e_l, seed=world + g)
            for case, case_ids in (("random", ids), ("one stack", torch.full_like(ids, world // 2 * e_l)),
                                   ("own experts", ids % e_l)):
                dense = _forward_backward(_dense_tied(world), x, case_ids, scores, weights)
                calls = collections.Counter()
                spies = {name: _counting(calls, name)
                         for name in ("backward_hop", "backward_group", "backward_group_into")}
                with unittest.mock.patch.multiple(ExpertRoutingStep, **spies), \
                        unittest.mock.patch.object(pipeline, "owners_per_hop", return_value=g_f), \
                        unittest.mock.patch.object(pipeline, "backward_owners_per_hop", return_value=g):
                    ring = _forward_backward(ring_moe, x, case_ids, scores, weights, group=group, routing="expert")
                self.assert_all_close(ring, dense, f"grouped backward, {case}, N={world}, g={g}")
                self.assertEqual((calls["backward_hop"], calls["backward_group"], calls["backward_group_into"]),
                                 (0, 1, world // g - 1), case)

    def test_token_routing_ring_computes_n_times_the_pairs_on_this_ranks_experts(self) -> None:
        # Every hop brings this rank's own tokens back to its own experts (module docstring of standin_group).
        world, e_l = 4, 2
        group = standin_group(world)
        x, ids, scores, weights = _inputs(world, e_l, seed=3)

        def model(x, ids, scores, w1, w2, w3):
            return world * _dense_tied(world)(x, ids, scores * (ids < e_l), w1, w2, w3)

        want = _forward_backward(model, x, ids, scores, weights)
        got = _forward_backward(ring_moe, x, ids, scores, weights, group=group, routing="token")
        self.assert_all_close(got, want, "ring_moe(token) at N=4")
        # Two sources per hop: every stack is two copies of this rank's tokens, their sums two slots returned.
        with unittest.mock.patch.object(pipeline, "token_partitions_per_hop", return_value=2), \
                unittest.mock.patch.object(pipeline, "token_backward_partitions_per_hop", return_value=2):
            got = _forward_backward(ring_moe, x, ids, scores, weights, group=group, routing="token")
        self.assert_all_close(got, want, "ring_moe(token), two sources per hop, at N=4")

    def test_compiled_rows_pass_the_group_by_name_and_equal_the_eager_a2a(self) -> None:
        # torch 2.11's Dynamo cannot proxy the stand-in group object (docs/ARCHITECTURE.md, section 5 "Measured
        # facts"): the name goes in.
        world, e_l = 4, 2
        group = standin_group(world)
        cfg = LayerConfig(name="c", hidden=H, ffn=F, experts=world * e_l, top_k=K, tokens=T, ep=world,
                          dtype="fp32", device="cpu")
        x, ids, scores, weights = _inputs(world, e_l, seed=5)
        groups = []

        def spy(*args, **kwargs):
            groups.append(kwargs["group"])
            return a2a_moe(*args, **kwargs)

        with unittest.mock.patch.object(bench_rows, "a2a_moe", spy):
            got = _forward_backward(compiled_a2a_builder("aot_eager")(cfg, group), x, ids, scores, weights)
        self.assertEqual(groups, [group.group_name])
        want = _forward_backward(a2a_moe, x, ids, scores, weights, group=group)
        self.assert_all_close(got, want, "a2a_moe compiled with the group's name")

class RingTransfersOnTheStandinGroup(StandinTestCase):
    def test_forwarded_payloads_take_one_send_per_transfer(self) -> None:
        # Expert routing, SwiGLU packed to (w13, w2), N = 8. Forward: hop 0 sends the local weights (2 tensors),
        # hops 1..N-2 forward what they received (1 span each); with four owners per hop, the first three
        # transfers send the local weights and then the slots received (2 tensors each: slots of two stacks), the
        # one stack transfer the first stack (2 tensors: not a received group). Backward (+1 status send per
        # transfer): hop 0's weights (2), hop 1's weights as received (1 span) and the fresh sums of hop 0 (2:
        # the sums travel as a batch of their own, so each part is matched to its receive buffers alone), hops
        # 2..N-2 forward the weights and the sums they added into (2 spans: weights and sums are separate
        # buffers), hop N-1 the sums (1), the return to the owners (2, separate tensors: they become the op's
        # outputs).
        n, hidden, experts, tokens, top_k = 8, 16, 16, 64, 4
        group = standin_group(n)
        w = moe_weights(0, hidden, 8, experts, experts=range(experts // n))
        weights = [w[k].requires_grad_() for k in ("w1", "w2", "w3")]
        x = torch.randn(tokens, hidden, requires_grad=True)
        ids = torch.randint(0, experts, (tokens, top_k))
        scores = torch.rand(tokens, top_k, requires_grad=True)
        original = StandinGroup.send

        def count_sends() -> dict[str, int]:
            sends = {"forward": 0, "backward": 0}
            phase = "forward"

            def counting_send(self, *args, **kwargs):
                sends[phase] += 1
                return original(self, *args, **kwargs)

            with unittest.mock.patch.object(StandinGroup, "send", counting_send):
                y = ring_moe(x, ids, scores, *weights, group=group, routing="expert")
                phase = "backward"
                y.sum().backward()
            return sends

        backward = (2 + 3 + 2 * (n - 3) + 1 + 2) + n + 1
        for owners, forward in ((1, 2 + (n - 2)), (4, 3 * 2 + 2)):
            with unittest.mock.patch.object(pipeline, "owners_per_hop", return_value=owners):
                self.assertEqual(count_sends(), {"forward": forward, "backward": backward}, f"{owners} owners")

class _DeferredLink:
    """A link stream at its most asynchronous: a copy runs only when its work is waited on, so a receive buffer
    read, or a sent tensor written, before its transfer's wait shows up as a wrong result (CPU stand-in for
    ``standin_group._LinkStream``, whose copies run on a CUDA stream of their own)."""

    def __init__(self) -> None:
        self.copies = 0

    def copy(self, outs: list[Tensor], ins: list[Tensor]) -> dist.Work:
        self.copies += 1

        class Deferred(dist.Work):
            ran = False

            def is_completed(self) -> bool:
                return self.ran

            def wait(self, timeout=None) -> bool:
                if not self.ran:
                    for out, t in zip(outs, ins, strict=True):
                        out.copy_(t)
                    self.ran = True
                return True

        return Deferred()


class TransfersOnALinkStream(StandinTestCase):
    def test_a_link_stream_group_is_a_group_of_its_own(self) -> None:
        plain, linked = standin_group(4), standin_group(4, link_stream=True)
        self.assertIsNot(plain, linked)
        self.assertNotEqual(plain.group_name, linked.group_name)
        self.assertIs(standin_group(4, link_stream=True), linked)
        self.assertEqual((plain.link_stream, linked.link_stream), (False, True))

    def test_copies_by_a_few_blocks_are_a_link_stream_group_of_their_own(self) -> None:
        linked, bounded = standin_group(4, link_stream=True), standin_group(4, link_stream=True, link_ctas=16)
        self.assertIsNot(linked, bounded)
        self.assertIs(standin_group(4, link_stream=True, link_ctas=16), bounded)
        self.assertEqual((linked.link_ctas, bounded.link_ctas), (0, 16))
        for bad in ({"link_ctas": 16}, {"link_stream": True, "link_ctas": -1}):
            with self.assertRaisesRegex(ValueError, "link_ctas"):
                standin_group(4, **bad)

    def test_a_high_priority_link_is_a_group_of_its_own_whose_stream_has_the_highest_priority(self) -> None:
        sg = sys.modules["relay_compile.bench.standin_group"]
        bounded = standin_group(4, link_stream=True, link_ctas=16)
        high = standin_group(4, link_stream=True, link_ctas=16, link_high_priority=True)
        self.assertIsNot(bounded, high)
        self.assertIs(standin_group(4, link_stream=True, link_ctas=16, link_high_priority=True), high)
        with self.assertRaisesRegex(ValueError, "link_high_priority"):
            standin_group(4, link_high_priority=True)
        with unittest.mock.patch.object(torch.cuda, "Stream") as stream:
            for group, priority in ((bounded, 0), (high, sg.HIGH_PRIORITY)):
                group._link(torch.device("cuda"))
                self.assertEqual(stream.call_args.kwargs["priority"], priority)
        self.assertLess(sg.HIGH_PRIORITY, 0)  # CUDA: lower numbers run first

    def test_a_link_of_a_few_blocks_copies_with_the_bounded_kernel(self) -> None:
        """The CUDA calls are stood in for (no GPU here): what is checked is that each copy of a ``link_ctas``
        group goes through ``bounded_copy_`` with the group's block count, on the link stream."""
        sg = sys.modules["relay_compile.bench.standin_group"]  # the package's ``standin_group`` is the function
        group = standin_group(4, link_stream=True, link_ctas=16)
        copies: list[tuple[int, bool]] = []
        with unittest.mock.patch.object(torch.cuda, "Stream"), unittest.mock.patch.object(torch.cuda, "stream"), \
                unittest.mock.patch.object(torch.cuda, "current_stream"), \
                unittest.mock.patch.object(torch.cuda, "Event"), \
                unittest.mock.patch.object(Tensor, "record_stream"), \
                unittest.mock.patch.object(sg, "bounded_copy_", lambda d, s, n: (copies.append((n, torch.equal(
                    d.copy_(s), s))))):
            link = group._link(torch.device("cuda"))
            self.assertEqual(link.ctas, 16)
            outs, ins = [torch.zeros(8), torch.zeros(2)], [torch.arange(8.0), torch.ones(2)]
            link.copy(outs, ins)
        self.assertEqual(copies, [(16, True), (16, True)])
        self.assertTrue(torch.equal(outs[0], ins[0]) and torch.equal(outs[1], ins[1]))

    def test_the_ring_waits_for_every_transfer_before_it_reads_or_reuses_it(self) -> None:
        # Forward and backward on a link whose copies run only once waited on: every received buffer the ring
        # reads and every sent tensor it writes again must be waited on first, as NCCL's streams require. Expert
        # routing with one and several owners per hop (weights and their travelling gradients), token routing
        # with one and several sources per hop (partitions and the partial sums added into on arrival).
        world, e_l = 4, 2
        plain, linked = standin_group(world), standin_group(world, link_stream=True)
        x, ids, scores, weights = _inputs(world, e_l, seed=3)
        link = _DeferredLink()
        for routing, owners in (("expert", 1), ("expert", 2), ("token", 1), ("token", 2)):
            with unittest.mock.patch.object(pipeline, "owners_per_hop", return_value=owners), \
                    unittest.mock.patch.object(pipeline, "token_partitions_per_hop", return_value=owners), \
                    unittest.mock.patch.object(pipeline, "token_backward_partitions_per_hop", return_value=owners):
                want = _forward_backward(ring_moe, x, ids, scores, weights, group=plain, routing=routing)
                with unittest.mock.patch.object(StandinGroup, "_link",
                                                lambda self, device: link if self.link_stream else None):
                    got = _forward_backward(ring_moe, x, ids, scores, weights, group=linked, routing=routing)
            for name, g, w in zip(["y", "dx", "d_scores", "dw1", "dw2", "dw3"], got, want, strict=True):
                self.assertTrue(torch.equal(g, w), f"{name}, {routing}, {owners} owners per hop")
        self.assertGreater(link.copies, 0)

    def test_a_send_taken_later_is_waited_for_through_the_send(self) -> None:
        group = standin_group(4, link_stream=True)
        link = _DeferredLink()
        sent, got = torch.arange(4.0), torch.zeros(4)
        with unittest.mock.patch.object(StandinGroup, "_link", lambda self, device: link):
            send = dist.isend(sent, 1, group, tag=3)
            recv = dist.irecv(got, 3, group, tag=3)  # takes the send: the copy is queued, not run
            self.assertFalse(recv.is_completed())
            send.wait()  # the sender may write its tensor now: the copy read it first
            sent.fill_(-1.0)
            recv.wait()
        self.assertTrue(torch.equal(got, torch.arange(4.0)))


if __name__ == "__main__":
    unittest.main()
