"""``python -m relay_compile.bench.full_model``: full-model training on one device, EP simulated.

    python -m relay_compile.bench.full_model --preset tiny --out /tmp/full_model       # CPU, < 1 minute
    python -m relay_compile.bench.full_model --preset h200 --out "$OUT"                # one H200
    python -m relay_compile.bench.full_model --replot --out docs/bench/full-model      # redraw .md / PNG

Trains one model (``model.FullModel``; ``--preset h200``: Qwen3-30B-A3B-shaped, 8 layers) as rank 0 of a
stand-in EP group, every row on the same parameters and optimizer, and for each row (``policies.POLICIES``)
searches the largest tokens per rank whose training step fits the memory budget: from ``--start`` tokens,
doubling, then bisecting in whole sequences; each length tried is one probe (warm-up steps, then timed steps
under ``relay_compile.memory.PeakMemory``; an out-of-memory error means "does not fit"). Then every row is
measured at the bars' comparison lengths (``bars.comparison_lengths``). Writes results.json, results.md and
full_model.png under ``--out`` after every row.

On CUDA the budget is enforced by the allocator: ``torch.cuda.set_per_process_memory_fraction`` caps this
process at ``--memory-gib`` (a smaller cap than the GPU keeps the search short; the weights' and optimizer's
share of it is printed). On the CPU it is a threshold on the measured peak.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from relay_compile.bench.configs import gib
from relay_compile.bench.full_model.bars import comparison_lengths
from relay_compile.bench.full_model.budget import LADDER
from relay_compile.bench.full_model.model import QWEN3_30B_A3B, TINY_MODEL, FullModelConfig, fused_gqa
from relay_compile.bench.full_model.policies import POLICIES
from relay_compile.bench.full_model.report import FullModelReport
from relay_compile.bench.full_model.search import RowRuns, SearchSettings
from relay_compile.bench.full_model.training import Trainer
from relay_compile.bench.measure import quiet_warnings
from relay_compile.bench.progress import Progress, fmt_bytes
from relay_compile.bench.standin_group import standin_group


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Defaults of a run; every field has a command-line option that overrides it."""

    model: FullModelConfig
    memory_gib: float
    start: int  # first length tried, tokens per rank
    max_tokens: int
    warmup: int
    repeats: int
    ladder: tuple[float, ...]  # partitioner budgets the budget row may use
    rel_tol: float  # bisection tolerance, a fraction of the length


PRESETS = {
    # Small enough for a test on the CPU (< 1 minute), with lengths where every row stops fitting.
    "tiny": Preset(model=TINY_MODEL, memory_gib=0.012, start=128, max_tokens=2048, warmup=1, repeats=1,
                   ladder=(1.0, 0.0), rel_tol=0.0),
    # One H200 within minutes: 8 layers, a 48 GiB cap, lengths from 8192 tokens per rank.
    "h200": Preset(model=QWEN3_30B_A3B, memory_gib=48.0, start=8192, max_tokens=1 << 19, warmup=1, repeats=1,
                   ladder=LADDER, rel_tol=0.1),
}
# Seconds the comparison lengths may take after a --time-budget spent on the searches.
COMPARISON_S = 90.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m relay_compile.bench.full_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    ap.add_argument("--out", default="bench_out/full_model", help="folder for results.json, results.md, PNG")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence; tokens per rank are whole sequences")
    ap.add_argument("--memory-gib", type=float, help="per-rank memory budget (CUDA: the process's cap)")
    ap.add_argument("--start", type=int, help="first length tried, tokens per rank")
    ap.add_argument("--max-tokens", type=int, help="the search's upper end, tokens per rank")
    ap.add_argument("--at", type=int, nargs="+", default=[],
                    help="more lengths (tokens per rank) to measure every row at, where it fits, after the searches")
    ap.add_argument("--rows", nargs="+", choices=[p.name for p in POLICIES], help="default: all")
    ap.add_argument("--ladder", type=float, nargs="+", help="partitioner budgets the budget rows may use")
    ap.add_argument("--rel-tol", type=float, help="bisection stops at this fraction of the length (or a sequence)")
    ap.add_argument("--time-budget", type=float, help="seconds; no probe starts after (searches stop, say so)")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--inner-compiler", choices=("inductor", "aot_eager"),
                    help="compiles the a2a row and the graphs after the relaymoe rewrite (default: inductor on CUDA, "
                         "aot_eager on the CPU)")
    ap.add_argument("--static-shapes", action="store_true",
                    help="compiled rows compile each length for its own size (default: one compile, tokens dynamic)")
    ap.add_argument("--link-gbps", type=float, default=450.0, help="modeled link bandwidth, GB/s one direction")
    ap.add_argument("--link-stream", action="store_true",
                    help="the stand-in's transfers on a stream of their own, overlapped with compute as NCCL's are "
                         "(standin_group(n, link_stream=True)); default: copies on the compute stream")
    ap.add_argument("--replot", action="store_true", help="redraw results.md and the PNG from --out/results.json")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    args.model = preset.model.with_(**{k: v for k, v in (("layers", args.layers), ("seq_len", args.seq_len)) if v})
    args.memory_gib = args.memory_gib or preset.memory_gib
    args.start, args.max_tokens = args.start or preset.start, args.max_tokens or preset.max_tokens
    args.warmup = preset.warmup if args.warmup is None else args.warmup
    args.repeats = args.repeats or preset.repeats
    args.ladder = tuple(sorted(args.ladder or preset.ladder, reverse=True))
    args.rel_tol = preset.rel_tol if args.rel_tol is None else args.rel_tol
    return args


