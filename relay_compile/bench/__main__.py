"""``python -m relay_compile.bench``: single-layer RelayMoE benchmarks on one device, EP simulated.

    python -m relay_compile.bench --preset tiny --out /tmp/bench            # CPU, < 1 minute
    python -m relay_compile.bench --preset device --out "$OUT"              # one H200, < 9 minutes, all tables
    python -m relay_compile.bench --preset qwen3 --device cuda --ep 8 64 --tokens 65536 --out runs/qwen3
    python -m relay_compile.bench --replot --out runs/qwen3                 # redraw results.md / PNG from JSON

Presets (each writes results.json, results.md, and where it records memory over time memory_timeline.png plus,
on CUDA, memory_a2a.pickle / memory_ring.pickle under --out; at most 5 files, one folder):

- ``tiny``: a small layer on the CPU (fp32, EP 4): every kind of measurement, for tests and a quick look.
- ``qwen3``: the Qwen3-30B-A3B layer (H=2048, F=768, E=128, K=8), all rows, at each ``--ep`` (default 8 64).
- ``table3``: paper Table 3's single-layer configurations at each ``--ep`` (default 8).
- ``tokens``: the Qwen3 layer over ``--tokens`` per rank (default 8192 .. 131072).
- ``ep``: the Qwen3 layer at EP 8, 16, 32, 64 (or ``--ep``).
- ``capacity``: largest tokens per rank that fit ``--budget-gib`` (default 40), a2a against ring.
- ``ablation``: paper Figure 17 (sequential / overlap, with and without grouped GEMM).
- ``memory``: memory over time of one forward+backward, a2a and ring (paper Figures 4 and 7).
- ``numerics``: bf16 leaf errors (y, dx, d scores, d weights) of the a2a layer and the ring against an fp32
  truth, the Qwen3 layer at each ``--ep`` (default 8 64) on the stand-in (expert routing); then every rank real
  (``bench.rank_threads``: both routings, random / all-to-one-expert / Zipf with uneven tokens) at each ``--ep``
  up to 8 (default 2 4 8) with ``--tokens`` (default 16384); with ``--dtype`` other than bf16, in that dtype.
- ``sweep``: the Qwen3 layer at each ``--ep`` (default 8 64) and ``--tokens`` (default 4096 .. 131072): the
  backend's default, ``ring_moe``'s default and the forced ring (auto / expert / token) beside a2a eager, steps
  interleaved (``bench.sweep``); also writes ``sweep.json`` with the cost model's predictions
  (``python -m relay_compile.bench.calibrate`` refits the model from it).
- ``all``: everything above but tiny.
- ``device``: what one GPU run needs, within ``--time-budget`` (default 420 s): qwen3 at EP 8 and 64 (compiled
  rows measured last and appended to those tables), ablation, memory plot, capacity at EP 8 with 40 GiB, a Table 3
  subset, a short tokens sweep. Sections and rows that would start after the budget is spent are skipped and say
  so; results are rewritten after every section.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from relay_compile.bench.capacity import capacity_search
from relay_compile.bench.configs import QWEN3_30B, TABLE3, BenchOptions, LayerConfig, gib
from relay_compile.bench.inputs import make_weights
from relay_compile.bench.measure import measure_layer, quiet_warnings
from relay_compile.bench.numerics import layer_numerics
from relay_compile.bench.progress import Progress
from relay_compile.bench.real_ranks import NUMERICS_ROUTERS, real_rank_numerics
from relay_compile.bench.results import Report, report_from_json
from relay_compile.bench.rows import A2A_EAGER, RowSpec, ablation_rows, default_rows, sweep_rows
from relay_compile.bench.sweep import token_sweep_rows, write_sweep
from relay_compile.bench.timeline import record_timeline

# Every rank real holds all N ranks on the one device.
REAL_RANKS_MAX_EP = 8
PRESETS = ("tiny", "qwen3", "table3", "tokens", "ep", "capacity", "ablation", "memory", "numerics", "sweep", "all",
           "device")

TINY = LayerConfig(name="tiny", hidden=64, ffn=32, experts=16, top_k=4, tokens=512, ep=4, dtype="fp32", device="cpu")
DEVICE_TABLE3 = ("MoE-E64", "MoE-E384", "MoE-K16", "MoE-H2048")


@dataclass(frozen=True, kw_only=True)
class Task:
    """One section of a run: a title and what it does to the report (rows starting after ``deadline`` skip)."""

    title: str
    run: Callable[[Report, Progress, float | None], None]


def _layers(title: str, configs: list[LayerConfig], rows: Callable[[], list[RowSpec]], opts: BenchOptions) -> Task:
    def run(report: Report, progress: Progress, deadline: float | None) -> None:
        for cfg in configs:
            report.section(title).append(measure_layer(cfg, opts, rows(), progress=progress, deadline=deadline))

    return Task(title=title, run=run)


def _late_rows(title: str, configs: list[LayerConfig], rows: Callable[[], list[RowSpec]], opts: BenchOptions) -> Task:
    """Rows measured after everything else (compiled rows on a time budget), appended to section ``title``."""

    def run(report: Report, progress: Progress, deadline: float | None) -> None:
        section = report.section(title)
        for cfg in configs:
            earlier = next((r for r in section if r.label == cfg.label()), None)
            result = measure_layer(cfg, opts, rows(), progress=progress, into=earlier, deadline=deadline)
            if earlier is None:
                section.append(result)

    return Task(title=f"{title}: compiled rows", run=run)


def _capacity(cfg: LayerConfig, opts: BenchOptions, budget: int, step: int, max_tokens: int) -> Task:
    specs = [s for s in sweep_rows(opts)]

    def run(report: Report, progress: Progress, deadline: float | None) -> None:
        weights = make_weights(cfg)
        for spec in specs:
            if deadline is not None and time.perf_counter() > deadline:
                report.notes.append(f"capacity of '{spec.name}' skipped: time budget spent")
                continue
            report.capacity.append(capacity_search(cfg, spec, budget, step=step, max_tokens=max_tokens,
                                                   progress=progress, weights=weights))

    return Task(title=f"capacity {cfg.name} EP={cfg.ep} budget {budget / (1 << 30):g} GiB", run=run)


def _timeline(cfg: LayerConfig, opts: BenchOptions, out: Path) -> Task:
    specs = [s for s in sweep_rows(opts) if s.name in (A2A_EAGER, "ring overlap")]

    def run(report: Report, progress: Progress, deadline: float | None) -> None:
        weights = make_weights(cfg)
        report.timeline_title = f"Memory over one forward+backward: {cfg.label()}"
        report.timelines = [record_timeline(cfg, s, out, weights=weights, progress=progress) for s in specs]

    return Task(title=f"memory over time {cfg.name} EP={cfg.ep}", run=run)


def _numerics(configs: list[LayerConfig], real_rank_configs: list[LayerConfig]) -> Task:
    """Stand-in numerics (expert routing) for ``configs``; every rank real (both routings, each router of
    ``real_ranks.NUMERICS_ROUTERS``) for ``real_rank_configs``."""

    def run(report: Report, progress: Progress, deadline: float | None) -> None:
        for cfg in configs:
            progress.line(f"numerics {cfg.label()}")
            report.numerics.append(layer_numerics(cfg))
        for cfg in real_rank_configs:
            for router in NUMERICS_ROUTERS:
                if deadline is not None and time.perf_counter() > deadline:
                    report.notes.append(f"numerics every rank real {cfg.label()} {router} skipped: time budget spent")
                    continue
                progress.line(f"numerics every rank real {cfg.label()} router {router}")
                report.numerics.append(real_rank_numerics(cfg, router))

    return Task(title="bf16 numerics", run=run)


def build_tasks(args: argparse.Namespace, opts: BenchOptions) -> list[Task]:
    """The sections of a preset, in run order."""
    dev, dt = args.device, args.dtype
    qwen = QWEN3_30B.with_(device=dev, dtype=dt)
    tokens = args.tokens or []
    eps = args.ep or []
    budget = gib(args.budget_gib)
    step = args.capacity_step
    out = Path(args.out)

    def qwen_at(ep: int, t: int | None = None) -> LayerConfig:
        return qwen.with_(ep=ep, tokens=t or (tokens[0] if tokens else qwen.tokens))

    qwen3_title = "Qwen3-30B-A3B layer, all rows"

    def qwen3(ep_list: list[int], compiled: bool = True) -> Task:
        rows = lambda: [r for r in default_rows(opts) if compiled or not r.compiles]  # noqa: E731
        return _layers(qwen3_title, [qwen_at(e) for e in ep_list], rows, opts)

    def qwen3_compiled(ep_list: list[int]) -> Task:
        rows = lambda: [r for r in default_rows(opts) if r.compiles]  # noqa: E731
        return _late_rows(qwen3_title, [qwen_at(e) for e in ep_list], rows, opts)

    def ablation(ep: int) -> Task:
        return _layers("Ablation (paper Figure 17)", [qwen_at(ep)], ablation_rows, opts)

    def table3(names: tuple[str, ...], ep_list: list[int]) -> Task:
        t = tokens[0] if tokens else qwen.tokens
        cfgs = [TABLE3[n].with_(device=dev, dtype=dt, ep=e, tokens=t) for e in ep_list for n in names]
        return _layers("Paper Table 3 configurations", cfgs, lambda: sweep_rows(opts), opts)

    def token_sweep(ep: int, t_list: list[int]) -> Task:
        return _layers("Tokens per rank sweep", [qwen_at(ep, t) for t in t_list], lambda: sweep_rows(opts), opts)

    def cost_sweep(ep_list: list[int], t_list: list[int]) -> Task:
        interleaved = dataclasses.replace(opts, interleave=True)

        def run(report: Report, progress: Progress, deadline: float | None) -> None:
            section = report.section("Ring or all-to-all: the token-count sweep")
            for ep in ep_list:
                for t in t_list:
                    section.append(measure_layer(qwen_at(ep, t), interleaved, token_sweep_rows(interleaved, args.rows),
                                                 progress=progress, deadline=deadline))
                    write_sweep(section, out)

        return Task(title="token-count sweep", run=run)

    def ep_sweep(ep_list: list[int]) -> Task:
        return _layers("EP sweep", [qwen_at(e) for e in ep_list], lambda: sweep_rows(opts), opts)

    p = args.preset
    if p == "tiny":
        tiny = TINY.with_(device=dev, dtype=dt, ep=eps[0] if eps else TINY.ep,
                          tokens=tokens[0] if tokens else TINY.tokens)
        return [
            _layers("Tiny layer, all rows", [tiny], lambda: default_rows(opts), opts),
            _layers("Ablation (paper Figure 17)", [tiny], ablation_rows, opts),
            _capacity(tiny, opts, budget, step, args.capacity_max),
            _timeline(tiny, opts, out),
        ]
    ep0 = eps[0] if eps else 8
    tasks = {
        "qwen3": lambda: [qwen3(eps or [8, 64])],
        "table3": lambda: [table3(tuple(TABLE3), eps or [8])],
        "tokens": lambda: [token_sweep(ep0, tokens or [8192, 16384, 32768, 65536, 131072])],
        "ep": lambda: [ep_sweep(eps or [8, 16, 32, 64])],
        "capacity": lambda: [_capacity(qwen_at(ep0), opts, budget, step, args.capacity_max)],
        "ablation": lambda: [ablation(ep0)],
        "memory": lambda: [_timeline(qwen_at(ep0), opts, out)],
        "numerics": lambda: [_numerics([qwen_at(e) for e in eps or [8, 64]],
                                       # Every rank real: N ranks share the device (16384 tokens fit 8 on the H200).
                                       [qwen_at(e, tokens[0] if tokens else 16384)
                                        for e in eps or [2, 4, 8] if e <= REAL_RANKS_MAX_EP])],
        "sweep": lambda: [cost_sweep(eps or [8, 64], tokens or [4096, 8192, 16384, 32768, 65536, 131072])],
    }
    if p in tasks:
        return tasks[p]()
    if p == "all":
        names = ("qwen3", "ablation", "memory", "capacity", "tokens", "ep", "table3", "numerics")
        return [t for name in names for t in tasks[name]()]
    assert p == "device", f"unknown preset {p}"
    # Compiled rows last: their compile time is the one unknown, and they may be skipped with a note.
    return [
        qwen3(eps or [8, 64], compiled=False),
        ablation(ep0),
        _timeline(qwen_at(ep0), opts, out),
        _capacity(qwen_at(ep0), opts, budget, step, args.capacity_max),
        table3(DEVICE_TABLE3, [ep0]),
        token_sweep(ep0, [16384, 131072]),
        qwen3_compiled(eps or [8, 64]),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m relay_compile.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS, default="tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="default: cpu for tiny, else cuda when available")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None,
                    help="default: fp32 for tiny, else bf16 (torch._grouped_mm on CUDA needs bf16)")
    ap.add_argument("--ep", type=int, nargs="+", help="EP sizes (simulated)")
    ap.add_argument("--tokens", type=int, nargs="+", help="tokens per rank")
    ap.add_argument("--out", default="bench_out", help="output folder (results.json, results.md, PNG, pickles)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--link-gbps", type=float, default=450.0, help="modeled link bandwidth, GB/s one direction")
    ap.add_argument("--max-hop-rows", type=int, default=None,
                    help="bounded-hops row's bound (default 16384; tiny 256); 0 drops that row")
    ap.add_argument("--budget-gib", type=float, default=None, help="capacity budget (default 40; tiny: 0.006)")
    ap.add_argument("--capacity-step", type=int, default=None, help="capacity granularity (default 4096; tiny 512)")
    ap.add_argument("--capacity-max", type=int, default=None, help="capacity search's upper end in tokens")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="rows that need torch.compile (default: on, except tiny)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds; later sections and rows are skipped once spent (default 420 for device)")
    ap.add_argument("--rows", nargs="+", default=None,
                    help="sweep: only these rows beside a2a eager (e.g. 'relaymoe backend' 'ring expert')")
    ap.add_argument("--replot", action="store_true", help="redraw results.md and the PNG from --out/results.json")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    tiny = args.preset == "tiny"
    if args.device is None:
        args.device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    if args.dtype is None:
        args.dtype = "fp32" if tiny else "bf16"
    if args.max_hop_rows is None:
        args.max_hop_rows = 256 if tiny else 16384
    if args.budget_gib is None:
        args.budget_gib = 0.006 if tiny else 40.0
    if args.capacity_step is None:
        args.capacity_step = 512 if tiny else 4096
    if args.capacity_max is None:
        args.capacity_max = 1 << 13 if tiny else 1 << 21
    if args.compile is None:
        args.compile = not tiny
    if args.time_budget is None and args.preset == "device":
        args.time_budget = 420.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    out = Path(args.out)
    if args.replot:
        import json

        report = report_from_json(json.loads((out / "results.json").read_text()))
        for p in report.write(out, with_json=False):
            print(p)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("relay_compile.bench: --device cuda but CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    opts = BenchOptions(warmup=args.warmup, repeats=args.repeats, link_gbps=args.link_gbps,
                        max_hop_rows=args.max_hop_rows or None, compile=args.compile)
    if args.rows is not None:
        if args.preset != "sweep":
            print("relay_compile.bench: --rows selects rows of --preset sweep only", file=sys.stderr)
            return 2
        try:
            token_sweep_rows(opts, args.rows)
        except ValueError as e:
            print(f"relay_compile.bench: {e}", file=sys.stderr)
            return 2
    report = Report(options=opts)
    report.notes.append(f"command: python -m relay_compile.bench {' '.join(sys.argv[1:] if argv is None else argv)}")
    progress = Progress()
    print(f"relay_compile.bench: preset {args.preset}, device {args.device} ({args.dtype}), torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "") + f", out {out}", flush=True)
    deadline = time.perf_counter() + args.time_budget if args.time_budget else None
    with quiet_warnings():
        for task in build_tasks(args, opts):
            if deadline is not None and time.perf_counter() > deadline:
                msg = f"skipped '{task.title}': time budget of {args.time_budget:g} s spent"
                report.notes.append(msg)
                progress.line(msg)
                continue
            t0 = time.perf_counter()
            try:
                task.run(report, progress, deadline)
            except Exception as e:  # keep what the other sections measured
                msg = f"section '{task.title}' failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                report.notes.append(msg)
                progress.line(msg)
                logging.getLogger("relay_compile.bench").debug("section failed", exc_info=True)
            progress.note(f"section '{task.title}' took {time.perf_counter() - t0:.1f} s")
            report.write(out)
    paths = report.write(out)
    print(f"relay_compile.bench: done in {progress.elapsed():.1f} s; wrote " + ", ".join(str(p) for p in paths),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
