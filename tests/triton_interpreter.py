"""Running a kernel's check under Triton's interpreter (``TRITON_INTERPRET=1``), so that the Triton kernels'
logic is tested on the CPU: in a process of its own, since the variable is read when Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import unittest


def run_interpreted(case: unittest.TestCase, script: str, timeout: float = 120) -> None:
    """Run ``script`` (dedented; it prints ``ok`` once its checks passed) from the repository root under Triton's
    interpreter; fail ``case`` with its stderr if it did not pass, skip it where Triton is not installed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=timeout)
    if "No module named 'triton'" in done.stderr:
        case.skipTest("Triton is not installed")
    case.assertEqual(done.returncode, 0, done.stderr[-3000:])
    case.assertIn("ok", done.stdout)
