"""Load a script of ``examples/`` as a module, under the name its spawned ranks import it by."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as module ``name`` (once per process)."""
    if name in sys.modules:
        return sys.modules[name]
    # Spawned children unpickle ``<name>._worker``: they need the examples folder on their path.
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"cannot load examples/{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
