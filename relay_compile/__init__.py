"""relay-compile: RelayMoE ring execution for expert-parallel MoE blocks, as a torch.compile backend and
as a function.

    model = torch.compile(model, backend="relaymoe")                              # the backend
    y = relay_compile.ring_moe(x, topk_ids, topk_scores, w1, w2, w3, group=ep)   # the function
    relay_compile.explain(model, *inputs)                                         # what the backend would do
"""

from typing import Any

from relay_compile import config
from relay_compile.ring_moe import ring_moe, ring_moe_experts
from relay_compile.runtime.agreement import RingInputError
from relay_compile.runtime.grouped_linear import register_grouped_linear
from relay_compile.runtime.transport import RingPeerError, RingTransportError

__all__ = [
    "RingInputError", "RingPeerError", "RingTransportError", "config", "explain", "register_grouped_linear",
    "ring_moe", "ring_moe_experts",
]


def __getattr__(name: str) -> Any:
    # The backend pulls in the graph passes; load it when used, not on `import relay_compile`.
    if name == "explain":
        from relay_compile.backend import explain

        return explain
    raise AttributeError(f"module 'relay_compile' has no attribute {name!r}")
