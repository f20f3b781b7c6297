"""Soak test (issue 13): many training steps under ``backend="relaymoe"`` with changing T and routing; memory and
the number of compilations must stay flat.

    python examples/soak.py                      # 2 gloo ranks on CPU, 1000 steps
    python examples/soak.py --steps 120 --every 20

Each rank builds two copies of a tiny MoE transformer (``moe_transformer.py``: all-to-all EP through the
reference ``AllToAllMoE``) and compiles them with ``torch.compile(model, backend="relaymoe",
options={"routing": R, "inner_compiler": "aot_eager"})``, R = "expert" for one and "token" for the other: the
ring option is fixed per compiled graph (its spec key), so alternating it between steps means alternating the
two compiled models (changing ``relay_compile.config.routing`` between steps would not recompile and would not
change a compiled ring). Step i trains model ``i % 2`` with SGD on fresh synthetic tokens of ``batch x seq``
per rank, seq cycling through ``--seqs`` (T = batch*seq changes every step; each model sees every size, the
cycle of 3 sizes against 2 models repeats every 6 steps). The routing changes at every step: the tokens are new
(a pure function of seed, step and rank) and the routers' weights move with SGD.

Every ``--every`` steps each rank records (after ``gc.collect()``): its current RSS (``/proc/self/statm``;
``getrusage``'s max RSS never falls), the Python objects alive (``len(gc.get_objects())``), the frames Dynamo
compiled (``counters["stats"]["unique_graphs"]``), the graphs the relaymoe backend compiled
(``compiled_reports()``), the ring specs registered (``relay_compile.runtime.specs.registered()``) and the loss
(mean over ranks).

The bar (exit 0 only if both hold on every rank):

- RSS growth from step ``--rss-from`` (100) to the last step under ``--max-rss-growth`` (2%);
- compilations bounded by the shape classes: per compiled model the first T compiles a graph with T static, the
  second T recompiles with a symbolic T (Dynamo's automatic dynamic) that every later T reuses, so at most 2
  per model, 4 in all (also the bound on the relaymoe backend's graphs). Later recompilations would show up as
  a count above the bound.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue as queue_module
import resource
import sys
import time
import traceback
import unittest.mock
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_transformer.py, train_moe.py; also in spawned ranks

from moe_transformer import MoEModelConfig, MoETransformer
from train_moe import Trainer, _free_port, _global_mean, synthetic_batch

from relay_compile.backend import compiled_reports
from relay_compile.runtime import specs

RING_ROUTINGS = ("expert", "token")
# Graphs per compiled model: one with the first T static, one with a symbolic T (automatic dynamic).
SHAPE_CLASSES_PER_MODEL = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="record every this many steps (and at the last)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqs", default="16,24,32", help="sequence lengths cycled through (T = batch*seq)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-from", type=int, default=100, help="the step RSS growth is measured from")
    p.add_argument("--max-rss-growth", type=float, default=2.0, help="percent")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    args.seqs = [int(s) for s in args.seqs.split(",")]
    if args.rss_from >= args.steps:
        p.error(f"--rss-from {args.rss_from} must be below --steps {args.steps}")
    return args


CFG = {"vocab": 64, "hidden": 32, "heads": 4, "layers": 2, "ffn": 16, "experts": 8, "top_k": 2}


@dataclass
class Record:
    step: int  # steps done
    rss: int  # bytes
    objects: int
    frames: int  # Dynamo's unique_graphs
    graphs: int  # graphs the relaymoe backend compiled
    specs: int
    loss: float


@dataclass
class RankResult:
    rank: int
    records: list[Record] = field(default_factory=list)
    rewritten: int = 0  # MoE regions rewritten, over all graphs
    seconds: float = 0.0


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def soak(rank: int, args: argparse.Namespace) -> RankResult:
    group = dist.group.WORLD
    cfg = MoEModelConfig(**CFG)
    result = RankResult(rank=rank)
    trainers = []
    for routing in RING_ROUTINGS:
        model = MoETransformer(cfg, group, seed=args.seed, use_grouped_mm=False)  # fp32: per-expert loop
        compiled = torch.compile(
            model, backend="relaymoe", options={"routing": routing, "inner_compiler": "aot_eager"}
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        trainers.append(Trainer(routing, model, compiled, optimizer, group))
    seen = len(compiled_reports())
    start = time.perf_counter()
    loss = torch.zeros(())
    for step in range(args.steps):
        seq = args.seqs[step % len(args.seqs)]
        tokens = synthetic_batch(args.seed, step, rank, args.batch, seq, cfg.vocab)
        loss = trainers[step % len(trainers)].step(tokens)
        done = step + 1
        if done % args.every == 0 or done == args.rss_from or done == args.steps:
            mean_loss = _global_mean(loss, group)
            gc.collect()
            result.records.append(Record(
                step=done, rss=current_rss(), objects=len(gc.get_objects()),
                frames=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                graphs=len(compiled_reports()) - seen, specs=specs.registered(), loss=mean_loss,
            ))
    result.seconds = time.perf_counter() - start
    result.rewritten = sum(r.status == "rewritten" for rep in compiled_reports()[seen:] for r in rep.regions)
    return result


def _spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        results.put(("ok", rank, soak(rank, args)))
    except BaseException:  # noqa: BLE001 - the parent must hear about every failure
        results.put(("error", rank, traceback.format_exc()))
        code = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (see train_moe._spawned_rank)


def run_ranks(args: argparse.Namespace) -> tuple[dict[int, RankResult], dict[int, str]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(r, args.world, port, args, results)) for r in range(args.world)]
    with unittest.mock.patch.dict(os.environ, {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}):
        for proc in procs:
            proc.start()
    reported: dict[int, RankResult] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + args.timeout
    while len(reported) + len(errors) < args.world and time.monotonic() < deadline:
        try:
            status, rank, payload = results.get(timeout=1.0)
        except queue_module.Empty:
            for r, p in enumerate(procs):
                if p.exitcode is not None and r not in reported and r not in errors:
                    try:  # it may have reported a moment ago
                        status, rank, payload = results.get(timeout=3.0)
                        (reported if status == "ok" else errors)[rank] = payload
                    except queue_module.Empty:
                        errors[r] = f"exited with status {p.exitcode} without reporting"
            if errors:
                deadline = min(deadline, time.monotonic() + 15.0)
            continue
        (reported if status == "ok" else errors)[rank] = payload
        if errors:
            deadline = min(deadline, time.monotonic() + 15.0)
    for proc in procs:
        proc.join(timeout=5 if errors else 30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for r in range(args.world):
        if r not in reported and r not in errors:
            errors[r] = f"no report within --timeout {args.timeout:.0f} s"
    return reported, errors


@dataclass
class Verdict:
    ok: bool
    rss_growth: dict[int, float]  # percent, per rank
    graphs: dict[int, int]
    frames: dict[int, int]
    bound: int
    rss_ok: bool
    compile_ok: bool


def judge(results: list[RankResult], args: argparse.Namespace) -> Verdict:
    bound = SHAPE_CLASSES_PER_MODEL * len(RING_ROUTINGS)
    growth, graphs, frames = {}, {}, {}
    for res in results:
        base = next(r for r in res.records if r.step == args.rss_from)
        last = res.records[-1]
        growth[res.rank] = 100.0 * (last.rss - base.rss) / base.rss
        graphs[res.rank] = max(r.graphs for r in res.records)
        frames[res.rank] = max(r.frames for r in res.records)
    rss_ok = all(g < args.max_rss_growth for g in growth.values())
    compile_ok = all(graphs[r] <= bound and frames[r] <= bound for r in graphs)
    return Verdict(rss_ok and compile_ok, growth, graphs, frames, bound, rss_ok, compile_ok)


def print_table(results: list[RankResult]) -> None:
    mib = 1 << 20
    header = f"{'step':>5} {'loss':>8}" + "".join(
        f" | r{res.rank} {'RSS MiB':>8} {'objects':>8} {'frames':>6} {'graphs':>6} {'specs':>5}" for res in results
    )
    print(header)
    for i, rec0 in enumerate(results[0].records):
        row = f"{rec0.step:5d} {rec0.loss:8.4f}"
        for res in results:
            r = res.records[i]
            row += f" | r{res.rank} {r.rss / mib:8.1f} {r.objects:8d} {r.frames:6d} {r.graphs:6d} {r.specs:5d}"
        print(row)


def run(argv: Sequence[str] | None = None) -> tuple[int, Verdict | None, list[RankResult]]:
    """Spawn the ranks, print the table and the verdict; (exit status, verdict, per-rank results)."""
    args = parse_args(argv)
    print(f"soak: {args.world} gloo ranks on CPU, {args.steps} steps of SGD lr {args.lr}, model {CFG}, "
          f"T = {args.batch} x seq, seq cycling {args.seqs}, two compiled models (routing {RING_ROUTINGS}) "
          f"alternating per step; backend relaymoe, inner_compiler aot_eager", flush=True)
    start = time.perf_counter()
    reported, errors = run_ranks(args)
    if errors:
        for rank in sorted(errors):
            print(f"rank {rank} FAILED:\n{errors[rank]}", file=sys.stderr)
        print("verdict: FAIL (a rank did not finish)", flush=True)
        return 2, None, []
    results = [reported[r] for r in range(args.world)]
    print_table(results)
    v = judge(results, args)
    mib = 1 << 20
    for res in results:
        base = next(r for r in res.records if r.step == args.rss_from)
        print(f"rank {res.rank}: RSS {base.rss / mib:.1f} MiB at step {args.rss_from} -> "
              f"{res.records[-1].rss / mib:.1f} MiB at step {res.records[-1].step} "
              f"({v.rss_growth[res.rank]:+.2f}%); objects {base.objects} -> {res.records[-1].objects}; "
              f"Dynamo frames compiled {v.frames[res.rank]}, relaymoe graphs {v.graphs[res.rank]} "
              f"({res.rewritten} MoE regions rewritten), ring specs {res.records[-1].specs}; "
              f"{res.seconds:.1f} s of steps")
    print(f"bar: RSS growth < {args.max_rss_growth}% from step {args.rss_from}: {'ok' if v.rss_ok else 'FAIL'}; "
          f"compilations <= {v.bound} (2 shape classes x {len(RING_ROUTINGS)} models): "
          f"{'ok' if v.compile_ok else 'FAIL'}")
    print(f"verdict: {'PASS' if v.ok else 'FAIL'}; wall time {time.perf_counter() - start:.1f} s", flush=True)
    return (0 if v.ok else 1), v, results


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv)[0]


if __name__ == "__main__":
    sys.exit(main())
