"""region: what the rewrite, the report and the backend read of a matched MoE block, whatever its dispatch family.

Each family's finder returns its own record (``match.MoERegion``: top-k routing with a counts exchange;
``capacity_match.CapacityRegion``: capacity buffers with equal splits); both implement ``Region``, so the code
downstream of matching never asks which family a block came from. A new family adds a record with these
fields and methods, and nothing else changes downstream.

A finder only reads the graph: a record holds nodes of the graph it was matched in and what their fake values
say. Running anything (F on probe inputs, its lowering) is the rewrite's work (``expert_lowering``).
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch.fx as fx

from relay_compile.runtime.block_shape import BlockShape
from relay_compile.runtime.region_fn import ExpertFnBinding
from relay_compile.runtime.specs import ScoresApplied

# What F reads: the received rows of a hop ``(R, H)`` grouped by source then local expert, with the counts and
# split sizes of the ExpertFn contract (``"rows"``); or the whole receive ``(N * E_l, C, H)`` of a capacity
# dispatch, so F runs only as grouped experts, never per hop as it is (``"capacity"``).
ExpertsInput = Literal["rows", "capacity"]


class Region(Protocol):
    """One EP MoE block of a graph, understood well enough to run as a ring.

    Nodes are those of the matched graph; ``expert_fn`` is a standalone copy of F (its own graph).
    """

    dispatch: fx.Node  # the token all-to-all (send -> recv): the region's anchor in reports and logs
    combine: fx.Node  # the reverse all-to-all
    recv: fx.Node  # end of the dispatch's wait chain: F's input
    x: fx.Node  # resident tokens (T, H)
    output: fx.Node  # y (T, H): what the ring replaces
    weights: tuple[fx.Node, ...]  # the local expert weights F reads
    expert_fn: fx.GraphModule
    binding: ExpertFnBinding
    experts_input: ExpertsInput
    experts_per_rank: int
    top_k: int
    group_name: str
    group_size: int
    nodes: frozenset[fx.Node]  # what dies once output's uses go elsewhere
    output_aliases: tuple[fx.Node, ...]  # buffers an in-place combine wrote, read after it
    scores_applied: ScoresApplied

    def block_shape(self) -> BlockShape:
        """Sizes of the block on this rank, from the nodes' fake values."""
        ...

    def idiom(self) -> str:
        """The dispatch, counts and combine forms recognized, in words (the report's ``idiom``)."""
        ...

    def describe(self) -> str:
        """One line naming the region's nodes and sizes, for logs and errors."""
        ...

    def inputs(self) -> dict[str, fx.Node]:
        """The nodes outside the region the ring reads besides ``x`` and the weights, by role."""
        ...

    def first_collective(self) -> fx.Node:
        """The region's first collective: where a rank that keeps the all-to-all checks that every rank does."""
        ...

    def insert_pairs(self) -> tuple[fx.Node, fx.Node]:
        """``(topk_ids, topk_scores)`` the ring reads, inserted at the graph's insertion point if the family
        derives them (capacity masks) or the region's own nodes."""
        ...
