"""The layers of docs/ARCHITECTURE.md section 1: imports run downward only.

Checked in a fresh interpreter (this process has imported everything already): the functional API and the
runtime load no graph pass; the backend loads them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import unittest

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
    def test_the_functional_api_and_the_runtime_load_no_graph_pass(self) -> None:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
        loaded = json.loads(out.stdout.strip().splitlines()[-1])
        self.assertEqual(loaded["before"], [])
        self.assertIn("relay_compile.passes.match", loaded["after"])


if __name__ == "__main__":
    unittest.main()
