"""Ring programs and their passes, on the graphs alone (no communication).

Goldens pin the schedule shape; regenerate with ``EXPECTTEST_ACCEPT=1`` after an intended change and read
the diff: transfers must stay posted before the hop they overlap, waits after it.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from expecttest import TestCase
from torch.testing._internal.common_utils import run_tests

from relay_compile.runtime.programs.build import build_program
from relay_compile.runtime.programs.instructions import (
    COMPUTE,
    hop_backward,
    hop_forward,
    hop_recompute,
    hop_vjp,
    ring_start,
    ring_wait,
)
from relay_compile.runtime.programs.overlap import check_overlap, overlap_pass
from relay_compile.runtime.programs.pipeline import shaped_program as ring_program
from relay_compile.runtime.programs.remat import remat_pass
from relay_compile.runtime.programs.schedule import schedule_for


def schedule_text(gm: fx.GraphModule) -> str:
    """One line per scheduling node: ``role ring hop [transfer index]`` (getitems and placeholders omitted)."""
    lines = []
    for node in gm.graph.nodes:
        info = node.meta.get("ring")
        if info is None or node.target is operator.getitem:
            continue
        extra = f" xfer={node.args[1]} sends={len(node.args) - 4}" if node.target is ring_start else ""
        extra += "".join(f" {k}={v}" for k, v in node.kwargs.items())
        lines.append(f"{node.target.__name__} {info.ring} hop={info.hop}{extra}")
    return "\n".join(lines)


def positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


class RingProgramGoldens(TestCase):
    def test_naive_expert_forward_sends_after_each_hop_compute(self) -> None:
        # The sequential ring: compute, then send the partition on and wait for the next one.
        gm = build_program(schedule_for("forward", "expert", 3, 3))
        self.assertExpectedInline(schedule_text(gm), """\
hop_forward forward hop=0
ring_start forward hop=0 xfer=0 sends=3
ring_wait forward hop=0
hop_forward forward hop=1
ring_start forward hop=1 xfer=1 sends=3
ring_wait forward hop=1
hop_forward forward hop=2
finish forward hop=3""")

    def test_overlapped_expert_forward_prefetches_next_partition_during_compute(self) -> None:
        # Each transfer is posted before the compute of its hop and waited right after it.
        gm = ring_program(schedule_for("forward", "expert", 3, 3), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
ring_start forward hop=0 xfer=0 sends=3
hop_forward forward hop=0
ring_wait forward hop=0
ring_start forward hop=1 xfer=1 sends=3
hop_forward forward hop=1
ring_wait forward hop=1
hop_forward forward hop=2
finish forward hop=3""")

    def test_expert_backward_sends_gradients_one_hop_behind_weights_then_returns_them(self) -> None:
        # Paper Figure 5: hop 0 sends weights only; hop h sends weights + the gradient of hop h-1;
        # the last hop sends gradients only, and a final gradient-only transfer returns them to the owners.
        # Hops >= 1 sum into the gradients their own transfer brings (sum_in_place): the hop reads the
        # transfer and its wait comes after the hop, where the next hop reads the weights.
        gm = ring_program(schedule_for("backward", "expert", 3, 2), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
ring_start grad hop=0 xfer=0 sends=2
hop_backward grad hop=0
ring_wait grad hop=0
ring_start grad hop=1 xfer=1 sends=4
hop_backward_into grad hop=1
ring_start grad hop=2 xfer=2 sends=2
ring_wait grad hop=1
hop_backward_into grad hop=2
ring_wait grad hop=2
ring_start grad hop=3 xfer=3 sends=2
ring_wait grad hop=3
finish grad hop=3""")

    def test_naive_backward_replays_the_whole_ring_before_the_gradient_ring(self) -> None:
        # Checkpoint-style: every hop's activations are recomputed first and stay alive until consumed.
        gm = build_program(schedule_for("backward", "token", 2, 2))
        self.assertExpectedInline(schedule_text(gm), """\
hop_recompute replay hop=0
ring_start replay hop=0 xfer=3 sends=3
ring_wait replay hop=0
hop_recompute replay hop=1
hop_vjp grad hop=0
ring_start grad hop=0 xfer=0 sends=4
ring_wait grad hop=0
hop_vjp grad hop=1
ring_start grad hop=1 xfer=1 sends=2
ring_wait grad hop=1
accumulate grad hop=1
ring_start grad hop=2 xfer=2 sends=2
ring_wait grad hop=2
finish grad hop=2""")

    def test_world_of_one_has_no_transfers(self) -> None:
        gm = ring_program(schedule_for("backward", "token", 1, 2), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
hop_backward grad hop=0
finish grad hop=1""")