@contextlib.contextmanager
def _compile_settings() -> Iterator[None]:
    # The a2a split sizes come from .tolist(): Dynamo must capture them as unbacked SymInts or every MoE block
    # breaks the graph (and relaymoe finds no region). Each (backend, budget) is one more compiled entry of the
    # shared layer function: more than Dynamo's default of 8 would silently fall back to eager.
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    # SDPA's math kernel would materialize (S, S) scores per head: fail loudly instead of falling back to it
    # (flash and cuDNN attention serve grouped-query attention on CUDA).
    math_sdp = torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.enable_math_sdp(not torch.cuda.is_available())
    try:
        with torch._dynamo.config.patch({"capture_scalar_outputs": True, limit: 64}), quiet_warnings():
            yield
    finally:
        torch.backends.cuda.enable_math_sdp(math_sdp)


def _cap_memory(cfg: FullModelConfig, budget: int) -> None:
    if cfg.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))


def _settings(args: argparse.Namespace, budget: int) -> SearchSettings:
    cfg: FullModelConfig = args.model
    return SearchSettings(budget_bytes=budget, start=args.start, step=cfg.seq_len, max_tokens=args.max_tokens,
                          warmup=args.warmup, repeats=args.repeats, link_gbps=args.link_gbps, ladder=args.ladder,
                          rel_tol=args.rel_tol,
                          deadline=time.perf_counter() + args.time_budget if args.time_budget else None,
                          inner_compiler=args.inner_compiler or ("inductor" if cfg.device == "cuda" else "aot_eager"),
                          static_shapes=args.static_shapes)


def _resident_note(trainer: Trainer, budget: int) -> str:
    """The parameters' and optimizer's share of the budget (AdamW's state is created at the first step)."""
    params = sum(p.numel() for p in trainer.model.parameters())
    resident = trainer.resident_bytes() + 8 * params  # + exp_avg, exp_avg_sq in fp32
    grads = params * trainer.model.cfg.torch_dtype.itemsize
    return (f"{params / 1e6:.1f} M parameters on this rank; parameters + fp32 masters + AdamW state "
            f"{fmt_bytes(resident)} between steps, + {fmt_bytes(grads)} gradients in backward: "
            f"{100 * (resident + grads) / budget:.0f}% of the memory budget")


def run(args: argparse.Namespace, out: Path, progress: Progress) -> FullModelReport:
    """Build the trainer, search every row, measure the comparison lengths; the report (also written)."""
    cfg: FullModelConfig = args.model
    budget = gib(args.memory_gib)
    _cap_memory(cfg, budget)
    settings = _settings(args, budget)
    trainer = Trainer.build(cfg, standin_group(cfg.ep, link_stream=args.link_stream))
    report = FullModelReport(config=dataclasses.asdict(cfg), label=cfg.label(),
                             settings=dataclasses.asdict(settings))
    report.notes.append("command: python -m relay_compile.bench.full_model " + " ".join(args.argv))
    if args.link_stream:
        report.notes.append("the stand-in's transfers run on a stream of their own (--link-stream)")
    report.notes.append(_resident_note(trainer, budget))
    report.notes.append("attention: scaled_dot_product_attention with " + (
        "grouped-query heads (enable_gqa)" if fused_gqa(cfg.device) else "KV heads repeated (no fused GQA kernel)"))
    progress.note(report.notes[-1])
    runs = RowRuns(trainer, settings, progress)
    policies = [p for p in POLICIES if not args.rows or p.name in args.rows]
    for policy in policies:
        report.rows.append(runs.search(policy))
        report.write(out)
    lengths = comparison_lengths(report.rows) | {f"--at {t}": t for t in args.at}
    if settings.deadline is not None:  # the comparison points get time of their own: the bars need them
        runs.settings = dataclasses.replace(settings, deadline=time.perf_counter() + COMPARISON_S)
    for what, tokens in lengths.items():
        progress.note(f"comparison length '{what}': T={tokens}")
        for policy, result in zip(policies, report.rows, strict=True):
            runs.measure_at(policy, result, tokens)
    report.write(out)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    out = Path(args.out)
    if args.replot:
        for path in FullModelReport.from_json(json.loads((out / "results.json").read_text())).write(out, with_json=False):
            print(path)
        return 0
    if args.model.device == "cuda" and not torch.cuda.is_available():
        print("relay_compile.bench.full_model: preset needs CUDA, which is not available; use --preset tiny",
              file=sys.stderr)
        return 2
    progress = Progress()
    print(f"relay_compile.bench.full_model: {args.model.label()}; budget {args.memory_gib:g} GiB; torch "
          f"{torch.__version__}; SIMULATED EP (stand-in group); out {out}", flush=True)
    with _compile_settings():
        report = run(args, out, progress)
    for bar in report.bars():
        print(f"  bar {bar.name}: {'-' if bar.value is None else f'{bar.value:.2f}x'} (target >= {bar.target:g}x) "
              f"{'met' if bar.met else 'NOT met'}; {bar.detail}", flush=True)
    print(f"relay_compile.bench.full_model: done in {progress.elapsed():.0f} s; wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

