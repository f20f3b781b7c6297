"""The scopes regions are matched in (``passes.scopes``): a Dynamo graph and its activation-checkpoint bodies, at
any depth, on graphs Dynamo traces from ``torch.utils.checkpoint`` calls (no process group: nothing here is
an MoE block). If a record test fails, fix the finder, not the assertion.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import Tensor
from torch.testing._internal.common_utils import TestCase, run_tests

from relay_compile.passes.liveness import assert_cones
from relay_compile.passes.scopes import RING_SAVED_CONTEXT_FN, find_scopes, keep_rings_saved


def dynamo_graph(fn, *inputs: Tensor) -> fx.GraphModule:
    """The one graph Dynamo traces from ``fn(*inputs)``."""
    graphs: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, example_inputs: list[Tensor]):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm


def inner(x: Tensor) -> Tensor:
    return torch.sin(x) * 2


def outer(x: Tensor) -> Tensor:
    return torch.utils.checkpoint.checkpoint(inner, torch.cos(x), use_reentrant=False) + 1


def stack(x: Tensor) -> Tensor:
    for _ in range(2):
        x = torch.utils.checkpoint.checkpoint(outer, x, use_reentrant=False)
    return x


class FindScopes(TestCase):
    def test_scopes_are_the_graph_then_checkpoint_bodies_depth_first_in_program_order(self) -> None:
        gm = dynamo_graph(stack, torch.randn(4, 3))
        scopes = find_scopes(gm)
        # Dynamo numbers bodies as it finishes them: an inner body before the body around it.
        self.assertEqual([s.path for s in scopes],
                         ["", "wrap_body_1", "wrap_body_1.wrap_body_0", "wrap_body_3", "wrap_body_3.wrap_body_2"])
        self.assertIsNone(scopes[0].checkpoint)
        for scope in scopes[1:]:
            assert scope.checkpoint is not None
            self.assertIs(scope.checkpoint.target, torch.ops.higher_order.tag_activation_checkpoint)
            self.assertIs(getattr(scope.checkpoint.graph.owning_module, str(scope.checkpoint.args[0].target)),
                          scope.module)
        self.assertEqual(scopes[2].anchor(next(iter(scopes[2].module.graph.nodes))),
                         f"{scopes[2].path}.{next(iter(scopes[2].module.graph.nodes)).name}")

    def test_a_body_with_rings_saves_them_under_plain_checkpointing_and_keeps_a_user_context_fn(self) -> None:
        gm = dynamo_graph(outer, torch.randn(4, 3))
        (_, body) = find_scopes(gm)
        keep_rings_saved(body)
        self.assertIs(body.module.meta["_checkpoint_context_fn"], RING_SAVED_CONTEXT_FN)
        user_fn = object()
        body.module.meta["_checkpoint_context_fn"] = user_fn
        keep_rings_saved(body)
        self.assertIs(body.module.meta["_checkpoint_context_fn"], user_fn)
        with self.assertRaisesRegex(AssertionError, "not a checkpoint body"):
            keep_rings_saved(find_scopes(gm)[0])


class Liveness(TestCase):
    def test_pure_values_nothing_reads_die_with_their_inputs_like_assert_cones(self) -> None:
        # Dynamo leaves `size = t.size(); size[1]` unread in checkpoint bodies: the region's liveness must
        # not count them as users that keep the all-to-all alive.
        graph = fx.Graph()
        t = graph.placeholder("t")
        size = graph.call_method("size", (t,))
        unread = graph.call_function(lambda s, i: s[i], (size, 1))
        used = graph.call_method("sum", (t,))
        graph.output(used)
        self.assertEqual(assert_cones(graph), {size, unread})


if __name__ == "__main__":
    run_tests()
