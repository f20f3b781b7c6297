"""``relay_compile.bench.capacity.capacity_search``: the largest multiple of the step under a memory budget."""

from __future__ import annotations

import unittest

from relay_compile.bench.capacity import capacity_search
from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.rows import A2A_EAGER, RowSpec, build_eager_a2a
from tests.bench.standin_case import StandinTestCase


class CapacitySearchTest(StandinTestCase):
    def test_capacity_search_finds_the_largest_multiple_of_step_under_the_budget(self) -> None:
        cfg = LayerConfig(name="c", hidden=16, ffn=8, experts=8, top_k=2, tokens=256, ep=2, dtype="fp32",
                          device="cpu")
        spec = RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a")
        res = capacity_search(cfg, spec, 200_000, step=64, max_tokens=4096)
        fitting = [t for t, b in res.probes if b is not None and b <= 200_000]
        over = [t for t, b in res.probes if b is None or b > 200_000]
        self.assertEqual(res.max_tokens, max(fitting))
        self.assertEqual(min(over), res.max_tokens + 64)
        self.assertFalse(res.limited_by_search)


if __name__ == "__main__":
    unittest.main()
