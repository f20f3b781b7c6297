"""What the idiom layers of ``tests/models`` share: an EP group, a router and this rank's SwiGLU experts.

Each layer subclasses ``EPLayer`` and writes its own ``forward`` in the idiom it stands for.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch import Tensor, nn

from relay_compile.reference import moe_weights


class EPLayer(nn.Module):
    """Sizes, router ``(E, H)`` and local experts ``w1, w3: (E_l, F, H)``, ``w2: (E_l, H, F)``.

    Args:
        dim, hidden, num_experts, top_k: H, F, E, K.
        group: the EP group (N ranks); this rank owns experts [r * E_l, (r + 1) * E_l).
        seed: every rank draws the router and all experts' weights from it (``relay_compile.reference.
            moe_weights``) and keeps its own experts.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, group: dist.ProcessGroup,
                 *, seed: int = 0) -> None:
        super().__init__()
        self.group = group
        self.ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        lo = ep_rank * self.num_local_experts
        w = moe_weights(seed, dim, hidden, num_experts, experts=range(lo, lo + self.num_local_experts))
        self.router = nn.Linear(dim, num_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(num_experts, dim, generator=torch.Generator().manual_seed(seed)))
        self.w1, self.w2, self.w3 = (nn.Parameter(w[name].clone()) for name in ("w1", "w2", "w3"))

    def expert(self, e: int, x_CH: Tensor) -> Tensor:
        """Local expert ``e`` (SwiGLU) on rows ``(C, H)``."""
        return (nnf.silu(x_CH @ self.w1[e].T) * (x_CH @ self.w3[e].T)) @ self.w2[e].T
