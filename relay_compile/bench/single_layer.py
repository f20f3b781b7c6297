"""One MoE layer, one rank, simulated EP: forward+backward latency and peak memory, all-to-all beside the ring.

Every measurement runs rank 0 of an N-rank stand-in group (``relay_compile.bench.standin_group``): its peers
are copies of this rank, so this rank's memory and compute are those of a real EP rank under symmetric routing,
while link time is not simulated. Link time is reported separately, from a stated model:

    a2a:   4 all-to-alls (dispatch, combine; twice in backward), each moving T*K*H*elem*(N-1)/N bytes off the rank
           modeled total = measured + 4 * a2a_bytes / BW                         (no overlap)
    ring:  per-hop bytes from ``relay_compile.routing.per_hop_bytes`` (forward, backward), BW = link GB/s
           transfers: forward N-1 (expert routing) or N (token routing: accumulators return), backward N
           sequential: modeled total = measured + sum(transfers) / BW
           overlap:    per direction, c = measured / N per hop, t = bytes / BW per transfer:
                       (N-1) * max(c, t) + c [+ t for a transfer that follows the last hop]

Everything under "model" is simulated; "measured" columns are what this device did (including the stand-in's
copies, which move data at device-memory bandwidth on the compute stream).

Routing of every configuration: the Qwen3 router (``relay_compile.reference.qwen3_route``: softmax of
``x @ gate.T`` in fp32, top-k, renormalized) over tokens ``x ~ N(0, 1)`` and a seeded gate ``N(0, 1/H)``.

Rows are ``RowSpec``s: a callable ``(x, ids, scores, w1, w2, w3) -> y`` and what the link model needs.
``default_rows`` builds the standard set; pass more through ``measure_layer(..., extra_rows=...)``.

Legend: T tokens per rank, H hidden, F expert FFN width, E experts, K top-k, N EP size, E_l = E / N.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from relay_compile import ring_moe
from relay_compile.bench.standin_group import drop_pending_messages, standin_group
from relay_compile.memory import PeakMemory, memory_timeline
from relay_compile.reference import a2a_moe, moe_weights, qwen3_route
from relay_compile.routing import per_hop_bytes

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

# ----------------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LayerConfig:
    """One SwiGLU MoE layer on one rank of an EP group of ``ep`` ranks."""

    name: str
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int
    ep: int
    dtype: str = "bf16"
    device: str = "cuda"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.experts % self.ep:
            raise ValueError(f"LayerConfig {self.name}: experts={self.experts} is not a multiple of ep={self.ep}")
        if self.dtype not in DTYPES:
            raise ValueError(f"LayerConfig {self.name}: dtype={self.dtype!r} is not one of {sorted(DTYPES)}")

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.ep

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def expert_bytes(self) -> int:
        """W: one expert's weights (w1, w2, w3)."""
        return 3 * self.hidden * self.ffn * self.elem_bytes

    def label(self) -> str:
        return (f"{self.name} H={self.hidden} F={self.ffn} E={self.experts} K={self.top_k} T={self.tokens} "
                f"EP={self.ep} {self.dtype} {self.device}")

    def with_(self, **changes: Any) -> LayerConfig:
        return dataclasses.replace(self, **changes)


# Qwen3-30B-A3B's MoE layer (paper Table 3), 65536 tokens per rank.
QWEN3_30B = LayerConfig(name="Qwen3-30B-A3B", hidden=2048, ffn=768, experts=128, top_k=8, tokens=65536, ep=8)

# Paper Table 3, the single-layer scaling configurations (hidden 2048; L differs only in full models).
TABLE3: dict[str, LayerConfig] = {
    c.name: c for c in (
        QWEN3_30B.with_(name="MoE-E64", experts=64),
        QWEN3_30B.with_(name="MoE-E128", experts=128),
        QWEN3_30B.with_(name="MoE-E384", experts=384),
        QWEN3_30B.with_(name="MoE-K4", top_k=4),
        QWEN3_30B.with_(name="MoE-K12", top_k=12),
        QWEN3_30B.with_(name="MoE-K16", top_k=16),
        QWEN3_30B.with_(name="MoE-H512", ffn=512),
        QWEN3_30B.with_(name="MoE-H2048", ffn=2048),
    )
}
# MoE-K8 and MoE-H768 are MoE-E128 (E128, K8, FFN 768): measured once, under that name.


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """How to measure. Link bandwidth is one direction of one link (NVLink on H100/H200: about 450 GB/s)."""

    warmup: int = 2
    repeats: int = 5
    link_gbps: float = 450.0
    # Bound of the "bounded hops" row (rows of one expert call); None drops that row.
    max_hop_rows: int | None = 16384
    # Rows that need torch.compile (a2a with inductor, the relaymoe backend).
    compile: bool = True
    # Measure peak memory (one extra forward+backward per row).
    memory: bool = True


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LayerInputs:
    """Resident tensors of one measurement: tokens, routing, this rank's experts and an output gradient."""

    x_TH: Tensor
    topk_ids_TK: Tensor
    topk_scores_TK: Tensor
    weights: list[Tensor]
    grad_y_TH: Tensor

    def leaves(self) -> list[Tensor]:
        return [self.x_TH, self.topk_scores_TK, *self.weights]

    def resident_bytes(self) -> int:
        tensors = [self.x_TH, self.topk_ids_TK, self.topk_scores_TK, self.grad_y_TH, *self.weights]
        return sum(t.numel() * t.element_size() for t in tensors)

    def clear_grads(self) -> None:
        for t in self.leaves():
            t.grad = None


