"""decision: what one call of a ring op runs, from the values every rank of its group agreed on.

``agreement.agree`` gathers every rank's claims into one table and checks them; this module reads the decision
off that table alone (so every rank makes the same one): the time model's constants (rank 0's device's,
``agreed_calibration``), the link a hop crosses (the slowest any rank reports, ``agreed_link``), and the
execution: the cost model's ``choose`` against the op's own all-to-all path where it is calibrated (CUDA), else
routing by bytes and the ring (``decide``). ``BlockSizes``: what the cost model needs beyond the table, the same
on every rank once the claims agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from relay_compile.routing import Routing, choose_routing
from relay_compile.runtime.block_shape import BlockShape, OwnerOptions
from relay_compile.runtime.cost_model import CALIBRATIONS, H200, Calibration, Choice, Execution, choose
from relay_compile.runtime.ring_options import MaxHopRows

__all__ = ["BlockSizes", "agreed_calibration", "agreed_link", "decide"]


@dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """What the cost model needs besides the agreed token counts (``runtime.cost_model.BlockShape``): the same
    on every rank once the claims agree. ``owners``: owners per forward and per backward hop of expert routing
    the ring may hold, for token counts (the rules', and larger stacks for grouped experts)."""

    ffn: int
    expert_params: int
    max_hop_rows: MaxHopRows
    owners: Callable[[list[int]], tuple[int, int] | OwnerOptions]


def agreed_link(links_N: Sequence[int]) -> float | None:
    """The link the group's decision takes hops to cross, from every rank's header (``link``, MB/s; 0: device
    copies): the slowest, since a hop waits for every rank's transfer (one rank's NIC, or a rank that was told
    ``link_gbps`` of the network the others do not see, slows them all). None where no rank crosses a link."""
    crossing = [v for v in links_N if v]
    return min(crossing) / 1000 if crossing else None


def agreed_calibration(machine: int) -> Calibration:
    """The time model's constants the group decides with: rank 0's device's (``machine``, its header's
    ``cost_model.calibration_code``; 0: ``H200``). Every rank reads the same row; a group of mixed GPU kinds
    decides alike, by one of them."""
    return CALIBRATIONS[machine - 1] if machine else H200


def decide(asked: str, ring: str, cuda: bool, volume_args: dict[str, int], tokens_N: list[int], size: int,
           sizes: BlockSizes | None, cal: Calibration = H200, saving: int = 0) -> tuple[Execution, Choice | None]:
    """The options ``routing`` and ``ring`` resolved from agreed values only (the same on every rank): by the
    cost model where it is calibrated (CUDA: ``cal``, rank 0's device's constants, with transfers over the
    group's slowest link or as device copies), else routing by bytes and the ring. ``saving``: 2 where every rank
    runs a saving op (the expert ring saves wherever it runs), else 0."""
    if cuda and sizes is not None and (asked == "auto" or ring != "always" or saving):
        shape = BlockShape(
            tokens=max(tokens_N), hidden=volume_args["hidden"], ffn=sizes.ffn, top_k=volume_args["top_k"],
            experts_per_rank=volume_args["experts_per_rank"], group_size=size, elem_bytes=volume_args["elem_bytes"],
            expert_bytes=volume_args["expert_bytes"], expert_params=sizes.expert_params)
        # The all-to-all a call keeps is the op's own path: the ring runs wherever it beats that.
        choice = choose(shape, routing=asked, ring=ring, cal=cal, owners=sizes.owners(tokens_N),
                        max_hop_rows=sizes.max_hop_rows, saving=saving, kept="op")
        return choice.execution, choice
    if ring == "never":
        return "all_to_all", None
    routing: Routing = choose_routing(**volume_args) if asked == "auto" else asked  # type: ignore[assignment]
    return routing, None
