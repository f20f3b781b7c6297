"""Weight gradients of a ring step: summed over chunks and hops, and the packed layout they are summed in.

``WeightGrads`` holds the partials of one hop (expert routing: they then travel with their weights) or of one
step (token routing: they stay). ``pack_weights`` puts a step's weights in the grouped expert function's packed
layout (``experts.GroupedExperts``: what circulates and what chunks slice); ``unpack_grads`` returns the
gradients in the caller's layout and dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relay_compile.experts import GroupedExperts
from relay_compile.routing import Chunk


class WeightGrads:
    """Weight-gradient partials of one hop (expert routing) or one step (token routing).

    A chunk over every expert contributes whole-partition gradients, taken as they are when they come first;
    any later contribution, or a chunk over a slice of experts, adds into a buffer of ``acc_dtype`` (None:
    the gradient's dtype), zero-initialised for a slice. A weight no pair touched (an empty hop) gets zeros.
    """

    def __init__(self, weights: Sequence[Tensor], acc_dtype: torch.dtype | None = None) -> None:
        self.weights, self.acc_dtype = list(weights), acc_dtype
        self.grads: list[Tensor | None] = [None] * len(self.weights)

    def add(self, grads: Sequence[Tensor | None], chunk: Chunk | None) -> None:
        """``chunk=None``: whole-partition gradients; else gradients of ``chunk``'s expert slice."""
        whole = chunk is None or chunk.whole
        for i, g in enumerate(grads):
            if g is None:
                continue
            acc = self.grads[i]
            if acc is None and whole:
                self.grads[i] = g
                continue
            dtype = g.dtype if self.acc_dtype is None else torch.promote_types(self.acc_dtype, g.dtype)
            if acc is None:
                acc = self.grads[i] = torch.zeros_like(self.weights[i], dtype=dtype)
            elif acc.dtype != dtype:
                acc = self.grads[i] = acc.to(dtype)
            if chunk is not None and not whole:
                acc = acc[chunk.lo : chunk.hi]
            acc.add_(g)

    def result(self, dtypes: Sequence[torch.dtype | None] | None = None) -> tuple[Tensor, ...]:
        """The accumulated gradients, each in its ``dtypes`` entry (None: as accumulated; zeros in the weight's
        dtype)."""
        dtypes = dtypes or [None] * len(self.weights)
        return tuple(
            torch.zeros_like(w, dtype=d) if g is None else g.to(d or g.dtype)
            for g, w, d in zip(self.grads, self.weights, dtypes, strict=True)
        )


def pack_weights(grouped: GroupedExperts | None, weights: Sequence[Tensor]) -> list[Tensor]:
    """The weights in the expert function's packed layout (what circulates and what chunks slice)."""
    return grouped.pack(weights) if grouped is not None else list(weights)


def unpack_grads(
    grouped: GroupedExperts | None, grads: Sequence[Tensor], packed: Sequence[Tensor], weights: Sequence[Tensor]
) -> list[Tensor]:
    """Gradients of the ``packed`` weights (summed in any dtype), in the layout and dtypes of ``weights``.

    Cast before unpacking, so the unpacked copies are made in the weights' (narrower) dtype.
    """
    grads = [g.to(w.dtype) for g, w in zip(grads, packed, strict=True)]
    unpacked = grouped.unpack_grads(grads, weights) if grouped is not None else grads
    return [g.to(w.dtype) for g, w in zip(unpacked, weights, strict=True)]
