"""sum_in_place: a ring's hops add into the trailing sums as they arrive, instead of beside them.

Contract:
    Consumes a ring program whose trailing accumulators are sums a hop adds to: expert routing's backward after
    ``remat`` (the weight gradients), token routing's forward (``y``) and backward after ``remat`` (``dx``,
    ``d_scores``). There every hop ``h >= 1`` computes a partial of the sums of the partition it holds, and
    ``accumulate`` adds it to the sum of the same partition that arrives from the previous rank with the hop's
    transfer: for a moment the hop holds both (with fp32 sums, two fp32 copies of a partition's gradients, or of
    the visiting tokens' rows, beside the one it sends). Rewrites each such hop into one ``hop_*_into`` that
    reads the hop's transfer, waits for it right before its first write to the sums (a weight-gradient GEMM, a
    row scatter) and writes into the arrived sums; they become the hop's trailing result. Hop 0, whose partial
    starts the sums, is unchanged; so is expert routing's forward (nothing trails it). A grouped ring's
    ``hop_*_group`` becomes ``hop_*_group_into`` the same way.
    Moves no transfer: the ``ring_wait`` stays (waiting again is free), ``overlap`` places it after the hop.
    Raises ``ValueError`` if an ``accumulate`` does not add its own hop's partial to what its hop's transfer
    brought.

Pseudo-code:
    # Step 1: for each accumulate(n, *incoming_h, *partial_h): its hop's compute (hop_backward, hop_forward,
    #         their group forms) and the transfer (ring_start, ring_wait) the incoming sums came with.
    # Step 2: insert its _into form (step, h, start, first incoming position, *circ) in its place, route
    #         the accumulate's results to its results; erase accumulate, the hop and their getitems.
    # Step 3: lint, recompile.

Before and after, hop h >= 1 of expert routing's backward (``circ`` the weights, ``trail`` the gradient sums; token
routing's the same with its tokens and sums):

    part = hop_backward(step, h, *circ_h)                xfer = ring_start(step, i, h, n, *circ_h, *trail_h-1)
    xfer = ring_start(step, i, h, n, *circ_h, *trail_h-1)  ->  ..., incoming = ring_wait(xfer)
    ..., incoming = ring_wait(xfer)                      trail_h = hop_backward_into(step, h, xfer, n, *circ_h)
    trail_h = accumulate(k, *incoming, *part)
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import cast

import torch.fx as fx

from relay_compile.runtime.programs.instructions import (
    accumulate,
    hop_backward,
    hop_backward_group,
    hop_backward_group_into,
    hop_backward_into,
    hop_forward,
    hop_forward_group,
    hop_forward_group_into,
    hop_forward_into,
    ring_start,
    ring_wait,
)
from relay_compile.runtime.programs.schedule import RingNode

log = logging.getLogger(__name__)

# A hop computing a partial -> the same hop summing into the arrivals.
_INTO: dict[Callable[..., object], Callable[..., object]] = {
    hop_backward: hop_backward_into, hop_backward_group: hop_backward_group_into,
    hop_forward: hop_forward_into, hop_forward_group: hop_forward_group_into}


def _source(items: tuple[fx.Node, ...], targets: tuple[Callable[..., object], ...], what: str, acc: fx.Node
            ) -> fx.Node:
    """The one node whose ``getitem``s ``items`` are; it must call one of ``targets``."""
    sources = {i.args[0] for i in items if i.target is operator.getitem}
    if len(sources) != 1 or len(items) != sum(1 for i in items if i.target is operator.getitem):
        raise ValueError(f"sum_in_place: the {what} of {acc.name} are not the results of one node")
    (src,) = sources
    assert isinstance(src, fx.Node)
    if src.target not in targets:
        names = " or ".join(t.__name__ for t in targets)
        raise ValueError(f"sum_in_place: the {what} of {acc.name} come from {src.name}, not a {names}")
    return src


def _sum_in_place(graph: fx.Graph, acc: fx.Node) -> None:
    num, *rest = acc.args
    assert isinstance(num, int) and all(isinstance(a, fx.Node) for a in rest)
    incoming, partial = cast(tuple[fx.Node, ...], tuple(rest[:num])), cast(tuple[fx.Node, ...], tuple(rest[num:]))
    # Step 1: the hop's compute and the transfer its incoming sums came with.
    hop_node = _source(partial, tuple(_INTO), "partials", acc)
    wait = _source(incoming, (ring_wait,), "incoming sums", acc)
    start = wait.args[0]
    assert isinstance(start, fx.Node) and start.target is ring_start
    info: RingNode = acc.meta["ring"]
    if hop_node.meta["ring"].hop != info.hop or start.meta["ring"].hop != info.hop:
        raise ValueError(f"sum_in_place: {acc.name} (hop {info.hop}) adds a partial or sums of another hop")
    first = incoming[0].args[1]
    # Step 2: one hop that sums into the arrivals.
    step, hop, *circ = hop_node.args
    with graph.inserting_before(acc):
        fused = graph.call_function(_INTO[hop_node.target], (step, hop, start, first, *circ))
        fused.meta["ring"] = hop_node.meta["ring"]
        sums = [graph.call_function(operator.getitem, (fused, i)) for i in range(num)]
    for item in sums:
        item.meta["ring"] = hop_node.meta["ring"]
    for user in list(acc.users):
        index = user.args[1]
        assert isinstance(index, int)
        user.replace_all_uses_with(sums[index])
        graph.erase_node(user)
    graph.erase_node(acc)
    for item in (*partial, *incoming):
        if not item.users:
            graph.erase_node(item)
    if hop_node.users:
        raise ValueError(f"sum_in_place: {hop_node.name}'s partials are read outside its accumulate")
    graph.erase_node(hop_node)


def sum_in_place_pass(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    # Steps 1-2 for every accumulate.
    accs = [n for n in graph.nodes if n.target is accumulate]
    for acc in accs:
        _sum_in_place(graph, acc)
    # Step 3: check the result.
    graph.lint()
    gm.recompile()
    log.debug("sum_in_place: %d hops sum into their incoming transfers", len(accs))
    return gm