def make_weights(cfg: LayerConfig) -> list[Tensor]:
    """This rank's ``E_l`` experts (``moe_weights`` seeded: the same experts on any device)."""
    w = moe_weights(cfg.seed, cfg.hidden, cfg.ffn, cfg.experts_per_rank, dtype=cfg.torch_dtype, device=cfg.device)
    return [w["w1"].requires_grad_(), w["w2"].requires_grad_(), w["w3"].requires_grad_()]


def make_inputs(cfg: LayerConfig, weights: list[Tensor] | None = None) -> LayerInputs:
    """Tokens, Qwen3 routing over all E experts, weights (made unless given) and a fixed output gradient."""
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    dt = cfg.torch_dtype
    x_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen, device=cfg.device, dtype=dt)
    gate_EH = moe_weights(cfg.seed, cfg.hidden, 1, cfg.experts, experts=range(1), dtype=dt, device=cfg.device)["gate"]
    with torch.no_grad():
        ids_TK, scores_TK = qwen3_route(x_TH, gate_EH, cfg.top_k)
    grad_y_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen, device=cfg.device, dtype=dt)
    return LayerInputs(
        x_TH=x_TH.requires_grad_(), topk_ids_TK=ids_TK, topk_scores_TK=scores_TK.requires_grad_(),
        weights=weights if weights is not None else make_weights(cfg), grad_y_TH=grad_y_TH,
    )


# ----------------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------------

LayerFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
RowKind = Literal["a2a", "ring"]


@dataclass(frozen=True, kw_only=True)
class RowSpec:
    """One row of a table: how to run the layer, and what the link model needs to know about it.

    ``build(cfg, group) -> LayerFn`` is called once per configuration (compiled rows compile on first call,
    during warm-up). It may raise ``RowSkipped`` to leave the row out with a reason.
    """

    name: str
    build: Callable[[LayerConfig, Any], LayerFn]
    kind: RowKind
    routing: str = "expert"
    overlap: bool = True
    note: str = ""
    # Compiles on first use (seconds to minutes): a run on a time budget may measure these rows last.
    compiles: bool = False


class RowSkipped(Exception):
    """A row that cannot run here; the message says why and goes into the table."""


def _a2a_eager(cfg: LayerConfig, group: Any) -> LayerFn:
    def fn(x, ids, scores, w1, w2, w3):
        return a2a_moe(x, ids, scores, w1, w2, w3, group=group)

    return fn


def _compiled_a2a(backend: str, enabled: bool = True) -> Callable[[LayerConfig, Any], LayerFn]:
    def build(cfg: LayerConfig, group: Any) -> LayerFn:
        if not enabled:
            raise RowSkipped("torch.compile rows are off (--compile runs them)")
        if backend not in torch._dynamo.list_backends(exclude_tags=()):  # debug ones too (aot_eager)
            raise RowSkipped(f"torch.compile backend {backend!r} is not registered")
        # torch._grouped_mm's fake kernel demands bf16: other dtypes compile the per-expert loop instead.
        grouped = None if cfg.torch_dtype == torch.bfloat16 else False
        # The group goes in by name (DESIGN.md section 6): Dynamo keeps the str as a constant and functional
        # collectives resolve it; torch 2.11's Dynamo cannot proxy the stand-in group object (a Python subclass
        # of ProcessGroup) and fails on the first collective.
        group_name = None if group is None else group.group_name

        def fn(x, ids, scores, w1, w2, w3):
            return a2a_moe(x, ids, scores, w1, w2, w3, group=group_name, use_grouped_mm=grouped)

        # Static shapes: each configuration compiles for its own sizes, as a training run with fixed shapes would
        # (a later configuration would otherwise recompile with dynamic sizes). Split sizes stay unbacked.
        compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

        def run(*args: Tensor) -> Tensor:
            # The split sizes are .tolist() of device tensors: one graph needs them as unbacked SymInts.
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                return compiled(*args)

        return run

    return build


def _ring(**options: Any) -> Callable[[LayerConfig, Any], LayerFn]:
    def build(cfg: LayerConfig, group: Any) -> LayerFn:
        def fn(x, ids, scores, w1, w2, w3):
            return ring_moe(x, ids, scores, w1, w2, w3, group=group, **options)

        return fn

    return build


A2A_EAGER = "a2a eager"

# Seconds of time budget a compiling row needs left to start (compilation takes tens of seconds to minutes).
COMPILE_RESERVE_S = 120.0


