"""MoE layers written in other codebases' dispatch idioms (tests/models), through ``torch.compile(model,
backend="relaymoe")`` and nothing else (no Dynamo config): each region is rewritten into a ring, and three SGD
steps of the compiled layer equal the same layer run eagerly through its all-to-alls (fp32, 1e-5 of scale), in lock
step (``tests.lockstep``: each compiled step starts from the parameters the eager step started from).

Legend: T tokens per rank, H hidden, F expert FFN width, E experts, K top-k.
"""

from __future__ import annotations

import datetime
import tempfile
import unittest.mock
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.testing._internal.common_utils import run_tests

import tests.distributed
from relay_compile.backend import compiled_reports
from relay_compile.comm_events import count_comm_events
from tests.distributed import DistributedTestCase
from tests.lockstep import load_parameters, parameters_of
from tests.models.autograd_a2a import AutogradAllToAllMoE
from tests.models.data_dependent import DataDependentMoE
from tests.models.scores_first import ScoresFirstMoE

H, F, E, K, T = 16, 8, 8, 2, 12
STEPS, LR = 3, 0.05


def sgd_steps(model: nn.Module, run: Callable[[Tensor], Tensor], rank: int, x_grad: bool,
              starts: list[dict[str, Tensor]] | None = None
              ) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """Per step: the output and the gradients of every parameter (and of the tokens, with ``x_grad``), then an
    SGD update (new tokens each step); and the parameters each step started from. ``starts``: the parameters
    each step starts from instead (another run's: the two runs in lock step, ``tests.lockstep``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out, started = [], []
    for step in range(STEPS):
        if starts is not None:
            load_parameters(model, starts[step])
        started.append(parameters_of(model))
        gen = torch.Generator().manual_seed(100 * step + rank)
        x_TH, dy_TH = torch.randn(T, H, generator=gen).requires_grad_(x_grad), torch.randn(T, H, generator=gen)
        optimizer.zero_grad(set_to_none=True)
        y_TH = run(x_TH)
        (y_TH * dy_TH).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()} | ({"x": x_TH.grad} if x_grad else {})
        out.append({"y": y_TH.detach(), **grads})
        optimizer.step()
    return out, started


class Idioms(DistributedTestCase):
    def init_pg(self, backend: str = "gloo") -> dist.ProcessGroup:
        # A regression that deadlocks one rank fails in seconds, not after the harness's two minutes.
        with unittest.mock.patch.object(tests.distributed, "PG_TIMEOUT", datetime.timedelta(seconds=15)):
            return super().init_pg(backend)

    def check_rewritten_and_equal_to_eager(self, build: Callable[[], nn.Module], what: str, x_grad: bool = True,
                                           function_applies: int = 0, regions: int = 1, experts: str = "") -> None:
        """One graph, its ``regions`` regions rewritten (no all-to-all left; ``function_applies``
        autograd.Function calls before the rewrite, none after; the report's experts start with ``experts``),
        and three SGD steps equal to eager."""
        eager, compiled = build(), build()
        want, starts = sgd_steps(eager, eager, self.rank, x_grad)
        torch._dynamo.reset()
        seen = len(compiled_reports())
        with tempfile.TemporaryDirectory() as dump_dir:
            options = {"inner_compiler": "aot_eager", "dump_dir": dump_dir}
            compiled_fn = torch.compile(compiled, backend="relaymoe", options=options)
            got, _ = sgd_steps(compiled, compiled_fn, self.rank, x_grad, starts=starts)
            (graph_dir,) = Path(dump_dir).glob(f"graph*_rank{self.rank}")
            before, after = ((graph_dir / name).read_text() for name in ("0_dynamo_graph.py", "1_rewritten_graph.py"))
        reports = compiled_reports()[seen:]
        self.assertEqual([[r.status for r in g.regions] for g in reports], [["rewritten"] * regions],
                         f"{what}: {[r.reason for g in reports for r in g.regions]}")
        for region in (r for g in reports for r in g.regions):
            self.assertTrue(region.experts.startswith(experts), f"{what}: experts {region.experts}")
        x_TH = torch.randn(T, H, generator=torch.Generator().manual_seed(7 + self.rank)).requires_grad_(x_grad)
        self.check_step_events(compiled_fn, eager, x_TH, what, regions)
        # At least the layer's own autograd.Function calls (torch 2.11 also traces each functional all-to-all's
        # autograd wrapper as one).
        self.assertGreaterEqual(before.count("autograd_function_apply("), function_applies, what)
        for op in ("all_to_all_single", "autograd_function_apply", "wait_tensor"):
            self.assertNotIn(op, after, what)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            self.assertEqual(sorted(g), sorted(w))
            for name in w:
                scale = w[name].abs().max().item()
                torch.testing.assert_close(g[name], w[name], rtol=1e-5, atol=1e-5 * scale,
                                           msg=lambda m, name=name, step=step: f"{what} step {step} {name}: {m}")

    def check_step_events(self, compiled: Callable[[Tensor], Tensor], eager: Callable[[Tensor], Tensor],
                          x_TH: Tensor, what: str, regions: int) -> None:
        """The profile of one compiled step (forward + backward): no all-to-all event (the eager layer's
        ``gloo:all_to_all`` events are gone), P2P events (``gloo:send``/``recv``) instead, and each region's
        ring once forward and once backward (a checkpoint recomputing the forward ring would show twice)."""
        eager_events = count_comm_events(lambda: eager(x_TH).sum().backward())
        events = count_comm_events(lambda: compiled(x_TH).sum().backward())
        self.assertGreater(eager_events.all_to_all, 0, f"{what}: eager {eager_events.names}")  # the probe sees them
        self.assertEqual(events.all_to_all, 0, f"{what}: {events.names}")
        self.assertGreater(events.p2p, 0, f"{what}: {events.names}")
        self.assertEqual(events.ring_calls, {"relaymoe::ring_moe": regions, "relaymoe::ring_moe_backward": regions},
                         what)

    def check_idioms(self, *, inline_dispatch: bool = True) -> None:
        group = dist.group.WORLD
        self.check_rewritten_and_equal_to_eager(lambda: DataDependentMoE(H, F, E, K, group, seed=3),
                                                "repeat_interleave / boolean mask / nonzero dispatcher")
        # Its experts loop over every (source, expert) chunk: recognized, so the fused scores-before backward runs.
        self.check_rewritten_and_equal_to_eager(lambda: ScoresFirstMoE(H, F, E, K, group, seed=4),
                                                "scores before the experts", experts="grouped: swiglu")
        # Tokens that need a gradient: both token all-to-alls are autograd_function_apply ops; tokens that do
        # not: Dynamo runs the dispatch's forward inline (an in-place all-to-all into a fresh buffer).
        for x_grad in (True, False) if inline_dispatch else (True,):
            self.check_rewritten_and_equal_to_eager(lambda: AutogradAllToAllMoE(H, F, E, K, group, seed=5),
                                                    f"autograd.Function all-to-alls, x_grad={x_grad}", x_grad,
                                                    function_applies=2 if x_grad else 1)


class IdiomsWorld2(Idioms):
    def test_layers_in_other_codebases_idioms_are_rewritten_with_no_configuration_and_train_like_eager(self) -> None:
        self.init_pg()
        self.check_idioms()


class IdiomsWorld4(Idioms):
    @property
    def world_size(self) -> int:
        return 4

    def test_layers_in_other_codebases_idioms_at_world_4_train_like_eager(self) -> None:
        self.init_pg()
        self.check_idioms(inline_dispatch=False)  # a structural variant: world 2 covers it


if __name__ == "__main__":
    run_tests()
