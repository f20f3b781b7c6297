"""rewrite: replace one matched all-to-all MoE region by one call of the ``relaymoe::ring_moe`` op.

Contract:
    Consumes a graph and one of its ``MoERegion`` records from ``find_moe_regions`` (the graph unchanged
    since, apart from the rewrite of other regions of the same graph). Guarantees: the region's output is
    computed by ``torch.ops.relaymoe.ring_moe.default(x, topk_ids, topk_scores, [weights], key)[0]`` (or
    ``ring_moe_saving``'s), the autograd boundary of the ring; every node of ``region.nodes`` is gone (both
    token all-to-alls, F, the counts exchange, its waits, ``.item()`` host syncs and ``_assert_scalar``
    checks), and so are pure nodes that only the region read (shared size arithmetic dies with the last region
    reading it); nothing else is touched; the graph lints and is recompiled. ``key`` names a ``RingSpec`` registered in this process
    whose expert function is F recognized and lowered onto grouped experts (``runtime.lowered_ffn.LoweredFFN``),
    or else a copy of the region's F compiled by ``inner_compiler`` (``runtime.compiled_experts``), or run
    eagerly at every hop (``runtime.region_fn.RegionExpertFn``) where it does not compile; the ring node's
    ``meta["relaymoe_experts"]`` says which (``ExpertsPath``);
    nothing data-dependent is baked into the graph, so new routings do not recompile. Raises ``ValueError``
    (naming the region and node) when the record no longer describes the graph or an option is invalid;
    never leaves a half-rewritten graph behind for those (all checks run before the first mutation).

Pseudo-code:
    # Step 1: check options and that the record still describes gm.
    # Step 2: the expert function: F lowered onto grouped experts if recognized, else F compiled, else F itself;
    #         register its RingSpec (key from the spec).
    # Step 3: insert ring_moe(x, topk_ids, topk_scores, [weights], key) before the output, with a fake value.
    # Step 4: route the output's uses to the ring; erase the region's nodes, last first, then the pure
    #         nodes left without users.
    # Step 5: drop subgraphs only the region used; lint, recompile, check that no node of the region is left.

Legend: T tokens, H hidden, K top-k, N ranks, E_l experts per rank, S segment rows, R received rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import operator

import torch
import torch.fx as fx
from torch import Tensor

from relay_compile.passes.expert_lowering import LoweredFFN, choose_expert_fn, recognized_ffn
from relay_compile.passes.fx_nodes import all_to_all_args, arg, is_all_to_all, node_value, upstream_collectives
from relay_compile.passes.liveness import erase_unused_pure
from relay_compile.passes.match import find_moe_regions
from relay_compile.passes.refusals import Refusal, RefusedRegion
from relay_compile.passes.region import Region
from relay_compile.runtime import cost_model
from relay_compile.runtime.block_shape import BlockShape, owner_options
from relay_compile.runtime.compiled_experts import CompiledExpertFn
from relay_compile.runtime.cost_model import H200, Calibration, Choice, calibration_for, choose
from relay_compile.runtime.fp8_experts import fp8_refusal
from relay_compile.runtime.ops import KEPT_ALL_TO_ALL, RING_MOE, RING_MOE_SAVING
from relay_compile.runtime.region_fn import RegionExpertFn
from relay_compile.runtime.ring_options import RingOptions
from relay_compile.runtime.saved_projections import compile_time_level, saving_op
from relay_compile.runtime.specs import RingSpec, register_spec
from relay_compile.runtime.transport import group_link_gbps

log = logging.getLogger(__name__)

__all__ = ["guard_refused", "moe_ring_pass", "region_fn_identity", "region_fn_name", "rewrite_moe_region"]

ExpertFns = RegionExpertFn | LoweredFFN | CompiledExpertFn


def region_fn_name(region: Region, fn: ExpertFns) -> str:
    """The expert function's name in the ring's spec key: the same region gives the same name in every
    process (F's code and binding, the weights' shapes and dtypes)."""
    weights = [(tuple(v.shape), str(v.dtype)) for v in map(node_value, region.weights) if isinstance(v, Tensor)]
    return f"fx_region[{hashlib.sha256(repr((fn.digest(), weights)).encode()).hexdigest()[:12]}]"


def region_fn_identity(region: Region, fn: ExpertFns) -> str:
    """What every rank of the group must agree on about the expert function (``runtime.agreement``): a lowered
    F by what it computes (its plan, the weights' shapes and dtypes), so that ranks whose graphs differ only in
    how Dynamo specialized the token count (one rank's static, another's dynamic after its T changed) agree;
    any other F by ``region_fn_name`` (its code)."""
    if not isinstance(fn, LoweredFFN):
        return region_fn_name(region, fn)
    weights = [(tuple(v.shape), str(v.dtype)) for v in map(node_value, region.weights) if isinstance(v, Tensor)]
    return f"fx_lowered[{hashlib.sha256(repr((fn.plan, fn.experts_per_rank, weights)).encode()).hexdigest()[:12]}]"


def _check_record(gm: fx.GraphModule, region: Region) -> None:
    """Step 1: every node the record names is alive in ``gm``, and the dying nodes are used only by each other."""
    named = {"x": region.x, "output": region.output, **region.inputs()}
    named |= {f"weights[{i}]": w for i, w in enumerate(region.weights)}
    for role, n in [*named.items(), *(("region node", n) for n in region.nodes)]:
        if n.graph is not gm.graph or getattr(n, "_erased", False):
            raise ValueError(
                f"rewrite: the region of dispatch {region.dispatch.name} names {role} {n.name}, which is not in "
                "this graph any more; match again with find_moe_regions(gm) after changing the graph"
            )
    for n in region.nodes:
        if n is region.output or n in region.output_aliases:
            continue
        outside = [u.name for u in n.users if u not in region.nodes]
        if outside:
            raise ValueError(
                f"rewrite: {n.name} of the region of dispatch {region.dispatch.name} is now also used by "
                f"{', '.join(outside)}; match again with find_moe_regions(gm)"
            )


def _fake_output(region: Region, op: object, args: tuple) -> object:
    """The ring's fake value: what ``op``'s fake kernel returns on the fake values of ``args``, in ``x``'s fake
    mode (``(y, [projections,] counts_E)``); a graph without fake values keeps the region's output as ``y``'s."""
    fake_mode = getattr(node_value(region.x), "fake_mode", None)
    if fake_mode is None:
        return None
    values = fx.node.map_arg(args, node_value)
    with fake_mode:
        return op(*values)  # type: ignore[operator]


def rewrite_moe_region(
    gm: fx.GraphModule,
    region: Region,
    options: RingOptions = RingOptions(),
    *,
    inner_compiler: str = "eager",
) -> fx.Node:
    """Replace ``region`` of ``gm`` by one ``relaymoe::ring_moe`` call; returns the new node.

    Before (torchtitan's graph, abridged; the reference and Megatron-style layers differ in the details)::

        x_TH = ...; ids_TK = ...; scores_TK = ...
        order_P = torch.argsort(ids_TK.view(-1), stable=True)
        send_PH = x_TH[order_P // K]
        counts = torch.ops._c10d_functional.all_to_all_single(local_counts.view(N, -1), [1, 1], [1, 1], g)
        counts_NL = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.wait_tensor(counts))
        u0, u1, u2, u3 = (split.item() for split in ...)          # + aten._assert_scalar checks
        recv = torch.ops._c10d_functional.all_to_all_single(send_PH, [u2, u3], [u0, u1], g)
        recv_RH = torch.ops._c10d_functional.wait_tensor(recv)
        out_RH = <F: permute, torch._grouped_mm x3 on w1.to_local() ..., setitem unpermute>
        back = torch.ops._c10d_functional.all_to_all_single(out_RH, [u0, u1], [u2, u3], g)
        back_PH = torch.ops._c10d_functional.wait_tensor(back)
        weighted_PH = back_PH * scores_TK.view(-1)[order_P].reshape(-1, 1)
        y_TH = torch.ops.torchtitan.deterministic_scatter_add.default(
            torch.zeros_like(x_TH), (order_P // K).reshape(-1, 1).expand(-1, H), weighted_PH)

    After::

        x_TH = ...; ids_TK = ...; scores_TK = ...
        ring_moe_call = torch.ops.relaymoe.ring_moe.default(
            x_TH, ids_TK, scores_TK, [w1_local, w2_local, w3_local],
            "fx_region[<digest>]|group=g|E_l=4|scores=after|routing=auto|overlap=1|remat=1|max_hop_rows=auto|fp32_accumulation=1|chunk_graphs=0|ring=auto")
        y_TH = ring_moe_call[0]  # [1]: the agreed counts_E, for the backward (runtime.ops)

    Args:
        options: the ring's options (``runtime.ring_options.RingOptions``: validated where they are made).
        inner_compiler: what compiles an F that is not lowered onto grouped experts (``"inductor"``,
            ``"aot_eager"``; ``"eager"``: F runs as it is).

    Raises:
        ValueError: an unknown option, or a record that no longer describes ``gm``.
        Refusal: experts that can run only lowered (a capacity receive) and do not lower or prove equal to F
            on probe inputs (``expert_lowering``); raised before anything of ``gm`` changes.
    """
    # Step 1: the record.
    _check_record(gm, region)

    # Step 2: the expert function and its spec.
    fn, path = choose_expert_fn(region, inner_compiler)
    fp8_refused = fp8_refusal(fn) if options.fp8 else None
    if fp8_refused is not None:  # the region runs its hops in the weights' dtype, and its report says why
        log.info("rewrite: %s keeps bf16 hops (option fp8): %s", region.describe(), fp8_refused)
        options = dataclasses.replace(options, fp8=False)
    spec = RingSpec(
        expert_fn=fn, experts_per_rank=region.experts_per_rank, group_name=region.group_name, options=options,
        scores_applied=region.scores_applied,
    )
    key = register_spec(spec, region_fn_name(region, fn), identity=region_fn_identity(region, fn))

    # Step 3: the ring call, right before the output (every input of the ring is upstream of the output); the
    # op's first output is ``y`` (the others are for its backward).
    saves = saves_at_compile_time(region, fn, options)
    op = RING_MOE_SAVING if saves else RING_MOE
    graph = gm.graph
    with graph.inserting_before(region.output):
        topk_ids, topk_scores = region.insert_pairs()  # capacity regions derive them from their masks
        args = (region.x, topk_ids, topk_scores, list(region.weights), key)
        ring = graph.create_node("call_function", op, args, name="ring_moe_saving" if saves else "ring_moe_call")
        y = graph.create_node("call_function", operator.getitem, (ring, 0), name="ring_moe")
    ring.meta["relaymoe_experts"] = path
    ring.meta["relaymoe_fp8"] = "on" if options.fp8 else (f"refused: {fp8_refused}" if fp8_refused else "")
    fake = _fake_output(region, op, args)
    if fake is not None:
        ring.meta["example_value"] = ring.meta["val"] = fake
    y.meta["example_value"] = y.meta["val"] = fake[0] if fake is not None else node_value(region.output)
    for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if k in region.output.meta:
            ring.meta[k] = y.meta[k] = region.output.meta[k]

    # Step 4: uses, then the dead region, users before producers; then what only the region read (values
    # shared by several regions, such as the T*K of Dynamo's size asserts, die with the last of them).
    region.output.replace_all_uses_with(y)
    for buffer in region.output_aliases:  # reads after an in-place combine scatter (match checked the order)
        buffer.replace_all_uses_with(y, delete_user_cb=lambda user: user not in region.nodes)
    frontier: set[fx.Node] = set()
    for n in reversed(list(graph.nodes)):
        if n in region.nodes:
            assert not n.users, f"rewrite: {n.name} still has users {list(n.users)} while erasing the region"
            frontier.update(n.all_input_nodes)
            graph.erase_node(n)
    erase_unused_pure(frontier - region.nodes)

    # Step 5: check. Subgraphs only the region used go too (torch 2.11 wraps each all-to-all's wait in an
    # autograd_function_apply whose forward/backward bodies are submodules read by get_attr).
    for n in graph.find_nodes(op="get_attr"):
        if not n.users and isinstance(getattr(gm, str(n.target), None), fx.GraphModule):
            graph.erase_node(n)
    gm.delete_all_unused_submodules()
    graph.lint()
    gm.recompile()
    assert all(getattr(n, "_erased", False) for n in region.nodes), "rewrite: region nodes left in the graph"
    log.debug("rewrite: %s -> %s (%s)", region.describe(), ring.name, key)
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "relaymoe_rewrite", "encoding": "string"},
        payload_fn=lambda: f"# relaymoe rewrite of {region.describe()}\n" + gm.print_readable(False),
    )
    return ring


def kept_at_compile_time(region: Region, options: RingOptions) -> Choice | None:
    """The cost model's choice where it keeps ``region``'s all-to-all for good, else None (the region becomes a
    ring op, which decides again at every call from every rank's shapes).

    Kept: under ``ring="never"``; under ``"auto"`` / ``"memory"`` where the token count is static, the tokens are
    on CUDA (where the model is calibrated) and ``cost_model.choose`` picks the all-to-all. Kept, the region runs
    as the original graph computes it, at its memory, compiled (``cost_model.Calibration.kept_a2a_ratio``: about a2a
    eager's time once its all-to-alls read their split sizes as tensors, ``passes.split_reads``; the ring op's own
    all-to-all path recomputes its experts in backward). The ring is predicted with the owners per hop the op will hold
    (``block_shape.owner_options`` where F lowers onto grouped experts, ``expert_lowering.recognized_ffn``; one
    otherwise; FP8 hops' weight bytes under ``fp8``) and the link it will take a hop to cross
    (``transport.group_link_gbps``), against the traced all-to-all the kept region runs, compiled. The op weighs a
    call's ring against its own all-to-all path instead (``cost_model.choose(kept="op")``, ~1.5x a2a eager), so a
    region kept here is one the op would keep or run as a ring between ``kept_a2a_ratio(N)`` and that ratio of a2a
    eager's time; up to what only a call knows (the other ranks' token counts and links, the probe's verdict on F).
    The memory budget of the larger owner stacks is taken at this rank's T (a call's is the group's smallest T): a call
    where another rank holds fewer tokens may fall back to the rules' stack, and its decision to that ring's.
    """
    x = node_value(region.x)
    if options.ring == "never":
        return choose(region.block_shape(), routing=options.routing, ring="never", cal=H200)
    shape, cal = _traced_model(region, options)
    if options.ring == "always" or shape is None or x.device.type not in cost_model.CALIBRATED_DEVICES:
        return None
    owners = owner_options(shape, fp8=options.fp8) if recognized_ffn(region) else (1, 1)
    choice = choose(shape, routing=options.routing, ring=options.ring, cal=cal, owners=owners,
                    max_hop_rows=options.max_hop_rows,
                    saving=compile_time_level(options, region.scores_applied, x.device, recognized_ffn(region)))
    return choice if choice.execution == "all_to_all" else None


def saves_at_compile_time(region: Region, fn: object, options: RingOptions) -> bool:
    """Whether ``region``'s ring runs as ``relaymoe::ring_moe_saving`` (``saved_projections.saving_op``): with
    expert function ``fn``, at the traced shapes where they are static (``"auto"``: the device's time model
    predicts that saving pays; True: wherever ``fn`` can)."""
    shape, cal = _traced_model(region, options)
    owners = owner_options(shape, fp8=options.fp8) if shape is not None and isinstance(fn, LoweredFFN) else (1, 1)
    device = node_value(region.x).device
    return saving_op(fn, options, region.scores_applied, device, shape, cal, owners)  # type: ignore[arg-type]


def _traced_model(region: Region, options: RingOptions) -> tuple[BlockShape | None, Calibration]:
    """What a compile-time decision predicts ``region`` with: its sizes where the token count is static (else
    None), and its device's constants over the link its hops cross."""
    x = node_value(region.x)
    static = isinstance(x, Tensor) and all(isinstance(d, int) for d in x.shape)
    cal = calibration_for(x.device).with_link(group_link_gbps(region.group_name, options.link_gbps))
    return (region.block_shape() if static else None), cal


def keep_all_to_all(gm: fx.GraphModule, region: Region) -> fx.Node:
    """Leave ``region`` of ``gm`` as it is (its all-to-alls run), behind one ``relaymoe::kept_all_to_all`` call:
    the input of the region's first collective (the counts exchange, else the token dispatch) becomes a copy made
    once every rank of the group is known to have kept the region too (``runtime.agreement.agree_kept``), so a
    rank that runs the ring instead raises with the others rather than meeting another collective. Returns the
    new node.

    Before::

        counts = torch.ops._c10d_functional.all_to_all_single(local_counts, [1, 1], [1, 1], g)

    After::

        kept = torch.ops.relaymoe.kept_all_to_all.default(local_counts, g)
        counts = torch.ops._c10d_functional.all_to_all_single(kept, [1, 1], [1, 1], g)
    """
    _check_record(gm, region)
    first = region.first_collective()
    source = next((a for a in first.all_input_nodes if isinstance(a.meta.get("example_value"), Tensor)), None)
    if source is None:
        raise ValueError(f"rewrite: the region's first collective {first.name} reads no tensor to order the check by")
    with gm.graph.inserting_before(first):
        kept = gm.graph.create_node("call_function", KEPT_ALL_TO_ALL, (source, region.group_name),
                                    name="kept_all_to_all")
    kept.meta["example_value"] = kept.meta["val"] = source.meta["example_value"]
    first.replace_input_with(source, kept)
    gm.graph.lint()
    gm.recompile()
    return kept


def guard_refused(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """Put a refused region's first collective behind ``relaymoe::kept_all_to_all``, as ``keep_all_to_all`` does
    for a kept one: ``node`` (a token all-to-all the matcher or the rewrite refused) and the collectives its
    input comes from on its group (the counts exchange) run once every rank of the group is known to run the
    all-to-all too. A rank whose graph differs (a graph break, a warning on that rank only) may refuse a region
    that the others rewrite: its exchange then meets their ring op's, and every rank raises ``RingInputError``
    instead of one waiting in an all-to-all the others never join. Returns the new node; None where the first
    collective is already guarded (two refusals of one block) or reads no tensor.
    """
    group = all_to_all_args(node).group_name
    same_group = [c for c in upstream_collectives(node.all_input_nodes) if _group_of(c) == group]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min([node, *same_group], key=order.__getitem__)
    source = next((a for a in first.all_input_nodes if isinstance(a.meta.get("example_value"), Tensor)), None)
    if source is None or source.target is KEPT_ALL_TO_ALL or not isinstance(group, str):
        return None
    with gm.graph.inserting_before(first):
        kept = gm.graph.create_node("call_function", KEPT_ALL_TO_ALL, (source, group, True), name="kept_all_to_all")
    kept.meta["example_value"] = kept.meta["val"] = source.meta["example_value"]
    first.replace_input_with(source, kept)
    gm.graph.lint()
    gm.recompile()
    return kept


def _group_of(collective: fx.Node) -> object:
    return all_to_all_args(collective).group_name if is_all_to_all(collective) else arg(collective, 2, "group_name")


def moe_ring_pass(
    gm: fx.GraphModule, options: RingOptions = RingOptions(), *, inner_compiler: str = "eager",
) -> tuple[list[fx.Node], list[RefusedRegion]]:
    """Find every a2a MoE region of ``gm`` and rewrite each into a ring; returns (ring nodes, refusals): what the
    finder refused and the regions whose experts the rewrite could not run (left as they were)."""
    regions, refused = find_moe_regions(gm)
    rings = []
    for region in regions:
        try:
            rings.append(rewrite_moe_region(gm, region, options, inner_compiler=inner_compiler))
        except Refusal as r:
            refused.append(r.record())
    return rings, refused
