"""The layers of docs/ARCHITECTURE.md section 1: imports run downward only, and no module imports itself back.

Read from the source (every import statement of every module, at any depth: under ``TYPE_CHECKING`` and inside
functions too), so a cycle or an upward import fails here even where Python's lazy imports would hide it; and
checked in a fresh interpreter: the functional API and the runtime load no graph pass.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first: a module may import its own layer and the layers before it. Matched by the longest prefix.
LAYERS: list[tuple[str, ...]] = [
    ("relay_compile.config", "relay_compile.comm_events", "relay_compile.memory", "relay_compile.kernels",
     "relay_compile.routing", "relay_compile.grouped_gemm", "relay_compile.fp8_gemm", "relay_compile.experts",
     "relay_compile.reference"),
    ("relay_compile.runtime",),
    ("relay_compile.ring_moe",),
    ("relay_compile.passes",),
    ("relay_compile.options", "relay_compile.report", "relay_compile.backend"),
    ("relay_compile",),
    ("relay_compile.bench",),
]


def modules() -> dict[str, Path]:
    """Every module of the package by its import name (``passes/`` installs as ``relay_compile.passes``)."""
    found = {}
    for path in [*ROOT.glob("relay_compile/**/*.py"), *ROOT.glob("passes/**/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "passes":
            parts = ["relay_compile", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports anywhere in its code (``from a import b``: ``a.b`` if a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out |= subs or ({node.module} & known.keys())
    return out


def layer(module: str) -> int:
    best = max((len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes
               if module == p or module.startswith(p + "."))
    return best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


_PROBE = """
import json, sys
import relay_compile
relay_compile.ring_moe
import relay_compile.runtime.ops, relay_compile.runtime.programs.pipeline
loaded = lambda: sorted(m for m in sys.modules if m.startswith("relay_compile.passes"))
before = loaded()
import relay_compile.backend
print(json.dumps({"before": before, "after": loaded()}))
"""


class ImportsRunDownward(unittest.TestCase):
    def setUp(self) -> None:
        self.known = modules()
        self.graph = {m: imports(p, self.known) - {m} for m, p in self.known.items()}

    def test_every_import_goes_to_the_same_layer_or_below(self) -> None:
        upward = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
                  for m, deps in sorted(self.graph.items()) for d in sorted(deps) if layer(d) > layer(m)]
        self.assertEqual(upward, [])

    def test_no_import_cycle_even_under_type_checking(self) -> None:
        self.assertEqual(cycles(self.graph), [])

    def test_the_checks_see_what_they_check(self) -> None:
        # They could pass by reading nothing: the graph must hold the edges every ring goes through.
        self.assertIn("relay_compile.runtime.lowered_ffn", self.graph["relay_compile.passes.expert_lowering"])
        self.assertIn("relay_compile.passes.rewrite", self.known)
        self.assertEqual(cycles({"a": {"b"}, "b": {"a"}, "c": set()}), [["a", "b"]])
        self.assertGreater(layer("relay_compile.passes.match"), layer("relay_compile.runtime.ops"))

    def test_the_functional_api_and_the_runtime_load_no_graph_pass(self) -> None:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
        loaded = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(loaded["before"], [])
        self.assertIn("relay_compile.passes.match", loaded["after"])


if __name__ == "__main__":
    unittest.main()
