"""Recon: for each top-k pair, run the matcher's steps 3, 5, 6 (and the expert recognizer), skipping step 4 (the
combine side, which refuses HF's combine), to see what else would stand in the way. Match-only backend."""
import torch
import torch.fx as fx

from relay_compile.passes import capacity_match as cm
from relay_compile.passes import match as mm
from relay_compile.passes.expert_block import NotAnFFN, recognize_expert_ffn
from relay_compile.passes.expert_fn import copy_expert_fn, slice_expert_fn
from relay_compile.passes.fx_nodes import all_to_all_args, ancestors, dtype_of, is_all_to_all, wait_end
from relay_compile.passes.refusals import Refusal
from relay_compile.runtime.dynamo_settings import dynamo_settings

LINES: list[str] = []


def probe_backend(gm: fx.GraphModule, example_inputs):
    p = LINES.append
    a2as = [n for n in gm.graph.nodes if is_all_to_all(n)]
    token = [n for n in a2as if (dtype_of(wait_end(n)) or torch.int64).is_floating_point]
    _, _, rest = cm.find_capacity_regions(gm, token, set())
    pairs, _ = mm._pair_token_a2as(rest)
    for dispatch, combine in pairs:
        p(f"pair {dispatch.name} -> {combine.name}")
        try:
            x, topk_ids, order, top_k, scores_before = mm._match_dispatch_side(dispatch)
            p(f"  step 3 ok: x={x.name} topk_ids={topk_ids.name} order={order.name} K={top_k} scores_before={scores_before}")
            try:
                mm._match_combine_side(combine, wait_end(combine), order, top_k, scores_before)
                p("  step 4 ok")
            except Refusal as r:
                p(f"  step 4 refuses: {r.reason}")
                back = wait_end(combine)
                p(f"    combine result {back.name} users: {[(u.name, u.op, str(u.target)) for u in back.users]}")
            kind, leaves, exchange, e_l = mm._match_splits(dispatch, len(all_to_all_args(dispatch)[1]))
            p(f"  step 5 ok: kind={kind} leaves={[[l.name for l in row] for row in leaves]} exchange={exchange.name} E_l={e_l}")
            counts = wait_end(exchange)
            inputs = {wait_end(dispatch): "rows", counts: "counts"}
            for row in leaves:
                for leaf in row:
                    inputs[leaf] = "split"
            forbidden = ancestors([all_to_all_args(dispatch)[0], topk_ids])
            body, used, weights = slice_expert_fn(dispatch, combine, inputs, forbidden)
            p(f"  step 6 slice ok: {len(body)} nodes, reads {[u.name for u in used]}, weights {[w.name for w in weights]}")
            p(f"    F nodes: {[n.name for n in body]}")
            fn, binding = copy_expert_fn(gm, body, all_to_all_args(combine)[0], wait_end(dispatch), counts, leaves,
                                         weights, used, kind)
            p(f"  copy ok: {len(fn.graph.nodes)} nodes")
            try:
                plan = recognize_expert_ffn(fn, binding, e_l)
                p(f"  recognized: {plan.describe()}")
            except NotAnFFN as e:
                p(f"  not recognized as an FFN of experts: {e}")
        except Refusal as r:
            p(f"  refused: {r.reason}")
        except Exception as e:  # noqa: BLE001
            p(f"  error: {e!r}")
    return gm.forward


probe_backend.backend_ctx_ctor = dynamo_settings
