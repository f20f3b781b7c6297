"""torchtitan 0.3.0's MoE through the relaymoe backend beside a2a eager, torchtitan eager and ring_moe direct, and
the compile time of the backend against inductor alone (issue 10, deliverable 5 and the compile-time bar).

    python docs/bench/h200-torchtitan/titan_rows.py OUT                         # the device run (Qwen3 layer)
    python docs/bench/h200-torchtitan/titan_rows.py OUT --device cpu --tiny     # CPU, tiny shape

Per EP size: the stand-in world of EP ranks (torchtitan's ParallelDims builds its mesh on it, unmodified), then
one ``measure_layer`` run of the rows below on the same inputs (a2a eager is the baseline of the ratios). Then
the compile-time table (``relay_compile.bench.compile_time``) at ``--compile-ep``. Writes OUT/titan_rows.json and
OUT/titan_rows.md; progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, when run from elsewhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from relay_compile.backend import compiled_reports  # noqa: E402
from relay_compile.bench import standin_world  # noqa: E402
from relay_compile.bench.compile_time import measure_compile_time  # noqa: E402
from relay_compile.bench.configs import QWEN3_30B, BenchOptions  # noqa: E402
from relay_compile.bench.measure import measure_layer, quiet_warnings  # noqa: E402
from relay_compile.bench.progress import Progress, fmt_bytes, fmt_ms, fmt_x  # noqa: E402
from relay_compile.bench.rows import A2A_EAGER, RowSpec, build_eager_a2a, compiled_a2a_builder, ring_builder  # noqa: E402
from relay_compile.bench.torchtitan_rows import TITAN_RELAYMOE, torchtitan_rows  # noqa: E402

RING_DIRECT = "ring_moe direct"
RING_DIRECT_WORLD = "ring_moe direct, world group"


def _on_world_group(cfg, group):
    """``ring_moe`` on the group torchtitan's EP mesh runs on when EP spans the world: the default group itself
    (torch.distributed resolves it per P2P call, a host cost the bench's own subgroup does not pay)."""
    return ring_builder(routing="expert")(cfg, dist.group.WORLD)


def main_rows() -> list[RowSpec]:
    return [
        RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
        *torchtitan_rows(eager=True, relaymoe=True),
        # ring_moe's defaults (overlapped ring, whole hops, fp32 sums), expert routing as the backend resolves it.
        RowSpec(name=RING_DIRECT, build=ring_builder(routing="expert"), kind="ring"),
        RowSpec(name=RING_DIRECT_WORLD, build=_on_world_group, kind="ring"),
    ]


def compile_rows() -> list[RowSpec]:
    return [
        RowSpec(name="a2a inductor", build=compiled_a2a_builder("inductor"), kind="a2a", compiles=True),
        RowSpec(name="a2a relaymoe backend", build=compiled_a2a_builder("relaymoe"), kind="ring", compiles=True),
        *torchtitan_rows(eager=False, relaymoe=False, inductor=True),
        *torchtitan_rows(eager=False, relaymoe=True),
    ]


def table(results: dict[int, dict]) -> str:
    eps = sorted(results)
    def label(key: int) -> str:
        return f"EP={key % 1000}" + (f" (round {key // 1000 + 1})" if key >= 1000 else "")

    head = "| row |" + "".join(f" {label(ep)} ms | vs a2a | peak | a2a / row |" for ep in eps)
    lines = [head, "|---|" + "---:|" * 4 * len(eps)]
    names = [r["row"] for r in results[eps[0]]["rows"]]
    for name in names:
        cells = []
        for ep in eps:
            r = next(r for r in results[ep]["rows"] if r["row"] == name)
            if r["skipped"]:
                cells += [f"skipped: {r['skipped'][:80]}", "", "", ""]
                continue
            inv = 1 / r["peak_ratio"] if r["peak_ratio"] else None
            cells += [fmt_ms(r["total_ms"]), fmt_x(r["time_ratio"]), fmt_bytes(r["peak_bytes"]), fmt_x(inv)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_lines(results: dict[int, dict]) -> list[str]:
    out = []
    for ep, res in sorted(results.items()):
        rows = {r["row"]: r for r in res["rows"]}
        t, d = rows.get(TITAN_RELAYMOE), rows.get(RING_DIRECT)
        if t and d and not t["skipped"] and not d["skipped"]:
            w = rows.get(RING_DIRECT_WORLD)
            world = (f"; / ring_moe direct on the world group: time {t['total_ms'] / w['total_ms']:.3f}x"
                     if w and not w["skipped"] else "")
            out.append(f"EP={ep % 1000} (key {ep}): torchtitan through the backend / ring_moe direct: time "
                       f"{t['total_ms'] / d['total_ms']:.3f}x, peak {t['peak_bytes'] / d['peak_bytes']:.3f}x "
                       f"(bar <= 1.1x){world}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ep", type=int, nargs="+", default=[8, 64])
    p.add_argument("--compile-ep", type=int, nargs="*", default=[8])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--tiny", action="store_true", help="H=64 F=32 E=16 K=4, 256 tokens (CPU)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--interleave", action="store_true", help="rows take their timed steps in turns (BenchOptions)")
    p.add_argument("--rounds", type=int, default=1, help="measure every EP this many times (round r: key EP + 1000 r)")
    p.add_argument("--compile-steps", type=int, default=3)
    p.add_argument("--time-budget", type=float, default=0.0, help="s; compile-time EPs after the first are "
                   "skipped past it (0: no limit)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = QWEN3_30B.with_(device=args.device, dtype="bf16", tokens=args.tokens)
    if args.tiny:
        base = base.with_(name="tiny", hidden=64, ffn=32, experts=16, top_k=4, tokens=256)
    opts = BenchOptions(repeats=args.repeats, interleave=args.interleave)
    progress = Progress()
    t_start = time.perf_counter()
    progress.note(f"torch {torch.__version__}, device {args.device}"
                  + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    results: dict[int, dict] = {}
    reports: dict[int, list[str]] = {}
    compile_times: dict[int, list[dict]] = {}
    with quiet_warnings():
        for rnd in range(args.rounds):  # rounds of every EP: host-bound rows move between runs (BENCHMARKS)
            for ep in args.ep:
                cfg = base.with_(ep=ep)
                standin_world(ep)  # torchtitan's mesh code builds on the world: EP ranks, this process rank 0
                n_reports = len(compiled_reports())
                res = measure_layer(cfg, opts, main_rows(), progress=progress)
                results[ep if rnd == 0 else ep + 1000 * rnd] = dataclasses.asdict(res)
                reports[ep] = reports.get(ep, []) + [r.summary() for r in compiled_reports()[n_reports:]]
                for text in [r.summary() for r in compiled_reports()[n_reports:]]:
                    progress.note(text.replace("\n", "\n           "))
        for i, ep in enumerate(args.compile_ep):
            if i and args.time_budget and time.perf_counter() - t_start > args.time_budget:
                progress.note(f"compile time at EP={ep}: skipped, past the time budget")
                continue
            cfg = base.with_(ep=ep)
            standin_world(ep)
            compile_times[ep] = [dataclasses.asdict(c) for c in measure_compile_time(
                cfg, compile_rows(), steps=args.compile_steps, progress=progress)]
    md = [f"# {base.label()} (EP varies)", "", table(results), "", *bar_lines(results), ""]
    for ep, rows in compile_times.items():
        md += [f"## Compile time, EP={ep} (first forward+backward - steady step, wall clock)", "",
               "| row | first call s | step ms | compile s |", "|---|---:|---:|---:|"]
        for c in rows:
            if c["skipped"]:
                md.append(f"| {c['row']} | skipped: {c['skipped'][:120]} | | |")
            else:
                md.append(f"| {c['row']} | {c['first_call_s']:.2f} | {c['step_s'] * 1e3:.1f} | {c['compile_s']:.2f} |")
        md.append("")
    text = "\n".join(md)
    print(text, flush=True)
    (out / "titan_rows.md").write_text(text)
    (out / "titan_rows.json").write_text(json.dumps(
        {"torch": torch.__version__, "rows": {str(k): v for k, v in results.items()},
         "reports": {str(k): v for k, v in reports.items()},
         "compile_time": {str(k): v for k, v in compile_times.items()}}, indent=1, default=str))
    progress.note(f"done in {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
