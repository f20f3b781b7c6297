"""The capacity-region finder on real Dynamo graphs, in one process: record fields, and refusals with reasons.

Graphs come from tracing the DeepSpeed- and GShard-style layers (``tests.models``) and their variants
(``tests.models.capacity_variants``) with ``torch.compile`` under torch's fake process group (world 2): the
collectives return garbage, so these tests look at structure only (numerics: ``test_capacity_dispatch.py``).
Each refusal test names the user code that gives the graph and checks the reason, the node refused, that no
region was found and that the graph was left as it was.

Legend: S tokens, M model dim, E experts, E_l experts per rank, C capacity, K top-k, N ranks.
"""

from __future__ import annotations

import dataclasses
import unittest
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from relay_compile.passes import (
    CapacityRegion,
    Refusal,
    RefusedRegion,
    expert_lowering,
    find_moe_regions,
    rewrite_moe_region,
)
from relay_compile.passes.expert_lowering import choose_expert_fn
from relay_compile.passes.fx_nodes import is_all_to_all
from tests.models import capacity_variants
from tests.models.deepspeed_style import DeepSpeedStyleMoE
from tests.models.fairseq_style import FairseqStyleMoE
from tests.models.gshard_style import GShardStyleMoE
from tests.passes.test_match_rewrite import ResidualStack

M, F, E, N, S = 8, 6, 4, 2, 12


