"""pyproject.toml ships every package of the source tree (a wheel holds only the packages it lists)."""

from __future__ import annotations

import tomllib
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_packages() -> set[str]:
    """Every directory with an ``__init__.py`` under the package roots, named as it is imported."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"relay_compile": "relay_compile", **config.get("package-dir", {})}
    found = set()
    for name, path in roots.items():
        for init in (ROOT / path).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / path).parts
            found.add(".".join((name, *rel)))
    return found


class PackagingTest(unittest.TestCase):
    def test_every_source_package_is_listed(self) -> None:
        listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
        self.assertEqual(_source_packages() - listed, set(), "add these to [tool.setuptools] packages")


if __name__ == "__main__":
    unittest.main()
