"""remat: hop-scoped rematerialization of expert activations in backward ring programs.

Contract:
    Consumes a naive backward ring program: a *replay* ring whose ``hop_recompute`` nodes rebuild every hop's
    expert activations (and keep them, as activation checkpointing of the whole block would), then a *grad*
    ring whose ``hop_vjp`` nodes consume them. Guarantees afterwards: one ring; each hop's activations are
    recomputed inside that hop's ``hop_backward``, chunk by chunk, consumed and released before the next chunk,
    so no expert activation lives beyond its hop; the replay ring's transfers are gone (the grad ring already
    brings the same partition to the same hop). Raises ``ValueError`` if a ``hop_vjp`` consumes activations of
    another hop (the grad ring would then see other data than the replay), or if anything outside the replay
    ring reads from it.

Pseudo-code:
    # Step 1: for each hop_vjp(step, h, acts_h, *circ_h) with acts_h = hop_recompute(step, h, ...):
    #             replace it by hop_backward(step, h, *circ_h).
    # Step 2: erase the replay ring (recompute, transfers, getitems), checking nothing else reads it.
    # Step 3: lint, recompile.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from relay_compile.runtime.programs.instructions import hop_backward, hop_recompute, hop_vjp
from relay_compile.runtime.programs.schedule import RingNode

log = logging.getLogger(__name__)


def _fuse_hop(graph: fx.Graph, vjp: fx.Node) -> None:
    step, hop, acts, *circ = vjp.args
    info: RingNode = vjp.meta["ring"]
    if not isinstance(acts, fx.Node) or acts.target is not hop_recompute or acts.meta["ring"].hop != info.hop:
        raise ValueError(f"remat: {vjp.name} (hop {info.hop}) does not consume the recompute of its own hop")
    with graph.inserting_before(vjp):
        fused = graph.call_function(hop_backward, (step, hop, *circ))
    fused.meta["ring"] = info
    vjp.replace_all_uses_with(fused)
    graph.erase_node(vjp)


def _erase_replay(graph: fx.Graph) -> int:
    replay = [n for n in graph.nodes if "ring" in n.meta and n.meta["ring"].ring == "replay"]
    members = set(replay)
    for node in replay:
        outside = [u for u in node.users if u not in members]
        if outside:
            raise ValueError(f"remat: {outside[0].name} reads {node.name} of the replay ring")
    for node in reversed(replay):
        graph.erase_node(node)
    return len(replay)


def remat_pass(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    # Step 1: each gradient hop recomputes its own activations.
    for vjp in [n for n in graph.nodes if n.target is hop_vjp]:
        _fuse_hop(graph, vjp)
    # Step 2: the replay ring is dead.
    erased = _erase_replay(graph)
    # Step 3: check the result.
    graph.lint()
    gm.recompile()
    log.debug("remat: fused recompute into gradient hops, erased %d replay nodes", erased)
    return gm
