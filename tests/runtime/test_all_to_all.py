"""The block run as its all-to-all (``ring="never"``, ``runtime.all_to_all``) against the reference layer, on real
gloo process groups, and the decision that picks it (``runtime.cost_model.choose``, ``runtime.decision``).

The all-to-all path runs the spec's own expert function (grouped experts, or an expert function without a fused
backward), scores after or before it, for every routing case of ``tests.test_ring_moe`` (adversarial: one expert,
one rank, duplicates, uneven token counts); fp32 to 1e-5 of scale. Its profile shows all-to-alls and no P2P.
A failing rank raises its own error, and the others a ``RingPeerError`` naming it, without waiting for the timeout.
The choice between ring and all-to-all is agreed: a rank whose token count alone would choose the other way
follows the group.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests

from relay_compile import RingInputError, ring_moe
from relay_compile.backend import compiled_reports
from relay_compile.comm_events import count_comm_events
from relay_compile.passes import host_reads
from relay_compile.reference import a2a_moe, moe_weights
from relay_compile.runtime import agreement, all_to_all, cost_model, decision, ops, segment_compute
from relay_compile.experts import GroupedFFN
from relay_compile.routing import per_hop_bytes
from relay_compile.runtime.block_shape import BlockShape, OwnerOptions, grouped_owners, hop_shape, owner_options
from relay_compile.runtime.cost_model import (
    H100,
    H200,
    INTER_NODE_GBPS,
    NVLINK_GBPS,
    SAVE_MARGIN,
    Choice,
    a2a_time,
    choose,
    ring_time,
    ring_traffic,
)
from relay_compile.runtime.peak_memory import predicted_peak_bytes
from relay_compile.runtime.ring_options import (
    HopShape,
    RingOptions,
    backward_owners_fit,
    backward_owners_per_hop,
    forward_owners_fit,
    larger_owners,
    owners_per_hop,
)
from relay_compile.runtime.saved_projections import saving_op
from relay_compile.runtime.transport import RingPeerError, link_gbps, spans_nodes
from tests import distributed
from tests.distributed import DistributedTestCase
from tests.test_backend import E_L, F, H, block, inputs, step_outputs
from tests.test_ring_moe import (
    ROUTER_CASES,
    assert_close_rel,
    forward_backward,
    local_weights,
    ring_with_plain_ffn,
    routed_inputs,
)

# The calibration's constants a threshold test zeroes (all but the GEMMs and the all-to-all's host time).
ZEROED = ("host_hop_us", "host_hop_expert_us", "host_chunk_us", "host_token_hop_us", "host_token_expert_us",
          "host_a2a_peer_us", "gemm_half_rows", "ring_row_bytes", "a2a_row_bytes", "gpu_hop_us", "token_hop_pair_ns")
QWEN3 = dict(hidden=2048, ffn=768, top_k=8, elem_bytes=2, expert_bytes=3 * 2048 * 768 * 2)


def qwen3(tokens: int, ep: int) -> BlockShape:
    return BlockShape(tokens=tokens, experts_per_rank=128 // ep, group_size=ep, **QWEN3)


class Decision(unittest.TestCase):
    """``choose`` on the H200 calibration: time first under ``auto``, memory under ``memory``."""

    def test_a_dynamic_token_counts_threshold_splits_the_counts_the_cost_model_keeps_from_those_it_rings(
        self,
    ) -> None:
        # passes.dynamic_keep bisects for the threshold assuming the ring's advantage grows with T: check that on
        # a grid around it, for both EP sizes and both ring options that decide.
        from relay_compile.passes.dynamic_keep import _keeps, ring_from_tokens
        from relay_compile.runtime.ring_options import RingOptions

        # Grouped experts hold owner_options' stacks per hop, which change with T; an F without grouped entry
        # points one.
        for ep, ring, grouped in itertools.product((8, 64), ("auto", "memory"), (True, False)):
            options = RingOptions(ring=ring)
            start = ring_from_tokens(qwen3(1, ep), options, grouped)
            self.assertIsNotNone(start, (ep, ring))
            for tokens in (*(2**k for k in range(8, 19)), start - 1, start):
                want = choose(qwen3(tokens, ep), routing="auto", ring=ring, cal=H200,
                              owners=None if grouped else (1, 1)).execution == "all_to_all"
                self.assertEqual(want, tokens < start, (ep, ring, grouped, tokens, start))
                self.assertEqual(_keeps((qwen3(1, ep),), (grouped,), options, tokens), want, (ep, ring, tokens))
        # ring="memory" runs the ring from fewer tokens than "auto": it also buys memory with time.
        self.assertLess(ring_from_tokens(qwen3(1, 8), RingOptions(ring="memory")), 8192)
        self.assertGreater(ring_from_tokens(qwen3(1, 8), RingOptions(ring="auto")), 8192)

    def test_a_link_bound_ring_is_charged_every_byte_it_sends_once(self) -> None:
        # Over a link so slow that no compute hides a transfer, the ring's link time is its bytes over the link
        # (cost_model.ring_traffic: the same total for every stack), less only what the hop passes hide; the
        # first stacks' gather and the sums' last trip home are charged once, not again as a hop's transfer.
        shape = qwen3(16384, 64)
        slow = H200.with_link(0.01)
        volumes = per_hop_bytes("expert", tokens=shape.tokens, hidden=shape.hidden, top_k=shape.top_k,
                                experts_per_rank=shape.experts_per_rank, expert_bytes=shape.expert_bytes,
                                elem_bytes=shape.elem_bytes, expert_grad_bytes=shape.expert_bytes // 2 * 4,
                                sum_elem_bytes=4)
        for g, g_b in ((1, 1), (4, 2), (8, 4), (32, 32)):
            total = ring_traffic("expert", 64, g, g_b, volumes).total
            link = ring_time(shape, "expert", slow, owners_per_hop=g, backward_owners=g_b).link_ms
            self.assertLessEqual(link, total / (0.01 * 1e6))
            self.assertGreater(link, 0.999 * total / (0.01 * 1e6), (g, g_b))

    def test_a_ring_whose_rules_lose_holds_a_larger_stack_before_the_all_to_all_is_kept(self) -> None:
        # Qwen3, EP=64, 20480 tokens: the rules stop a stack at AUTO_MIN_HOP_ROWS rows (4 / 2 owners), a ring
        # predicted slower than the kept all-to-all; 8 / 4 owners fit the memory budget and are predicted faster.
        shape = qwen3(20480, 64)
        hop = hop_shape(shape)
        self.assertEqual(larger_owners(hop, (4, 2)), [(4, 4), (8, 2), (8, 4)])
        for f, b in larger_owners(hop, (4, 2)):
            self.assertTrue(forward_owners_fit(hop, f) and backward_owners_fit(hop, b))
        self.assertFalse(forward_owners_fit(hop, 16))  # 15 more owners' rows and partitions exceed it
        rules = choose(shape, routing="auto", ring="auto", cal=H200, owners=grouped_owners(shape))
        self.assertEqual((rules.execution, rules.owners), ("all_to_all", (4, 2)), rules.reason)
        widened = choose(shape, routing="auto", ring="auto", cal=H200)
        self.assertEqual((widened.execution, widened.owners), ("expert", (8, 4)), widened.reason)
        self.assertIn("beyond the rules' 4/2", widened.reason)
        self.assertLess(widened.peaks["ring"] * 3, widened.peaks["a2a"])
        # A call (kept="op") holds the same stack: the traced all-to-all decides the widening, whatever is kept.
        self.assertEqual(choose(shape, routing="auto", ring="auto", cal=H200, kept="op").owners, (8, 4))
        # "always" and "memory" hold the rules' stacks (memory first); where the rules' ring wins, "auto" does too.
        for ring in ("always", "memory"):
            self.assertEqual(choose(shape, routing="auto", ring=ring, cal=H200).owners, (4, 2), ring)
        self.assertEqual(choose(qwen3(32768, 64), routing="auto", ring="auto", cal=H200).owners, (4, 2))
        # A block kept although a larger stack was tried holds the rules' owners (what a forced ring would).
        kept = choose(qwen3(16384, 8), routing="auto", ring="auto", cal=H100)
        self.assertEqual((kept.execution, kept.owners), ("all_to_all", (1, 1)), kept.reason)
        self.assertIn("beyond the rules' 1/1", kept.reason)

    def test_at_ep64_a_ring_once_chosen_stays_chosen_as_tokens_grow(self) -> None:
        # The rules' owners step down as hops grow (8 / 4 at 16384 tokens, 4 / 2 from 16385, 2 / 1 from 32769):
        # under them alone the EP=64 ring ran at 16384 and 32768 tokens and kept the all-to-all at 20480-24576
        # and 40960. With larger stacks where the rules' lose, the decision no longer turns back. (Elsewhere a
        # chunk count stepping at a boundary can still flip one point: EP=8 H200 at 17408, within 0.1%.)
        for cal in (H200, H100):
            kept = [t for t in range(1024, 131073, 1024)
                    if choose(qwen3(t, 64), routing="auto", ring="auto", cal=cal).execution == "all_to_all"]
            self.assertEqual(kept, list(range(1024, kept[-1] + 1, 1024)), cal.name)
            # (A kept region runs at about a2a eager's time since passes.split_reads: kept to 18432 / 20480.)
            self.assertLess(kept[-1], 24576, cal.name)

    def test_decisions_before_the_op_predict_the_owners_per_hop_the_op_holds(self) -> None:
        # The compile-time keep, the token switch and the report predict from the block's sizes
        # (cost_model.grouped_owners, owner_options); the op from its packed weights (runtime.ops, ring_options
        # rules): they must agree, or
        # a region is kept at compile time that the op would run as a ring. Qwen3 (SwiGLU, packed [w13, w2]) and
        # a non-gated FFN ([w1, w2]), bf16 and fp32, and FP8 hops, EP 8-128, 1024-131072 tokens.
        for activation, elem, ep, tokens in itertools.product(
                ("swiglu", "gelu"), (2, 4), (8, 16, 32, 64, 128), (1024, 4096, 16384, 32768, 65536, 131072)):
            e_l, h, f = 128 // ep, 2048, 768
            dtype = {2: torch.bfloat16, 4: torch.float32}[elem]
            unpacked = [torch.empty(e_l, f, h, dtype=dtype, device="meta"), torch.empty(e_l, h, f, dtype=dtype,
                        device="meta")] + ([torch.empty(e_l, f, h, dtype=dtype, device="meta")] if activation ==
                                           "swiglu" else [])
            packed = GroupedFFN(activation).pack(unpacked)
            hop = HopShape.of(ep, [tokens] * ep, 8, [(w.shape, w.numel() * elem) for w in packed], h, elem)
            shape = BlockShape(tokens=tokens, hidden=h, ffn=f, top_k=8, experts_per_rank=e_l, group_size=ep,
                               elem_bytes=elem, expert_bytes=sum(w.numel() for w in unpacked) // e_l * elem)
            self.assertEqual(grouped_owners(shape), (owners_per_hop(hop), backward_owners_per_hop(hop)),
                             (activation, elem, ep, tokens))
            # ... and the larger stacks the cost model may take instead (cost_model.owner_options).
            self.assertEqual(list(owner_options(shape).larger), larger_owners(hop, grouped_owners(shape)),
                             (activation, elem, ep, tokens))
            if activation == "swiglu" and elem == 2:  # FP8 hops: E4M3 q13, fp32 s13, q2, s2 (fp8_experts.pack)
                fp8 = [((e_l, 2 * f, h), e_l * 2 * f * h), ((e_l,), 4 * e_l), ((e_l, h, f), e_l * h * f),
                       ((e_l,), 4 * e_l)]
                hop = HopShape.of(ep, [tokens] * ep, 8, fp8, h, elem)
                self.assertEqual(grouped_owners(shape, fp8=True), (owners_per_hop(hop), backward_owners_per_hop(hop)),
                                 ("fp8", ep, tokens))
        # Qwen3 at EP=64: the grouped ring at 32768 tokens (4 / 2 owners) is predicted faster than the all-to-all,
        # one owner per hop is not: the compile-time keep used to assume one and kept what the op runs as a ring.
        shape = qwen3(32768, 64)
        self.assertEqual(grouped_owners(shape), (4, 2))
        self.assertEqual(choose(shape, routing="auto", ring="auto", cal=H200).execution, "expert")
        self.assertEqual(choose(shape, routing="auto", ring="auto", cal=H200, owners=(1, 1)).execution, "all_to_all")

    def test_the_link_a_hop_crosses_comes_from_the_group_or_the_option_and_moves_the_decision(self) -> None:
        from relay_compile.bench.standin_group import standin_group

        # "auto": NCCL an NVLink-class link; the one-GPU stand-in (what H200 was fitted on) device copies.
        self.assertIsNone(link_gbps(standin_group(8)))
        self.assertIsNone(link_gbps(None))
        self.assertEqual(link_gbps(standin_group(8), 50), 50.0)
        with mock.patch.object(dist, "get_backend", return_value="nccl"):
            self.assertEqual(link_gbps(standin_group(8)), NVLINK_GBPS)  # no LOCAL_WORLD_SIZE: one node
            for per_node, want in (("8", NVLINK_GBPS), ("4", INTER_NODE_GBPS), ("", NVLINK_GBPS)):
                with mock.patch.dict("os.environ", {"LOCAL_WORLD_SIZE": per_node}):
                    self.assertEqual(link_gbps(standin_group(8)), want, per_node)
        # torchrun's placement: LOCAL_WORLD_SIZE consecutive global ranks per node.
        with mock.patch.dict("os.environ", {"LOCAL_WORLD_SIZE": "8"}):
            self.assertEqual([spans_nodes(r) for r in ([0, 7], [8, 15], [7, 8], [0, 8, 16], [3])],
                             [False, False, True, True, False])
        # The group decides with the slowest link any rank crosses (header values in MB/s; 0: device copies).
        self.assertEqual(decision.agreed_link([450_000, 50_000, 450_000]), 50.0)
        self.assertIsNone(decision.agreed_link([0, 0]))
        # Qwen3, EP=8, 14336 tokens: the all-to-all's four exchanges over NVLink are exposed, the ring's transfers
        # hide behind its hops; with device copies (the stand-in) the all-to-all is the faster.
        copies = choose(qwen3(14336, 8), routing="auto", ring="auto", cal=H200)
        nvlink = choose(qwen3(14336, 8), routing="auto", ring="auto", cal=H200.with_link(NVLINK_GBPS))
        self.assertEqual(copies.execution, "all_to_all", copies.reason)
        self.assertIn(nvlink.execution, ("expert", "token"), nvlink.reason)
        self.assertGreater(nvlink.times["a2a"].total_ms, copies.times["a2a"].total_ms)
        # EP=16 over an inter-node network (50 GB/s per GPU) at 16384 tokens: the ring's weights no longer hide
        # behind its hops, the all-to-all is kept; over NVLink the ring runs.
        self.assertEqual(choose(qwen3(16384, 16), routing="auto", ring="auto",
                                cal=H200.with_link(NVLINK_GBPS)).execution, "expert")
        self.assertEqual(choose(qwen3(16384, 16), routing="auto", ring="auto", cal=H200.with_link(50)).execution,
                         "all_to_all")
        self.assertEqual(H200.with_link(50).describe(), "h200 model, 50 GB/s link")

    def test_the_device_picks_its_calibration_and_the_group_decides_with_rank_0s(self) -> None:
        from relay_compile.runtime.decision import agreed_calibration

        for name, want in (("NVIDIA H100 80GB HBM3", H100), ("NVIDIA H200", H200), ("NVIDIA B200", H200)):
            with mock.patch.object(cost_model, "_device_name", return_value=name):
                self.assertIs(cost_model.calibration_for(torch.device("cuda", 0)), want, name)
        self.assertIs(cost_model.calibration_for(torch.device("cpu")), H200)
        for cal in cost_model.CALIBRATIONS:
            self.assertIs(agreed_calibration(cost_model.calibration_code(cal)), cal)
        self.assertIs(agreed_calibration(0), H200)
        # The constants decide: at EP=8, 20480 tokens the H200's (cheaper hops) run the ring, the H100's keep the
        # all-to-all.
        self.assertEqual(choose(qwen3(20480, 8), routing="auto", ring="auto", cal=H100).execution, "all_to_all")
        self.assertEqual(choose(qwen3(20480, 8), routing="auto", ring="auto", cal=H200).execution, "expert")

    def test_auto_keeps_the_all_to_all_where_the_ring_is_slower_and_runs_the_ring_where_it_is_faster(self) -> None:
        small, large = choose(qwen3(4096, 64), routing="auto", ring="auto", cal=H200), choose(
            qwen3(131072, 8), routing="auto", ring="auto", cal=H200)
        self.assertEqual(small.execution, "all_to_all", small.reason)
        self.assertGreater(small.times["expert"].total_ms, small.times["a2a"].total_ms)
        self.assertIn("predicted slower", small.reason)
        self.assertEqual(large.execution, "expert", large.reason)
        self.assertLess(large.times["expert"].total_ms, large.times["a2a"].total_ms)

    def test_memory_runs_the_slower_ring_where_it_saves_memory_and_never_and_always_force(self) -> None:
        shape = qwen3(8192, 64)
        mem = choose(shape, routing="auto", ring="memory", cal=H200)
        self.assertGreater(mem.peaks["a2a"], mem.peaks["ring"])
        self.assertEqual(mem.execution, "expert", mem.reason)
        tiny = BlockShape(tokens=64, hidden=2048, ffn=768, top_k=8, experts_per_rank=64, group_size=2, elem_bytes=2,
                          expert_bytes=QWEN3["expert_bytes"])
        self.assertEqual(choose(tiny, routing="auto", ring="memory", cal=H200).execution, "all_to_all")
        self.assertEqual(choose(shape, routing="token", ring="always", cal=H200).execution, "token")
        self.assertEqual(choose(qwen3(131072, 8), routing="auto", ring="never", cal=H200).execution, "all_to_all")

    def test_saved_projections_speed_up_a_ring_that_runs_where_it_would_lose_and_memory_allows(self) -> None:
        # H100 constants, EP=8, 16384 tokens: the ring forced (ring="always") is predicted slower than the
        # all-to-all without saved projections: it saves them (faster, its peak still below a2a's). They never
        # decide that the ring runs: under ring="auto" the all-to-all stays. At 65536 the ring wins without them:
        # nothing saved (the ring's memory is what it is for), unless the option says True; an op that cannot
        # save (0) never does.
        shape = qwen3(16384, 8)
        forced = choose(shape, routing="auto", ring="always", cal=H100, saving=1)
        self.assertEqual((forced.execution, forced.saves), ("expert", True), forced.reason)
        self.assertIn("projections saved", forced.reason)
        unsaved = choose(shape, routing="auto", ring="always", cal=H100)
        self.assertGreater(unsaved.times["expert"].total_ms, unsaved.times["a2a"].total_ms)
        self.assertLess(forced.times["expert"].total_ms, unsaved.times["expert"].total_ms)
        self.assertEqual(forced.peaks["ring"] - unsaved.peaks["ring"], shape.tokens * shape.top_k * 2 * shape.ffn * 2)
        self.assertLess(forced.peaks["ring"], forced.peaks["a2a"])
        auto = choose(shape, routing="auto", ring="auto", cal=H100, saving=1)
        self.assertEqual((auto.execution, auto.saves), ("all_to_all", False), auto.reason)
        large = choose(qwen3(65536, 8), routing="auto", ring="auto", cal=H100, saving=1)
        self.assertEqual((large.execution, large.saves), ("expert", False))
        self.assertEqual(choose(qwen3(65536, 8), routing="auto", ring="auto", cal=H100, saving=2).saves, True)
        self.assertEqual(choose(shape, routing="auto", ring="always", cal=H100, saving=0).saves, False)

    def test_auto_saves_projections_where_a_running_ring_is_within_the_models_error_of_the_all_to_all(self) -> None:
        # H100, EP=64, 22528 tokens: the ring runs (8 / 4 owners), predicted 0.98x a2a eager without saved
        # projections: within SAVE_MARGIN, so "auto" saves. At 65536 it is predicted ~0.84x: it runs without them,
        # its peak what the ring is for. (Until kept regions ran at a2a eager's time, passes.split_reads, this was
        # 16384 tokens: predicted 1.12x, measured 1.06x, 0.98x saved; now the all-to-all is kept there.)
        close = qwen3(22528, 64)
        unsaved = choose(close, routing="auto", ring="auto", cal=H100)
        ratio = unsaved.times["expert"].total_ms / unsaved.times["a2a"].total_ms
        self.assertGreater(ratio, 1.0 - SAVE_MARGIN)
        # It runs: the all-to-all a kept region would run is slower (kept_a2a_ratio).
        self.assertEqual(unsaved.execution, "expert", unsaved.reason)
        self.assertLess(unsaved.times["expert"].total_ms, unsaved.times["kept_a2a"].total_ms)
        saved = choose(close, routing="auto", ring="auto", cal=H100, saving=1)
        self.assertEqual((saved.execution, saved.saves), ("expert", True), saved.reason)
        self.assertLess(saved.times["expert"].total_ms, unsaved.times["expert"].total_ms)
        self.assertLessEqual(saved.peaks["ring"], saved.peaks["a2a"])
        clear = choose(qwen3(65536, 64), routing="auto", ring="auto", cal=H100, saving=1)
        self.assertLess(clear.times["expert"].total_ms, (1.0 - SAVE_MARGIN) * clear.times["a2a"].total_ms)
        self.assertEqual((clear.execution, clear.saves), ("expert", False), clear.reason)

    def test_a_call_weighs_the_ring_against_the_ops_own_all_to_all_path(self) -> None:
        # H100, EP=8, 16384 tokens: the ring is predicted slower than the traced all-to-all (the backend keeps
        # that region as traced) but faster than the op's own path (measured 1.45-1.50x a2a eager there, the ring
        # 1.02-1.11x): a call runs the ring, and saves its projections (predicted slower than a2a without them).
        # At 4096 tokens the ring loses to both: kept either way.
        shape = qwen3(16384, 8)
        traced = choose(shape, routing="auto", ring="auto", cal=H100, saving=1)
        call = choose(shape, routing="auto", ring="auto", cal=H100, saving=1, kept="op")
        self.assertEqual(traced.execution, "all_to_all", traced.reason)
        self.assertNotIn("op_a2a", traced.times)
        self.assertEqual((call.execution, call.saves), ("expert", True), call.reason)
        self.assertIn("the op's all-to-all path", call.reason)
        self.assertAlmostEqual(call.times["op_a2a"].total_ms, H100.op_a2a_ratio * call.times["a2a"].total_ms)
        unsaved = choose(shape, routing="auto", ring="auto", cal=H100, kept="op")  # what decides that it runs
        self.assertEqual(unsaved.execution, "expert", unsaved.reason)
        self.assertGreater(unsaved.times["expert"].total_ms, unsaved.times["a2a"].total_ms)
        self.assertLess(unsaved.times["expert"].total_ms, unsaved.times["op_a2a"].total_ms)
        # The decision before the op (which op a call runs) is the call's: the saving one.
        grouped = GroupedFFN("swiglu")
        self.assertTrue(saving_op(grouped, RingOptions(), "after", torch.device("cuda"), shape, H100,
                                  grouped_owners(shape)))
        small = choose(qwen3(4096, 8), routing="auto", ring="auto", cal=H100, saving=1, kept="op")
        self.assertEqual(small.execution, "all_to_all", small.reason)
        self.assertGreater(small.times["expert"].total_ms, small.times["op_a2a"].total_ms)
        # Without the measured ratio (1.0) a call keeps the all-to-all here, as the compile-time keep does.
        even = dataclasses.replace(H100, op_a2a_ratio=1.0)
        self.assertEqual(choose(shape, routing="auto", ring="auto", cal=even, kept="op").execution, "all_to_all")

    def test_auto_routing_takes_the_faster_ring_not_the_smaller_volume(self) -> None:
        # Bytes per hop would take token routing here (paper Table 2); it is the slower ring on the H200.
        shape = qwen3(8192, 8)
        choice = choose(shape, routing="auto", ring="always", cal=H200)
        self.assertEqual(choice.execution, "expert")
        self.assertLess(ring_time(shape, "expert", H200).total_ms, ring_time(shape, "token", H200).total_ms)

    def test_a_token_ring_is_predicted_and_held_with_the_sources_per_hop_its_rules_give(self) -> None:
        # Qwen3, EP=64, 8192 tokens: two sources per forward hop, one per backward hop (ring_options), any F.
        shape = qwen3(8192, 64)
        self.assertEqual(owner_options(shape).token, (2, 1))
        choice = choose(shape, routing="token", ring="always", cal=H200)
        self.assertEqual((choice.execution, choice.owners), ("token", (2, 1)))
        self.assertIn("2/1 sources per forward/backward hop", choice.reason)
        plain = ring_time(shape, "token", H200)
        stacked = ring_time(shape, "token", H200, owners_per_hop=2)
        self.assertEqual((plain.hops, stacked.hops), (128, 96))
        self.assertLess(stacked.host_ms, plain.host_ms)  # 32 hop passes fewer, each computing E_l experts
        # The same pairs sorted and the same bytes sent (a stack moves two partitions half as often).
        self.assertAlmostEqual(stacked.gpu_ms, plain.gpu_ms, places=9)
        volumes = per_hop_bytes("token", tokens=8192, hidden=2048, top_k=8, experts_per_rank=2,
                                expert_bytes=shape.expert_bytes, elem_bytes=2, expert_grad_bytes=1, sum_elem_bytes=4)
        traffic = ring_traffic("token", 64, 2, 1, volumes)
        self.assertEqual(traffic.total, ring_traffic("token", 64, 1, 1, volumes).total)
        self.assertEqual(traffic.exposed + traffic.forward_transfers * traffic.forward_hop
                         + traffic.backward_transfers * traffic.backward_hop, traffic.total)
        # The peak counts the forward's extra source (its tokens and sums, twice), within one expanded buffer: the
        # forward then holds more than the backward (measured: 402 -> 527 MiB, docs/bench/token-stacks).
        one, two = (predicted_peak_bytes(shape, "auto", sources=g, routing="token")["ring"] for g in ((1, 1), (2, 1)))
        self.assertGreater(two, one)
        self.assertLessEqual(two - one, 8192 * 8 * 2048 * 2)
        self.assertEqual(choice.peaks["ring"], two)
        # An expert function without grouped entry points (owners given as a tuple) still stacks token sources.
        self.assertEqual(choose(shape, routing="token", ring="always", cal=H200, owners=(1, 1)).owners, (2, 1))
        # A direction of one source per hop is the plain ring's: nothing exposed, a transfer behind every hop.
        self.assertEqual((traffic.backward_transfers, traffic.exposed), (64, 2 * volumes["forward"]))

    def test_a_link_adds_exposed_transfer_time_to_both_and_more_to_the_all_to_all_at_large_tokens(self) -> None:
        shape = qwen3(65536, 8)
        linked = H200.with_link(50.0)  # an inter-node class link
        self.assertGreater(a2a_time(shape, linked).link_ms, 0)
        self.assertGreater(a2a_time(shape, linked).total_ms, a2a_time(shape, H200).total_ms)
        self.assertLess(ring_time(shape, "expert", linked).link_ms, a2a_time(shape, linked).link_ms)


class AllToAllPath(DistributedTestCase):
    e_l = 2

    def init_pg(self, backend: str = "gloo") -> dist.ProcessGroup:
        with mock.patch.object(distributed, "PG_TIMEOUT", datetime.timedelta(seconds=15)):
            return super().init_pg(backend)

    @property
    def world_size(self) -> int:
        return 4

    def check_matches_a2a(self, case: str, ring=ring_moe, **kw) -> None:
        """The all-to-all path against ``a2a_moe`` (scores before the experts: against the ring, which
        tests.test_ring_moe checks against a dense loop)."""
        world = dist.get_world_size()
        x, ids, scores = routed_inputs(case, self.rank, world, self.e_l * world, seed=len(case) + 3)
        weights = local_weights(self.rank, self.e_l, world)
        if kw.get("scores_applied") == "before":
            want = forward_backward(ring, x, ids, scores, weights, self.rank, ring="always", **kw)
        else:
            want = forward_backward(a2a_moe, x, ids, scores, weights, self.rank)
        got = forward_backward(ring, x, ids, scores, weights, self.rank, ring="never", **kw)
        for name, g, w in zip(("y", "dx", "d_scores", "dw1", "dw2", "dw3"), got, want, strict=True):
            assert_close_rel(g, w, 1e-5, f"{case} {kw} {name}")

    def test_the_all_to_all_path_matches_the_reference_for_every_routing_case_and_expert_function(self) -> None:
        self.init_pg()
        for case in ROUTER_CASES:
            self.check_matches_a2a(case)
        for case in ("random", "one_expert", "uneven"):
            self.check_matches_a2a(case, ring=ring_with_plain_ffn)
            self.check_matches_a2a(case, max_hop_rows=5)  # chunks of the received rows
        self.check_matches_a2a("random", scores_applied="before")
        self.check_runs_all_to_alls_and_no_p2p()
        self.check_a_failure_raises_on_every_rank_without_waiting()
        self.check_every_rank_follows_the_agreed_decision()
        self.check_the_backend_keeps_the_region_and_every_rank_must()

    def check_runs_all_to_alls_and_no_p2p(self) -> None:
        world = dist.get_world_size()
        x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=2)
        weights = [w.requires_grad_() for w in local_weights(self.rank, self.e_l, world)]
        events = count_comm_events(lambda: ring_moe(x, ids, scores, *weights, ring="never").sum().backward())
        # Forward: the counts, the rows, their scores, the combine, the failure status. Backward: the counts,
        # the rows with their scores as extra columns, dx, the score gradients, the failure status. (The profiler
        # shows one all-to-all as more than one event.)
        one = torch.zeros(world)
        per_call = count_comm_events(lambda: dist.all_to_all_single(torch.empty_like(one), one)).all_to_all
        self.assertEqual(events.all_to_all, 10 * per_call, events.names)
        self.assertEqual(events.p2p, 0, events.names)
        ring_events = count_comm_events(lambda: ring_moe(x, ids, scores, *weights, ring="always").sum().backward())
        self.assertEqual(ring_events.all_to_all, 0, ring_events.names)
        self.assertGreater(ring_events.p2p, 0, ring_events.names)

    def check_a_failure_raises_on_every_rank_without_waiting(self) -> None:
        world = dist.get_world_size()
        x, ids, scores = routed_inputs("random", self.rank, world, self.e_l * world, seed=4)
        weights = local_weights(self.rank, self.e_l, world)
        real = segment_compute.segment_forward

        def fails_on_rank_1(*args, **kwargs):
            if dist.get_rank() == 1:
                raise RuntimeError("injected expert failure")
            return real(*args, **kwargs)

        with mock.patch("relay_compile.runtime.all_to_all.segment_forward", fails_on_rank_1):
            expected, pattern = (RuntimeError, "injected") if self.rank == 1 else (RingPeerError, "rank 1")
            with self.assertRaisesRegex(expected, pattern):
                ring_moe(x, ids, scores, *weights, ring="never")
        # The group is usable afterwards.
        self.check_matches_a2a("random")

    def check_every_rank_follows_the_agreed_decision(self) -> None:
        """Ranks hold 7, 12, 17, 22 tokens ("uneven"), under a calibration whose threshold lies between 12 and 17:
        the ring below it, the all-to-all above. Each rank's own count would split the group; the agreement decides
        from the largest, so every rank runs the all-to-all (and the result matches the reference)."""
        world = dist.get_world_size()
        decided: list[tuple[str, int, str]] = []
        real_choose, real_execution = decision.choose, decision.decide

        def threshold_choose(shape: BlockShape, **kw) -> Choice:
            # All costs zero but the GEMMs and the all-to-all's fixed host time, set between the ring's times at
            # 12 and 17 tokens: the ring (4 GEMM passes) wins below it, the all-to-all (3 passes) above.
            # (The op weighs the ring against its own all-to-all path: here at the traced one's time.)
            gemms = dataclasses.replace(H200, **{f: 0.0 for f in ZEROED}, gemm_tflops=1e-6, hbm_gbps=1e12,
                                        copy_gbps=1e12, op_a2a_ratio=1.0)
            at = [ring_time(dataclasses.replace(shape, tokens=t), "expert", gemms).total_ms for t in (12, 17)]
            cal = dataclasses.replace(gemms, host_a2a_us=500.0 * sum(at))
            kw["cal"] = cal
            mine = real_choose(dataclasses.replace(shape, tokens=x.shape[0]), **kw).execution
            choice = real_choose(shape, **kw)
            decided.append((choice.execution, shape.tokens, mine))
            return choice

        def on_cuda(asked, ring, cuda, *args):
            return real_execution(asked, ring, True, *args)

        x, ids, scores = routed_inputs("uneven", self.rank, world, self.e_l * world, seed=5)
        weights = local_weights(self.rank, self.e_l, world)
        want = forward_backward(a2a_moe, x, ids, scores, weights, self.rank)
        with mock.patch.object(decision, "choose", threshold_choose), \
                mock.patch.object(decision, "decide", on_cuda):
            got = forward_backward(ring_moe, x, ids, scores, weights, self.rank)
        for name, g, w in zip(("y", "dx", "d_scores", "dw1", "dw2", "dw3"), got, want, strict=True):
            assert_close_rel(g, w, 1e-5, f"agreed decision {name}")
        self.assertEqual(len(decided), 2, decided)  # forward and backward
        self.assertEqual({(e, t) for e, t, _ in decided}, {("all_to_all", 22)}, decided)
        own = [None] * world
        dist.all_gather_object(own, decided[0][2] == "all_to_all")
        self.assertEqual(own, [False, False, True, True])  # what each count alone decides: a ring, or not
        # Links are not checked alike: rank 1 crosses a 50 GB/s network the others do not see (gloo: no link), and
        # every rank decides with the slowest link (decision.agreed_link), forward and backward. Nor are GPU kinds:
        # rank 0 has an H100, the others not; every rank decides with rank 0's constants (agreed_calibration).
        # A call keeps the op's own all-to-all path, and weighs the ring against it (kept="op").
        used: list[tuple[str, float | None, str]] = []

        def recording_choose(shape: BlockShape, **kw) -> Choice:
            used.append((kw["cal"].name, kw["cal"].link_gbps, kw["kept"]))
            return real_choose(shape, **kw)

        # Neither is a disagreement: the table's one-comparison check passes (the field-by-field checks never run).
        with mock.patch.object(decision, "choose", recording_choose), \
                mock.patch.object(decision, "decide", on_cuda), \
                mock.patch.object(ops, "calibration_for", lambda device: H100 if self.rank == 0 else H200), \
                mock.patch.object(agreement, "_check_problems", wraps=agreement._check_problems) as slow_check:
            forward_backward(ring_moe, x, ids, scores, weights, self.rank, link_gbps=50 if self.rank == 1 else "auto")
        self.assertEqual(used, [("h100", 50.0, "op"), ("h100", 50.0, "op")])
        self.assertEqual(slow_check.call_count, 0)

    def check_the_backend_keeps_the_region_and_every_rank_must(self) -> None:
        """``ring="never"`` at compile time: the region stays as Dynamo traced it (its all-to-alls run, equal to
        eager), behind one ``kept_all_to_all`` check; a rank compiled to run the ring instead raises with the
        others at the first call (no hang, no mismatched collectives)."""
        world = dist.get_world_size()
        weights = [w.requires_grad_() for w in moe_weights_of(self.rank, world)]
        items = _items_traced(block, world)
        # The split sizes' host reads go through one copy (passes.host_reads; on CUDA by default, here on the CPU).
        with tempfile.TemporaryDirectory() as dump, mock.patch.object(host_reads, "on_accelerator",
                                                                              lambda t: True), \
                mock.patch("relay_compile.report.owner_options", return_value=OwnerOptions((2, 3))):
            torch._dynamo.reset()
            seen = len(compiled_reports())
            kept = torch.compile(block, backend="relaymoe", fullgraph=True, options={
                "inner_compiler": "aot_eager", "ring": "never", "dump_dir": dump})
            for step in range(2):
                x, ids, scores = inputs(self.rank, world, step)
                for g, w in zip(step_outputs(kept, x, ids, scores, weights), step_outputs(block, x, ids, scores, weights)):
                    assert_close_rel(g, w, 1e-5, f"kept step {step}")
            (report,) = compiled_reports()[seen:]
            self.assertEqual([r.status for r in report.regions], ["kept"], report.summary())
            self.assertIn("ring='never'", report.regions[0].reason)
            # Its F lowers onto grouped experts: the report predicts with the owners per hop the op would hold
            # (owner_options, patched: at these sizes the rule holds one).
            self.assertEqual(report.regions[0].owners_per_hop, [2, 3], report.summary())
            (after,) = Path(dump).glob(f"{report.graph}_rank{self.rank}/1_rewritten_graph.py")
            code = after.read_text()
            self.assertEqual(code.count("relaymoe.kept_all_to_all"), 1, code)
            self.assertIn("all_to_all_single", code)
            # Both splits of the dispatch (2 x world items) are read from one host copy, as is every other
            # tensor the block reads on the host (the expert loop's counts).
            self.assertIn(f"splits_2N: {2 * world} host reads from one copy", report.host_reads, report.summary())
            self.assertEqual(code.count(".to('cpu', copy = True)"), len(report.host_reads), code)
            # Both token all-to-alls take those splits as tensors (passes.split_reads): their 2 x world reads go.
            self.assertEqual(code.count("relaymoe.split_all_to_all"), 2, code)
            self.assertEqual(len(report.split_reads), 2, report.summary())
            self.assertIn(f"sends by splits_2N_host[0], receives by splits_2N_host[1] ({world} ranks)",
                          report.split_reads[0])
            self.assertEqual(code.count(".item()"), items - 2 * world, code)
            self.assertNotIn("relaymoe.ring_moe", code)
        x, ids, scores = inputs(self.rank, world, 0)
        events = count_comm_events(lambda: kept(x, ids, scores, *weights).sum().backward())
        self.assertGreater(events.all_to_all, 0, events.names)
        self.assertEqual(events.p2p, 0, events.names)
        # The compiled graph ran (not an eager fallback): both token all-to-alls, forward and backward.
        self.assertGreater(events.ring_calls.get("relaymoe::split_all_to_all", 0), 0, events.names)
        # Rank 0 keeps the all-to-all, the others run the ring: every rank raises, naming the decision.
        torch._dynamo.reset()
        mixed = torch.compile(block, backend="relaymoe", options={
            "inner_compiler": "aot_eager", "ring": "never" if self.rank == 0 else "always"})
        with self.assertRaisesRegex(RingInputError, "kept the region's all-to-all"):
            mixed(x, ids, scores, *weights)
        dist.barrier()
        self.check_matches_a2a("random")  # the group is usable afterwards


class ValuesBesideRows(unittest.TestCase):
    def test_values_ride_as_columns_of_the_rows_dtype_bit_for_bit_or_not_at_all(self) -> None:
        gen = torch.Generator().manual_seed(0)
        special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
        for rows_dtype, values_dtype, width in ((torch.bfloat16, torch.float32, 2), (torch.float32, torch.float32, 1),
                                                (torch.float16, torch.float64, 4)):
            for n in (0, 1, 4, 7):  # none and one row: slices whose storage offset is the rows' width
                rows = torch.randn(n, 5, generator=gen).to(rows_dtype)
                values = torch.cat([special, torch.randn(n, generator=gen)])[:n].to(values_dtype)
                packed = torch.cat([rows, all_to_all._value_columns(values, rows_dtype)], dim=1)
                self.assertEqual(packed.shape, (n, 5 + width))
                got_rows, got_values = all_to_all._split_values(packed, 5, values_dtype)
                self.assertTrue(torch.equal(got_rows, rows))
                self.assertEqual(got_values.view(torch.uint8).tolist(), values.view(torch.uint8).tolist())
        # A value narrower than a column, or not a whole number of columns: no packing (its own all-to-all).
        self.assertIsNone(all_to_all._value_columns(torch.zeros(3, dtype=torch.bfloat16), torch.float32))
        self.assertIsNone(all_to_all._value_columns(torch.zeros(3), torch.float64))


def _items_traced(fn, world: int) -> int:
    """How many ``.item()`` Dynamo traces in ``fn``'s graph (each a host read; batching keeps every one)."""
    counts: list[int] = []

    def count(gm, example_inputs):
        counts.append(sum(n.op == "call_method" and n.target == "item" for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        x, ids, scores = inputs(dist.get_rank(), world, 0)
        torch.compile(fn, backend=count, fullgraph=True)(x, ids, scores, *moe_weights_of(dist.get_rank(), world))
    return counts[0]


def moe_weights_of(rank: int, world: int) -> list[torch.Tensor]:
    w = moe_weights(0, H, F, E_L * world, experts=range(rank * E_L, (rank + 1) * E_L))
    return [w["w1"], w["w2"], w["w3"]]


if __name__ == "__main__":
    run_tests()
