"""Train a small Qwen3-style MoE transformer twice, eager all-to-all vs ``torch.compile(backend="relaymoe")``.

    python examples/train_moe.py                                  # CPU: spawns 4 gloo ranks, 20 steps
    python examples/train_moe.py --world 2 --steps 5 --routing token
    torchrun --nproc-per-node 4 examples/train_moe.py --device cuda   # GPUs: NCCL, one rank per GPU

The model (``moe_transformer.py``) is unmodified all-to-all expert parallelism: every rank holds the non-expert
parameters replicated and its own experts, and trains on its own data shard. Two copies start from the same
initialization and see the same data, step by step:

    (a) eager, the MoE blocks exchanging tokens through all-to-alls;
    (b) ``torch.compile(model, backend="relaymoe", options={...})``: the backend rewrites every MoE block into
        a RelayMoE ring (expert weights or token partitions circulate; no top-k-expanded buffers).

Each step prints both losses and their difference. The summary gives the largest loss difference, the per-rank
peak memory of one training step (forward, backward, gradient all-reduce, optimizer step; a step after
warm-up), the per-rank peak memory of one MoE block alone (forward + backward, same shapes, eager a2a vs the
block compiled with relaymoe), and writes a figure of memory over time (``--plot``).

Exit status 0 only if the loss curves match: per step ``|a - b| <= rtol * |a|`` with rtol 1e-4 in fp32. The
two runs are the same math but not bitwise (the ring adds a token's top-k contributions in another order and
runs expert GEMMs on other row counts); such rounding differences, ~1e-7 relative per step, feed back through
the optimizer's updates and grow over the steps, so the tolerance sits well above rounding and well below any
real error (a wrong gradient moves the loss by percents within a few steps). ``--lockstep`` starts every
relaymoe step from the a2a run's parameters instead, so each step compares one step of the same math and a
near-tie routing decision cannot go one way in one run and the other way in the other (what the tests run).

Gradients: each rank back-propagates ``loss / world``. Expert gradients then arrive complete (the all-to-all, or
the ring, carries every rank's contribution to the owner); the replicated parameters' gradients are summed over
the group with one all-reduce. The result is the gradient of the mean loss over all ranks' tokens.

The training step's peak also reflects what the inner compiler changes outside the MoE blocks (aot_autograd
saves other activations than eager; ``--backend aot_eager`` shows that part alone); the MoE block alone isolates
the ring.

Memory on CPU is measured with the profiler's allocator events on the rank's main thread
(``relay_compile.memory``); buffers freed by gloo's threads are not seen, which makes CPU numbers upper bounds.
On CUDA, PeakMemory reads the caching allocator's statistics.
"""

from __future__ import annotations

import argparse
import math
import os
import queue as queue_module
import socket
import sys
import time
import traceback
import unittest.mock
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as nnf
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # moe_transformer.py, also in spawned ranks

from moe_transformer import MoEModelConfig, MoETransformer  # noqa: E402
from train_moe_report import LABELS, MEASURED_STEPS, RTOL, RankResult, report  # noqa: E402

