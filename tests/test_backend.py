"""The ``relaymoe`` backend end to end: options, reports, dumps, verify, explain, inner compilers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest
import unittest.mock
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests

import relay_compile
from relay_compile.backend import _compare_outputs, compiled_reports
from relay_compile.reference import a2a_moe, moe_weights
from relay_compile.runtime.dynamo_settings import DYNAMO_SETTINGS, NON_EMPTY_BRANCHES
from tests.distributed import DistributedTestCase
from tests.models import variants
from tests.test_ring_moe import projections_read

H, F, E_L, K, T = 16, 8, 2, 2, 12


def block(x, ids, scores, w1, w2, w3):
    """A model around one all-to-all MoE block (fp32 compiles need the loop expert path)."""
    return torch.tanh(a2a_moe(x, ids, scores, w1, w2, w3, use_grouped_mm=False)) * 2


def inputs(rank: int, world: int, step: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E_L * world, generator=gen)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=gen)


def step_outputs(fn, x, ids, scores, weights) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, scores, *weights)]
    y = fn(leaves[0], ids, leaves[1], *leaves[2:])
    return [y.detach(), *torch.autograd.grad(y.square().sum(), leaves)]


class BackendOptions(unittest.TestCase):
    def test_backend_is_registered_by_entry_point(self) -> None:
        self.assertIn("relaymoe", torch._dynamo.list_backends(exclude_tags=()))

    def test_unknown_option_names_the_valid_ones(self) -> None:
        fn = torch.compile(lambda x: x + 1, backend="relaymoe", options={"routin": "expert"})
        with self.assertRaisesRegex(Exception, r"unknown option\(s\) \['routin'\]; valid options are \['routing'"):
            fn(torch.ones(2))

    def test_bad_option_value_lists_the_choices(self) -> None:
        fn = torch.compile(lambda x: x + 1, backend="relaymoe", options={"inner_compiler": "tvm"})
        with self.assertRaisesRegex(Exception, r"inner_compiler='tvm' is not one of \('inductor', 'aot_eager', 'eager'\)"):
            fn(torch.ones(2))

    def test_config_patch_and_environment_reach_the_options(self) -> None:
        from relay_compile.options import resolve

        with relay_compile.config.patch(routing="token", max_hop_rows=64):
            self.assertEqual((resolve().ring.routing, resolve().ring.max_hop_rows), ("token", 64))
        self.assertEqual(resolve({"overlap": False}).ring.overlap, False)
        with unittest.mock.patch.dict("os.environ", {"RELAYMOE_MAX_HOP_ROWS": "128"}):
            self.assertEqual(resolve().ring.max_hop_rows, 128)

    def test_option_values_of_the_wrong_type_are_refused_by_name(self) -> None:
        from relay_compile.options import resolve

        # options={...} is Python: no conversions (2.7 is not 2, True is not 1, "false" is not False).
        cases = [
            ({"max_hop_rows": 2.7}, r"option max_hop_rows=2\.7 must be an int"),
            ({"max_hop_rows": True}, r"option max_hop_rows=True must be an int"),
            ({"max_hop_rows": "64"}, r"option max_hop_rows='64' must be an int"),
            ({"overlap": "false"}, r"option overlap='false' must be a bool"),
            ({"verify": 1}, r"option verify=1 must be a bool"),
            ({"dynamic_keep": "no"}, r"option dynamic_keep='no' must be a bool"),
            ({"routing": 1}, r"option routing=1 must be a str$"),
            ({"inner_compiler": None}, r"option inner_compiler=None must be a str$"),
            ({"dump_dir": True}, r"option dump_dir=True must be a directory"),
            ({"activation_memory_budget": 1.5}, r"option activation_memory_budget=1\.5 must be a number in \[0, 1\]"),
            ({"activation_memory_budget": "0.5"}, r"option activation_memory_budget='0\.5' must be a number"),
            ({"link_gbps": "50"}, r"option link_gbps must be 'auto' or a positive bandwidth in GB/s, got '50'"),
            ({"link_gbps": 0}, r"option link_gbps must be 'auto' or a positive bandwidth in GB/s, got 0"),
            ({"link_gbps": True}, r"option link_gbps must be 'auto' or a positive bandwidth in GB/s, got True"),
            ({"save_projections": "yes"}, r"option save_projections='yes' must be True, False or 'auto'"),
            ({"save_projections": 1}, r"option save_projections=1 must be True, False or 'auto'"),
            (["routing"], r"options must be a dict \{option: value\}, got list \['routing'\]; valid options are"),
        ]
        for options, message in cases:
            with self.subTest(options=options), self.assertRaisesRegex(ValueError, f"^relaymoe: {message}"):
                resolve(options)
        self.assertIs(resolve({"save_projections": True}).ring.save_projections, True)
        with relay_compile.config.patch(save_projections="0"):  # the environment's spelling
            self.assertIs(resolve().ring.save_projections, False)
        opts = resolve({"dump_dir": Path("dumps"), "max_hop_rows": 0, "overlap": False})
        self.assertEqual((opts.dump_dir, opts.ring.max_hop_rows, opts.ring.overlap), ("dumps", None, False))
        fn = torch.compile(lambda x: x + 1, backend="relaymoe", options=[("routing", "token")])
        with self.assertRaisesRegex(Exception, r"relaymoe: options must be a dict"):
            fn(torch.ones(2))

    def test_config_values_which_may_come_from_the_environment_are_parsed_strictly(self) -> None:
        from relay_compile.options import resolve

        # What torch's config module holds for RELAYMOE_X=value: "1"/"0" as True/False, anything else verbatim.
        refused = [
            ({"dump_dir": False}, r"dump_dir=False is a switch, not a directory \(RELAYMOE_DUMP_DIR=0"),
            ({"dump_dir": "False"}, r"dump_dir='False' is a switch, not a directory"),
            ({"routing": True}, r"routing=True must be a str \(the environment's 1 and 0 read as True and False\)"),
            ({"inner_compiler": False}, r"inner_compiler=False must be a str \(the environment's 1 and 0"),
            ({"verify": "yes"}, r"verify='yes' must be a bool \(True/False; true/false/1/0 in the environment\)"),
            ({"max_hop_rows": 2.7}, r"max_hop_rows=2\.7 must be an int"),
        ]
        for values, message in refused:
            with self.subTest(config=values), relay_compile.config.patch(**values), self.assertRaisesRegex(
                ValueError, f"^relaymoe: option {message}"
            ):
                resolve()
        with relay_compile.config.patch(overlap="FALSE", remat="true", dump_dir="dumps/run1"):
            opts = resolve()
            self.assertEqual((opts.ring.overlap, opts.ring.remat, opts.dump_dir), (False, True, "dumps/run1"))
        for value in ("2.7", "-3", "1e3", "64 rows", ""):
            with self.subTest(RELAYMOE_MAX_HOP_ROWS=value), unittest.mock.patch.dict(
                "os.environ", {"RELAYMOE_MAX_HOP_ROWS": value}
            ), self.assertRaisesRegex(ValueError, r"^relaymoe: option max_hop_rows=.* \(RELAYMOE_MAX_HOP_ROWS\) "
                                                  r"must be 'auto' or a decimal row count"):
                resolve()
        with unittest.mock.patch.dict("os.environ", {"RELAYMOE_MAX_HOP_ROWS": " 64 "}):
            self.assertEqual(resolve().ring.max_hop_rows, 64)
        with unittest.mock.patch.dict("os.environ", {"RELAYMOE_MAX_HOP_ROWS": "0"}):
            self.assertIsNone(resolve().ring.max_hop_rows)
        self.assertEqual(resolve().ring.max_hop_rows, "auto")
        with relay_compile.config.patch(link_gbps=" 50.5 "):
            self.assertEqual(resolve().ring.link_gbps, 50.5)
        # "1" is a number here, not the switch torch's config module would read it as.
        with unittest.mock.patch.dict("os.environ", {"RELAYMOE_LINK_GBPS": "1"}):
            self.assertEqual(resolve().ring.link_gbps, 1.0)
        for value, message in (("fast", r"link_gbps='fast' \(RELAYMOE_LINK_GBPS\) must be 'auto' or a number"),
                               ("-3", r"link_gbps must be 'auto' or a positive bandwidth in GB/s, got -3\.0")):
            with self.subTest(RELAYMOE_LINK_GBPS=value), relay_compile.config.patch(link_gbps=value), \
                    self.assertRaisesRegex(ValueError, f"^relaymoe: option {message}"):
                resolve()
        self.assertEqual(resolve().ring.link_gbps, "auto")

    def test_the_environment_reaches_the_options_through_the_config_module(self) -> None:
        # The config module reads RELAYMOE_* once, at import: a fresh interpreter.
        env = {**os.environ, "RELAYMOE_DUMP_DIR": "0", "RELAYMOE_OVERLAP": "FALSE", "RELAYMOE_VERIFY": "1",
               "RELAYMOE_ROUTING": "token", "RELAYMOE_CHUNK_GRAPHS": "auto", "RELAYMOE_RING": "memory",
               "RELAYMOE_DYNAMIC_KEEP": "false", "RELAYMOE_LINK_GBPS": "50", "RELAYMOE_SAVE_PROJECTIONS": "true",
               "RELAYMOE_ADD_IN_GEMM": "1", "OMP_NUM_THREADS": "1"}
        script = (
            "from relay_compile.options import resolve\n"
            "try:\n    resolve()\nexcept ValueError as e:\n    print(e)\n"
            "print(resolve({'dump_dir': ''}))\n"
        )
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[1], check=True).stdout.splitlines()
        self.assertRegex(out[0], r"^relaymoe: option dump_dir=False is a switch, not a directory")
        self.assertIn("RingOptions(routing='token', overlap=False, remat=True, max_hop_rows='auto', "
                      "fp32_accumulation=True, chunk_graphs='auto', ring='memory', fp8=False, link_gbps=50.0, "
                      "save_projections=True, gather_in_gemm=False, add_in_gemm=True)", out[1])
        self.assertIn("dump_dir='', verify=True", out[1])
        self.assertIn("dynamic_keep=False", out[1])

    def test_activation_memory_budget_reaches_the_partitioner_for_this_graph_only(self) -> None:
        def saved_by(options: dict) -> int:
            """Tensors the compiled graph's forward saves for backward."""
            torch._dynamo.reset()
            x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
            fn = torch.compile(lambda x, w: ((x @ w).relu() @ w).sum(), backend="relaymoe", options=options)
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                fn(x, w)
            return len(saved)

        base = {"inner_compiler": "aot_eager"}
        # Budget 0 saves only the graph's inputs (x, w); by default the partitioner also saves x @ w's relu
        # (a matmul is not worth recomputing). torch's own setting is untouched afterwards.
        self.assertEqual(saved_by({**base, "activation_memory_budget": 0.0}), 2)
        self.assertGreater(saved_by(base), 2)
        self.assertEqual(torch._functorch.config.activation_memory_budget, 1.0)

    def test_verify_raises_on_a_mismatch_naming_the_graph(self) -> None:
        good = torch.ones(3)
        _compare_outputs([good], [good.clone()], "graph7")
        with self.assertRaisesRegex(RuntimeError, "relaymoe verify: output 0 of graph7 differs"):
            _compare_outputs([good * 1.01], [good], "graph7")


