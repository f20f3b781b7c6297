"""overlap: post each hop's transfer before the hop's compute and wait for it as late as possible.

Contract:
    Consumes a ring program (``build.build_program``, after ``remat`` and ``sum_in_place`` for a backward) whose
    ``ring_start``/``ring_wait`` nodes carry ``meta["ring"]``. Moves only those nodes (and the ``getitem``
    nodes of a wait), never compute, so every rank keeps posting the same transfers in the same order. Guarantees, per transfer: the start comes right
    after the last node it reads (the previous transfer's wait, or the accumulation it forwards), and the wait
    right before the first node that reads what arrived. In the naive ring both sit after the hop's compute;
    afterwards the hop's compute runs between them, so the transfer proceeds while the hop computes.
    Raises ``ValueError`` if a start would not precede the compute of its hop afterwards.

Pseudo-code:
    # Step 1: for each wait, sink it (with its getitems) to just before the first reader of its results.
    # Step 2: for each start, hoist it to just after the last of its inputs.
    # Step 3: lint, recompile, check that each hop's start precedes its compute.
"""

from __future__ import annotations

import logging
import operator

import torch.fx as fx

from relay_compile.runtime.programs.instructions import COMPUTE, ring_start, ring_wait
from relay_compile.runtime.programs.schedule import RingNode

log = logging.getLogger(__name__)


def _position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _sink_wait(graph: fx.Graph, wait: fx.Node) -> None:
    """Move ``wait`` right before the first reader of what arrived, and after every hop that waits on the same
    transfer itself (``sum_in_place``: it sums into the arrivals mid-hop)."""
    items = [u for u in wait.users if u.target is operator.getitem]
    readers = [r for item in items for r in item.users]
    start = wait.args[0]
    assert isinstance(start, fx.Node)
    sharers = [u for u in start.users if u is not wait]
    pos = _position(graph)
    if readers:
        anchor = min(readers, key=pos.__getitem__)
    elif sharers:
        anchor = max(sharers, key=pos.__getitem__).next
    else:
        return
    if sharers and pos[anchor] <= max(pos[s] for s in sharers):
        raise ValueError(f"overlap: {wait.name}'s arrivals are read before a hop that sums into them completes")
    anchor.prepend(wait)
    for item in sorted(items, key=pos.__getitem__):
        anchor.prepend(item)


def _hoist_start(graph: fx.Graph, start: fx.Node) -> None:
    pos = _position(graph)
    last_input = max(start.all_input_nodes, key=pos.__getitem__)
    if last_input.op == "placeholder":
        # Placeholders must stay together at the top: start right after the last of them.
        last_input = max((n for n in graph.nodes if n.op == "placeholder"), key=pos.__getitem__)
    last_input.append(start)


def check_overlap(gm: fx.GraphModule) -> None:
    """Every hop's transfer is posted before that hop's compute starts (validate-only entry point)."""
    pos = _position(gm.graph)
    compute = {(n.meta["ring"].ring, n.meta["ring"].hop): n for n in gm.graph.nodes if n.target in COMPUTE}
    for start in (n for n in gm.graph.nodes if n.target is ring_start):
        info: RingNode = start.meta["ring"]
        hop_compute = compute.get((info.ring, info.hop))
        if hop_compute is not None and pos[start] > pos[hop_compute]:
            raise ValueError(
                f"overlap: transfer {start.name} of hop {info.hop} is posted after that hop's compute "
                f"{hop_compute.name}; its inputs are not ready before the hop"
            )


def overlap_pass(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    # Step 1: waits as late as possible.
    for wait in [n for n in graph.nodes if n.target is ring_wait]:
        _sink_wait(graph, wait)
    # Step 2: starts as early as possible.
    for start in [n for n in graph.nodes if n.target is ring_start]:
        _hoist_start(graph, start)
    # Step 3: check the result.
    graph.lint()
    gm.recompile()
    check_overlap(gm)
    log.debug("overlap: scheduled %s", type(gm).__name__)
    return gm
