"""``routing="auto"``: per-hop transfer volumes of each mode and the rule that picks the smaller.

Volumes are worked out by hand from what each ring sends per hop (routing.per_hop_bytes' docstring).
"""

from __future__ import annotations

import unittest

from relay_compile.routing import ROUTINGS, choose_routing, per_hop_bytes

# 16 tokens, H=32, K=4, 2 experts per rank of 1000 bytes each, bf16 (2 bytes).
ARGS = dict(tokens=16, hidden=32, top_k=4, experts_per_rank=2, expert_bytes=1000, elem_bytes=2)


class PerHopBytes(unittest.TestCase):
    def test_expert_routing_moves_the_partition_forward_and_the_partition_with_its_gradient_backward(self) -> None:
        # 2 experts * 1000 bytes; backward the weights and their gradients.
        self.assertEqual(per_hop_bytes("expert", **ARGS), {"forward": 2000, "backward": 4000})

    def test_token_routing_moves_tokens_with_their_routing_and_the_accumulators_one_hop_behind(self) -> None:
        # Row 32*2 = 64 bytes; routing per token: 4 ids * 8 bytes + 4 scores * 2 bytes = 40.
        # Forward: tokens (64 + 40) and the output accumulator (64), per token: 16 * 168 = 2688.
        # Backward: tokens and dy (128 + 40), then dx (64) and d_scores (4 * 2): 16 * (168 + 72) = 3840.
        self.assertEqual(per_hop_bytes("token", **ARGS), {"forward": 2688, "backward": 3840})

    def test_token_volumes_scale_with_the_tokens_and_expert_volumes_do_not(self) -> None:
        double = dict(ARGS, tokens=32)
        self.assertEqual(per_hop_bytes("token", **double), {"forward": 5376, "backward": 7680})
        self.assertEqual(per_hop_bytes("expert", **double), per_hop_bytes("expert", **ARGS))


class ChooseRouting(unittest.TestCase):
    def test_the_mode_with_less_forward_plus_backward_traffic_wins(self) -> None:
        # expert 6000 against token 6528.
        self.assertEqual(choose_routing(**ARGS), "expert")
        # 1100-byte experts: 6600 against 6528.
        self.assertEqual(choose_routing(**dict(ARGS, expert_bytes=1100)), "token")
        # Fewer tokens make token routing cheaper: 8 tokens, 3264 against 6000.
        self.assertEqual(choose_routing(**dict(ARGS, tokens=8)), "token")

    def test_a_tie_goes_to_expert_routing(self) -> None:
        # 6528 / 3 = 2176 bytes per hop forward = 2 experts of 1088 bytes.
        self.assertEqual(choose_routing(**dict(ARGS, expert_bytes=1088)), "expert")
        self.assertEqual(choose_routing(**dict(ARGS, expert_bytes=1087)), "expert")
        self.assertEqual(choose_routing(**dict(ARGS, expert_bytes=1089)), "token")

    def test_the_routing_options_are_auto_expert_and_token(self) -> None:
        self.assertEqual(ROUTINGS, ("auto", "expert", "token"))


if __name__ == "__main__":
    unittest.main()
