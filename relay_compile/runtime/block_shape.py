"""``BlockShape``: the static sizes of one MoE block on one rank, and what the ring's rules derive from them alone:
the owners (expert routing) and sources (token routing) a ring holds per hop, the ``HopShape`` the runtime's rules
read, a row's first projection. The decisions made before the op runs (the compile-time keep, the token switch's
threshold, the report) predict from these what the op, reading its packed weights, will hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay_compile.runtime.ring_options import (
    HopShape,
    backward_owners_per_hop,
    larger_owners,
    owners_per_hop,
    token_backward_partitions_per_hop,
    token_partitions_per_hop,
)


@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """Static sizes of one MoE block on one rank (``tokens``: the largest of the group's ranks where agreed).

    ``expert_bytes``: one expert's weights as they circulate; ``expert_params``: the elements of its matrices
    (a row's GEMM flops are twice that per pass; 0: ``expert_bytes / elem_bytes``).
    """

    tokens: int
    hidden: int
    ffn: int
    top_k: int
    experts_per_rank: int
    group_size: int
    elem_bytes: int
    expert_bytes: int
    expert_params: int = 0

    @property
    def params(self) -> int:
        return self.expert_params or self.expert_bytes // max(1, self.elem_bytes)


def grouped_owners(shape: BlockShape, min_tokens: int | None = None, *, fp8: bool = False) -> tuple[int, int]:
    """Owners per forward and per backward hop of expert routing (``ring_options.owners_per_hop``,
    ``backward_owners_per_hop``) that a ring of grouped experts runs at ``shape``, from the block's sizes alone.

    The runtime reads the packed weights (``runtime.ops``); this reads what a compile-time decision has (the
    region's shapes, before the expert function is packed), so the decisions made before the op runs (the
    compile-time keep, the token switch's threshold, the report: through ``owner_options``, which adds the larger
    stacks ``choose`` may take) predict the ring the op will run. It takes the
    packed layout of a grouped FFN: two matrices per expert, ``(out, H)`` in and ``(H, in)`` out, whose
    ``out + in`` rows sum to ``2 H + params / H`` (SwiGLU packed ``[w1; w3]``: ``2H + 3F``).
    ``min_tokens``: the group's smallest token count (its memory budget; default ``shape.tokens``). ``fp8``: the
    weights circulate in E4M3 (``runtime.fp8_experts``: one byte a weight and an fp32 scale per matrix).
    """
    return owner_options(shape, min_tokens, fp8=fp8).rules


@dataclass(frozen=True)
class OwnerOptions:
    """What a grouped expert ring may hold per forward and per backward hop: the rules' owners, and the larger
    stacks memory allows (``ring_options.larger_owners``) that ``choose`` weighs where the rules' ring would lose
    to the all-to-all."""

    rules: tuple[int, int]
    larger: tuple[tuple[int, int], ...] = ()
    # Token routing's sources per forward and per backward hop (``ring_options.token_partitions_per_hop``,
    # ``token_backward_partitions_per_hop``): any expert function.
    token: tuple[int, int] = (1, 1)


def owner_options(shape: BlockShape, min_tokens: int | None = None, *, fp8: bool = False) -> OwnerOptions:
    """``grouped_owners`` and the larger stacks beside them, from the block's sizes (as ``grouped_owners``)."""
    return stacks_of(hop_shape(shape, min_tokens, fp8))


def stacks_of(hop: HopShape) -> OwnerOptions:
    """A grouped expert ring's owners at ``hop``: the rules' (``ring_options.owners_per_hop``,
    ``backward_owners_per_hop``) and the larger stacks memory allows (``ring_options.larger_owners``). The op
    reads ``hop`` off its packed weights (``ops``), a compile-time decision off the block's sizes
    (``owner_options``)."""
    rules = (owners_per_hop(hop), backward_owners_per_hop(hop))
    return OwnerOptions(rules, tuple(larger_owners(hop, rules)), token_partitions(hop))


def token_partitions(hop: HopShape) -> tuple[int, int]:
    """Token routing's sources per forward and per backward hop at ``hop`` (the rules: any expert function)."""
    return token_partitions_per_hop(hop), token_backward_partitions_per_hop(hop)


def hop_shape(shape: BlockShape, min_tokens: int | None = None, fp8: bool = False) -> HopShape:
    """The ``HopShape`` the runtime's owner rules would read off the block's packed grouped experts."""
    s = shape
    expert_bytes = s.params + 2 * 4 if fp8 else s.expert_bytes
    return HopShape(
        ranks=s.group_size, max_tokens=s.tokens, min_tokens=s.tokens if min_tokens is None else min_tokens,
        top_k=s.top_k, row_bytes=(2 * s.hidden + s.params // max(1, s.hidden)) * s.elem_bytes,
        partition_bytes=s.experts_per_rank * expert_bytes, token_bytes=s.hidden * s.elem_bytes,
        elem_bytes=s.elem_bytes,
    )


def projection_width(shape: BlockShape) -> int:
    """Columns of a row's first projection (a grouped FFN's packed ``w13``: ``2F`` gated, ``F`` otherwise): the
    expert matrices' elements per hidden unit, less the down projection's ``F``."""
    return max(0, shape.params // max(1, shape.hidden) - shape.ffn)


def saved_projection_bytes(shape: BlockShape) -> int:
    """What ``save_projections`` holds from forward to backward: every pair's first projection."""
    return shape.tokens * shape.top_k * projection_width(shape) * shape.elem_bytes
