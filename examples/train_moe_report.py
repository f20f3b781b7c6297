"""What ``train_moe.py`` reports: each rank's results, the summary table, the memory figure and the JSON.

Kept apart from the training script so each file reads in one sitting; ``train_moe.py`` imports it (spawned
ranks pickle ``RankResult`` by this module's name).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Loss tolerance per step, relative, by dtype (see the module docstring). bf16 keeps ~3 significant digits and
# its rounding differences grow through the optimizer much faster.
RTOL = {"float32": 1e-4, "bfloat16": 3e-2}
# The two steps before the last are measured (after warm-up and compilation): peak, then timeline.
MEASURED_STEPS = 2
LABELS = ("a2a (eager)", "relaymoe (compiled)")


@dataclass
class RankResult:
    """What one rank reports: losses (global means, alike on every rank), its peaks and its timelines."""

    rank: int
    losses: dict[str, list[float]] = field(default_factory=dict)  # label -> loss per step
    step_seconds: dict[str, list[float]] = field(default_factory=dict)
    step_peak: dict[str, int] = field(default_factory=dict)
    block_peak: dict[str, int] = field(default_factory=dict)
    block_max_rel_err: float = 0.0
    # label -> (times_s, bytes) of one training step / of the MoE block alone.
    step_timeline: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    block_timeline: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)  # relaymoe's report of the model's graphs
    regions_rewritten: int = 0


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def summarize(results: list[RankResult], args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Print the summary; returns it as a dict (``ok`` says whether the loss curves match)."""
    rtol = RTOL[args.dtype]
    la, lb = (results[0].losses[label] for label in LABELS)
    abs_diffs = [abs(a - b) for a, b in zip(la, lb, strict=True)]
    rel_diffs = [d / abs(a) for d, a in zip(abs_diffs, la, strict=True)]
    loss_ok = all(math.isfinite(a) and math.isfinite(b) for a, b in zip(la, lb, strict=True))
    loss_ok = loss_ok and max(rel_diffs) <= rtol
    rewrite_ok = args.backend != "relaymoe" or all(r.regions_rewritten >= args.layers for r in results)
    print("\nsummary")
    if args.backend == "relaymoe":
        print("  relaymoe's report of the model's graphs (rank 0):")
        for summary in results[0].regions:
            print("    " + summary.replace("\n", "\n    "))
    print(f"  loss {la[0]:.4f} -> {la[-1]:.4f} (a2a), {lb[0]:.4f} -> {lb[-1]:.4f} (relaymoe) over {len(la)} steps")
    worst = max(range(len(rel_diffs)), key=rel_diffs.__getitem__)
    print(f"  max |loss a2a - loss relaymoe| = {max(abs_diffs):.3e}; max relative {max(rel_diffs):.3e} at step "
          f"{worst} (tolerance {rtol:.0e} relative per step, {args.dtype}): "
          f"{'MATCH' if loss_ok else 'MISMATCH'}")
    for label in LABELS:
        secs = results[0].step_seconds[label][1:]  # without the first (compiling) step
        print(f"  median step time, {label}: {statistics.median(secs):.3f} s (rank 0, excluding step 0)")

    def table(title: str, peaks: list[dict[str, int]]) -> list[dict[str, Any]]:
        print(f"  {title}")
        print(f"    {'rank':>4} {LABELS[0]:>14} {LABELS[1]:>20} {'a2a / relaymoe':>15}")
        rows = []
        for rank, peak in enumerate(peaks):
            a, b = peak[LABELS[0]], peak[LABELS[1]]
            ratio = a / b if b else float("inf")
            print(f"    {rank:>4} {_mib(a):>14} {_mib(b):>20} {ratio:>14.2f}x")
            rows.append({"rank": rank, "a2a": a, "relaymoe": b, "ratio": ratio})
        return rows

    step_rows = table(
        f"peak memory per rank of one training step (step {args.steps - MEASURED_STEPS}: forward, backward, "
        f"grad all-reduce, {args.optimizer}; above the step's start)",
        [r.step_peak for r in results],
    )
    tokens = args.batch * args.seq_len
    block_rows = [] if not all(r.block_peak for r in results) else table(
        f"peak memory per rank of one MoE block alone (forward + backward; T={tokens} tokens/rank, "
        f"H={args.hidden}, F={args.ffn}, E={args.experts}, K={args.top_k}, EP={world})",
        [r.block_peak for r in results],
    )
    block_err = max(r.block_max_rel_err for r in results)
    if block_rows:
        print(f"  MoE block alone: output max relative difference a2a vs relaymoe {block_err:.2e}")
    if not rewrite_ok:
        counts = [r.regions_rewritten for r in results]
        print(f"  relaymoe REWROTE TOO FEW MoE blocks: {counts} per rank, expected {args.layers} "
              "(the compiled run was not RelayMoE); see the region reports above")
    if not loss_ok:
        print(f"  LOSS CURVES DIFFER: step {worst} differs by {rel_diffs[worst]:.3e} relative > {rtol:.0e}")
    ok = loss_ok and rewrite_ok
    print(f"  result: {'PASS' if ok else 'FAIL'}", flush=True)
    return {
        "ok": ok, "loss_ok": loss_ok, "rewrite_ok": rewrite_ok, "rtol": rtol, "world": world,
        "losses": {"a2a": la, "relaymoe": lb}, "max_abs_diff": max(abs_diffs), "max_rel_diff": max(rel_diffs),
        "step_peak": step_rows, "block_peak": block_rows, "block_max_rel_err": block_err,
        "regions_rewritten": [r.regions_rewritten for r in results], "args": vars(args),
    }


def plot_memory(path: str, result: RankResult, title: str) -> None:
    """Memory above the start over time, a2a vs relaymoe, for one training step and for the MoE block alone."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    colors = {LABELS[0]: "tab:red", LABELS[1]: "tab:blue"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = [
        (axes[0], result.step_timeline, "one training step (fwd + bwd + all-reduce + optimizer)"),
        (axes[1], result.block_timeline, "one MoE block alone (fwd + bwd)"),
    ]
    for ax, timelines, subtitle in panels:
        for label, (times_s, levels) in timelines.items():
            t_ms = [t * 1e3 for t in times_s]
            mib = [b / 2**20 for b in levels]
            ax.step(t_ms, mib, where="post", color=colors[label], label=label)
            peak = max(mib)
            ax.axhline(peak, color=colors[label], linestyle="--", linewidth=1,
                       label=f"{label.split()[0]} peak {peak:.2f} MiB")
        ax.set_title(subtitle)
        ax.set_xlabel("time since start (ms)")
        ax.set_ylabel("allocated above start (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[RankResult], args: argparse.Namespace, world: int, device: str) -> int:
    """Summary, figure and JSON from every rank's results; the exit status."""
    summary = summarize(results, args, world)
    if args.plot:
        plot_memory(
            args.plot, results[0],
            f"rank 0 of EP={world} ({device}, {args.dtype}): eager all-to-all vs relaymoe ring "
            f"(routing {args.routing}); CPU: profiler allocator events",
        )
        print(f"  figure: {args.plot}")
        summary["plot"] = args.plot
    if args.report_json:
        Path(args.report_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report_json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1
