"""The ``relaymoe`` backend under dynamic shapes, over gloo at world 2: the token count T changes between steps.

Dynamo recompiles once with a symbolic T when T changes (automatic dynamic), or traces T symbolically from
the start with ``dynamic=True``; either way the region must stay rewritten, no step may recompile again, and
forward and gradients must equal the eager all-to-all layer. The report's block shape shows T's hint.
Where Dynamo gives the tokens and the top-k ids separate symbols (no duck sizing), the rewrite holds only while
they are equal: the matcher guards that, so a call where they differ recompiles and is left as it was.

Legend: T tokens per rank, H hidden, F expert FFN width, E experts, K top-k.
"""

from __future__ import annotations

import datetime
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.experimental._config as fx_config
from torch import Tensor, nn
from torch.testing._internal.common_utils import run_tests

import tests.distributed
from relay_compile import RingInputError
from relay_compile.backend import compiled_reports, relaymoe_backend
from relay_compile.comm_events import count_comm_events
from relay_compile.passes import dynamic_keep
from relay_compile.reference import AllToAllMoE, a2a_moe, moe_weights
from relay_compile.report import GraphReport
from relay_compile.runtime import cost_model
from tests.distributed import DistributedTestCase

# H, F differ from every T below (and from each other): Dynamo's duck sizing would give equal sizes one symbol.
H, F, E, K = 12, 8, 4, 2
TOKENS = (16, 24, 32)


class Block(nn.Module):
    """``a2a_moe`` on given ids and scores, with this rank's experts as parameters (static shapes in Dynamo)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        e_l = E // world
        w = moe_weights(0, H, F, E, experts=range(rank * e_l, (rank + 1) * e_l))
        self.w1, self.w2, self.w3 = (nn.Parameter(w[name]) for name in ("w1", "w2", "w3"))

    def forward(self, x: Tensor, ids: Tensor, scores: Tensor) -> Tensor:
        # fp32 compiles take the per-expert loop (docs/ARCHITECTURE.md section 5: torch._grouped_mm wants bf16).
        return a2a_moe(x, ids, scores, self.w1, self.w2, self.w3, use_grouped_mm=False)


def routed(rank: int, x_tokens: int, ids_tokens: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens (x_tokens, H) and a routing of ids_tokens (default: as many) of them over E experts."""
    gen = torch.Generator().manual_seed(1000 * rank + x_tokens)
    t = x_tokens if ids_tokens is None else ids_tokens
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
    return torch.randn(x_tokens, H, generator=gen), ids, torch.rand(t, K, generator=gen)


def step(fn: Callable[..., Tensor], module: nn.Module, x: Tensor, *routing: Tensor) -> list[Tensor]:
    """Output, and gradients of the float inputs and the parameters, of ``fn(x, *routing)``."""
    module.zero_grad(set_to_none=True)
    leaves = [x.clone().requires_grad_(), *(r.clone().requires_grad_(r.is_floating_point()) for r in routing)]
    y = fn(*leaves)
    y.square().sum().backward()
    return [y.detach(), *(t.grad for t in leaves if t.grad is not None), *(p.grad for p in module.parameters())]


class CountingBackend:
    """``backend="relaymoe"`` (aot_eager after the rewrite) that keeps the report of each graph it compiles."""

    def __init__(self) -> None:
        self.reports: list[GraphReport] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = relaymoe_backend(gm, example_inputs, options={"inner_compiler": "aot_eager"})
        self.reports.append(compiled_reports()[-1])
        return compiled

    def regions(self) -> list[tuple[str, int]]:
        """(status, T's hint in the block shape; 0 when refused) of every region of every graph, in order."""
        return [(r.status, r.shape.get("tokens", 0)) for report in self.reports for r in report.regions]


def _first(fn: Callable[..., Any]) -> Callable[[Tensor], Tensor]:
    """``fn`` returning only its first output where it returns a tuple (a layer's ``(y, aux)``)."""
    def call(x: Tensor) -> Tensor:
        out = fn(x)
        return out[0] if isinstance(out, tuple) else out

    return call