class DynamoSettings(unittest.TestCase):
    """The backend's Dynamo settings hold around calls of what it compiled, and nowhere else."""

    @staticmethod
    def probe(x):
        # A boolean mask (data-dependent shape) and a host read: each breaks the graph under Dynamo's defaults.
        return x[x > 0] * x.sum().item()

    def test_backend_captures_host_reads_and_data_dependent_shapes_only_inside_its_calls(self) -> None:
        before = {name: getattr(torch._dynamo.config, name) for name in DYNAMO_SETTINGS}
        x = torch.tensor([1.0, -2.0, 3.0])
        for fullgraph in (False, True):
            torch._dynamo.reset()
            seen = len(compiled_reports())
            compiled = torch.compile(self.probe, backend="relaymoe", fullgraph=fullgraph,
                                     options={"inner_compiler": "eager"})
            torch.testing.assert_close(compiled(x), self.probe(x))
            self.assertEqual(len(compiled_reports()) - seen, 1, f"fullgraph={fullgraph}: one graph")
            self.assertEqual({name: getattr(torch._dynamo.config, name) for name in DYNAMO_SETTINGS}, before)
        graphs: list[torch.fx.GraphModule] = []

        def other(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
            torch._dynamo.reset()
            torch.testing.assert_close(torch.compile(self.probe, backend=other)(x), self.probe(x))
        self.assertGreater(len(graphs), 1, "another backend in the same process keeps Dynamo's defaults")


class NonEmptyBranches(unittest.TestCase):
    """An emptiness test on a data-dependent size takes the general path in one graph; other branches still break."""

    @staticmethod
    def empty_test(x):
        rows = x[x > 0]
        if rows.shape[0] == 0:  # transformers' AllToAllEP: the special path for an empty receive
            return x.sum() * 0
        return rows.sum() + 1

    @staticmethod
    def size_test(x):
        rows = x[x > 0]
        if rows.shape[0] > 1:  # not an emptiness test: Dynamo cannot decide it, and breaks the graph
            return rows.sum()
        return x.sum()

    def compile_and_count(self, fn, x) -> tuple[torch.Tensor, int]:
        torch._dynamo.reset()
        NON_EMPTY_BRANCHES.clear()
        seen = len(compiled_reports())
        out = torch.compile(fn, backend="relaymoe", options={"inner_compiler": "eager"})(x)
        return out, len(compiled_reports()) - seen

    def test_an_emptiness_test_takes_the_general_path_and_a_size_test_still_breaks(self) -> None:
        x = torch.tensor([1.0, -2.0, 3.0])
        out, graphs = self.compile_and_count(self.empty_test, x)
        torch.testing.assert_close(out, self.empty_test(x))
        self.assertEqual(graphs, 1)
        self.assertEqual([(b.taken, Path(b.where).name.split(":")[0]) for b in NON_EMPTY_BRANCHES],
                         [(False, "test_backend.py")])
        self.assertRegex(NON_EMPTY_BRANCHES[0].condition, r"^Eq\(u\d+, 0\)$")
        out, graphs = self.compile_and_count(self.size_test, x)
        torch.testing.assert_close(out, self.size_test(x))
        self.assertGreater(graphs, 1)
        self.assertEqual(NON_EMPTY_BRANCHES, [])


class BackendEndToEnd(DistributedTestCase):
    def weights(self, world: int) -> list[torch.Tensor]:
        w = moe_weights(0, H, F, E_L * world, experts=range(self.rank * E_L, (self.rank + 1) * E_L))
        return [w["w1"], w["w2"], w["w3"]]

    def test_rewritten_block_matches_eager_over_steps_with_dumps_verify_and_no_recompiles(self) -> None:
        # No Dynamo config set here: the backend sets what a region needs around its own calls.
        self.init_pg()
        world = dist.get_world_size()
        weights = self.weights(world)
        reports = relay_compile.explain(block, *inputs(self.rank, world, 0), *weights)
        self.assertEqual([r.status for r in reports[0].regions], ["matched"])
        with tempfile.TemporaryDirectory() as dump_dir:
            for inner in ("aot_eager", "inductor"):
                torch._dynamo.reset()
                options = {"inner_compiler": inner, "dump_dir": dump_dir, "verify": True}
                seen = len(compiled_reports())
                compiled = torch.compile(block, backend="relaymoe", options=options)
                for step in range(3):  # three routings, one compilation
                    x, ids, scores = inputs(self.rank, world, step)
                    got = step_outputs(compiled, x, ids, scores, weights)
                    want = step_outputs(block, x, ids, scores, weights)
                    for g, w in zip(got, want):
                        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())
                graphs = compiled_reports()[seen:]
                self.assertEqual(len(graphs), 1, f"{inner}: one graph, no recompilation across routings")
                self.assertEqual([r.status for r in graphs[0].regions], ["rewritten"])
            report = json.loads(next(Path(dump_dir).glob(f"graph*_rank{self.rank}/report.json")).read_text())
            region = report["regions"][0]
            self.assertEqual((region["status"], region["group_size"]), ("rewritten", world))
            self.assertIn(region["routing_predicted"], ("expert", "token"))
            files = {p.name for p in next(Path(dump_dir).glob(f"graph*_rank{self.rank}")).iterdir()}
            self.assertLessEqual({"0_dynamo_graph.py", "1_rewritten_graph.py", "region0_decisions.txt", "report.json"},
                                 files)
            ran = sorted(f for f in files if f.startswith("region0_ring_"))  # written by the op, as it ran them
            self.assertTrue(any("_forward" in f for f in ran) and any("_backward" in f for f in ran), ran)
            rewritten = (next(Path(dump_dir).glob(f"graph*_rank{self.rank}")) / "1_rewritten_graph.py").read_text()
            self.assertIn("relaymoe.ring_moe", rewritten)
            self.assertNotIn("all_to_all_single", rewritten)

    def test_saving_ring_matches_eager_over_steps_and_reads_its_projections(self) -> None:
        # save_projections=True: the region becomes relaymoe::ring_moe_saving, whose projections the partitioner
        # saves for the backward op, which reads them (vjp_rows gets them) instead of recomputing them.
        self.init_pg()
        world = dist.get_world_size()
        weights = self.weights(world)
        for inner in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            options = {"inner_compiler": inner, "routing": "expert", "save_projections": True}
            seen = len(compiled_reports())
            compiled = torch.compile(block, backend="relaymoe", options=options)
            with projections_read() as given:
                for step in range(3):
                    x, ids, scores = inputs(self.rank, world, step)
                    got = step_outputs(compiled, x, ids, scores, weights)
                    want = step_outputs(block, x, ids, scores, weights)
                    for g, w in zip(got, want):
                        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())
            (graph,) = compiled_reports()[seen:]
            self.assertEqual([(r.status, r.saves_projections) for r in graph.regions], [("rewritten", True)])
            self.assertTrue(given and all(given), f"{inner}: a backward chunk recomputed its projections")

    def test_dumped_programs_are_the_ones_the_op_ran_with_uneven_tokens_across_ranks(self) -> None:
        # Rank r has 6 + 7 r tokens: what a call runs is decided from every rank's counts (the agreement), so
        # the dump is written by the op from that decision: the same files on every rank, naming both counts.
        self.init_pg()
        world = dist.get_world_size()
        weights = self.weights(world)
        tokens = [6 + 7 * r for r in range(world)]
        gen = torch.Generator().manual_seed(7 + self.rank)
        x = torch.randn(tokens[self.rank], H, generator=gen)
        ids = torch.stack([torch.randperm(E_L * world, generator=gen)[:K] for _ in range(tokens[self.rank])])
        scores = torch.rand(tokens[self.rank], K, generator=gen)
        with tempfile.TemporaryDirectory() as dump_dir:
            torch._dynamo.reset()
            compiled = torch.compile(block, backend="relaymoe", options={"inner_compiler": "aot_eager",
                                                                         "dump_dir": dump_dir})
            for _ in range(2):
                got = step_outputs(compiled, x, ids, scores, weights)
            for g, w in zip(got, step_outputs(block, x, ids, scores, weights)):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())
            (rank_dir,) = Path(dump_dir).glob(f"graph*_rank{self.rank}")
            dumped = {p.name: p.read_text() for p in rank_dir.iterdir() if p.name.startswith("region0_")}
        programs = sorted(n for n in dumped if n.startswith("region0_ring_"))
        self.assertTrue(programs, sorted(dumped))
        for name in programs:
            self.assertIn(f"tokens per rank {tokens}", dumped[name].splitlines()[0])
            self.assertIn("def forward(", dumped[name])
        everyone: list[object] = [None] * world
        dist.all_gather_object(everyone, (programs, dumped["region0_decisions.txt"]))
        self.assertEqual(everyone, [everyone[0]] * world)

    def test_region_split_by_a_graph_break_is_refused_and_other_backends_keep_dynamo_defaults(self) -> None:
        self.init_pg()
        world = dist.get_world_size()
        weights = self.weights(world)
        x, ids, scores = inputs(self.rank, world, 1)

        def broken(x, ids, scores, w1, w2, w3):
            return variants.a2a_moe_graph_break(x, ids, scores, w1, w2, w3, group=dist.group.WORLD)

        # A graph break inside the block (torch._dynamo.graph_break()): no graph holds a whole region.
        reports = relay_compile.explain(broken, x, ids, scores, *weights)
        refused = [r for rep in reports for r in rep.regions]
        self.assertTrue(refused and all(r.status == "refused" and "no partner" in r.reason for r in refused), refused)
        torch._dynamo.reset()
        compiled = torch.compile(broken, backend="relaymoe", options={"inner_compiler": "eager"})
        for g, w in zip(step_outputs(compiled, x, ids, scores, weights), step_outputs(broken, x, ids, scores, weights)):
            torch.testing.assert_close(g, w)
        # The same block under another backend, after relaymoe's calls: Dynamo's defaults, so .tolist() of the
        # split sizes breaks the graph as it always did.
        graphs: list[torch.fx.GraphModule] = []

        def other(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        step_outputs(torch.compile(block, backend=other), x, ids, scores, weights)
        self.assertGreater(len(graphs), 1)
        self.assertFalse(any(n.target == "item" for gm in graphs for n in gm.graph.nodes))

if __name__ == "__main__":
    run_tests()
