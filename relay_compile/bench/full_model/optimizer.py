"""Mixed-precision AdamW: low-precision parameters and gradients, fp32 master weights and fp32 AdamW state.

Per parameter element, resident across steps: the parameter in the model's dtype (bf16: 2 bytes), an fp32
master copy (4), AdamW's ``exp_avg`` and ``exp_avg_sq`` in fp32 (4 + 4): 14 bytes; during backward the
gradient in the model's dtype (2 more, 16 in all). The step runs bucket by bucket (the embedding, each layer,
the head): a bucket's gradients are upcast into its masters' fp32 ``.grad``, released from the model, the
bucket steps, and the masters are copied back into the parameters. So the step's transient fp32 gradients
are one bucket's, not the model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class MixedPrecisionAdamW:
    """AdamW over fp32 masters of ``buckets`` (lists of model parameters); see the module docstring."""

    def __init__(self, buckets: Sequence[Sequence[nn.Parameter]], *, lr: float = 1e-4, weight_decay: float = 0.01,
                 fused: bool | None = None) -> None:
        self.params = [list(b) for b in buckets if b]
        self.masters = [[p.detach().float().clone() for p in b] for b in self.params]
        # fused needs CUDA; foreach elsewhere. One optimizer per bucket, so a bucket can step alone.
        self.optimizers = [
            torch.optim.AdamW(m, lr=lr, weight_decay=weight_decay, fused=fused, foreach=None if fused else True)
            for m in self.masters
        ]

    def zero_grad(self) -> None:
        for bucket in self.params:
            for p in bucket:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of every bucket, in turn; parameters without a gradient keep theirs at zero."""
        for params, masters, opt in zip(self.params, self.masters, self.optimizers, strict=True):
            for p, m in zip(params, masters, strict=True):
                m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
                p.grad = None
            opt.step()
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
                m.grad = None

    def state_tensors(self) -> list[Tensor]:
        """Every tensor the optimizer keeps across steps (masters, ``exp_avg``, ``exp_avg_sq``, steps)."""
        out = [m for ms in self.masters for m in ms]
        for opt in self.optimizers:
            out += [t for state in opt.state.values() for t in state.values() if isinstance(t, Tensor)]
        return out
