"""A match-only Dynamo backend that records, per token all-to-all, what each matcher step sees (recon only)."""
import torch
import torch.fx as fx

from relay_compile.passes import capacity_match as cm
from relay_compile.passes import match as mm
from relay_compile.passes.fx_nodes import all_to_all_args, dtype_of, is_all_to_all, wait_end
from relay_compile.passes.roles import CAST_METHODS, VIEW_FUNCTIONS, VIEW_METHODS, peel, row_gather
from relay_compile.runtime.dynamo_settings import dynamo_settings

LINES: list[str] = []


def _chain(n, depth=6):
    out = []
    while isinstance(n, fx.Node) and depth:
        out.append(f"{n.name}={n.op}:{getattr(n.target, '__name__', n.target)}")
        n = n.args[0] if n.args else None
        depth -= 1
    return " <- ".join(out)


def probe_backend(gm: fx.GraphModule, example_inputs):
    p = LINES.append
    p(f"graph with {len(gm.graph.nodes)} nodes")
    a2as = [n for n in gm.graph.nodes if is_all_to_all(n)]
    for n in a2as:
        args = all_to_all_args(n)
        p(f"all_to_all {n.name}: target={getattr(n.target, '__name__', n.target)} moves {dtype_of(wait_end(n))} "
          f"splits out={args.output_split_sizes} in={args.input_split_sizes} group={args.group_name}")
        p(f"  input chain: {_chain(args.input)}")
        send_cast = peel(args.input, CAST_METHODS)
        send_view = peel(args.input, VIEW_METHODS + ("contiguous",), VIEW_FUNCTIONS)
        p(f"  top-k matcher sees (peel casts): {getattr(send_cast, 'name', send_cast)}; row_gather -> "
          f"{row_gather(send_cast) if isinstance(send_cast, fx.Node) else None}")
        p(f"  capacity matcher sees (peel views): {getattr(send_view, 'name', send_view)}; row_gather -> "
          f"{row_gather(send_view) if isinstance(send_view, fx.Node) else None}; _dispatch_of -> {cm._dispatch_of(n)}; "
          f"_is_capacity_dispatch -> {cm._is_capacity_dispatch(n)}")
    token = [n for n in a2as if (dtype_of(wait_end(n)) or torch.int64).is_floating_point]
    regions, refused, rest = cm.find_capacity_regions(gm, token, set())
    p(f"capacity matcher: regions={len(regions)} refused={[(r.node.name, r.reason) for r in refused]} "
      f"unclaimed={[n.name for n in rest]}")
    pairs, unpaired = mm._pair_token_a2as(rest)
    p(f"top-k pairing: pairs={[(d.name, c.name) for d, c in pairs]} unpaired={[(r.node.name, r.reason) for r in unpaired]}")
    regs, refs = mm.find_moe_regions(gm)
    p(f"find_moe_regions: regions={[r.describe() for r in regs]} refused={[(r.node.name, r.reason) for r in refs]}")
    return gm.forward


probe_backend.backend_ctx_ctor = dynamo_settings
