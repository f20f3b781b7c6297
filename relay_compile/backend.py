"""The ``relaymoe`` torch.compile backend: all-to-all MoE regions become RelayMoE rings.

    model = torch.compile(model, backend="relaymoe", options={"routing": "auto"})

Registered through the ``torch_dynamo_backends`` entry point, so the name works without importing the
package. Dynamo must see each MoE block whole: the backend's ``backend_ctx_ctor`` sets what that takes
(``runtime.dynamo_settings``: host reads of split sizes and data-dependent shapes stay in the graph) around
each call of a model compiled with it, and only there.

Per Dynamo graph:

    find_moe_regions      (passes.match)    regions + refusals, from static information only
    rewrite_moe_region    (passes.rewrite)  each region -> one relaymoe::ring_moe call whose experts run on
                                            grouped GEMMs when F is recognized (passes.expert_lowering), else
                                            F compiled by the inner compiler (runtime.compiled_experts), else F
                                            eagerly; its ring programs (remat, overlap) are built on first use
    batch_host_reads      (passes.host_reads)  split sizes still read on the host (kept or refused regions):
                                            one device-to-host copy per tensor, not one sync per element
    fold_split_reads      (passes.split_reads)  the all-to-alls among them read those copies themselves
                                            (relaymoe::split_all_to_all): no unbacked SymInt per split size
    inner compiler        (option)          inductor / aot_eager / eager on the rewritten graph, under the
                                            activation_memory_budget option (torch's partitioner budget)
    token switch          (passes.dynamic_keep, runtime.token_switch)  regions with a dynamic token count the
                                            cost model may keep: the graph from before the rewrite is also
                                            compiled with them kept; each call runs one variant, agreed
    verify                (option)          the first call also runs the original graph and compares

Options are ``relay_compile.config`` values overridden per call (``relay_compile.options``). Every graph's
report (``relay_compile.report``) goes to the log, to ``<dump_dir>/.../report.json`` with readable code of
the graph before and after the rewrite, and to ``trace_structured`` (tlparse); the ring programs a region
runs are written beside them by the op, when it first runs each (``runtime.program_dumps``).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._logging import trace_structured

from relay_compile.options import Options, resolve
from relay_compile.passes import (
    batch_host_reads,
    find_moe_regions,
    guard_refused,
    keep_all_to_all,
    kept_at_compile_time,
    rewrite_moe_region,
)
from relay_compile.passes.dynamic_keep import SwitchPlan, plan_switch, switchable
from relay_compile.passes.expert_lowering import choose_expert_fn, recognized_ffn
from relay_compile.passes.fx_nodes import is_all_to_all, node_value
from relay_compile.passes.refusals import Refusal
from relay_compile.passes.split_reads import fold_split_reads
from relay_compile.passes.region import Region
from relay_compile.passes.scopes import Scope, find_scopes, keep_rings_saved
from relay_compile.report import GraphDump, GraphReport, RegionReport
from relay_compile.runtime import program_dumps
from relay_compile.runtime.ops import RING_MOE_SAVING
from relay_compile.runtime.cost_model import calibration_for
from relay_compile.runtime.saved_projections import compile_time_level
from relay_compile.runtime.dynamo_settings import dynamo_settings, keep_backend_ctx_through_torch_compile
from relay_compile.runtime.token_switch import TokenSwitch
from relay_compile.runtime.transport import group_link_gbps

log = logging.getLogger(__name__)

_GRAPH_COUNTER = itertools.count()
# Reports of the graphs this process compiled with the backend, oldest first (``compiled_reports``).
_REPORTS: list[GraphReport] = []


def compiled_reports() -> list[GraphReport]:
    """The report of every graph this process compiled with ``backend="relaymoe"``, oldest first."""
    return list(_REPORTS)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _inner_compiler(name: str) -> Callable:
    if name == "eager":
        return lambda gm, example_inputs: gm.forward
    return torch._dynamo.lookup_backend(name)


def _compile_inner(opts: Options, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """The inner compiler on the rewritten graph; aot_autograd partitions it here, so the budget applies here."""
    budget = opts.activation_memory_budget
    if budget is None:
        return _inner_compiler(opts.inner_compiler)(gm, example_inputs)
    # Scoped to this graph: torch's partitioner reads the global config while it partitions, inside this call.
    with torch._functorch.config.patch(activation_memory_budget=budget):
        return _inner_compiler(opts.inner_compiler)(gm, example_inputs)


# verify's tolerance (max error / max magnitude) where a region runs FP8 hops (option fp8): E4M3 keeps 3
# mantissa bits, and the layer's outputs carry two FP8 products.
FP8_VERIFY_TOLERANCE = 0.25


def _compare_outputs(
    got: Sequence[Any], want: Sequence[Any], graph: str, note: str = "", fp8: bool = False
) -> None:
    """Raise if a tensor output of the rewritten graph differs from the original beyond its dtype's rounding
    (``fp8``: beyond FP8's, ``FP8_VERIFY_TOLERANCE``); ``note`` ends the message."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            continue
        tol = FP8_VERIFY_TOLERANCE if fp8 else 1e-4 if w.dtype in (torch.float32, torch.float64) else 3e-2
        err = ((g.detach().float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-12)).item()
        if not err <= tol:
            raise RuntimeError(
                f"relaymoe verify: output {i} of {graph} differs from the original graph: max relative error "
                f"{err:.3e} > {tol:.0e}. Run with options={{'dump_dir': ...}} and compare the dumped graphs; "
                f"report it with the dump{note}"
            )


def _draws_random(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` samples random numbers (dropout, a gate's noise or sampling), by its ops' names."""
    return any(n.op in ("call_function", "call_method") and str(getattr(n.target, "__name__", n.target)) in _RANDOM
               for n in gm.graph.nodes)


# Dynamo graphs' names of torch's sampling functions and methods (torch.*, Tensor.*, nn.functional.*).
_RANDOM = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
    "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "random_", "poisson", "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
    "dropout2d", "dropout3d", "gumbel_softmax", "rrelu",
})


def _verifying(
    compiled: Callable, original: fx.GraphModule, graph: str, inner_compiler: str, fp8: bool = False
) -> Callable:
    """``compiled``, whose first call also runs ``original`` on the same inputs and compares outputs. A graph
    that draws random numbers is run from the RNG state the compiled call started from (``aot_eager`` and
    ``eager`` draw as the original does; inductor draws otherwise, so a mismatch there may be the draws)."""
    pending = [True]
    random = _draws_random(original)
    note = "" if not random or inner_compiler != "inductor" else (
        ". The graph draws random numbers, which inductor draws differently from the original: verify with "
        "options={'inner_compiler': 'aot_eager'}")

    def run(*args: Any) -> Any:
        if not pending:
            return compiled(*args)
        pending.clear()
        cuda = random and torch.cuda.is_available() and torch.cuda.is_initialized()
        start = torch.random.get_rng_state() if random else None
        start_cuda = torch.cuda.get_rng_state_all() if cuda else None
        out = compiled(*args)
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else [], enabled=random):
            if start is not None:
                torch.random.set_rng_state(start)
            if start_cuda is not None:
                torch.cuda.set_rng_state_all(start_cuda)
            with torch.no_grad():
                want = original(*args)
        _compare_outputs(
            out if isinstance(out, (list, tuple)) else [out],
            want if isinstance(want, (list, tuple)) else [want], graph, note, fp8,
        )
        log.info("relaymoe verify: %s matches the original graph", graph)
        return out

    return run


class Analyzed(NamedTuple):
    """What ``analyze`` did to a graph: its report; where regions with a dynamic token count may be kept per call
    (``passes.dynamic_keep``) the switch's plan, and with ``rewrite`` a copy of the graph from before the rewrite
    (for the kept variant)."""

    report: GraphReport
    plan: SwitchPlan | None = None
    pristine: fx.GraphModule | None = None


def analyze(gm: fx.GraphModule, opts: Options, graph: str, rewrite: bool, keep_switched: bool = False) -> Analyzed:
    """Match (and with ``rewrite``, rewrite) ``gm``'s MoE regions in place (``Analyzed``). With
    ``keep_switched``, the switch's regions are kept (the graph's kept variant)."""
    report = GraphReport(graph=graph, rank=_rank(), options=opts.as_dict())
    dump = GraphDump(opts.dump_dir, graph, report.rank)
    dump.write("0_dynamo_graph.py", gm.print_readable(False), header="Dynamo graph, before relaymoe")
    # Step 1: match, in the graph and in the bodies of its activation checkpoints (passes.scopes).
    start = time.perf_counter()
    found = [(scope, find_moe_regions(scope.module)) for scope in find_scopes(gm)]
    report.pass_seconds["match"] = time.perf_counter() - start
    refused = [(scope, r) for scope, (_, refusals) in found for r in refusals]
    regions = [(scope, r) for scope, (matched, _) in found for r in matched]
    for i, (scope, r) in enumerate(refused):
        report.regions.append(RegionReport(index=i, status="refused", anchor=scope.anchor(r.node), reason=r.reason))
    # A dynamic token count: the graph may also be compiled with its regions kept, chosen per call.
    first = len(refused)
    plan = _plan_switch(report, gm, [r for _, r in regions], opts, first)
    switched = set(report.token_switch.get("regions", ()))
    pristine = copy.deepcopy(gm) if plan is not None and rewrite and not keep_switched else None
    # Step 2: rewrite, one region at a time (records hold nodes of the graph being rewritten).
    start = time.perf_counter()
    for i, (scope, region) in enumerate(regions, start=first):
        device = node_value(region.x).device
        entry = RegionReport.matched(
            i, scope.anchor(region.dispatch), region.group_name, region.block_shape(), opts.ring.routing,
            opts.ring.max_hop_rows, opts.ring.fp32_accumulation, opts.ring.ring, opts.ring.fp8,
            grouped=recognized_ffn(region), cal=calibration_for(device).with_link(
                group_link_gbps(region.group_name, opts.ring.link_gbps)),
            saving=compile_time_level(opts.ring, region.scores_applied, device, recognized_ffn(region)),
        )
        entry.idiom = region.idiom()
        try:
            _apply(scope, region, opts, entry, dump, i, rewrite,
                   _switch_reason(report.token_switch) if i in switched else None, keep_switched)
        except Refusal as r:  # experts the ring cannot run: raised before the graph changed
            entry.status, entry.reason = "refused", r.reason
            refused.append((scope, r.record()))
        report.regions.append(entry)
    unswitched = [r.index for r in report.regions if r.index in switched and r.status == "refused"]
    if unswitched:  # a refused region runs its all-to-alls in both variants: no switch
        report.token_switch, plan, pristine = {"none": f"regions {unswitched} were refused"}, None, None
    if rewrite:  # what runs its all-to-alls checks that every rank does (a rank whose graph differs may not)
        for scope, r in refused:
            if is_all_to_all(r.node):
                guard_refused(scope.module, r.node)
    report.pass_seconds["rewrite"] = time.perf_counter() - start
    if rewrite:
        # What still reads split sizes on the host (kept and refused regions, other all-to-alls): one copy each.
        start = time.perf_counter()
        report.host_reads = [f"{r.base.name}: {len(r.reads)} host reads from one copy"
                             for scope in find_scopes(gm) for r in batch_host_reads(scope.module)]
        report.pass_seconds["host_reads"] = time.perf_counter() - start
        if opts.split_reads:  # ... and the all-to-alls among those take them as tensors: no SymInt per split
            start = time.perf_counter()
            report.split_reads = [line for scope in find_scopes(gm) for line in _split_reads(scope.module)]
            report.pass_seconds["split_reads"] = time.perf_counter() - start
        dump.write("1_rewritten_graph.py", gm.print_readable(False),
                   header=f"after relaymoe rewrite ({report.pass_seconds['rewrite']:.3f} s)")
    report.dumps = dump.files + ([str(dump.dir / "report.json")] if dump.dir else [])
    dump.write("report.json", report.to_json())
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "relaymoe_report", "encoding": "json"},
        payload_fn=report.to_json,
    )
    log.info("%s", report.summary())
    return Analyzed(report, plan, pristine)


def _split_reads(gm: fx.GraphModule) -> list[str]:
    """``fold_split_reads`` on one graph, as the report's lines."""
    done, skipped = fold_split_reads(gm)
    return ([f"{m.node.name}: relaymoe::split_all_to_all, sends by {m.send}, receives by {m.recv} "
             f"({len(m.send.reads)} ranks)" for m in done] + [f"left as traced: {line}" for line in skipped])


def _plan_switch(report: GraphReport, gm: fx.GraphModule, regions: list[Region], opts: Options,
                 first: int) -> SwitchPlan | None:
    """``passes.dynamic_keep.plan_switch`` for ``regions`` (report indices from ``first``), into the report's
    ``token_switch``: the plan, or why there is none where some region has a dynamic token count."""
    plan = plan_switch(gm, regions, opts.ring) if opts.dynamic_keep else "option dynamic_keep=False"
    if isinstance(plan, SwitchPlan):
        report.token_switch = {"tokens": str(plan.tokens), "ring_from": plan.ring_from,
                               "regions": [first + i for i in plan.regions], "calls": {"kept": 0, "ring": 0}}
        return plan
    if any(switchable(r, opts.ring) for r in regions):
        report.token_switch = {"none": plan}
    return None


def _switch_reason(switch: dict[str, Any]) -> str:
    """A switched region's reason in the ring variant's report."""
    return (f"token count {switch['tokens']} is dynamic: the graph is also compiled with this region kept, and each "
            "call runs that variant where the cost model keeps it at the group's largest token count (the first ring "
            f"at {switch['ring_from']} tokens per rank when the counts are equal)")


def _apply(
    scope: Scope, region: Region, opts: Options, entry: RegionReport, dump: GraphDump, i: int, rewrite: bool,
    switched: str | None = None, keep_switched: bool = False,
) -> None:
    """One matched region: kept (the cost model keeps its all-to-all), rewritten into a ring, or with
    ``rewrite`` off only analyzed; ``entry`` records which. ``switched``: the graph's token switch covers the
    region, and why (kept in the kept variant, ``keep_switched``). Raises ``Refusal`` before changing the graph."""
    if switched is not None and keep_switched:
        entry.status, entry.execution_predicted = "kept", "all_to_all"
        entry.reason = KEPT_VARIANT_REASON
        if rewrite:
            keep_all_to_all(scope.module, region)
        return
    entry.reason = switched or ""
    kept = kept_at_compile_time(region, opts.ring)
    if kept is not None:
        entry.status, entry.reason = ("kept" if rewrite else "matched"), f"kept its all-to-all: {kept.reason}"
        entry.execution_predicted = "all_to_all"
        if rewrite:
            keep_all_to_all(scope.module, region)
    elif rewrite:
        node = rewrite_moe_region(scope.module, region, opts.ring, inner_compiler=opts.inner_compiler)
        if scope.checkpoint is not None:
            keep_rings_saved(scope)
        entry.status, entry.ring_op = "rewritten", str(node.args[-1])
        entry.saves_projections = node.target is RING_MOE_SAVING  # what the rewrite emitted, not a prediction
        entry.experts = node.meta["relaymoe_experts"].summary()
        entry.fp8 = node.meta["relaymoe_fp8"]
        if dump.dir is not None:  # the op writes each program it runs, from the decision it makes
            program_dumps.dump_to(entry.ring_op, dump.dir, f"region{i}")
    else:
        entry.experts = choose_expert_fn(region, opts.inner_compiler)[1].summary()


def relaymoe_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Callable:
    """The Dynamo backend (see the module docstring)."""
    opts = resolve(options)
    graph = f"graph{next(_GRAPH_COUNTER)}"
    original = copy.deepcopy(gm) if opts.verify else None
    report, plan, pristine = analyze(gm, opts, graph, rewrite=True)
    _REPORTS.append(report)
    compiled = _compile_inner(opts, gm, example_inputs)
    if original is not None and any(r.status == "rewritten" for r in report.regions):
        compiled = _verifying(compiled, original, graph, opts.inner_compiler,
                              fp8=any(r.fp8 == "on" for r in report.regions))
    if plan is None or pristine is None:
        return compiled
    kept = _kept_variant(pristine, report, opts, graph, example_inputs)
    return compiled if kept is None else TokenSwitch(plan, kept, compiled, graph, report.token_switch["calls"])


# The reason a switched region gives in the kept variant's report.
KEPT_VARIANT_REASON = "kept: the kept variant of a graph whose token count is dynamic (runtime.token_switch)"


def _kept_variant(pristine: fx.GraphModule, report: GraphReport, opts: Options, graph: str,
                  example_inputs: list[Any]) -> Callable | None:
    """The graph before the rewrite with the switch's regions kept, compiled; None (the report says why, and the
    ring variant's ops decide per call) where its analysis does not keep exactly those regions."""
    start = time.perf_counter()
    kept_report = analyze(pristine, opts, f"{graph}_kept", rewrite=True, keep_switched=True).report
    kept_at = [r.index for r in kept_report.regions if r.reason == KEPT_VARIANT_REASON]
    if kept_at != report.token_switch["regions"]:
        report.token_switch = {"none": f"the kept variant's analysis kept regions {kept_at}, not the plan's "
                                       f"{report.token_switch['regions']}: each region runs as a ring op that "
                                       "decides per call"}
        log.warning("relaymoe %s: no token switch: %s", graph, report.token_switch["none"])
        return None
    report.token_switch["kept_split_reads"] = kept_report.split_reads  # the kept all-to-alls' split sizes
    kept = _compile_inner(opts, pristine, example_inputs)
    log.info("relaymoe %s: kept variant analyzed and compiled in %.1f s", graph, time.perf_counter() - start)
    return kept


# Dynamo enters this around each call of a frame compiled with the backend (tracing included): the settings
# that keep a region in one graph hold there and nowhere else. torch.compile needs help to find it.
relaymoe_backend.backend_ctx_ctor = dynamo_settings  # type: ignore[attr-defined]
keep_backend_ctx_through_torch_compile()


def explain(model: Callable, *inputs: Any, **options: Any) -> list[GraphReport]:
    """What ``backend="relaymoe"`` would do to ``model(*inputs)``, without rewriting or training.

    Runs ``model`` once (without gradients) under Dynamo with a backend that only matches, and returns one
    report per graph: every region found, rewritten or refused and why, the routing it would take with the
    per-hop volumes, and the predicted per-rank peak memory of a2a and ring. ``options`` are backend options.
    Collective calls run as in the model: call it on every rank.
    """
    opts = resolve(options)
    reports: list[GraphReport] = []

    def match_only(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        reports.append(analyze(gm, opts, f"explain{len(reports)}", rewrite=False).report)
        return gm.forward

    match_only.backend_ctx_ctor = dynamo_settings  # type: ignore[attr-defined]
    with torch.no_grad():
        torch.compile(model, backend=match_only, fullgraph=False)(*inputs)
    return reports
