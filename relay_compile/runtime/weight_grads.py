"""Weight gradients of a ring step: summed over chunks and hops, and the packed layout they are summed in.

``WeightGrads`` holds the partials of one hop (expert routing: they then travel with their weights) or of one
step (token routing: they stay). ``pack_weights`` puts a step's weights in the grouped expert function's packed
layout (``experts.GroupedExperts``: what circulates and what chunks slice); ``unpack_grads`` returns the
gradients in the caller's layout and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from relay_compile.experts import GroupedExperts
from relay_compile.routing import Chunk


class WeightGrads:
    """Weight-gradient sums of one hop (expert routing) or one step (token routing).

    Contributions come per chunk, either as gradients (``add``) or written by the chunk's GEMMs into the
    accumulators ``sink`` gives them. A chunk over every expert contributes whole-partition gradients,
    taken as they are when they come first (no accumulator is allocated); any later contribution, or a
    chunk over a slice of experts, adds into accumulators of the sum dtype (``acc_dtype`` or wider),
    zero-initialised. ``into`` (expert routing, hops after the first): the accumulators are the travelling
    sums arriving from the previous rank, fetched when the first contribution is about to be added (the
    call may block on that transfer), so a hop never holds a partial of its own beside them. A weight no
    pair touched (an empty hop) gets zeros, or the incoming sum unchanged.
    """

    def __init__(
        self, weights: Sequence[Tensor], acc_dtype: torch.dtype | None = None,
        into: Callable[[], Sequence[Tensor]] | None = None,
    ) -> None:
        self.weights, self.acc_dtype, self.into = list(weights), acc_dtype, into
        self.grads: list[Tensor | None] = [None] * len(self.weights)
        self._accumulating = False

    def _sum_dtype(self, weight: Tensor) -> torch.dtype:
        return weight.dtype if self.acc_dtype is None else torch.promote_types(self.acc_dtype, weight.dtype)

    def _accumulators(self) -> list[Tensor]:
        """The sums, made accumulators once: the incoming ones (``into``), else zeros or widened firsts."""
        if not self._accumulating:
            self._accumulating = True
            if self.into is not None:
                incoming = list(self.into())
                assert len(incoming) == len(self.weights), "weight_grads: the incoming sums do not match"
                self.grads = list(incoming)  # type: ignore[arg-type]
            for i, (g, w) in enumerate(zip(self.grads, self.weights, strict=True)):
                if g is None:
                    self.grads[i] = torch.zeros_like(w, dtype=self._sum_dtype(w))
                elif self.into is None and g.dtype != self._sum_dtype(w):
                    self.grads[i] = g.to(self._sum_dtype(w))
        return self.grads  # type: ignore[return-value]

    def _takes_as_is(self, chunk: Chunk | None) -> bool:
        whole = chunk is None or chunk.whole
        return whole and self.into is None and not self._accumulating and all(g is None for g in self.grads)

    def sink(self, chunk: Chunk | None) -> list[Tensor] | None:
        """The accumulators ``chunk``'s weight-gradient GEMMs add into (its experts' slices), or None where
        its gradients are better taken as they are (``add``)."""
        if self._takes_as_is(chunk):
            return None
        accs = self._accumulators()
        if chunk is None or chunk.whole:
            return list(accs)
        return [a[chunk.lo : chunk.hi] for a in accs]

    def add(self, grads: Sequence[Tensor | None], chunk: Chunk | None) -> None:
        """``chunk=None``: whole-partition gradients; else gradients of ``chunk``'s expert slice."""
        if self._takes_as_is(chunk):
            self.grads = list(grads)
            return
        sinks = self.sink(chunk)
        assert sinks is not None
        for acc, g in zip(sinks, grads, strict=True):
            if g is not None:
                acc.add_(g)

    def result(self, dtypes: Sequence[torch.dtype | None] | None = None) -> tuple[Tensor, ...]:
        """The accumulated gradients, each in its ``dtypes`` entry (None: as accumulated; zeros in the weight's
        dtype). With ``into``, the incoming sums themselves (waited for if no pair contributed)."""
        if self.into is not None:
            return tuple(self._accumulators())
        dtypes = dtypes or [None] * len(self.weights)
        return tuple(
            torch.zeros_like(w, dtype=d) if g is None else g.to(d or g.dtype)
            for g, w, d in zip(self.grads, self.weights, dtypes, strict=True)
        )


def pack_weights(grouped: GroupedExperts | None, weights: Sequence[Tensor]) -> list[Tensor]:
    """The weights in the expert function's packed layout (what circulates and what chunks slice)."""
    return grouped.pack(weights) if grouped is not None else list(weights)


def grads_like(grouped: GroupedExperts | None, packed: Sequence[Tensor], weights: Sequence[Tensor]) -> list[Tensor]:
    """Tensors shaped and typed like the packed weights' gradients (what ``WeightGrads`` sums and what trails
    the weights): the packed weights themselves, unless the expert function circulates them otherwise than
    their gradients (FP8 weights with their scales, ``runtime.fp8_experts``: its ``grads_like``)."""
    like = getattr(grouped, "grads_like", None)
    return list(packed) if like is None else like(packed, weights)


def unpack_grads(
    grouped: GroupedExperts | None, grads: Sequence[Tensor], like: Sequence[Tensor], weights: Sequence[Tensor]
) -> list[Tensor]:
    """Gradients of the packed weights (summed in any dtype), in the layout and dtypes of ``weights``;
    ``like``: ``grads_like``'s.

    Cast before unpacking, so the unpacked copies are made in the weights' (narrower) dtype.
    """
    grads = [g.to(w.dtype) for g, w in zip(grads, like, strict=True)]
    unpacked = grouped.unpack_grads(grads, weights) if grouped is not None else grads
    return [g.to(w.dtype) for g, w in zip(unpacked, weights, strict=True)]
