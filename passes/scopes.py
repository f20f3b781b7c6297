"""scopes: the graphs MoE regions are matched and rewritten in: a Dynamo graph and the bodies of its activation
checkpoints (``torch.utils.checkpoint``), at any depth.

Dynamo traces ``checkpoint(block, x)`` as ``tag_activation_checkpoint(wrap_body_0, x, *lifted)`` with every op
of the block in the ``wrap_body_0`` subgraph. aot_autograd later runs that body under the checkpoint's policy
(plain checkpointing: every op ``PREFER_RECOMPUTE``), tagging the ops it traces, and its partitioner recomputes
tagged values in backward instead of saving them. A region in a body is rewritten in that body, so the ring
call stays inside the checkpoint and the rest of the block (attention, norms, the router) keeps the user's
memory intent: recomputed in backward, not saved. The ring itself needs no checkpoint (its backward,
``relaymoe::ring_moe_backward``, recomputes its hops from ``x``, the ids, scores and weights): ``y`` is the
only value of it a backward could want, and ``keep_rings_saved`` makes the policy save it rather than run
the forward ring again inside the backward.

Contract:
    ``find_scopes(gm)`` is pure: the top graph, then each checkpoint body in program order, depth-first (a
    body module called twice is one scope). Other higher-order ops are not scopes: a user autograd.Function's
    all-to-all is read from the calling graph (``fx_nodes.function_all_to_all``); all-to-alls in control flow
    or ``wrap`` bodies are refused (``fx_nodes.subgraph_all_to_alls``).
    ``keep_rings_saved(scope)``, after rings were inserted into a checkpoint body: the body's checkpoint policy
    becomes "the user's policy, except ``relaymoe::ring_moe`` is MUST_SAVE". Plain checkpointing gets a
    selective-checkpoint policy with that one exception; a body with the user's own ``context_fn`` keeps it
    unchanged (its policy decides the ring like any op; logged).

Pseudo-code:
    # Step 1: scopes: the top graph, then for each tag_activation_checkpoint node its body, recursively.
    # Step 2 (after the rewrite of a body's regions): its checkpoint policy saves the ring's output.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from relay_compile.passes.fx_nodes import checkpoint_body
from relay_compile.runtime.ops import RING_MOE, RING_MOE_SAVING

log = logging.getLogger(__name__)

__all__ = ["Scope", "find_scopes", "keep_rings_saved"]


def _ring_saved_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Plain checkpointing's policy (recompute every op), except the ring: its outputs are saved (a saving ring's
    projections too: recomputing them would run the ring's forward again)."""
    return CheckpointPolicy.MUST_SAVE if op in (RING_MOE, RING_MOE_SAVING) else CheckpointPolicy.PREFER_RECOMPUTE


# The body's context_fn for plain checkpointing (a module-level partial: Dynamo's recompile guards and
# torch's ``_checkpoint_context_fn`` reader see one stable object).
RING_SAVED_CONTEXT_FN = functools.partial(create_selective_checkpoint_contexts, _ring_saved_policy)


@dataclass(frozen=True, kw_only=True)
class Scope:
    """A graph regions are matched in: the Dynamo graph, or the body of one of its activation checkpoints."""

    module: fx.GraphModule  # owns the graph the region records name
    path: str  # "" for the top graph; "wrap_body_0", "wrap_body_0.wrap_body_0" for (nested) bodies
    checkpoint: fx.Node | None = None  # the tag_activation_checkpoint node that calls the body

    def anchor(self, n: fx.Node) -> str:
        """A node's name for reports: qualified by the body it sits in."""
        return f"{self.path}.{n.name}" if self.path else n.name


def find_scopes(gm: fx.GraphModule) -> list[Scope]:
    """Step 1: ``gm`` and the bodies of its activation checkpoints, depth-first in program order."""
    scopes = [Scope(module=gm, path="")]
    seen = {id(gm)}

    def visit(parent: Scope) -> None:
        for n in parent.module.graph.nodes:
            body = checkpoint_body(n)
            if body is None or id(body) in seen:
                continue
            seen.add(id(body))
            name = str(n.args[0].target) if isinstance(n.args[0], fx.Node) else n.name
            scope = Scope(module=body, path=f"{parent.path}.{name}".lstrip("."), checkpoint=n)
            scopes.append(scope)
            visit(scope)

    visit(scopes[0])
    return scopes


def keep_rings_saved(scope: Scope) -> None:
    """Step 2: the checkpoint around ``scope`` saves the output of the rings in it instead of recomputing them.

    Before: ``wrap_body_0.meta`` has no ``_checkpoint_context_fn`` (plain checkpointing: aot_autograd tags every
    op of the body ``PREFER_RECOMPUTE``). After: ``_checkpoint_context_fn`` is ``RING_SAVED_CONTEXT_FN``, the same
    policy with ``relaymoe::ring_moe`` ``MUST_SAVE``. A user ``context_fn`` is left as it is.
    """
    assert scope.checkpoint is not None, f"scopes: {scope.path or 'the top graph'} is not a checkpoint body"
    meta = scope.module.meta
    if meta.get("_checkpoint_context_fn", RING_SAVED_CONTEXT_FN) is not RING_SAVED_CONTEXT_FN:
        log.debug("scopes: %s has the user's context_fn: its policy decides whether the ring is recomputed",
                  scope.path)
        return
    meta["_checkpoint_context_fn"] = RING_SAVED_CONTEXT_FN
