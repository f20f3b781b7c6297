"""The rows of a table: how each one runs the layer (``RowSpec``) and the standard sets of rows.

A row is a ``RowSpec``: a builder ``(cfg, group) -> LayerFn``, where a ``LayerFn`` is
``(x, ids, scores, w1, w2, w3) -> y``, and what the link model needs (kind, routing, overlap). Builders:
``build_eager_a2a`` (``relay_compile.reference.a2a_moe``, the baseline of every ratio, row ``A2A_EAGER``),
``compiled_a2a_builder`` (``a2a_moe`` under ``torch.compile``) and ``ring_builder`` (``relay_compile.ring_moe``
with options). ``default_rows``, ``ablation_rows`` and ``sweep_rows`` build the standard sets; pass more
through ``measure_layer(..., extra_rows=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from relay_compile import ring_moe
from relay_compile.bench.configs import BenchOptions, LayerConfig
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

LayerFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
RowKind = Literal["a2a", "ring"]
# ``RowSpec.build``: called once per configuration with the stand-in group, returns the row's layer.
RowBuilder = Callable[[LayerConfig, Any], LayerFn]

# The baseline row of every ratio.
A2A_EAGER = "a2a eager"


@dataclass(frozen=True, kw_only=True)
class RowSpec:
    """One row of a table: how to run the layer, and what the link model needs to know about it.

    ``build(cfg, group) -> LayerFn`` is called once per configuration (compiled rows compile on first call,
    during warm-up). It may raise ``RowSkipped`` to leave the row out with a reason.
    """

    name: str
    build: RowBuilder
    kind: RowKind
    routing: str = "expert"
    overlap: bool = True
    note: str = ""
    # Compiles on first use (seconds to minutes): a run on a time budget may measure these rows last.
    compiles: bool = False
    # Runs only where a table names it (the sweep's ``--rows``): a stand-in variant, not a way the block runs.
    named_only: bool = False


class RowSkipped(Exception):
    """A row that cannot run here; the message says why and goes into the table."""


def build_eager_a2a(cfg: LayerConfig, group: Any) -> LayerFn:
    """Row ``A2A_EAGER``'s builder: the reference layer ``a2a_moe`` on ``group``, eager."""

    def fn(x, ids, scores, w1, w2, w3):
        return a2a_moe(x, ids, scores, w1, w2, w3, group=group)

    return fn


def compiled_a2a_builder(backend: str, enabled: bool = True, dynamic: bool = False) -> RowBuilder:
    """A builder of ``torch.compile(a2a_moe, backend=backend, fullgraph=True)`` on the group (passed by name);
    with ``dynamic``, the token count marked dynamic (one graph for every token count of an EP size: the
    backend's token switch decides per call).

    The row is skipped (``RowSkipped``) when ``enabled`` is false or ``backend`` is not registered.
    """

    def build(cfg: LayerConfig, group: Any) -> LayerFn:
        if not enabled:
            raise RowSkipped("torch.compile rows are off (--compile runs them)")
        if backend not in torch._dynamo.list_backends(exclude_tags=()):  # debug ones too (aot_eager)
            raise RowSkipped(f"torch.compile backend {backend!r} is not registered")
        # torch._grouped_mm's fake kernel demands bf16: other dtypes compile the per-expert loop instead.
        grouped = None if cfg.torch_dtype == torch.bfloat16 else False
        # The group goes in by name (docs/ARCHITECTURE.md, section 5 "Measured facts"): Dynamo keeps the str as
        # a constant and functional collectives resolve it; torch 2.11's Dynamo cannot proxy the stand-in group
        # object (a Python subclass of ProcessGroup) and fails on the first collective.
        group_name = None if group is None else group.group_name

        def fn(x, ids, scores, w1, w2, w3):
            return a2a_moe(x, ids, scores, w1, w2, w3, group=group_name, use_grouped_mm=grouped)

        # Static shapes: each configuration compiles for its own sizes, as a training run with fixed shapes would
        # (a later configuration would otherwise recompile with dynamic sizes). Split sizes stay unbacked.
        # Dynamic: T (dimension 0 of x, the ids and the scores) is marked dynamic at every call.
        compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

        def run(*args: Tensor) -> Tensor:
            if dynamic:
                for t in args[:3]:
                    torch._dynamo.mark_dynamic(t, 0)
            # The split sizes are .tolist() of device tensors: one graph needs them as unbacked SymInts.
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                return compiled(*args)

        return run

    return build


