"""Transformer Engine's ``GroupedLinear`` experts seen through by the backend (``runtime.grouped_linear``), on CPU
with the stand-in ``tests.models.te_grouped_linear.GroupedLinear`` (TE's interface, forward behind
``torch._dynamo.disable``), registered with ``relay_compile.register_grouped_linear`` (TE's own class is found by
its module path).

megatron-core's ``TEGroupedMLP`` expert side (``MegatronStyleMoE(grouped_linear=...)``: fc1 -> GLU -> fc2 over
``tokens_per_expert.tolist()``, with and without biases) at world 2 and 4: one graph, rewritten, experts lowered
onto grouped GEMMs, equal to the eager layer over 3 steps. ``fuse_wgrad_accumulation`` (which the ring does not
honour) keeps TE's forward: the graph breaks there and the refusal says why. Outside the backend, the module's
forward is TE's.
"""

from __future__ import annotations

import unittest

import torch
from torch.testing._internal.common_utils import run_tests

import relay_compile
from relay_compile.backend import compiled_reports
from relay_compile.runtime import grouped_linear
from tests.distributed import DistributedTestCase
from tests.models.megatron_style import MegatronStyleMoE
from tests.models.te_grouped_linear import GroupedLinear

H, F, E, K, T = 16, 8, 8, 2, 12

relay_compile.register_grouped_linear(GroupedLinear)
TE_FORWARD = GroupedLinear.forward  # the disabled forward, before any compile


class GroupedLinearCases(DistributedTestCase):
    def steps(self, fn, module, batches):
        out = []
        for x in batches:
            module.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_()
            y = fn(leaf)
            y.pow(2).sum().backward()
            out.append([y.detach(), leaf.grad, *(p.grad for p in module.parameters())])
        return out

    def check_te_experts(self, bias: bool = False) -> None:
        group = torch.distributed.group.WORLD
        moe = MegatronStyleMoE(H, F, E, K, group, seed=3, bias=bias, grouped_linear=GroupedLinear)
        gen = torch.Generator().manual_seed(self.rank)
        batches = [torch.randn(T, H, generator=gen) for _ in range(3)]
        want = self.steps(moe, moe, batches)
        torch._dynamo.reset()
        seen = len(compiled_reports())
        compiled = torch.compile(moe, backend="relaymoe", options={"inner_compiler": "aot_eager"})
        got = self.steps(compiled, moe, batches)
        regions = [r for report in compiled_reports()[seen:] for r in report.regions]
        self.assertEqual([r.status for r in regions], ["rewritten"], [r.reason for r in regions])
        self.assertTrue(regions[0].experts.startswith("grouped: swiglu experts"), regions[0].experts)
        self.assertEqual("with bias" in regions[0].experts, bias, regions[0].experts)
        for step, (g, w) in enumerate(zip(got, want)):
            for a, b in zip(g, w):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        self.assertIs(GroupedLinear.forward, TE_FORWARD, "the seen-through forward outlived the backend's calls")

    def check_unsupported_option_is_refused_with_the_reason(self) -> None:
        group = torch.distributed.group.WORLD
        moe = MegatronStyleMoE(H, F, E, K, group, seed=3, grouped_linear=GroupedLinear,
                               fuse_wgrad_accumulation=True)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(self.rank))
        want = moe(x)
        torch._dynamo.reset()
        grouped_linear.UNSEEN.clear()
        seen = len(compiled_reports())
        got = torch.compile(moe, backend="relaymoe", options={"inner_compiler": "aot_eager"})(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        reasons = [r.reason for report in compiled_reports()[seen:] for r in report.regions]
        self.assertTrue(reasons, "no region reported")
        for reason in reasons:
            self.assertIn("GroupedLinear runs with fuse_wgrad_accumulation, which the ring does not honour", reason)

    def check_outside_the_backend_te_forward_runs(self) -> None:
        module = GroupedLinear(2, H, F)
        graphs = []

        def count(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        x = torch.randn(6, H)
        out = torch.compile(lambda x: module(x * 2, [2, 4]) + 1, backend=count)(x)
        torch.testing.assert_close(out, module(x * 2, [2, 4]) + 1)
        self.assertEqual(len(graphs), 2, "another backend breaks the graph at the disabled forward, as with TE")


class GroupedLinearWorld2(GroupedLinearCases):
    def test_te_grouped_linear_experts_are_rewritten_and_unsupported_options_refused(self) -> None:
        self.init_pg()
        self.check_te_experts()
        self.check_te_experts(bias=True)
        self.check_unsupported_option_is_refused_with_the_reason()
        self.check_outside_the_backend_te_forward_runs()


class GroupedLinearWorld4(GroupedLinearCases):
    @property
    def world_size(self) -> int:
        return 4

    def test_te_grouped_linear_experts_at_world_4_are_rewritten(self) -> None:
        self.init_pg()
        self.check_te_experts()


class FP8Refusals(unittest.TestCase):
    """FP8, from TE's autocast or the module's own flag, is refused with what to do instead."""

    class _Manager:
        def __init__(self, enabled: bool) -> None:
            self.enabled = enabled

        def is_fp8_enabled(self) -> bool:
            return self.enabled

    def test_fp8_autocast_and_module_fp8_name_the_ring_option(self) -> None:
        module = GroupedLinear(2, H, F)
        self.assertEqual(grouped_linear.unsupported(module, self._Manager(False)), "")
        for why in (grouped_linear.unsupported(module, self._Manager(True)),
                    grouped_linear.unsupported(type("FP8Module", (), {"fp8": True})())):
            self.assertIn("fp8_autocast", why)
            self.assertIn("options={'fp8': True}", why)
            self.assertTrue(why.endswith("which the ring does not honour"), why)


if __name__ == "__main__":
    run_tests()
