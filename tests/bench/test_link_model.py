"""The link model (``relay_compile.bench.link_model``): bytes, transfers and modeled times of a2a and ring rows."""

from __future__ import annotations

import unittest

from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.link_model import link_model
from relay_compile.bench.rows import RowSpec, build_eager_a2a


class LinkModelTest(unittest.TestCase):
    def test_expert_routing_moves_the_partition_per_hop_and_overlap_hides_the_smaller_side(self) -> None:
        cfg = LayerConfig(name="m", hidden=2048, ffn=768, experts=128, top_k=8, tokens=65536, ep=8)
        ring = RowSpec(name="ring", build=build_eager_a2a, kind="ring")
        m = link_model(cfg, ring, fwd_ms=8.0, bwd_ms=16.0, gbps=450.0)
        partition = 16 * 3 * 2048 * 768 * 2
        self.assertEqual((m.bytes_fwd, m.bytes_bwd, m.transfers_fwd, m.transfers_bwd), (partition, 2 * partition, 7, 8))
        t_fwd, t_bwd = partition / 450e6, 2 * partition / 450e6  # ms
        self.assertAlmostEqual(m.link_ms, 7 * t_fwd + 8 * t_bwd)
        self.assertAlmostEqual(m.total_ms, 7 * max(1.0, t_fwd) + 1.0 + 7 * max(2.0, t_bwd) + 2.0 + t_bwd)
        seq = link_model(cfg, RowSpec(name="s", build=build_eager_a2a, kind="ring", overlap=False), 8.0, 16.0, 450.0)
        self.assertAlmostEqual(seq.total_ms, 24.0 + seq.link_ms)
        a2a = link_model(cfg, RowSpec(name="a", build=build_eager_a2a, kind="a2a"), 8.0, 16.0, 450.0)
        self.assertEqual(a2a.bytes_fwd, 65536 * 8 * 2048 * 2 * 7 // 8)


if __name__ == "__main__":
    unittest.main()
