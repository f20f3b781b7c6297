"""Expert functions: what one ring hop calls on the (token, expert) pairs that meet there.

An expert function ``F`` is the block of an all-to-all dispatcher that runs between the two all-to-alls
(DESIGN.md section 4). The ring calls it verbatim, once per hop (or per bounded chunk of a hop):

    out_SH = F(x_SH, counts_NL, splits_N, weights)

- ``x_SH``: the rows of one (source rank, owner partition) segment, sorted by local expert ``(S, H)``.
- ``counts_NL``: int64 ``(N, E_l)`` on ``x``'s device; row ``src`` holds the rows per local expert, every other
  row is zero (the counts an owner receives from the a2a counts exchange, restricted to one source).
- ``splits_N``: host ints, rows per source rank (``counts_NL.sum(1)``); ``sum(splits_N) == S``.
- ``weights``: the visiting partition's tensors, in the order the caller passed them.

``F`` must be a pure function of its inputs (the backward recomputes it per hop) and differentiable with
respect to ``x_SH`` and ``weights``.

Legend: S rows of a segment, H hidden, F expert FFN width, N ranks in the EP group, E_l experts per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as nnf
from torch import Tensor

ExpertFn = Callable[[Tensor, Tensor, list[int], Sequence[Tensor]], Tensor]
Activation = Literal["swiglu", "silu", "gelu"]
ACTIVATIONS: tuple[str, ...] = ("swiglu", "silu", "gelu")


def grouped_mm_supported(x: Tensor, *weights: Tensor) -> bool:
    """``torch._grouped_mm`` runs bf16 on CUDA and any float dtype in eager on CPU, on 16-byte-aligned rows."""
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, *weights))
    return aligned and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def _grouped_linear(x_SD: Tensor, w_EOD: Tensor, offsets_E: Tensor | None, counts_E: list[int] | None) -> Tensor:
    """``y[s] = x[s] @ w[e(s)].T`` for rows sorted by expert: one grouped GEMM, or a loop over experts."""
    if offsets_E is not None:
        return torch._grouped_mm(x_SD, w_EOD.transpose(-2, -1), offs=offsets_E)
    assert counts_E is not None
    chunks = torch.split(x_SD, counts_E)
    return torch.cat([c @ w_EOD[e].T for e, c in enumerate(chunks)], dim=0)


def expert_ffn(
    x_SH: Tensor,
    counts_L: Tensor,
    w1_LFH: Tensor,
    w2_LHF: Tensor,
    w3_LFH: Tensor | None = None,
    *,
    activation: Activation = "swiglu",
    use_grouped_mm: bool | None = None,
) -> Tensor:
    """The experts' FFN on rows sorted by local expert, in torchtitan's weight layout.

    Args:
        x_SH: rows sorted by local expert ``(S, H)``.
        counts_L: rows per local expert ``(E_l,)``, int, on ``x``'s device; sums to S.
        w1_LFH, w3_LFH: ``(E_l, F, H)``; w3 only for ``swiglu``.
        w2_LHF: ``(E_l, H, F)``.
        use_grouped_mm: None picks ``torch._grouped_mm`` where it runs (see ``grouped_mm_supported``);
            False loops over experts, which reads the counts on the host.
            # NOTE: the loop path is a device-to-host sync.

    Returns:
        ``(S, H)``: ``w2 @ act(w1 @ x) [* (w3 @ x)]`` per row, with its own expert's weights.
    """
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x_SH, w1_LFH, w2_LHF)
    if use_grouped_mm:
        offsets_L, counts_host = torch.cumsum(counts_L, 0, dtype=torch.int32), None
    else:
        offsets_L, counts_host = None, counts_L.tolist()
    h_SF = _grouped_linear(x_SH, w1_LFH, offsets_L, counts_host)
    if activation == "swiglu":
        assert w3_LFH is not None, "swiglu needs w3"
        h_SF = nnf.silu(h_SF) * _grouped_linear(x_SH, w3_LFH, offsets_L, counts_host)
    elif activation == "silu":
        h_SF = nnf.silu(h_SF)
    elif activation == "gelu":
        h_SF = nnf.gelu(h_SF)
    else:
        raise ValueError(f"expert_ffn: unknown activation {activation!r}; use one of {ACTIVATIONS}")
    return _grouped_linear(h_SF, w2_LHF, offsets_L, counts_host)


def ffn_expert_fn(activation: Activation = "swiglu", use_grouped_mm: bool | None = None) -> ExpertFn:
    """The ring's expert function for ``expert_ffn``: weights are ``(w1, w2)`` or ``(w1, w2, w3)``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"ring_moe: activation={activation!r} is not one of {ACTIVATIONS}")

    def ffn(x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor]) -> Tensor:
        return expert_ffn(
            x_SH, counts_NL.sum(0), *weights, activation=activation, use_grouped_mm=use_grouped_mm
        )

    ffn.__qualname__ = f"expert_ffn[{activation}]"
    return ffn
