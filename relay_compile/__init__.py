"""relay-compile: RelayMoE ring execution for expert-parallel MoE blocks, as a function and as a
torch.compile backend.

    y = relay_compile.ring_moe(x, topk_ids, topk_scores, w1, w2, w3, group=ep_group)
"""

from relay_compile.ring_moe import ring_moe, ring_moe_experts
from relay_compile.runtime.hop_compute import RingInputError

__all__ = ["RingInputError", "ring_moe", "ring_moe_experts"]
