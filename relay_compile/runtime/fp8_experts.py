"""FP8 hops (option ``fp8``): SwiGLU grouped experts whose weights circulate in E4M3 and whose hop GEMMs run in FP8.

``Fp8Experts`` wraps a grouped SwiGLU expert function (``experts.GroupedFFN``, or a region's ``LoweredFFN``) as
the ring's expert function (``experts.GroupedExperts``):

- *What circulates*: ``pack`` quantizes the inner function's packed ``[w13 (E_l, 2F, H), w2 (E_l, H, F)]`` once
  per step to ``[q13, scale13 (E_l,), q2, scale2 (E_l,)]``: one fp32 scale per expert matrix
  (``kernels.fp8_quantize.quantize_experts``), so a hop moves half the weight bytes, and the transposed
  matrices the backward multiplies by are the same bytes transposed under the same scales.
- *Hop GEMMs*: every product with a weight (the forward's two, the backward's recomputed ``h13``, ``dy @ w2``
  and ``dh13 @ w13``) runs on ``fp8_gemm.scaled_grouped_linear`` (``torch._scaled_grouped_mm`` on CUDA, fp32
  accumulation), its left operand quantized row by row in one fused pass (``quantize_rows``: the SwiGLU
  activation is computed inside the quantization of the down projection's rows).
- *What sums across hops* stays wide: the weight gradients are products of bf16 rows (``dy``, ``x`` and the
  activation and pre-activation gradients) summed in fp32 (``grouped_gemm.grouped_weight_grad``), exactly as
  the bf16 ring sums them; so the gradients (``grads_like``) have the unquantized packed shapes and dtype,
  not the FP8 ones, and ``unpack_grads`` hands them back through the inner function's layout.

Every rank quantizes its own weights alike and the option is agreed (``runtime.agreement``), so what travels
has the same shapes everywhere. ``fp8_refusal`` says why an expert function cannot run so (other
activations, biases, experts not lowered onto grouped GEMMs).

Legend (docs/ARCHITECTURE.md): T tokens, S rows, H hidden, F expert FFN width, U = 2F, E_l experts per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relay_compile.experts import ExpertFn, GradSink, GroupedFFN
from relay_compile.fp8_gemm import scaled_grouped_linear, transposed
from relay_compile.grouped_gemm import grouped_weight_grad
from relay_compile.kernels.fp8_quantize import quantize_experts, quantize_rows
from relay_compile.kernels.swiglu_backward import swiglu_backward_


def _grouped_ffn(fn: ExpertFn) -> GroupedFFN | None:
    """The ``GroupedFFN`` an expert function runs: itself, or a ``LoweredFFN``'s engine."""
    inner = getattr(fn, "inner", fn)
    return inner if isinstance(inner, GroupedFFN) else None


def fp8_refusal(fn: ExpertFn) -> str | None:
    """Why ``fn`` cannot run with FP8 hops (None: it can)."""
    ffn = _grouped_ffn(fn)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if ffn is None:
        return (f"the experts ({name}) are not lowered onto grouped FFN experts; FP8 hops run grouped SwiGLU "
                "experts (the region's F runs as it is)")
    if ffn.activation != "swiglu":
        return f"the experts' activation is {ffn.activation}; FP8 hops run SwiGLU experts"
    if any(ffn.biases):
        return "the experts have biases; FP8 hops run SwiGLU experts without biases"
    return None


def _compute_dtype(fn: ExpertFn, rows: Tensor) -> torch.dtype:
    """The dtype of the FP8 GEMMs' outputs and of the weight-gradient rows: bf16 on CUDA (what
    ``torch._scaled_grouped_mm`` writes); elsewhere the experts' compute dtype, or the rows'."""
    if rows.is_cuda:
        return torch.bfloat16
    plan = getattr(fn, "plan", None)
    return getattr(plan, "compute_dtype", None) or rows.dtype


