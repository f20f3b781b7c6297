"""FP8 grouped GEMMs: rows sorted by expert, each row with its own expert's FP8 matrix, fp32 accumulation.

``scaled_grouped_linear`` is the one product the FP8 hops need, ``y[s] = (a[s] * sa[s]) @ (b[e(s)] * sb[e]).T``
for E4M3 rows ``a_SK`` with row scales and E4M3 matrices ``b_ENK`` with one scale per expert
(``kernels.fp8_quantize``): on CUDA one ``torch._scaled_grouped_mm`` (row-wise scales, fp32 accumulation,
bf16 out), elsewhere the same values by an fp32 grouped GEMM on the dequantized operands (CPU tests, CI: no
FP8 GEMM exists there). ``transposed`` gives the matrix a backward product reads (``dy @ w[e]`` is
``dy @ (w[e].T).T``): the FP8 bytes transposed, exact, the same scale.

Legend: S rows sorted by expert, E experts, K the contracted width, N the output width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relay_compile.kernels.fp8_quantize import dequantize


def scaled_grouped_linear(
    a_SK: Tensor, a_scale_S: Tensor, b_ENK: Tensor, b_scale_E: Tensor, offsets_E: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``(S, N)`` in ``out_dtype``: each row times its expert's matrix, transposed (``offsets_E``: int32 prefix
    sums of the rows per expert)."""
    if a_SK.is_cuda:
        experts, width = b_ENK.shape[0], b_ENK.shape[1]
        # Row-wise scales of the (K, N) operand: one per output column and expert, here the expert's.
        b_scale_EN = b_scale_E[:, None].expand(experts, width).contiguous()
        out = torch._scaled_grouped_mm(a_SK, b_ENK.transpose(-2, -1), a_scale_S, b_scale_EN, offs=offsets_E,
                                       out_dtype=torch.bfloat16)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
    a = dequantize(a_SK, a_scale_S)
    b = dequantize(b_ENK, b_scale_E)
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets_E).to(out_dtype)


def transposed(b_ENK: Tensor) -> Tensor:
    """``b`` with its last two dims swapped, contiguous (FP8 bytes moved, not rounded)."""
    return b_ENK.transpose(-2, -1).contiguous()
