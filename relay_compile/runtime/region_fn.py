"""region_fn: a region's F, cut out of its graph by the passes, run per hop as the ring's ``ExpertFn``.

F's inputs are the token receive, the counts exchange's received tensor, the receive's split SymInts and the
expert weights (placeholders or ``p.to_local()`` of DTensor parameters); ``ExpertFnBinding`` says which
placeholder of F's standalone copy (``passes.expert_fn.copy_expert_fn``) each of them became, and
``RegionExpertFn`` feeds them from a hop's segment.

Legend: R received rows, S segment rows, H hidden, N ranks, E_l experts per rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx
from torch import Tensor

SplitKind = Literal["source", "source_expert"]


@dataclass(frozen=True, kw_only=True)
class ExpertFnBinding:
    """How the ring's ``F(x_SH, counts_NL, splits_N, weights)`` maps onto ``expert_fn``'s placeholders.

    Every field holds placeholder positions of ``expert_fn`` (None: F does not read that input).

    - ``rows``: the receive ``(R, H)``; gets the segment ``x_SH``.
    - ``counts``: the counts exchange's received tensor; gets ``counts_NL.reshape(counts_shape)``.
    - ``splits``: ``splits[s][e]`` is the SymInt of source ``s`` (``split_kind="source"``: one per source,
      gets ``splits_N[s]``) or of (source ``s``, local expert ``e``) (``"source_expert"``: gets
      ``counts_NL[s, e]`` read on the host).
    - ``weights``: one per ``MoERegion.weights`` entry, in that order; gets the visiting partition.
    """

    rows: int
    counts: int | None
    counts_shape: tuple[int, ...] | None
    split_kind: SplitKind
    splits: tuple[tuple[int | None, ...], ...]
    weights: tuple[int, ...]


class RegionExpertFn:
    """The ring's ``ExpertFn`` over a region's F: ``(x_SH, counts_NL, splits_N, weights) -> out_SH``.

    Maps the ring's inputs onto F's placeholders (``ExpertFnBinding``) and runs F eagerly. Split SymInts get
    plain ints: per source from ``splits_N``, per (source, expert) from ``counts_NL`` read on the host.
    Two adapters are equal when their F has the same code and binding, so re-registering the same region
    (a recompile, or identical layers) reuses one spec.
    """

    def __init__(self, fn: fx.GraphModule, binding: ExpertFnBinding) -> None:
        self.fn = fn
        self.binding = binding
        self.num_inputs = len(fn.graph.find_nodes(op="placeholder"))
        # F with constants of its own (get_attr) is only equal to itself.
        constants = () if not fn.graph.find_nodes(op="get_attr") else (id(fn),)
        self._identity = (fn.code, binding, constants)
        self.__qualname__ = f"RegionExpertFn[{self.digest()}]"

    def digest(self) -> str:
        return hashlib.sha256(repr(self._identity).encode()).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RegionExpertFn) and other._identity == self._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def split_values(self, counts_NL: Tensor, splits_N: list[int]) -> list[int]:
        """The ints F's split placeholders get, in binding order (``binding.splits`` row by row, used ones)."""
        b = self.binding
        if b.split_kind == "source":
            return [int(splits_N[s]) for s, (pos,) in enumerate(b.splits) if pos is not None]
        counts_host = counts_NL.tolist()  # NOTE: device-to-host sync (F splits rows per (source, expert))
        return [counts_host[s][e] for s, row in enumerate(b.splits) for e, pos in enumerate(row) if pos is not None]

    def arguments(
        self, x_SH: Tensor, counts_NL: Tensor, split_values: Sequence[object], weights: Sequence[Tensor]
    ) -> list[object]:
        """F's arguments, in placeholder order, from the ring's inputs and ``split_values`` (``split_values``
        order; ints, or SymInts when a compiler traces this)."""
        b = self.binding
        args: list[object] = [None] * self.num_inputs
        args[b.rows] = x_SH
        if b.counts is not None:
            assert b.counts_shape is not None
            args[b.counts] = counts_NL.reshape(b.counts_shape)
        positions = [pos for row in b.splits for pos in row if pos is not None]
        for pos, value in zip(positions, split_values, strict=True):
            args[pos] = value
        if len(weights) != len(b.weights):
            raise ValueError(f"rewrite: {self.__qualname__} takes {len(b.weights)} weights, got {len(weights)}")
        for pos, w in zip(b.weights, weights):
            args[pos] = w
        return args

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor]) -> Tensor:
        return self.fn(*self.arguments(x_SH, counts_NL, self.split_values(counts_NL, splits_N), weights))