def ring_builder(**options: Any) -> RowBuilder:
    """A builder of ``ring_moe(..., group=group, **options)`` (options: routing, overlap, max_hop_rows, ...)."""

    def build(cfg: LayerConfig, group: Any) -> LayerFn:
        def fn(x, ids, scores, w1, w2, w3):
            return ring_moe(x, ids, scores, w1, w2, w3, group=group, **options)

        return fn

    return build


def link_stream_builder(builder: RowBuilder, ctas: int = 0, high_priority: bool = False) -> RowBuilder:
    """``builder`` on the stand-in group of the same size whose transfers run on a stream of their own
    (``standin_group(n, link_stream=True)``: overlapped with compute, as NCCL's sends and receives are);
    ``ctas``: each copy by that many thread blocks (``link_ctas``), as NCCL's channels; ``high_priority``: that
    stream of the device's highest priority (``link_high_priority``)."""

    def build(cfg: LayerConfig, group: Any) -> LayerFn:
        return builder(cfg, standin_group(cfg.ep, link_stream=True, link_ctas=ctas,
                                          link_high_priority=high_priority))

    return build


def default_rows(opts: BenchOptions) -> list[RowSpec]:
    """The standard rows: eager a2a (the baseline of every ratio), compiled a2a, ring variants."""
    rows = [
        RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
        RowSpec(name="a2a inductor", build=compiled_a2a_builder("inductor", opts.compile), kind="a2a",
                note="torch.compile(a2a_moe, fullgraph=True)", compiles=True),
    ]
    if "relaymoe" in torch._dynamo.list_backends():
        # The compiled reference layer: the backend rewrites a2a_moe's all-to-alls into a ring.
        rows.append(RowSpec(name="relaymoe backend", build=compiled_a2a_builder("relaymoe", opts.compile),
                            kind="ring", note="torch.compile(a2a_moe, backend='relaymoe')", compiles=True))
    rows += [
        RowSpec(name="ring sequential", build=ring_builder(routing="expert", overlap=False), kind="ring",
                overlap=False),
        RowSpec(name="ring overlap", build=ring_builder(routing="expert", overlap=True), kind="ring"),
    ]
    if opts.max_hop_rows:
        rows.append(RowSpec(name=f"ring overlap, hops <= {opts.max_hop_rows} rows",
                            build=ring_builder(routing="expert", max_hop_rows=opts.max_hop_rows), kind="ring"))
    rows += [
        RowSpec(name="ring overlap, no grouped GEMM", build=ring_builder(routing="expert", use_grouped_mm=False),
                kind="ring", note="per-expert matmul loop (Figure 17 ablation)"),
        RowSpec(name="ring token routing", build=ring_builder(routing="token"), kind="ring", routing="token",
                note="stand-in numerics: N x own-expert pairs"),
    ]
    return rows


def ablation_rows() -> list[RowSpec]:
    """Paper Figure 17: naive ring (sequential, no grouped GEMM), + overlap, + grouped GEMM; a2a for ratios."""
    return [
        RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
        RowSpec(name="ring sequential, no grouped GEMM", build=ring_builder(routing="expert", overlap=False,
                use_grouped_mm=False), kind="ring", overlap=False),
        RowSpec(name="ring overlap, no grouped GEMM", build=ring_builder(routing="expert", use_grouped_mm=False),
                kind="ring"),
        RowSpec(name="ring overlap + grouped GEMM", build=ring_builder(routing="expert"), kind="ring"),
        RowSpec(name="ring sequential + grouped GEMM", build=ring_builder(routing="expert", overlap=False), kind="ring",
                overlap=False),
    ]


def sweep_rows(opts: BenchOptions) -> list[RowSpec]:
    """The rows of sweeps: eager a2a, ring overlap, and ring with bounded hops."""
    rows = [RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
            RowSpec(name="ring overlap", build=ring_builder(routing="expert"), kind="ring")]
    if opts.max_hop_rows:
        rows.append(RowSpec(name=f"ring overlap, hops <= {opts.max_hop_rows} rows",
                            build=ring_builder(routing="expert", max_hop_rows=opts.max_hop_rows), kind="ring"))
    return rows