class Fp8Experts:
    """``inner``'s SwiGLU experts with FP8 weights and hop GEMMs (module docstring); a ``GroupedExperts``."""

    has_fused_backward = True

    def __init__(self, inner: ExpertFn) -> None:
        reason = fp8_refusal(inner)
        if reason is not None:
            raise ValueError(f"ring_moe: option fp8: {reason}")
        self.inner = inner
        self.__qualname__ = f"fp8[{getattr(inner, '__qualname__', type(inner).__name__)}]"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fp8Experts) and other.inner == self.inner

    def __hash__(self) -> int:
        return hash(("fp8", self.inner))

    # --- packing ---

    def num_packed(self, num_weights: int) -> int:
        return 4

    def num_grads(self, num_weights: int) -> int:
        return 2

    def pack(self, weights: Sequence[Tensor]) -> list[Tensor]:
        w13_LUH, w2_LHF = self.inner.pack(weights)  # type: ignore[attr-defined]
        return [*quantize_experts(w13_LUH), *quantize_experts(w2_LHF)]

    def grads_like(self, packed: Sequence[Tensor], weights: Sequence[Tensor]) -> list[Tensor]:
        """What the packed weights' gradients look like: ``w13``'s and ``w2``'s shapes in the experts' compute
        dtype (stand-ins: no memory)."""
        plan = getattr(self.inner, "plan", None)
        dtype = getattr(plan, "compute_dtype", None) or weights[0].dtype
        return [packed[i].new_empty((), dtype=dtype).expand(packed[i].shape) for i in (0, 2)]

    def unpack_grads(self, grads: Sequence[Tensor], weights: Sequence[Tensor]) -> list[Tensor]:
        return self.inner.unpack_grads(grads, weights)  # type: ignore[attr-defined]

    # --- entry points ---

    def forward_rows(
        self, x_SH: Tensor, offsets_G: Tensor, rows_G: Sequence[int], weights: Sequence[Tensor]
    ) -> Tensor:
        q13, s13, q2, s2 = weights
        dtype = _compute_dtype(self.inner, x_SH)
        h13_SU = scaled_grouped_linear(*quantize_rows(x_SH), q13, s13, offsets_G, dtype)
        act = quantize_rows(h13_SU, gated=True)  # silu(h1) * h3, quantized in the same pass
        del h13_SU
        return scaled_grouped_linear(*act, q2, s2, offsets_G, x_SH.dtype)

    def vjp_rows(
        self, x_TH: Tensor, tok_S: Tensor | None, offsets_G: Tensor, rows_G: Sequence[int],
        weights: Sequence[Tensor], dy_TH: Tensor, score_S: Tensor, grad_dtype: torch.dtype | None = None,
        grad_into: GradSink | None = None, d_score_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The fused SwiGLU backward (``experts._swiglu_vjp``'s steps) with FP8 products by the weights and bf16
        (or the compute dtype's) weight-gradient GEMMs summed in ``grad_dtype``."""
        q13, s13, q2, s2 = weights
        dtype = _compute_dtype(self.inner, x_TH)
        counts = list(rows_G) or None
        dy_SH = (dy_TH if tok_S is None else torch.index_select(dy_TH, 0, tok_S)).to(dtype)
        g_SF = scaled_grouped_linear(*quantize_rows(dy_SH), transposed(q2), s2, offsets_G, dtype)  # dy @ w2[e]
        x_SH = (x_TH if tok_S is None else torch.index_select(x_TH, 0, tok_S)).to(dtype)
        h13_SU = scaled_grouped_linear(*quantize_rows(x_SH), q13, s13, offsets_G, dtype)
        d_score_S = swiglu_backward_(h13_SU, g_SF, score_S, d_score_out)  # g <- score * act, h13 <- dh13
        into = grad_into() if grad_into is not None else None  # may wait for the ring's incoming sum
        into13, into2 = into if into is not None else (None, None)
        dw2 = grouped_weight_grad(dy_SH, g_SF, offsets_G, counts, grad_dtype, into2)
        del dy_SH, g_SF
        dw13 = grouped_weight_grad(h13_SU, x_SH, offsets_G, counts, grad_dtype, into13)
        del x_SH
        dx_SH = scaled_grouped_linear(*quantize_rows(h13_SU), transposed(q13), s13, offsets_G, x_TH.dtype)
        return dx_SH, d_score_S, [] if into is not None else [dw13, dw2]


def fp8_experts(fn: ExpertFn) -> Fp8Experts:
    """``fn`` with FP8 hops (``fn`` itself where it already has them); ``ValueError`` naming the option where it
    cannot (``fp8_refusal``)."""
    return fn if isinstance(fn, Fp8Experts) else Fp8Experts(fn)