class RematPass(TestCase):
    def test_remat_leaves_one_ring_with_no_activation_crossing_a_hop(self) -> None:
        for routing in ("expert", "token"):
            gm = remat_pass(build_program(schedule_for("backward", routing, 4, 3)))
            targets = [n.target for n in gm.graph.nodes]
            self.assertNotIn(hop_recompute, targets)
            self.assertNotIn(hop_vjp, targets)
            self.assertEqual(targets.count(hop_backward), 4)
            self.assertFalse([n for n in gm.graph.nodes if "ring" in n.meta and n.meta["ring"].ring == "replay"])
            # Exactly the gradient ring's N + 1 transfers remain.
            self.assertEqual(targets.count(ring_start), 5)

    def test_remat_refuses_a_gradient_hop_that_reads_another_hops_activations(self) -> None:
        gm = build_program(schedule_for("backward", "expert", 3, 2))
        vjps = [n for n in gm.graph.nodes if n.target is hop_vjp]
        recomputes = [n for n in gm.graph.nodes if n.target is hop_recompute]
        vjps[2].update_arg(2, recomputes[1])
        with self.assertRaisesRegex(ValueError, r"remat: hop_vjp_2 \(hop 2\) does not consume the recompute"):
            remat_pass(gm)


class OverlapPass(TestCase):
    def test_every_transfer_is_in_flight_during_the_compute_of_its_hop(self) -> None:
        for direction in ("forward", "backward"):
            for routing in ("expert", "token"):
                gm = ring_program(schedule_for(direction, routing, 4, 3), True, True)
                pos = positions(gm)
                compute = {n.meta["ring"].hop: n for n in gm.graph.nodes if n.target in COMPUTE}
                self.assertEqual(sorted(compute), list(range(4)), f"{direction}/{routing}")
                for start in (n for n in gm.graph.nodes if n.target is ring_start):
                    hop = start.meta["ring"].hop
                    wait = next(iter(start.users))
                    self.assertIs(wait.target, ring_wait)
                    if hop in compute and hop < 3:
                        self.assertLess(pos[start], pos[compute[hop]], f"{direction}/{routing} hop {hop}")
                        self.assertGreater(pos[wait], pos[compute[hop]], f"{direction}/{routing} hop {hop}")

    def test_overlap_keeps_the_order_of_transfers_identical_to_the_naive_ring(self) -> None:
        # All ranks must post transfers in one order: the pass may move them but never swap two.
        for direction in ("forward", "backward"):
            naive = remat_pass(build_program(schedule_for(direction, "expert", 4, 3)))
            order = [n.args[1] for n in naive.graph.nodes if n.target is ring_start]
            shaped = overlap_pass(naive)
            self.assertEqual(order, [n.args[1] for n in shaped.graph.nodes if n.target is ring_start])

    def test_grouped_forward_gathers_the_first_stack_then_moves_stacks_g_ranks_per_hop(self) -> None:
        # N=6, two owners per hop: the first transfer brings r-1 into slot 0 of the first stack (r's own weights
        # go into slot 1), then stacks of two move two ranks per hop: 3 transfers and 3 computes instead of 5
        # and 6.
        gm = build_program(schedule_for("forward", "expert", 6, 2, owners_per_hop=2))
        self.assertExpectedInline(schedule_text(gm), """\
ring_start forward hop=0 xfer=0 sends=2 stride=1 slot=0
ring_wait forward hop=0
stack_owners forward hop=0
hop_forward_group forward hop=0
ring_start forward hop=0 xfer=1 sends=2 stride=2
ring_wait forward hop=0
hop_forward_group forward hop=1
ring_start forward hop=1 xfer=2 sends=2 stride=2
ring_wait forward hop=1
hop_forward_group forward hop=2
finish forward hop=3""")

    def test_overlapped_grouped_forward_posts_every_transfer_before_a_compute(self) -> None:
        # The gather's three transfers go out together, and the next stack's before the first stack's compute.
        gm = ring_program(schedule_for("forward", "expert", 8, 2, owners_per_hop=4), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
ring_start forward hop=0 xfer=2 sends=2 stride=3 slot=0
ring_start forward hop=0 xfer=1 sends=2 stride=2 slot=1
ring_start forward hop=0 xfer=0 sends=2 stride=1 slot=2
ring_wait forward hop=0
ring_wait forward hop=0
ring_wait forward hop=0
stack_owners forward hop=0
ring_start forward hop=0 xfer=3 sends=2 stride=4
hop_forward_group forward hop=0
ring_wait forward hop=0
hop_forward_group forward hop=1
finish forward hop=2""")
        check_overlap(gm)

    def test_grouped_backward_trails_gradient_stacks_then_returns_each_slot_to_its_owner(self) -> None:
        # N=6, two owners per hop: the first stack gathered as forward, then three stacks whose gradient sums
        # trail one stack behind, two ranks per hop (the first stack's start them); the last stack's slots go
        # back to owners r+1 (one rank on) and r+2 (two ranks on).
        gm = build_program(schedule_for("backward", "expert", 6, 2, owners_per_hop=2))
        self.assertExpectedInline(schedule_text(gm), """\
ring_start grad hop=0 xfer=0 sends=2 stride=1 slot=0
ring_wait grad hop=0
stack_owners grad hop=0
hop_backward_group grad hop=0
ring_start grad hop=0 xfer=1 sends=2 stride=2
ring_wait grad hop=0
hop_backward_group grad hop=1
ring_start grad hop=1 xfer=2 sends=4 stride=2
ring_wait grad hop=1
accumulate grad hop=1
hop_backward_group grad hop=2
ring_start grad hop=2 xfer=3 sends=2 stride=2
ring_wait grad hop=2
accumulate grad hop=2
unstack grad hop=3
ring_start grad hop=3 xfer=4 sends=2 stride=1
ring_wait grad hop=3
unstack grad hop=3
ring_start grad hop=3 xfer=5 sends=2 stride=2
ring_wait grad hop=3
finish grad hop=3""")

    def test_shaped_grouped_backward_sums_into_arrivals_and_posts_every_transfer_before_its_hop(self) -> None:
        gm = ring_program(schedule_for("backward", "expert", 6, 2, owners_per_hop=2), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
ring_start grad hop=0 xfer=0 sends=2 stride=1 slot=0
ring_wait grad hop=0
stack_owners grad hop=0
ring_start grad hop=0 xfer=1 sends=2 stride=2
hop_backward_group grad hop=0
ring_wait grad hop=0
ring_start grad hop=1 xfer=2 sends=4 stride=2
hop_backward_group_into grad hop=1
ring_start grad hop=2 xfer=3 sends=2 stride=2
ring_wait grad hop=1
hop_backward_group_into grad hop=2
ring_wait grad hop=2
unstack grad hop=3
ring_start grad hop=3 xfer=4 sends=2 stride=1
unstack grad hop=3
ring_start grad hop=3 xfer=5 sends=2 stride=2
ring_wait grad hop=3
ring_wait grad hop=3
finish grad hop=3""")
        check_overlap(gm)

    def test_shaped_token_forward_adds_into_the_arriving_sums_and_posts_them_ahead_of_its_compute(self) -> None:
        # Hop 0 starts the y sums of the visiting tokens; hops >= 1 add into the sums their own transfer brings
        # (sum_in_place); every transfer is posted before the hop that computes beside it.
        gm = ring_program(schedule_for("forward", "token", 3, 3), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
ring_start forward hop=0 xfer=0 sends=3
hop_forward forward hop=0
ring_wait forward hop=0
ring_start forward hop=1 xfer=1 sends=4
hop_forward_into forward hop=1
ring_start forward hop=2 xfer=2 sends=1
ring_wait forward hop=1
hop_forward_into forward hop=2
ring_wait forward hop=2
ring_start forward hop=3 xfer=3 sends=1
ring_wait forward hop=3
finish forward hop=3""")
        check_overlap(gm)

    def test_token_forward_stacks_sources_and_trails_their_sums_as_the_expert_backward_does(self) -> None:
        # N=4, two sources per hop: the first stack (sources r-1, r) gathered, the next one (r-3, r-2) arriving
        # two ranks on while the first computes; y sums trail one stack behind, added into on arrival, then each
        # slot goes home.
        gm = ring_program(schedule_for("forward", "token", 4, 3, owners_per_hop=2), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
ring_start forward hop=0 xfer=0 sends=3 stride=1 slot=0
ring_wait forward hop=0
stack_owners forward hop=0
ring_start forward hop=0 xfer=1 sends=3 stride=2
hop_forward_group forward hop=0
ring_start forward hop=1 xfer=2 sends=1 stride=2
ring_wait forward hop=0
hop_forward_group_into forward hop=1
ring_wait forward hop=1
unstack forward hop=2
ring_start forward hop=2 xfer=3 sends=1 stride=1
unstack forward hop=2
ring_start forward hop=2 xfer=4 sends=1 stride=2
ring_wait forward hop=2
ring_wait forward hop=2
finish forward hop=2""")
        check_overlap(gm)

    def test_token_backward_stacks_sources_with_their_output_gradients_and_trails_dx_and_d_scores(self) -> None:
        gm = ring_program(schedule_for("backward", "token", 4, 3, owners_per_hop=2), True, True)
        self.assertExpectedInline(schedule_text(gm), """\
ring_start grad hop=0 xfer=0 sends=4 stride=1 slot=0
ring_wait grad hop=0
stack_owners grad hop=0
ring_start grad hop=0 xfer=1 sends=4 stride=2
hop_backward_group grad hop=0
ring_start grad hop=1 xfer=2 sends=2 stride=2
ring_wait grad hop=0
hop_backward_group_into grad hop=1
ring_wait grad hop=1
unstack grad hop=2
ring_start grad hop=2 xfer=3 sends=2 stride=1
unstack grad hop=2
ring_start grad hop=2 xfer=4 sends=2 stride=2
ring_wait grad hop=2
ring_wait grad hop=2
finish grad hop=2""")
        check_overlap(gm)

    def test_partitions_per_hop_are_refused_where_the_ring_cannot_stack_them(self) -> None:
        for direction, routing, n, g in (("backward", "token", 6, 4), ("forward", "token", 2, 2),
                                         ("forward", "expert", 6, 4), ("backward", "expert", 4, 4)):
            with self.assertRaisesRegex(ValueError, "partitions per hop need a ring of a multiple"):
                schedule_for(direction, routing, n, 2, owners_per_hop=g)

    def test_check_overlap_rejects_a_transfer_posted_after_its_hop(self) -> None:
        gm = build_program(schedule_for("forward", "expert", 3, 1))
        with self.assertRaisesRegex(ValueError, r"overlap: transfer ring_start of hop 0 is posted after"):
            check_overlap(gm)


if __name__ == "__main__":
    run_tests()
