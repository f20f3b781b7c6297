"""pairing: step 2 of matching top-k regions, each combine all-to-all paired with its dispatch on dataflow.

A combine's partner is the closest token all-to-all upstream of its input whose split lists are its own swapped
(what was received goes back). An all-to-all left without a partner is refused with its likely cause: a
partner whose splits are not swapped, a graph break (named from Dynamo's config and counted breaks), or else
how to tell (``match`` runs the other steps on the pairs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from relay_compile.passes.fx_nodes import all_to_all_args, closest, upstream_collectives
from relay_compile.passes.refusals import RefusedRegion
from relay_compile.runtime import grouped_linear

__all__ = ["pair_token_all_to_alls"]


def _same_splits(a: Sequence[object], b: Sequence[object]) -> bool:
    return len(a) == len(b) and all(x is y or (not isinstance(x, fx.Node) and x == y) for x, y in zip(a, b))


def pair_token_all_to_alls(token_a2as: list[fx.Node]) -> tuple[list[tuple[fx.Node, fx.Node]], list[RefusedRegion]]:
    """Pair each combine with its dispatch on dataflow: the closest token a2a upstream, with swapped splits."""
    paired: set[fx.Node] = set()
    pairs: list[tuple[fx.Node, fx.Node]] = []
    token_set = set(token_a2as)
    for combine in token_a2as:
        upstream = closest(upstream_collectives([all_to_all_args(combine)[0]]) & token_set)
        if len(upstream) != 1:
            continue
        dispatch = upstream.pop()
        if dispatch in paired:
            continue
        _, d_out, d_in, _ = all_to_all_args(dispatch)
        _, c_out, c_in, _ = all_to_all_args(combine)
        if not (_same_splits(c_out, d_in) and _same_splits(c_in, d_out)):
            continue
        paired |= {dispatch, combine}
        pairs.append((dispatch, combine))
    refused = [
        RefusedRegion(n, f"all_to_all {n.name} has no partner in this graph (no all_to_all with swapped splits reads "
                         f"its result, nor is it the answer to one): {_why_unpaired(n, token_a2as)}")
        for n in token_a2as if n not in paired
    ]
    return pairs, refused


def _why_unpaired(n: fx.Node, token_a2as: list[fx.Node]) -> str:
    """The likely cause of an all-to-all without a partner: a partner whose splits are not swapped, else a graph
    break (named from Dynamo's config and counted breaks), else, where Dynamo counted none, how to tell."""
    token_set = set(token_a2as)
    upstream = closest(upstream_collectives([all_to_all_args(n)[0]]) & token_set)
    answers = [m for m in token_a2as if m is not n
               and closest(upstream_collectives([all_to_all_args(m)[0]]) & token_set) == {n}]
    partner = answers[0] if answers else (next(iter(upstream)) if len(upstream) == 1 else None)
    if partner is not None:
        return (f"{partner.name} answers it, but with splits that are not its swapped ones (the combine sends "
                "back what the dispatch received: output_split_sizes = the dispatch's input_split_sizes)")
    if not torch._dynamo.utils.counters.get("graph_break") and not _recorded_breaks():
        # Not proof: a frame Dynamo skips (a function it declines inside a context manager, nested breaks) is
        # not counted, so the reason says how to look.
        return ("Dynamo counted no graph break: unless TORCH_LOGS=graph_breaks shows one it did not count (a "
                "frame skipped inside a context manager), the block is whole and this all-to-all is not one of "
                "an MoE block's pair, or its partner is reached through a dataflow the matcher does not follow")
    return f"the region is probably split by a graph break ({_graph_break_hint()})"


# The smallest edit for the graph breaks Dynamo's settings cannot avoid, by what Dynamo's reason says.
_EDITS = (
    ("Data-dependent branching", "write the condition with torch.fx.experimental.symbolic_shapes.guard_or_false "
                                 "(or guard_or_true): the general path then runs for every size"),
    ("reorder a debugging function", "log constants, tensors or format strings only (a size formatted into the "
                                     "message breaks the graph)"),
    ("marked as skipped", "move the call out of the MoE block, or wrap it as a custom op"),
    ("context manager", "move the context manager out of the MoE block, or remove the break inside it"),
)


def _recorded_breaks() -> list[str]:
    """Dynamo's latest graph breaks (``torch._dynamo.utils.graph_break_reasons``), each as ``file:line: why;
    edit: <the smallest edit>``; oldest first."""
    out = []
    for record in list(torch._dynamo.utils.graph_break_reasons)[-3:]:
        frame = record.user_stack[-1] if record.user_stack else None
        where = f"{frame.filename}:{frame.lineno}" if frame is not None else "<unknown>"
        why = next((line.strip() for line in record.reason.splitlines() if line.strip()), "")
        edit = next((e for key, e in _EDITS if key in record.reason), None)
        out.append(f"{where}: {why}" + (f" (edit: {edit})" if edit else ""))
    return out


def _graph_break_hint() -> str:
    """Where a region was most likely split, from Dynamo's config and the graph breaks it recorded."""
    config = torch._dynamo.config
    if not config.capture_scalar_outputs:
        hint = "at .tolist() of the split sizes: compile with torch._dynamo.config.capture_scalar_outputs=True"
    elif not config.capture_dynamic_output_shape_ops:
        hint = ("capture_scalar_outputs is on; at an op whose output shape depends on data (repeat_interleave of "
                "counts, nonzero, a boolean mask), set torch._dynamo.config.capture_dynamic_output_shape_ops=True; "
                "at a Python branch on a received size, .cpu() or a print inside the dispatcher, no rewrite is "
                "possible without editing the model")
    else:
        hint = ("inside the dispatcher: a Python branch on a received size, .cpu() or a print; no rewrite is "
                "possible without editing the model")
    # The latest breaks, with their file:line, are the likeliest; the counters' keys where none was recorded.
    reasons = _recorded_breaks() or list(torch._dynamo.utils.counters.get("graph_break", {}))[-3:]
    if reasons:
        hint += f"; Dynamo's latest graph breaks: {'; '.join(reasons)}"
    if grouped_linear.UNSEEN:  # a Transformer Engine GroupedLinear the backend could not see through
        kept = "; ".join(grouped_linear.UNSEEN[-3:])
        hint += f"; Transformer Engine's forward kept (a graph break by design): {kept}"
    return hint + "; TORCH_LOGS=graph_breaks shows each break with its line"