from relay_compile.backend import compiled_reports  # noqa: E402
from relay_compile.bench.rank_threads import RankPeak, run_rank_threads  # noqa: E402
from relay_compile.runtime.dynamo_settings import dynamo_settings  # noqa: E402
from relay_compile.memory import PeakMemory, memory_timeline  # noqa: E402
from relay_compile.reference import AllToAllMoE  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run = p.add_argument_group("run")
    run.add_argument("--world", type=int, default=4, help="ranks to spawn on CPU (ignored under torchrun)")
    run.add_argument(
        "--simulate-ep", type=int, default=0, metavar="N",
        help="SIMULATED EP: this one process is rank 0 of an N-rank stand-in group (relay_compile.bench."
             "standin_group; peers are copies of this rank: memory and compute exact, no link time); default 8 "
             "on one GPU under torchrun (EP=1 has no all-to-all to rewrite)",
    )
    run.add_argument(
        "--rank-threads", type=int, default=0, metavar="N",
        help="EVERY RANK REAL on one device: N ranks as threads of this process (relay_compile.bench.rank_threads:"
             " each rank its own data and experts, real transfers; per-rank peaks from each rank's allocations; "
             "the MoE-block-alone measurement and the timeline are skipped)",
    )
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run.add_argument("--dtype", choices=tuple(RTOL), default="float32")
    run.add_argument("--steps", type=int, default=20)
    run.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    run.add_argument("--lr", type=float, default=None, help="default: 3e-3 for adamw, 0.1 for sgd")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--data-seed", type=int, default=None,
                     help="seed of the data order (default: --seed); another value with the same --seed measures "
                     "run-to-run noise: same initialization, other batches")
    run.add_argument("--lockstep", action="store_true",
                     help="start every relaymoe step from the a2a run's parameters: each step compares one step of "
                          "the same math, so rounding drift cannot flip a near-tie routing decision (tests)")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds the spawned ranks may take in all")
    model = p.add_argument_group("model and data (per rank: batch x seq-len tokens)")
    model.add_argument("--batch", type=int, default=4)
    model.add_argument("--seq-len", type=int, default=64)
    model.add_argument("--vocab", type=int, default=256)
    model.add_argument("--hidden", type=int, default=64)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--ffn", type=int, default=32, help="expert FFN width")
    model.add_argument("--experts", type=int, default=8, help="experts of the whole EP group")
    model.add_argument("--top-k", type=int, default=4)
    model.add_argument("--shared-ffn", type=int, default=0, help="shared expert width (0: none)")
    backend = p.add_argument_group("relaymoe backend options")
    backend.add_argument("--routing", choices=("auto", "expert", "token"), default="auto")
    backend.add_argument(
        "--inner-compiler", choices=("inductor", "aot_eager", "eager"), default=None,
        help="default: aot_eager on CPU, inductor on CUDA",
    )
    backend.add_argument("--ring", choices=("auto", "memory", "always"), default="auto",
                         help="the backend's ring option: on CUDA, auto keeps the all-to-all where the time model "
                              "predicts the ring slower; always runs the ring")
    backend.add_argument("--dump-dir", default="", help="per-graph dumps of the backend (empty: none)")
    backend.add_argument(
        "--activation-memory-budget", type=float, default=None, metavar="F",
        help="the backend's activation_memory_budget, torch's partitioner budget: 1 its default choice, 0 save only "
             "each graph's inputs, in between recompute what costs least time per byte (default: torch's setting; "
             "docs/BENCHMARKS.md, full-model training, measures it)",
    )
    backend.add_argument(
        "--backend", default="relaymoe",
        help="compile (b) with another torch.compile backend instead, e.g. aot_eager, for comparison",
    )
    out = p.add_argument_group("output")
    out.add_argument("--plot", default="out/train_moe_memory.png", help="figure of memory over time ('': none)")
    out.add_argument("--report-json", default="", help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if not args.simulate_ep and _under_torchrun() and int(os.environ["WORLD_SIZE"]) == 1 and args.device == "cuda":
        args.simulate_ep = 8  # one GPU: EP=1 would have no all-to-all to rewrite
    if args.experts % _world_size(args):
        p.error(f"--experts {args.experts} must be a multiple of the EP size {_world_size(args)}")
    if args.steps < MEASURED_STEPS + 1:
        p.error(f"--steps {args.steps}: need at least {MEASURED_STEPS + 1} (warm-up, then the measured steps)")
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "adamw" else 0.1
    if args.inner_compiler is None:
        args.inner_compiler = "inductor" if args.device == "cuda" else "aot_eager"
    if args.simulate_ep and args.routing != "expert":
        # The stand-in group mirrors this rank as every peer: token routing would revisit this rank's own tokens
        # with its own experts at every hop, another function than the model's (relay_compile.bench.standin_group).
        if args.routing == "token":
            p.error("--simulate-ep computes the model's function only with expert routing: use --routing expert")
        args.routing = "expert"
    return args


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _world_size(args: argparse.Namespace) -> int:
    if args.simulate_ep or args.rank_threads:
        return args.simulate_ep or args.rank_threads
    return int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.world


def model_config(args: argparse.Namespace) -> MoEModelConfig:
    return MoEModelConfig(
        vocab=args.vocab, hidden=args.hidden, heads=args.heads, layers=args.layers, ffn=args.ffn,
        experts=args.experts, top_k=args.top_k, shared_ffn=args.shared_ffn,
    )


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"routing": args.routing, "inner_compiler": args.inner_compiler, "dump_dir": args.dump_dir}
    if args.ring != "auto":
        options["ring"] = args.ring
    if args.activation_memory_budget is not None:
        options["activation_memory_budget"] = args.activation_memory_budget
    return options


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


