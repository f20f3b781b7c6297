"""A stand-in for Transformer Engine's ``GroupedLinear`` (TE cannot be imported without a GPU): its interface and
semantics as ``transformer_engine.pytorch.GroupedLinear`` 2.20 has them, and its forward behind
``torch._dynamo.disable`` as TE's ``@no_torch_dynamo`` puts it, so Dynamo breaks the graph at it unless the
backend sees it through (``relay_compile.runtime.grouped_linear``, where the tests register this class).

    GroupedLinear(num_gemms, in_features, out_features, bias=True, return_bias=False,
                  fuse_wgrad_accumulation=False, params_dtype=None)
    forward(inp, m_splits) -> y: rows split by m_splits (a list or an int64 tensor), y_i = x_i W_i^T + b_i

Weights ``weight{i}`` (out, in) and biases ``bias{i}`` (out,), one per GEMM; ``return_bias``: the biases are not
added but returned, ``(y, [b_0, ...])``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import Tensor, nn


class GroupedLinear(nn.Module):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True,
                 return_bias: bool = False, fuse_wgrad_accumulation: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.fp8 = False
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features, dtype=dtype)))
            bias_i = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
            self.register_parameter(f"bias{i}", bias_i)
            nn.init.normal_(getattr(self, f"weight{i}"), std=in_features ** -0.5)

    @torch._dynamo.disable
    def forward(self, inp: Tensor, m_splits: Tensor | list[int]) -> Tensor | tuple[Tensor, list[Tensor]]:
        splits = m_splits.tolist() if isinstance(m_splits, Tensor) else list(m_splits)
        if len(splits) != self.num_gemms:
            raise ValueError(f"Shape of splits ({len(splits)}) does not match number of GEMMs ({self.num_gemms}).")
        pieces = torch.split(inp, splits)
        outs = [nnf.linear(x, getattr(self, f"weight{i}"), getattr(self, f"bias{i}") if self.apply_bias else None)
                for i, x in enumerate(pieces)]
        out = torch.cat(outs)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out