def default_rows(opts: BenchOptions) -> list[RowSpec]:
    """The standard rows: eager a2a (the baseline of every ratio), compiled a2a, ring variants."""
    rows = [
        RowSpec(name=A2A_EAGER, build=_a2a_eager, kind="a2a"),
        RowSpec(name="a2a inductor", build=_compiled_a2a("inductor", opts.compile), kind="a2a",
                note="torch.compile(a2a_moe, fullgraph=True)", compiles=True),
    ]
    if "relaymoe" in torch._dynamo.list_backends():
        # The compiled reference layer: the backend rewrites a2a_moe's all-to-alls into a ring.
        rows.append(RowSpec(name="relaymoe backend", build=_compiled_a2a("relaymoe", opts.compile), kind="ring",
                            note="torch.compile(a2a_moe, backend='relaymoe')", compiles=True))
    rows += [
        RowSpec(name="ring sequential", build=_ring(routing="expert", overlap=False), kind="ring", overlap=False),
        RowSpec(name="ring overlap", build=_ring(routing="expert", overlap=True), kind="ring"),
    ]
    if opts.max_hop_rows:
        rows.append(RowSpec(name=f"ring overlap, hops <= {opts.max_hop_rows} rows",
                            build=_ring(routing="expert", max_hop_rows=opts.max_hop_rows), kind="ring"))
    rows += [
        RowSpec(name="ring overlap, no grouped GEMM", build=_ring(routing="expert", use_grouped_mm=False),
                kind="ring", note="per-expert matmul loop (Figure 17 ablation)"),
        RowSpec(name="ring token routing", build=_ring(routing="token"), kind="ring", routing="token",
                note="stand-in numerics: N x own-expert pairs"),
    ]
    return rows


def ablation_rows() -> list[RowSpec]:
    """Paper Figure 17: naive ring (sequential, no grouped GEMM), + overlap, + grouped GEMM; a2a for ratios."""
    return [
        RowSpec(name=A2A_EAGER, build=_a2a_eager, kind="a2a"),
        RowSpec(name="ring sequential, no grouped GEMM", build=_ring(routing="expert", overlap=False,
                use_grouped_mm=False), kind="ring", overlap=False),
        RowSpec(name="ring overlap, no grouped GEMM", build=_ring(routing="expert", use_grouped_mm=False),
                kind="ring"),
        RowSpec(name="ring overlap + grouped GEMM", build=_ring(routing="expert"), kind="ring"),
        RowSpec(name="ring sequential + grouped GEMM", build=_ring(routing="expert", overlap=False), kind="ring",
                overlap=False),
    ]


def sweep_rows(opts: BenchOptions) -> list[RowSpec]:
    """The rows of sweeps: eager a2a, ring overlap, and ring with bounded hops."""
    rows = [RowSpec(name=A2A_EAGER, build=_a2a_eager, kind="a2a"),
            RowSpec(name="ring overlap", build=_ring(routing="expert"), kind="ring")]
    if opts.max_hop_rows:
        rows.append(RowSpec(name=f"ring overlap, hops <= {opts.max_hop_rows} rows",
                            build=_ring(routing="expert", max_hop_rows=opts.max_hop_rows), kind="ring"))
    return rows


# ----------------------------------------------------------------------------------------------------------
# Timing and memory of one row
# ----------------------------------------------------------------------------------------------------------


def _step(fn: LayerFn, inp: LayerInputs) -> Tensor:
    """One forward+backward; gradients land in the leaves' ``.grad``."""
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    y.backward(inp.grad_y_TH)
    return y


def time_step(fn: LayerFn, inp: LayerInputs, device: str) -> tuple[float, float]:
    """(forward ms, backward ms) of one step: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    inp.clear_grads()
    if device.startswith("cuda"):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
        mid.record()
        y.backward(inp.grad_y_TH)
        end.record()
        end.synchronize()
        return start.elapsed_time(mid), mid.elapsed_time(end)
    t0 = time.perf_counter()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    t1 = time.perf_counter()
    y.backward(inp.grad_y_TH)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def peak_step(fn: LayerFn, inp: LayerInputs, device: str) -> int:
    """Peak bytes above the resident inputs and weights during one forward+backward (``relay_compile.memory``).

    Everything allocated inside the step counts: the ring's transfer buffers (allocated inside its op), weight
    gradients, ``dx``, ``d_scores``.
    """
    inp.clear_grads()
    with PeakMemory(device) as mem:
        y = _step(fn, inp)
        del y
    return mem.peak_bytes


def _free_cached(device: str) -> None:
    """Between rows and probes on a GPU: drop unreachable cycles and return cached blocks (avoids false OOMs)."""
    if device.startswith("cuda"):
        gc.collect()  # costs ~0.3 s: not on the CPU, where nothing is cached
        torch.cuda.empty_cache()


def _error_summary(e: BaseException, limit: int = 300) -> str:
    """One line for a table: the exception's type and message, with the root cause of wrapped errors."""
    if _is_oom(e):
        return "out of memory: " + " ".join(str(e).split())[:limit]
    parts = [f"{type(e).__name__}: {' '.join(str(e).split())}"]
    cause = e.__cause__ or e.__context__
    if cause is not None and cause is not e:
        parts.append(f"caused by {type(cause).__name__}: {' '.join(str(cause).split())}")
    text = "; ".join(parts).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