def traced(model: nn.Module) -> tuple[fx.GraphModule, list[Any], list[RefusedRegion]]:
    """``(Dynamo's graph of model(x), regions, refusals)``; checks that matching left the graph unchanged."""
    seen: list[tuple[fx.GraphModule, list[Any], list[RefusedRegion]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        code = gm.code
        regions, refused = find_moe_regions(gm)
        assert gm.code == code, "find_moe_regions mutated the graph"
        seen.append((gm, regions, refused))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(S, M))
    assert len(seen) == 1, f"{len(seen)} graphs"
    return seen[0]


class CapacityMatch(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        # One process stands in for rank 0 of 2: Dynamo traces the collectives, which return garbage.
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)

    @classmethod
    def tearDownClass(cls) -> None:
        dist.destroy_process_group()

    def deepspeed(self, **kwargs: Any) -> DeepSpeedStyleMoE:
        return DeepSpeedStyleMoE(M, F, E, dist.group.WORLD, capacity_factor=0.5, seed=1, **kwargs)

    def refusal(self, model: nn.Module) -> str:
        """The one reason the graph of ``model`` is refused for, at its first all-to-all."""
        gm, regions, refused = traced(model)
        self.assertEqual(regions, [])
        self.assertEqual(len(refused), 1, [r.reason for r in refused])
        self.assertIs(refused[0].node, next(n for n in gm.graph.nodes if is_all_to_all(n)))
        return refused[0].reason

    # --- the pattern ---------------------------------------------------------------------------------------

    def test_finds_the_deepspeed_block_with_its_masks_capacity_and_top_k(self) -> None:
        # tests.models.deepspeed_style: top2gating + MOELayer + Experts (chunks of (N, E_l, C, M)).
        gm, regions, refused = traced(self.deepspeed())
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertIsInstance(region, CapacityRegion)
        self.assertEqual((region.experts_per_rank, region.capacity, region.top_k), (E // N, 3, 2))
        shape = region.block_shape()
        self.assertEqual((shape.tokens, shape.hidden, shape.ffn, shape.top_k, shape.experts_per_rank), (S, M, F, 2, 2))
        self.assertEqual((region.group_size, region.group_name), (N, dist.group.WORLD.group_name))
        self.assertEqual(region.x.name, "reshaped_input")
        self.assertEqual(region.pairs.dispatch_mask.name, "dispatch_mask")  # combine_weights.bool()
        self.assertEqual(region.pairs.combine_weights.target, "type_as")  # the combine einsum's operand
        self.assertEqual(region.output.args[0], "sec,ecm->sm")
        self.assertEqual(len(region.weights), 2 * E // N)  # fc1, fc2 of each local expert
        lowered, path = choose_expert_fn(region)  # what the rewrite runs: F lowered, proven on probe inputs
        self.assertEqual(path.summary(), "grouped: " + region.plan.describe())
        self.assertEqual(lowered.plan, region.plan)  # recognized alike from the same graph
        self.assertTrue(path.description.startswith("gelu experts"))
        # What dies: both all-to-alls, the dispatch einsum, F, the combine; never the masks, tokens, weights.
        self.assertTrue({region.dispatch, region.combine, region.recv, region.back, region.output} <= region.nodes)
        self.assertFalse({region.x, *region.pairs.inputs().values(), *region.weights} & region.nodes)
        self.assertEqual({n for n in region.nodes if is_all_to_all(n)}, {region.dispatch, region.combine})

    def test_finds_the_gshard_block_with_batched_experts_and_rewrites_it_to_one_ring(self) -> None:
        # tests.models.gshard_style: topk gating, einsum("sm,sec->ecm"), einsum/bmm experts on (E_l, N*C, M).
        gm, regions, refused = traced(GShardStyleMoE(M, F, E, 2, dist.group.WORLD, capacity_factor=0.5, seed=1))
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertEqual((region.capacity, region.top_k, region.block_shape().ffn), (3, 2, F))
        self.assertIn("relu experts, gate weights[0] stacked (in_out)", choose_expert_fn(region)[1].description)
        ring = rewrite_moe_region(gm, region)
        self.assertEqual([n for n in gm.graph.nodes if is_all_to_all(n)], [])
        ids, scores = ring.args[1:3]
        self.assertEqual(ids.meta["val"].shape, (S, 2))  # (S, K) pairs from the masks
        self.assertEqual(scores.meta["val"].shape, (S, 2))
        self.assertNotIn("einsum('sec,ecm->sm'", gm.code)

    def test_finds_the_gshard_block_with_tutel_biases_on_its_batched_experts(self) -> None:
        # Tutel's biases: (E_l, 1, F) added as stored, (E_l, M)[:, None, :] broadcast over every slot.
        _, regions, refused = traced(GShardStyleMoE(M, F, E, 2, dist.group.WORLD, capacity_factor=0.5, seed=1,
                                                    bias=True))
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertEqual(choose_expert_fn(region)[1].description, (
            "relu experts with bias (gate, down), gate weights[0] stacked (in_out), down weights[2] stacked (in_out), "
            "gate bias weights[1] stacked, down bias weights[3] stacked"))

    def test_two_capacity_layers_in_one_graph_are_two_disjoint_regions_and_two_rings(self) -> None:
        # x + moe1(x), then + moe2(...): the second dispatch has the first layer's all-to-alls upstream.
        blocks = [GShardStyleMoE(M, F, E, 2, dist.group.WORLD, capacity_factor=0.5, seed=s) for s in (1, 2)]
        gm, regions, refused = traced(ResidualStack(blocks))
        self.assertEqual(refused, [])
        self.assertEqual(len(regions), 2)
        self.assertFalse(regions[0].nodes & regions[1].nodes)
        for region in regions:
            rewrite_moe_region(gm, region)
        self.assertEqual([n for n in gm.graph.nodes if is_all_to_all(n)], [])
        self.assertEqual(gm.code.count("relaymoe.ring_moe"), 2)

    def test_a_token_keeping_more_pairs_than_the_read_top_k_fails_loudly_at_run_time(self) -> None:
        # K comes from the gate's code; were it read too small, the ring would lose pairs: the rewrite asserts
        # (on the device, before the ring) that no token keeps more than K. Here K is forced to 1 under top-2.
        def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            (region,) = find_moe_regions(gm)[0]
            rewrite_moe_region(gm, dataclasses.replace(region, top_k=1))
            return gm.forward

        torch._dynamo.reset()
        model = GShardStyleMoE(M, F, E, 2, dist.group.WORLD, capacity_factor=2.0, seed=1)
        with self.assertRaisesRegex(RuntimeError, r"relaymoe: a token keeps more than K=1 experts"):
            torch.compile(model, backend=backend)(torch.randn(S, M))

    # --- refusals ------------------------------------------------------------------------------------------

    def test_refuses_scores_applied_before_the_experts(self) -> None:
        # einsum("sec,sm->ecm", combine_weights.type_as(x), x): the buffers hold scaled tokens.
        reason = self.refusal(capacity_variants.ScoresBeforeExperts(M, F, E, dist.group.WORLD, seed=1))
        self.assertRegex(reason, r"^the dispatch einsum's mask combine_weights is not a boolean mask cast to the "
                                 r"tokens' dtype")
        self.assertIn("scores applied before the experts?", reason)

    def test_experts_with_biases_are_lowered_with_their_biases(self) -> None:
        # nn.Linear(..., bias=True) experts: empty slots compute F(0) = b2 + ... in the original, times a combine
        # weight of 0, so the ring over kept pairs computes the same (capacity_pairs).
        _, regions, refused = traced(self.deepspeed(bias=True))
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertEqual(len(region.weights), 4 * E // N)  # fc1, its bias, fc2, its bias of each local expert
        self.assertTrue(choose_expert_fn(region)[1].description.startswith("gelu experts with bias (gate, down), "),
                        choose_expert_fn(region)[1].description)
        self.assertEqual(choose_expert_fn(region)[0].num_packed(len(region.weights)), 4)

    def test_refuses_experts_that_mix_capacity_slots(self) -> None:
        # out - out.mean(dim=2): a slot's result depends on the other tokens of its expert.
        reason = self.refusal(capacity_variants.with_experts(self.deepspeed(), capacity_variants.SlotMixingExperts))
        self.assertRegex(reason, r"^the capacity experts are not recognized as an FFN of experts \(.*mean")

    def test_refuses_experts_on_the_wrong_dimension_found_by_the_probe_at_the_rewrite(self) -> None:
        # inputs.chunk(E_l, dim=0): structurally an FFN per chunk, but chunks of sources, not of experts; only
        # running F beside its lowering on a random receive tells them apart. The finder only reads the graph,
        # so the region is found; the rewrite probes it, refuses, and leaves the graph as it was.
        model = capacity_variants.with_experts(self.deepspeed(), capacity_variants.SourceChunkExperts)
        gm, regions, refused = traced(model)
        self.assertEqual(refused, [])
        (region,) = regions
        code = gm.code
        with self.assertRaises(Refusal) as caught:
            rewrite_moe_region(gm, region)
        self.assertIs(caught.exception.node, region.dispatch)
        self.assertRegex(caught.exception.reason, r"^the capacity experts do not run as grouped experts \(recognized "
                                                  r"as gelu experts, .* differs from F on probe inputs by \d")
        self.assertEqual(gm.code, code)

    def test_the_finder_runs_nothing(self) -> None:
        # Matching reads the graph and fake values only: probing F (which runs it) is the rewrite's work.
        def ran(*args: Any, **kwargs: Any) -> float:
            raise AssertionError("the finder ran F on probe inputs")

        with unittest.mock.patch.object(expert_lowering, "capacity_probe_error", ran), \
                unittest.mock.patch.object(expert_lowering, "probe_error", ran):
            _, regions, refused = traced(self.deepspeed())
        self.assertEqual((len(regions), refused), (1, []))

    def test_refuses_a_batched_matmul_dispatch_naming_the_supported_forms(self) -> None:
        # torch.matmul(dispatch_mask.to(x.dtype).permute(1, 2, 0), x): (E, C, S) @ (S, M).
        reason = self.refusal(capacity_variants.BatchedMatmulDispatch(M, F, E, dist.group.WORLD, seed=1))
        self.assertRegex(reason, r"^the equal-split all_to_all \w+ sends \w+, not einsum\('sec,sm->ecm', "
                                 r"dispatch_mask, x\), its mm form, nor a gather of the tokens by slot")

    def test_finds_fairseqs_mm_dispatch_and_combine(self) -> None:
        # tests.models.fairseq_style: mm(mask.permute(1, 2, 0).reshape(E*C, S), x); cw.view(S, E*C).mm(out).
        gm, regions, refused = traced(FairseqStyleMoE(M, F, E, dist.group.WORLD, capacity_factor=0.5, seed=1))
        self.assertEqual(refused, [])
        (region,) = regions
        self.assertEqual((region.capacity, region.top_k, region.pairs.dispatch_mask.name), (3, 2, "dispatch_mask"))
        self.assertEqual(region.pairs.combine_weights.meta["example_value"].shape, (S, E, 3))
        self.assertIs(region.output.target, "mm")

    def test_refuses_a_capacity_agreed_by_all_reduce_naming_the_graph_break(self) -> None:
        # DeepSpeed's drop_tokens=False: C = all_reduce(max(exp_counts)); one_hot(locations, C) breaks the graph
        # (a data-dependent num_classes), so the dispatch graph gets the masks as inputs.
        seen: list[list[RefusedRegion]] = []

        def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            seen.append(find_moe_regions(gm)[1])
            return gm.forward

        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            torch.compile(self.deepspeed(drop_tokens=False), backend=backend)(torch.randn(S, M))
        reasons = [r.reason for refused in seen for r in refused]
        self.assertEqual(len(reasons), 1, reasons)
        self.assertRegex(reasons[0], r"^the dispatch mask \w+ is an input of this graph: the gate is in another graph")
        self.assertIn("compute C as a Python int", reasons[0])


if __name__ == "__main__":
    unittest.main()