class Checkpointed(nn.Module):
    """``block`` under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def KEEP_BELOW_24(shape: Any, options: Any, tokens: int, *model: Any) -> str:  # noqa: N802 -- a stand-in rule
    """``dynamic_keep._choice`` as a threshold: the all-to-all below 24 tokens per rank, an expert ring from 24."""
    return "all_to_all" if tokens < 24 else "expert"


class DynamicTokenCount(DistributedTestCase):
    def init_pg(self, backend: str = "gloo") -> dist.ProcessGroup:
        # A regression that deadlocks one rank fails in seconds, not after the harness's two minutes.
        with unittest.mock.patch.object(tests.distributed, "PG_TIMEOUT", datetime.timedelta(seconds=15)):
            return super().init_pg(backend)

    def assert_steps_equal(self, got: list[Tensor], want: list[Tensor], what: str, tol: float = 1e-5) -> None:
        self.assertEqual(len(got), len(want), what)
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item(), msg=f"{what} [{i}]")

    @torch._dynamo.config.patch(capture_scalar_outputs=True)
    def test_reference_layer_stays_rewritten_as_the_token_count_changes_recompiling_at_most_once(self) -> None:
        self.init_pg()
        moe = AllToAllMoE(H, F, E, K, group=dist.group.WORLD, seed=3, use_grouped_mm=False)
        # Automatic dynamic: T=16 compiles static, T=24 recompiles with a symbolic T that T=32 reuses.
        # dynamic=True: one graph with a symbolic T from the start.
        for dynamic, graphs in ((None, [("rewritten", 16), ("rewritten", 24)]), (True, [("rewritten", 16)])):
            torch._dynamo.reset()
            backend = CountingBackend()
            compiled = torch.compile(moe, backend=backend, dynamic=dynamic)
            for tokens in TOKENS:
                x = routed(self.rank, tokens)[0]
                self.assert_steps_equal(step(compiled, moe, x), step(moe, moe, x), f"dynamic={dynamic} T={tokens}")
            self.assertEqual(backend.regions(), graphs, f"dynamic={dynamic}")

    @torch._dynamo.config.patch(capture_scalar_outputs=True)
    def test_tokens_and_ids_of_separate_symbols_are_rewritten_only_while_equal(self) -> None:
        self.init_pg()
        block = Block(self.rank, self.world_size)
        backend = CountingBackend()
        torch._dynamo.reset()
        # Without duck sizing x, ids and scores get a symbol each for one T.
        with fx_config.patch(use_duck_shape=False):
            compiled = torch.compile(block, backend=backend, dynamic=True)
            cases = [(16, None), (40, 32), (24, None)]  # (40, 32): x has more rows than the routing covers
            for x_tokens, ids_tokens in cases:
                inputs = routed(self.rank, x_tokens, ids_tokens)
                self.assert_steps_equal(step(compiled, block, *inputs), step(block, block, *inputs),
                                        f"x {x_tokens} rows, ids {ids_tokens or x_tokens}")
        # The first graph holds under its guard x.T == ids.T: the unequal call recompiled (and was left alone),
        # the equal one after it reused the first graph.
        self.assertEqual(backend.regions(), [("rewritten", 16), ("refused", 0)])
        refused = backend.reports[1].regions[0].reason
        self.assertRegex(refused, rf"^tokens \w+ have shape \(s\d+, {H}\), not \(T=s\d+, H\)")

    @torch._dynamo.config.patch(capture_scalar_outputs=True)
    def test_a_dynamic_token_count_runs_the_kept_graph_or_the_ring_per_call_from_every_ranks_largest(self) -> None:
        # "Keep below 24 tokens" stands in for the H200 cost model's decision (these shapes are far too small to
        # reach its real threshold). CPU joins the calibrated devices so the switch is built.
        self.init_pg()
        moe = AllToAllMoE(H, F, E, K, group=dist.group.WORLD, seed=3, use_grouped_mm=False)
        torch._dynamo.reset()
        backend = CountingBackend()
        with unittest.mock.patch.object(cost_model, "CALIBRATED_DEVICES", {"cuda", "cpu"}), \
                unittest.mock.patch.object(dynamic_keep, "_choice", KEEP_BELOW_24):
            compiled = torch.compile(moe, backend=backend, dynamic=True)
            # (this rank's T, the other rank's T, the variant both run): the group's largest T decides.
            mine = lambda a, b: a if self.rank == 0 else b  # noqa: E731
            cases = [(16, 16, "kept"), (32, 32, "ring"), (16, 20, "kept"), (16, 32, "ring"), (20, 16, "kept")]
            for a, b, variant in cases:
                x = routed(self.rank, mine(a, b))[0]
                before = dict(backend.reports[-1].token_switch["calls"]) if backend.reports else {variant: 0}
                events = count_comm_events(lambda: step(compiled, moe, x))
                self.assert_steps_equal(step(compiled, moe, x), step(moe, moe, x), f"T {a}/{b}")
                calls = backend.reports[-1].token_switch["calls"]
                self.assertEqual(calls[variant] - before[variant], 2, (a, b, calls))
                # The kept graph runs the traced all-to-alls, the ring graph P2P transfers only.
                self.assertEqual(events.p2p > 0, variant == "ring", (a, b, events.names))
                self.assertEqual(events.all_to_all > 0, variant == "kept", (a, b, events.names))
        self.assertEqual(len(backend.reports), 1)  # one graph, both variants: no recompile
        (region,) = backend.reports[0].regions
        self.assertEqual(region.status, "rewritten")
        self.assertIn("the graph is also compiled with this region kept", region.reason)
        switch = backend.reports[0].token_switch
        self.assertEqual((switch["regions"], switch["ring_from"]), ([0], 24), switch)
        self.assertRegex(switch["tokens"], r"^s\d+$")
        self.assertIn(f"token switch on T={switch['tokens']}: regions [0] kept per call", backend.reports[0].summary())
        # Tokens as (B, S, H), flattened by the layer: T = B*S, read from both dimensions of the input.
        torch._dynamo.reset()
        backend = CountingBackend()
        with unittest.mock.patch.object(cost_model, "CALIBRATED_DEVICES", {"cuda", "cpu"}), \
                unittest.mock.patch.object(dynamic_keep, "_choice", KEEP_BELOW_24):
            compiled = torch.compile(moe, backend=backend, dynamic=True)
            for batch, seq, variant in ((2, 8, "kept"), (3, 8, "ring"), (2, 10, "kept")):
                x = routed(self.rank, batch * seq)[0].view(batch, seq, H)
                before = dict(backend.reports[-1].token_switch["calls"]) if backend.reports else {variant: 0}
                self.assert_steps_equal(step(compiled, moe, x), step(moe, moe, x), f"B {batch} S {seq}")
                self.assertEqual(backend.reports[-1].token_switch["calls"][variant], before[variant] + 1)
        switch = backend.reports[-1].token_switch
        self.assertEqual(len(backend.reports), 1)
        self.assertRegex(switch["tokens"], r"^s\d+\*s\d+$")
        self.assertEqual(switch["calls"], {"kept": 2, "ring": 1})
        # The block inside torch.utils.checkpoint: its all-to-alls live in the checkpoint's body, switched alike.
        torch._dynamo.reset()
        backend = CountingBackend()
        checkpointed = Checkpointed(moe)
        with unittest.mock.patch.object(cost_model, "CALIBRATED_DEVICES", {"cuda", "cpu"}), \
                unittest.mock.patch.object(dynamic_keep, "_choice", KEEP_BELOW_24):
            compiled = torch.compile(checkpointed, backend=backend, dynamic=True)
            for tokens in (16, 32):
                x = routed(self.rank, tokens)[0]
                self.assert_steps_equal(step(compiled, moe, x), step(moe, moe, x), f"checkpointed T {tokens}")
        self.assertEqual(backend.reports[-1].token_switch["calls"], {"kept": 1, "ring": 1})
        self.assertRegex(backend.reports[-1].regions[0].anchor, r"^wrap_body")
        # dynamic_keep=False: one compile, no switch; the ring op decides per call (and runs the ring on the CPU).
        torch._dynamo.reset()
        seen = len(compiled_reports())
        with unittest.mock.patch.object(cost_model, "CALIBRATED_DEVICES", {"cuda", "cpu"}):
            single = torch.compile(moe, backend="relaymoe", options={"inner_compiler": "aot_eager",
                                                                     "dynamic_keep": False}, dynamic=True)
            x = routed(self.rank, 16)[0]
            self.assert_steps_equal(step(single, moe, x), step(moe, moe, x), "dynamic_keep=False")
        (report,) = compiled_reports()[seen:]
        self.assertEqual(report.token_switch, {"none": "option dynamic_keep=False"})
        self.assertEqual(report.regions[0].reason, "")
        # Rank 1 compiled the ring only (ring="always": no switch): its op's exchange meets rank 0's switch's, and
        # both raise instead of meeting different collectives.
        torch._dynamo.reset()
        options = {"inner_compiler": "aot_eager", **({"ring": "always"} if self.rank == 1 else {})}
        with unittest.mock.patch.object(cost_model, "CALIBRATED_DEVICES", {"cuda", "cpu"}), \
                unittest.mock.patch.object(dynamic_keep, "_choice", KEEP_BELOW_24):
            mixed = torch.compile(moe, backend="relaymoe", options=options, dynamic=True)
            with self.assertRaisesRegex(RingInputError, "some ranks compiled this graph with a kept variant"):
                step(mixed, moe, routed(self.rank, 16)[0])
            # Automatic dynamic: only rank 1's count changes, so only rank 1 recompiles with a symbolic T (and a
            # switch) while rank 0 runs its static graph's ring op: both raise, naming the remedy.
            torch._dynamo.reset()
            auto = torch.compile(moe, backend="relaymoe", options={"inner_compiler": "aot_eager"})
            step(auto, moe, routed(self.rank, 16)[0])
            with self.assertRaisesRegex(RingInputError, r"Mark the token dimension dynamic on every rank"):
                step(auto, moe, routed(self.rank, 16 if self.rank == 0 else 24)[0])

    @torch._dynamo.config.patch(capture_scalar_outputs=True)
    def test_torchtitan_and_transformers_layers_switch_per_call_under_a_dynamic_token_count(self) -> None:
        # The released layers (torchtitan 0.3.0, transformers' Qwen3-MoE block with its all_to_all EP), tokens
        # (1, S, H) with S dynamic: one switched graph, the kept variant below 24 tokens and the ring from 24,
        # equal to eager.
        self.init_pg()
        from tests.models.torchtitan_moe import build_torchtitan_moe, torchtitan_available
        from tests.thirdparty import packages

        layers = {"transformers qwen3_moe": (*packages.hf_moe_block("qwen3_moe", H, F, E, K), H, 1e-5)}
        if torchtitan_available():
            # Its grouped GEMMs run in bf16 (rows of 16-byte multiples): equal to bf16 sums' rounding, as in
            # tests/passes/test_match_rewrite.py.
            titan = build_torchtitan_moe(self.world_size, dim=16, hidden=F, num_experts=E, top_k=K, seed=7)
            layers["torchtitan"] = (titan, titan, 16, 1e-2)
        for name, (module, forward, hidden, tol) in layers.items():
            torch._dynamo.reset()
            seen = len(compiled_reports())
            with unittest.mock.patch.object(cost_model, "CALIBRATED_DEVICES", {"cuda", "cpu"}), \
                    unittest.mock.patch.object(dynamic_keep, "_choice", KEEP_BELOW_24):
                # backend="relaymoe" by name: its Dynamo settings (runtime.dynamo_settings) hold around the calls.
                compiled = torch.compile(forward, backend="relaymoe", options={"inner_compiler": "aot_eager"},
                                         dynamic=True)
                for seq in (16, 32, 20):
                    x = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(self.rank * 100 + seq))
                    self.assert_steps_equal(step(_first(compiled), module, x), step(_first(forward), module, x),
                                            f"{name} S {seq}", tol)
            reports = compiled_reports()[seen:]
            summary = "\n".join(r.summary() + f" {r.token_switch}" for r in reports)
            switched = [r for r in reports if "calls" in r.token_switch]
            self.assertEqual(len(switched), 1, f"{name}: {summary}")
            self.assertEqual([r.status for r in switched[0].regions], ["rewritten"], summary)
            # (torchtitan's first call compiles with a static T, which Dynamo makes dynamic at the second.)
            calls = switched[0].token_switch["calls"]
            self.assertTrue(calls["kept"] >= 1 and calls["ring"] == 1, summary)
            # The kept variant's dispatch and combine take the package's split tensors (passes.split_reads):
            # transformers reads both lists from one stacked tensor, torchtitan each from its own host copy.
            folded = switched[0].token_switch["kept_split_reads"]
            self.assertEqual([line.split(": ")[1].split(",")[0] for line in folded],
                             ["relaymoe::split_all_to_all"] * 2, f"{name}: {folded}")


if __name__ == "__main__":
    run_tests()