# ----------------------------------------------------------------------------------------------------------
# Link model
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Modeled link time of one row (simulated: nothing here was measured)."""

    bytes_fwd: int  # per transfer (ring: per hop; a2a: per all-to-all), bytes leaving this rank
    bytes_bwd: int
    transfers_fwd: int
    transfers_bwd: int
    link_ms: float  # all transfers of one forward+backward, back to back
    total_ms: float  # measured compute with the modeled link time, on this row's schedule


def link_model(cfg: LayerConfig, spec: RowSpec, fwd_ms: float, bwd_ms: float, gbps: float) -> LinkModel:
    """The module docstring's model, for one row's measured forward and backward times."""
    n = cfg.ep
    ms_per_byte = 1e3 / (gbps * 1e9)
    if spec.kind == "a2a":
        per = cfg.tokens * cfg.top_k * cfg.hidden * cfg.elem_bytes * (n - 1) // n
        link = 4 * per * ms_per_byte
        return LinkModel(bytes_fwd=per, bytes_bwd=per, transfers_fwd=2, transfers_bwd=2, link_ms=link,
                         total_ms=fwd_ms + bwd_ms + link)
    routing = spec.routing if spec.routing in ("expert", "token") else "expert"
    vol = per_hop_bytes(
        routing, tokens=cfg.tokens, hidden=cfg.hidden, top_k=cfg.top_k, experts_per_rank=cfg.experts_per_rank,
        expert_bytes=cfg.expert_bytes, elem_bytes=cfg.elem_bytes,
    )
    if n == 1:
        return LinkModel(bytes_fwd=0, bytes_bwd=0, transfers_fwd=0, transfers_bwd=0, link_ms=0.0,
                         total_ms=fwd_ms + bwd_ms)
    tr_fwd = n - 1 if routing == "expert" else n
    tr_bwd = n
    t_fwd, t_bwd = vol["forward"] * ms_per_byte, vol["backward"] * ms_per_byte
    link = tr_fwd * t_fwd + tr_bwd * t_bwd
    if not spec.overlap:
        total = fwd_ms + bwd_ms + link
    else:
        c_fwd, c_bwd = fwd_ms / n, bwd_ms / n
        total = (n - 1) * max(c_fwd, t_fwd) + c_fwd + (t_fwd if tr_fwd == n else 0.0)
        total += (n - 1) * max(c_bwd, t_bwd) + c_bwd + t_bwd
    return LinkModel(bytes_fwd=vol["forward"], bytes_bwd=vol["backward"], transfers_fwd=tr_fwd,
                     transfers_bwd=tr_bwd, link_ms=link, total_ms=total)


# ----------------------------------------------------------------------------------------------------------
# One configuration, all rows
# ----------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RowResult:
    """One measured row (JSON-able). Times in ms (medians), memory in bytes; None where not measured."""

    row: str
    kind: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    total_ms: float | None = None
    peak_bytes: int | None = None
    time_ratio: float | None = None  # total_ms / eager a2a's
    peak_ratio: float | None = None  # peak_bytes / eager a2a's
    link: dict[str, Any] | None = None  # LinkModel fields (simulated)
    model_ratio: float | None = None  # link-modeled total / eager a2a's link-modeled total
    note: str = ""
    skipped: str = ""


@dataclass(kw_only=True)
class LayerResult:
    config: dict[str, Any]
    label: str
    resident_bytes: int
    rows: list[RowResult] = field(default_factory=list)
    check: str = ""

    def row(self, name: str) -> RowResult:
        for r in self.rows:
            if r.row == name:
                return r
        raise KeyError(f"no row {name!r} in {self.label}; rows: {[r.row for r in self.rows]}")


class Progress:
    """One printed line per finished measurement, flushed at once; counts and elapsed time."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.count = 0
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def line(self, text: str) -> None:
        self.count += 1
        print(f"[{self.count:3d} {self.elapsed():6.1f}s] {text}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        print(f"           {text}", file=self.stream, flush=True)


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _fmt_bytes(v: int | float | None) -> str:
    """``2.70 GiB``, ``3.9 MiB``, ``12 KiB``: one unit per value, picked by its size."""
    if v is None:
        return "-"
    if abs(v) >= GiB:
        return f"{v / GiB:.2f} GiB"
    if abs(v) >= MiB:
        return f"{v / MiB:.1f} MiB"
    return f"{v / 1024:.0f} KiB"


def _fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _check_ring(cfg: LayerConfig, fns: dict[str, LayerFn], inp: LayerInputs) -> str:
    """Forward of ``ring overlap`` against eager a2a on this configuration's inputs (max error / max |y|)."""
    if A2A_EAGER not in fns or "ring overlap" not in fns:
        return ""
    with torch.no_grad():
        args = (inp.x_TH.detach(), inp.topk_ids_TK, inp.topk_scores_TK.detach(), *(w.detach() for w in inp.weights))
        want = fns[A2A_EAGER](*args).float()
        got = fns["ring overlap"](*args).float()
    rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    return f"ring overlap vs a2a eager forward: max |diff| / max |y| = {rel:.2e}"


def measure_layer(
    cfg: LayerConfig,
    opts: BenchOptions,
    rows: Sequence[RowSpec] | None = None,
    *,
    extra_rows: Sequence[RowSpec] = (),
    progress: Progress | None = None,
    weights: list[Tensor] | None = None,
    into: LayerResult | None = None,
    deadline: float | None = None,
) -> LayerResult:
    """Measure every row on one configuration, side by side in this process.

    Args:
        rows: default ``default_rows(opts)``; the row named ``"a2a eager"`` is the baseline of ratios.
        extra_rows: appended rows (for example a future compiled reference layer).
        weights: reuse this rank's experts (same shapes as ``make_weights(cfg)``).
        into: append the rows to this earlier result of the same configuration (inputs are seeded, so they
            are the same tensors) and recompute its ratios.
        deadline: a ``time.perf_counter()`` value; rows that would start after it are skipped and say so.

    A row that raises ``RowSkipped``, runs out of memory or fails keeps its place with the reason in ``skipped``.
    """
    progress = progress or Progress()
    specs = list(rows if rows is not None else default_rows(opts)) + list(extra_rows)
    group = standin_group(cfg.ep)
    inp = make_inputs(cfg, weights)
    result = into or LayerResult(config=dataclasses.asdict(cfg), label=cfg.label(), resident_bytes=inp.resident_bytes())
    fns: dict[str, LayerFn] = {}
    for spec in specs:
        row = RowResult(row=spec.name, kind=spec.kind, note=spec.note)
        result.rows.append(row)
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and (left <= 0 or (spec.compiles and left < COMPILE_RESERVE_S)):
            row.skipped = ("time budget spent" if left <= 0
                           else f"less than {COMPILE_RESERVE_S:g} s of the time budget left to compile")
            _report_row(progress, cfg, row)
            continue
        try:
            fn = spec.build(cfg, group)
            for _ in range(opts.warmup):
                time_step(fn, inp, cfg.device)
            times = [time_step(fn, inp, cfg.device) for _ in range(max(1, opts.repeats))]
            row.fwd_ms = statistics.median(t[0] for t in times)
            row.bwd_ms = statistics.median(t[1] for t in times)
            row.total_ms = row.fwd_ms + row.bwd_ms  # the sum of the medians, as the link model uses them
            if opts.memory:
                row.peak_bytes = peak_step(fn, inp, cfg.device)
            lm = link_model(cfg, spec, row.fwd_ms, row.bwd_ms, opts.link_gbps)
            row.link = dataclasses.asdict(lm)
            fns[spec.name] = fn
        except RowSkipped as e:
            row.skipped = str(e)
        except Exception as e:  # one failing row must not lose the others
            row.skipped = _error_summary(e)
            log.debug("row %s failed", spec.name, exc_info=True)
            drop_pending_messages()
        finally:
            inp.clear_grads()
            _free_cached(cfg.device)
        _report_row(progress, cfg, row)
    check = _check_ring(cfg, fns, inp)
    if check:
        result.check = check
        progress.note(check)
    _fill_ratios(result)
    del inp, fns
    _free_cached(cfg.device)
    return result


def _report_row(progress: Progress, cfg: LayerConfig, row: RowResult) -> None:
    head = f"{cfg.name} EP={cfg.ep} T={cfg.tokens} | {row.row:<34}"
    if row.skipped:
        progress.line(f"{head} | skipped: {row.skipped}")
        return
    progress.line(f"{head} | fwd {_fmt_ms(row.fwd_ms)} ms + bwd {_fmt_ms(row.bwd_ms)} ms "
                  f"= {_fmt_ms(row.total_ms)} ms | peak {_fmt_bytes(row.peak_bytes)}")


def _fill_ratios(result: LayerResult) -> None:
    base = next((r for r in result.rows if r.row == A2A_EAGER and not r.skipped), None)
    if base is None:
        return
    for r in result.rows:
        if r.skipped:
            continue
        if base.total_ms and r.total_ms is not None:
            r.time_ratio = r.total_ms / base.total_ms
        if base.peak_bytes and r.peak_bytes is not None:
            r.peak_ratio = r.peak_bytes / base.peak_bytes
        if base.link and r.link:
            r.model_ratio = r.link["total_ms"] / base.link["total_ms"]


# ----------------------------------------------------------------------------------------------------------
# Capacity: the largest tokens per rank that fit a memory budget
# ----------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class CapacityResult:
    row: str
    config: str
    budget_bytes: int
    step: int
    max_tokens: int  # 0: not even one step fits
    bytes_at_max: int | None  # resident + peak at max_tokens
    limited_by_search: bool  # max_tokens is the search's upper end, not a measured limit
    probes: list[tuple[int, int | None]] = field(default_factory=list)  # (tokens, resident + peak | None = OOM)


def capacity_search(
    cfg: LayerConfig,
    spec: RowSpec,
    budget_bytes: int,
    *,
    step: int = 4096,
    max_tokens: int = 1 << 21,
    progress: Progress | None = None,
    weights: list[Tensor] | None = None,
) -> CapacityResult:
    """Largest multiple of ``step`` tokens per rank whose forward+backward fits ``budget_bytes``.

    "Fits": resident inputs, output gradient and weights plus the step's peak above them, at most the budget
    (an out-of-memory error also means it does not fit). Doubling brackets the limit, then a binary
    search over multiples of ``step`` narrows it; one forward+backward per probe. The search starts at
    ``cfg.tokens`` and doubles (or halves) from there, up to ``max_tokens``.
    """
    progress = progress or Progress()
    group = standin_group(cfg.ep)
    weights = weights if weights is not None else make_weights(cfg)
    label = cfg.label().replace(f" T={cfg.tokens}", "")
    result = CapacityResult(row=spec.name, config=label, budget_bytes=budget_bytes, step=step,
                            max_tokens=0, bytes_at_max=None, limited_by_search=False)
    fn_cache: dict[str, LayerFn] = {}

    def used(tokens: int) -> int | None:
        inp = None
        try:
            fn = fn_cache.setdefault("fn", spec.build(cfg, group))
            inp = make_inputs(cfg.with_(tokens=tokens), weights)
            total = inp.resident_bytes() + peak_step(fn, inp, cfg.device)
        except Exception as e:
            if not _is_oom(e):
                raise
            total = None
            drop_pending_messages()
        finally:
            if inp is not None:
                inp.clear_grads()
            del inp
            _free_cached(cfg.device)
        result.probes.append((tokens, total))
        verdict = "OOM" if total is None else _fmt_bytes(total)
        fits = total is not None and total <= budget_bytes
        progress.line(f"capacity {cfg.name} EP={cfg.ep} | {spec.name:<34} | T={tokens:>8} | {verdict} "
                      f"({'fits' if fits else 'over'} {_fmt_bytes(budget_bytes)})")
        return total if fits else None

    # Step 1: bracket the limit by doubling (or halving) from the configuration's own token count.
    lo, lo_bytes = 0, None  # largest multiple of step known to fit
    hi: int | None = None  # smallest multiple of step known not to fit
    top = max(step, max_tokens // step * step)
    t = min(top, max(step, cfg.tokens // step * step))
    if (b := used(t)) is not None:
        lo, lo_bytes = t, b
        while hi is None and lo < top:
            t = min(top, lo * 2)
            if (b := used(t)) is None:
                hi = t
            else:
                lo, lo_bytes = t, b
    else:
        hi = t
        while lo == 0 and t > step:
            t = max(step, t // 2 // step * step)
            if (b := used(t)) is None:
                hi = t
            else:
                lo, lo_bytes = t, b
    if hi is None:
        result.limited_by_search = True
        hi = lo + step
    # Step 2: binary search over multiples of step inside (lo, hi).
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if (b := used(mid)) is None:
            hi = mid
        else:
            lo, lo_bytes = mid, b
    result.max_tokens, result.bytes_at_max = lo, lo_bytes
    return result


# ----------------------------------------------------------------------------------------------------------
# Memory over time (paper Figures 4 and 7)
# ----------------------------------------------------------------------------------------------------------

# A marker allocation between forward and backward: an odd size no tensor of the layer has (512-aligned so the
# CUDA caching allocator keeps it exact). Its two events are removed from the series.
_MARKER_BYTES = 512 * 10007


@dataclass(kw_only=True)
class Timeline:
    """Allocated bytes above the level at the start, over one forward+backward (a step function)."""

    row: str
    times_ms: list[float]
    bytes: list[int]
    backward_starts_ms: float | None
    peak_bytes: int
    snapshot_file: str = ""


def _downsample(times: list[float], levels: list[int], points: int = 4000) -> tuple[list[float], list[int]]:
    """At most ``points`` points; each bin keeps its maximum, so peaks survive."""
    if len(times) <= points:
        return times, levels
    t0, t1 = times[0], times[-1]
    width = (t1 - t0) / points or 1.0
    out_t: list[float] = []
    out_b: list[int] = []
    i = 0
    for k in range(points):
        end = t0 + (k + 1) * width
        best = None
        while i < len(times) and (times[i] <= end or k == points - 1):
            best = levels[i] if best is None else max(best, levels[i])
            i += 1
        if best is not None:
            out_t.append(t0 + k * width)
            out_b.append(best)
    return out_t, out_b


def _marked_step(fn: LayerFn, inp: LayerInputs, device: str) -> None:
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8, device=device)
    del marker
    y.backward(inp.grad_y_TH)
    del y


def _levels_without_marker(deltas: list[tuple[float, int]]) -> tuple[list[float], list[int], float | None]:
    """Running level from (time, signed bytes) events, the marker's pair removed; the marker's time."""
    marker_at = None
    times, levels, level = [], [], 0
    skip_free = False
    for t, d in deltas:
        if marker_at is None and d == _MARKER_BYTES:
            marker_at, skip_free = t, True
            continue
        if skip_free and d == -_MARKER_BYTES:
            skip_free = False
            continue
        level += d
        times.append(t)
        levels.append(level)
    return times, levels, marker_at


def _cuda_trace_deltas(snapshot: dict[str, Any]) -> list[tuple[float, int]]:
    """(ms since the first event, signed bytes) of allocations and frees in a memory-history snapshot."""
    traces = snapshot.get("device_traces") or []
    device = torch.cuda.current_device()
    events = traces[device] if device < len(traces) else []
    out: list[tuple[float, int]] = []
    t_first = None
    for i, e in enumerate(events):
        action = e.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        t = e.get("time_us", i)
        t_first = t if t_first is None else t_first
        out.append(((t - t_first) / 1e3, e["size"] if action == "alloc" else -e["size"]))
    return out


def _strip_frames(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The snapshot without Python/C++ stack frames (memory_viz still draws it), for a small file."""
    snap = dict(snapshot)
    snap["device_traces"] = [[{k: v for k, v in e.items() if k != "frames"} for e in trace]
                             for trace in snapshot.get("device_traces", [])]
    segs = []
    for seg in snapshot.get("segments", []):
        seg = dict(seg)
        seg["blocks"] = [{k: v for k, v in b.items() if k != "frames"} for b in seg.get("blocks", [])]
        segs.append(seg)
    snap["segments"] = segs
    return snap


def record_timeline(
    cfg: LayerConfig, spec: RowSpec, out_dir: Path | None, *, max_file_bytes: int = 12 * MiB,
    weights: list[Tensor] | None = None, progress: Progress | None = None,
) -> Timeline:
    """Memory over one forward+backward of ``spec`` (after one warm-up step).

    CUDA: ``torch.cuda.memory._record_memory_history``; the snapshot goes to ``out_dir/memory_<row>.pickle``
    (open it at pytorch.org/memory_viz; stack frames are dropped when the file would exceed ``max_file_bytes``).
    CPU: ``relay_compile.memory.memory_timeline`` (profiler events), no snapshot file.
    """
    progress = progress or Progress()
    group = standin_group(cfg.ep)
    inp = make_inputs(cfg, weights)
    fn = spec.build(cfg, group)
    _step(fn, inp)  # warm-up: first-call allocations (specs, workspaces) stay out of the picture
    inp.clear_grads()
    _free_cached(cfg.device)
    snapshot_file = ""
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()
        # Python stacks only: C++ frames take long to symbolize and make the file large.
        torch.cuda.memory._record_memory_history(context="all", stacks="python", max_entries=1_000_000)
        try:
            _marked_step(fn, inp, cfg.device)
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        times, levels, marker = _levels_without_marker(_cuda_trace_deltas(snapshot))
        if out_dir is not None:
            slug = "a2a" if spec.kind == "a2a" else "ring"
            path = out_dir / f"memory_{slug}.pickle"
            data = pickle.dumps(snapshot)
            if len(data) > max_file_bytes:
                data = pickle.dumps(_strip_frames(snapshot))
            path.write_bytes(data)
            snapshot_file = path.name
    else:
        t_s, lv = memory_timeline(_marked_step, fn, inp, cfg.device, device=cfg.device)
        deltas = [(t * 1e3, b - a) for t, a, b in zip(t_s[1:], lv[:-1], lv[1:], strict=True)]
        times, levels, marker = _levels_without_marker(deltas)
    times, levels = [0.0, *times], [0, *levels]
    peak = max(levels)
    ds_t, ds_b = _downsample(times, levels)
    inp.clear_grads()
    del inp
    _free_cached(cfg.device)
    progress.line(f"memory timeline {cfg.name} EP={cfg.ep} T={cfg.tokens} | {spec.name:<34} | "
                  f"{len(times)} events, peak {_fmt_bytes(peak)}" + (f" -> {snapshot_file}" if snapshot_file else ""))
    return Timeline(row=spec.name, times_ms=ds_t, bytes=ds_b, backward_starts_ms=marker, peak_bytes=peak,
                    snapshot_file=snapshot_file)


_warned_no_matplotlib: list[bool] = []


def plot_timelines(timelines: Sequence[Timeline], title: str, path: Path) -> bool:
    """One panel per row, shared byte axis, dashed peak lines and the start of backward; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _warned_no_matplotlib:
            log.warning("plot_timelines: matplotlib is not installed; %s not drawn (--replot draws it from "
                        "results.json)", path)
            _warned_no_matplotlib.append(True)
        return False
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 2.6 * len(timelines) + 0.6), sharey=True, squeeze=False)
    peak = max((max(t.bytes) for t in timelines if t.bytes), default=1)
    unit, scale = ("GiB", GiB) if peak >= GiB else ("MiB", MiB)
    top = peak / scale * 1.1 or 1.0
    for ax, tl in zip(axes[:, 0], timelines, strict=True):
        ax.step(tl.times_ms, [b / scale for b in tl.bytes], where="post", lw=1.0)
        ax.axhline(tl.peak_bytes / scale, ls="--", lw=0.8, color="gray")
        if tl.backward_starts_ms is not None:
            ax.axvline(tl.backward_starts_ms, ls=":", lw=0.8, color="red")
            ax.text(tl.backward_starts_ms, top * 0.92, " backward", color="red", fontsize=8)
        ax.set_ylim(0, top)
        ax.set_ylabel(f"{unit} above start")
        ax.set_title(f"{tl.row}: peak {_fmt_bytes(tl.peak_bytes)}", fontsize=10)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def layer_table(result: LayerResult, opts: BenchOptions) -> str:
    """Markdown table of one configuration: measured columns, then the simulated link model."""
    lines = [
        f"**{result.label}** (resident inputs+weights {_fmt_bytes(result.resident_bytes)}; link model "
        f"{opts.link_gbps:g} GB/s, simulated)",
        "",
        "| row | fwd ms | bwd ms | fwd+bwd ms | time vs a2a | peak | peak vs a2a | link MB/transfer fwd/bwd "
        "(model) | link ms (model) | total ms (model) | total vs a2a (model) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result.rows:
        if r.skipped:
            lines.append(f"| {r.row} | - | - | - | - | - | - | - | - | - | - | skipped: {r.skipped} |")
            continue
        lk = r.link or {}
        link_mb = (f"{lk['bytes_fwd'] / MiB:.1f} x{lk['transfers_fwd']} / {lk['bytes_bwd'] / MiB:.1f} "
                   f"x{lk['transfers_bwd']}") if lk else "-"
        lines.append(
            f"| {r.row} | {_fmt_ms(r.fwd_ms)} | {_fmt_ms(r.bwd_ms)} | {_fmt_ms(r.total_ms)} | {_fmt_x(r.time_ratio)} "
            f"| {_fmt_bytes(r.peak_bytes)} | {_fmt_x(r.peak_ratio)} | {link_mb} | {_fmt_ms(lk.get('link_ms'))} "
            f"| {_fmt_ms(lk.get('total_ms'))} | {_fmt_x(r.model_ratio)} | {r.note} |"
        )
    if result.check:
        lines += ["", result.check]
    return "\n".join(lines)


def capacity_table(results: Sequence[CapacityResult]) -> str:
    if not results:
        return ""
    lines = [f"Capacity: largest tokens per rank (multiple of {results[0].step}) whose resident inputs+weights+"
             f"forward/backward peak fit {_fmt_bytes(results[0].budget_bytes)}. {results[0].config}",
             "", "| row | max tokens/rank | memory at max | vs a2a | probes |", "|---|---:|---:|---:|---:|"]
    base = next((r.max_tokens for r in results if r.row == A2A_EAGER), None)
    for r in results:
        ratio = f"{r.max_tokens / base:.2f}x" if base else "-"
        limit = f">= {r.max_tokens} (search limit)" if r.limited_by_search else str(r.max_tokens)
        lines.append(f"| {r.row} | {limit} | {_fmt_bytes(r.bytes_at_max)} | {ratio} | {len(r.probes)} |")
    return "\n".join(lines)


@dataclass(kw_only=True)
class Report:
    """Everything one run produced, written as ``results.json`` + ``results.md`` (+ PNG, snapshots) under ``out``."""

    options: BenchOptions
    sections: list[tuple[str, list[LayerResult]]] = field(default_factory=list)
    capacity: list[CapacityResult] = field(default_factory=list)
    timelines: list[Timeline] = field(default_factory=list)
    timeline_title: str = ""
    notes: list[str] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=environment)

    def section(self, title: str) -> list[LayerResult]:
        for name, results in self.sections:
            if name == title:
                return results
        self.sections.append((title, []))
        return self.sections[-1][1]

    def to_json(self) -> dict[str, Any]:
        return {
            "environment": self.env,
            "options": dataclasses.asdict(self.options),
            "notes": self.notes,
            "sections": [{"title": t, "layers": [dataclasses.asdict(r) for r in rs]} for t, rs in self.sections],
            "capacity": [dataclasses.asdict(c) for c in self.capacity],
            "timelines": [dataclasses.asdict(t) for t in self.timelines],
            "timeline_title": self.timeline_title,
        }

    def markdown(self) -> str:
        env = self.env
        out = [
            "# RelayMoE single-layer benchmark (simulated EP)",
            "",
            f"torch {env['torch']}" + (f", {env['gpu']}" if "gpu" in env else ", CPU") + f", {env['date']}. "
            "Rank 0 of an N-rank stand-in group whose peers are copies of this rank (symmetric routing): "
            "memory and compute are this rank's, link time is NOT simulated; '(model)' columns add "
            f"transfers at {self.options.link_gbps:g} GB/s per the model in relay_compile/bench/single_layer.py. "
            f"Times: median of {self.options.repeats} after {self.options.warmup} warm-up steps. Peak: bytes "
            "allocated above resident inputs and weights during one forward+backward. Routing: Qwen3 router "
            "(softmax top-k, renormalized) over random tokens.",
            "",
        ]
        out += [f"- {n}" for n in self.notes]
        for title, results in self.sections:
            out += ["", f"## {title}", ""]
            for r in results:
                out += [layer_table(r, self.options), ""]
        if self.capacity:
            out += ["", "## Capacity", "", capacity_table(self.capacity), ""]
        if self.timelines:
            out += ["", "## Memory over time", "", self.timeline_title, "",
                    "| row | peak | snapshot |", "|---|---:|---|"]
            out += [f"| {t.row} | {_fmt_bytes(t.peak_bytes)} | {t.snapshot_file or '-'} |" for t in self.timelines]
            out += ["", "![memory over time](memory_timeline.png)", ""]
        return "\n".join(out) + "\n"

    def write(self, out: Path, *, with_json: bool = True) -> list[Path]:
        """Write results.json, results.md and (with timelines) memory_timeline.png; the paths written."""
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        if with_json:
            paths.append(out / "results.json")
            paths[-1].write_text(json.dumps(self.to_json(), indent=1, default=str))
        paths.append(out / "results.md")
        paths[-1].write_text(self.markdown())
        if self.timelines and plot_timelines(self.timelines, self.timeline_title, out / "memory_timeline.png"):
            paths.append(out / "memory_timeline.png")
        return paths


def report_from_json(data: dict[str, Any]) -> Report:
    """Rebuild a ``Report`` from ``results.json`` (to redraw tables and plots on another machine)."""
    opts = BenchOptions(**data["options"])
    rep = Report(options=opts, notes=list(data.get("notes", [])), timeline_title=data.get("timeline_title", ""),
                 env=dict(data.get("environment", {})))
    for sec in data.get("sections", []):
        layers = []
        for lr in sec["layers"]:
            rows = [RowResult(**r) for r in lr.pop("rows")]
            layers.append(LayerResult(rows=rows, **lr))
        rep.sections.append((sec["title"], layers))
    rep.capacity = [CapacityResult(**{**c, "probes": [tuple(p) for p in c["probes"]]})
                    for c in data.get("capacity", [])]
    rep.timelines = [Timeline(**t) for t in data.get("timelines", [])]
    return rep


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """Hide the deprecation warnings torch prints on every collective of the ring (they are not ours to fix here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        yield


def gib(value: float) -> int:
    return int(math.floor(value * GiB))