def synthetic_batch(seed: int, step: int, rank: int, batch: int, seq_len: int, vocab: int) -> Tensor:
    """Tokens ``(B, S + 1)`` of one rank at one step, a pure function of its arguments.

    Each row repeats a random pattern of 3 to 8 tokens drawn from a Zipf-like distribution over the vocabulary:
    a model first learns the token frequencies, then to copy the token one period back (attention), so the
    loss falls from ln(V) within a few steps and keeps falling.
    """
    gen = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    zipf_V = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    rows = []
    for _ in range(batch):
        period = int(torch.randint(3, 9, (), generator=gen))
        pattern_P = torch.multinomial(zipf_V, period, replacement=True, generator=gen)
        rows.append(pattern_P.repeat(math.ceil((seq_len + 1) / period))[: seq_len + 1])
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------


def _all_reduce_replicated_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum the gradients of the replicated parameters over the EP group, in one flat all-reduce."""
    for p in params:
        if p.grad is None:  # e.g. a router no token reached on this rank: still take part in the sum
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def _global_mean(value: Tensor, group: dist.ProcessGroup) -> float:
    """Mean of a scalar over the ranks."""
    total = value.detach().float().clone()
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(group)


@dataclass
class Trainer:
    """One of the two runs: the module (for parameters), what to call (eager module or compiled), its optimizer."""

    label: str
    module: MoETransformer
    forward: Callable[[Tensor], Tensor]
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup

    def step(self, tokens_BS1: Tensor) -> Tensor:
        """One training step: forward, loss, backward of ``loss / world``, gradient all-reduce, optimizer."""
        inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
        self.optimizer.zero_grad(set_to_none=True)
        logits_BSV = self.forward(inputs_BS)
        loss = nnf.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())
        (loss / dist.get_world_size(self.group)).backward()
        _all_reduce_replicated_grads(self.module.replicated_parameters(), self.group)
        self.optimizer.step()
        return loss.detach()


def _optimizer(args: argparse.Namespace, params: Any) -> torch.optim.Optimizer:
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=args.lr, momentum=0.9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _appending(out: list[Tensor], fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], None]:
    """``fn`` that appends its result to ``out`` (``memory_timeline`` drops results)."""
    return lambda tokens: out.append(fn(tokens))


def _use_grouped_mm(dtype: torch.dtype) -> bool | None:
    # fp32 takes the loop over experts in BOTH runs: torch._grouped_mm's fake kernel demands bf16 under
    # torch.compile, and the eager run must compute the experts the same way for the comparison.
    return None if dtype == torch.bfloat16 else False


def _compile(module: nn.Module, args: argparse.Namespace, options: dict[str, Any]) -> Callable[..., Any]:
    """``module`` compiled with ``args.backend``: relaymoe with ``options``, or another backend for comparison,
    run under the Dynamo settings relaymoe sets for its own calls (so each MoE block is one graph there too)."""
    if args.backend == "relaymoe":
        return torch.compile(module, backend="relaymoe", options=options)
    inner = torch._dynamo.lookup_backend(args.backend)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return inner(gm, example_inputs)

    backend.backend_ctx_ctor = dynamo_settings  # type: ignore[attr-defined]
    return torch.compile(module, backend=backend)


def train(
    rank: int, world: int, args: argparse.Namespace, device: torch.device, group: dist.ProcessGroup | None = None,
    *, model_group_by_name: bool = False,
) -> RankResult:
    """Both runs on this rank, interleaved step by step; then the MoE block alone. Rank 0 prints progress.

    ``group``: the EP group (default: the world). ``model_group_by_name``: the model's MoE blocks get the group's
    name (compiled code keeps a str as a constant; torch 2.11's Dynamo cannot proxy the stand-in group).
    """
    group = dist.group.WORLD if group is None else group
    model_group = group.group_name if model_group_by_name else group
    dtype = getattr(torch, args.dtype)
    cfg = model_config(args)
    result = RankResult(rank=rank)

    def build() -> MoETransformer:
        model = MoETransformer(cfg, model_group, seed=args.seed, use_grouped_mm=_use_grouped_mm(dtype))
        return model.to(device=device, dtype=dtype)

    model_a, model_b = build(), build()
    options = backend_options(args)
    compiled_b = _compile(model_b, args, options)
    trainers = [
        Trainer(LABELS[0], model_a, model_a, _optimizer(args, model_a.parameters()), group),
        Trainer(LABELS[1], model_b, compiled_b, _optimizer(args, model_b.parameters()), group),
    ]
    data_seed = args.seed if args.data_seed is None else args.data_seed
    batch = lambda step: synthetic_batch(  # noqa: E731
        data_seed, step, rank, args.batch, args.seq_len, args.vocab
    ).to(device)

    peak_step, timeline_step = args.steps - MEASURED_STEPS, args.steps - MEASURED_STEPS + 1
    if args.rank_threads:  # one profiler per process: no timeline; the reports are the process's
        timeline_step = -1
    seen = len(compiled_reports())
    train_steps(rank, args, trainers, batch, peak_step, timeline_step, result)
    reports = compiled_reports()[seen:]  # rank threads share the process's compiled graphs and their reports
    result.regions = [report.summary() for report in reports]
    result.regions_rewritten = sum(r.status == "rewritten" for report in reports for r in report.regions)
    if not args.rank_threads:
        measure_block(rank, args, cfg, model_group, device, dtype, options, result)
    return result


def train_steps(
    rank: int,
    args: argparse.Namespace,
    trainers: list[Trainer],
    batch: Callable[[int], Tensor],
    peak_step: int,
    timeline_step: int,
    result: RankResult,
) -> None:
    """The training loop of both runs, interleaved; rank 0 prints one line per step."""
    device = trainers[0].module.embed.weight.device
    group = trainers[0].group
    if rank == 0:
        print(f"\n{'step':>4} {'loss ' + LABELS[0]:>18} {'loss ' + LABELS[1]:>26} {'|diff|':>9} {'rel':>8}"
              f" {'s/step a2a':>10} {'s/step relay':>12}", flush=True)
    for step in range(args.steps):
        tokens = batch(step)
        if args.lockstep:
            trainers[1].module.load_state_dict(trainers[0].module.state_dict())
        for trainer in trainers:
            _sync(device)
            start = time.perf_counter()
            if step == peak_step:
                with (RankPeak(device) if args.rank_threads else PeakMemory(device)) as mem:
                    loss = trainer.step(tokens)
                result.step_peak[trainer.label] = mem.peak_bytes
            elif step == timeline_step:
                losses: list[Tensor] = []
                result.step_timeline[trainer.label] = memory_timeline(
                    _appending(losses, trainer.step), tokens, device=device
                )
                loss = losses[0]
            else:
                loss = trainer.step(tokens)
            _sync(device)
            result.step_seconds.setdefault(trainer.label, []).append(time.perf_counter() - start)
            result.losses.setdefault(trainer.label, []).append(_global_mean(loss, group))
        if rank == 0:
            la, lb = (result.losses[label][-1] for label in LABELS)
            ta, tb = (result.step_seconds[label][-1] for label in LABELS)
            note = {peak_step: "  (peak measured)", timeline_step: "  (timeline recorded)"}.get(step, "")
            print(f"{step:4d} {la:18.6f} {lb:26.6f} {abs(la - lb):9.2e} {abs(la - lb) / abs(la):8.1e}"
                  f" {ta:10.3f} {tb:12.3f}{note}", flush=True)


def measure_block(
    rank: int,
    args: argparse.Namespace,
    cfg: MoEModelConfig,
    group: dist.ProcessGroup | str,
    device: torch.device,
    dtype: torch.dtype,
    options: dict[str, Any],
    result: RankResult,
) -> None:
    """Peak memory and timeline of one MoE block alone, forward + backward, eager a2a vs compiled relaymoe."""
    block = AllToAllMoE(
        cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, group, shared_ffn=cfg.shared_ffn, seed=args.seed + 7,
        use_grouped_mm=_use_grouped_mm(dtype),
    ).to(device=device, dtype=dtype)
    compiled = _compile(block, args, options)
    gen = torch.Generator(device="cpu").manual_seed(10_000 + rank)
    x_BSH = torch.randn(args.batch, args.seq_len, cfg.hidden, generator=gen).to(device=device, dtype=dtype)
    dy_BSH = torch.randn(args.batch, args.seq_len, cfg.hidden, generator=gen).to(device=device, dtype=dtype)
    x_BSH.requires_grad_()

    def fwd_bwd(fn: Callable[[Tensor], Tensor]) -> Tensor:
        y_BSH = fn(x_BSH)
        y_BSH.backward(dy_BSH)
        return y_BSH.detach()

    outputs = []
    for label, fn in zip(LABELS, (block, compiled), strict=True):
        outputs.append(fwd_bwd(fn))  # warm-up: compilation, first-call allocations
        for measure in ("peak", "timeline"):
            block.zero_grad(set_to_none=True)
            x_BSH.grad = None
            if measure == "peak":
                with (RankPeak(device) if args.rank_threads else PeakMemory(device)) as mem:
                    fwd_bwd(fn)
                result.block_peak[label] = mem.peak_bytes
            else:
                result.block_timeline[label] = memory_timeline(fwd_bwd, fn, device=device)
    want, got = outputs
    result.block_max_rel_err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    torch.set_num_threads(1)
    return torch.device("cpu")


def _spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    """A spawned rank: train, report through ``results`` (a queue), destroy the group, leave at once."""
    code = 0
    try:
        device = _device(args, rank)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
            rank=rank, world_size=world,
        )
        results.put(("ok", rank, train(rank, world, args, device)))
    except BaseException:  # noqa: BLE001 - the parent must hear about every failure
        results.put(("error", rank, traceback.format_exc()))
        code = 1
    if dist.is_initialized():
        dist.destroy_process_group()
    results.close()
    results.join_thread()  # the queue's feeder thread must deliver before os._exit
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: it costs seconds and on CPU sometimes aborts with "terminate called without
    # an active exception" after all work is done (docs/ARCHITECTURE.md section 5). The parent judges the reports.
    os._exit(code)


def spawn_and_report(args: argparse.Namespace) -> int:
    """CPU (or one process per local GPU): spawn ``--world`` ranks, collect what each reported, summarize."""
    world = args.world
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, port, args, results)) for r in range(world)]
    # Children inherit the environment: one OpenMP thread each (unless set), or N ranks oversubscribe the cores.
    with unittest.mock.patch.dict(os.environ, {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}):
        for proc in procs:
            proc.start()
    reported: dict[int, RankResult] = {}
    errors: dict[int, str] = {}

    def receive(timeout: float) -> bool:
        try:
            status, rank, payload = results.get(timeout=timeout)
        except queue_module.Empty:
            return False
        (reported if status == "ok" else errors)[rank] = payload
        return True

    deadline = time.monotonic() + args.timeout
    while len(reported) + len(errors) < world and time.monotonic() < deadline:
        if receive(timeout=1.0):
            if errors:  # the others may be stuck in a collective with the failed rank: a short grace period
                deadline = min(deadline, time.monotonic() + 15.0)
            continue
        if any(p.exitcode is not None and r not in reported | errors for r, p in enumerate(procs)):
            while receive(timeout=3.0):  # a rank that just exited may have reported a moment ago
                pass
            for r, p in enumerate(procs):
                if p.exitcode is not None and r not in reported | errors:  # killed, or crashed in C++
                    errors[r] = f"exited with status {p.exitcode} without reporting"
            deadline = min(deadline, time.monotonic() + 15.0)
    for proc in procs:
        proc.join(timeout=5 if errors else 30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for r in range(world):
        if r not in reported and r not in errors:
            errors[r] = "stopped waiting after another rank failed" if errors else (
                f"no report within --timeout {args.timeout:.0f} s")
    if errors:
        for rank in sorted(errors):
            print(f"rank {rank} FAILED:\n{errors[rank]}", file=sys.stderr)
        print("result: FAIL (a rank did not finish)", file=sys.stderr)
        return 2
    return report([reported[r] for r in range(world)], args, world, args.device)


def torchrun_rank(args: argparse.Namespace) -> int:
    """Under torchrun: this process is one rank; rank 0 gathers the results and reports."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device(args, int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        result = train(rank, world, args, device)
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(result, gathered if rank == 0 else None, dst=0)
        code = report(gathered, args, world, args.device) if rank == 0 else 0
        verdict = torch.tensor([code], device=device)
        dist.broadcast(verdict, src=0)  # every rank exits with rank 0's verdict
        return int(verdict.item())
    finally:
        dist.destroy_process_group()


def simulated_rank(args: argparse.Namespace) -> int:
    """``--simulate-ep N``: rank 0 of a stand-in N-rank group in this one process (SIMULATED EP)."""
    from relay_compile.bench import destroy_standin_groups, standin_group

    world = args.simulate_ep
    print(f"  SIMULATED EP={world}: rank 0 of a stand-in group in one process (no link time; peers mirror this "
          "rank's data; expert routing, the one the stand-in computes exactly)", flush=True)
    device = _device(args, int(os.environ.get("LOCAL_RANK", 0)))
    try:
        result = train(0, world, args, device, group=standin_group(world), model_group_by_name=True)
        return report([result], args, world, f"{args.device}, SIMULATED EP")
    finally:
        destroy_standin_groups()


def threaded_ranks(args: argparse.Namespace) -> int:
    """``--rank-threads N``: N ranks as threads of this process on one device, every rank real."""
    world = args.rank_threads
    print(f"  EVERY RANK REAL: {world} ranks as threads of one process on one {args.device} device "
          "(relay_compile.bench.rank_threads)", flush=True)
    device = _device(args, 0)
    results = run_rank_threads(world, lambda rank, group: train(rank, world, args, device, group,
                                                                model_group_by_name=True),
                               device=device, timeout=args.timeout)
    return report(results, args, world, f"{args.device}, {world} ranks as threads")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    world = _world_size(args)
    if not _under_torchrun() or int(os.environ["RANK"]) == 0:
        print(f"train_moe: EP={world} ranks on {args.device} ({'torchrun' if _under_torchrun() else 'spawned'}), "
              f"{args.dtype}, {args.steps} steps of {args.optimizer} lr {args.lr}; model {model_config(args)}; "
              f"{args.batch}x{args.seq_len} tokens per rank; backend {args.backend} {backend_options(args)}",
              flush=True)
    start = time.perf_counter()
    if args.simulate_ep:
        code = simulated_rank(args)
    elif args.rank_threads:
        code = threaded_ranks(args)
    else:
        code = torchrun_rank(args) if _under_torchrun() else spawn_and_report(args)
    if not _under_torchrun() or int(os.environ["RANK"]) == 0:
        print(f"  wall time {time.perf_counter() - start:.1f} s; exit status {code}", flush=True)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if _under_torchrun():
        os._exit(code)  # skip teardown: see _spawned_rank
    sys.exit(code)
