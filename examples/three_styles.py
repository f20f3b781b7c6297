"""The issue's bar for three client MoE styles on CPU ranks: training parity, no token all-to-all, peak memory.

    python examples/three_styles.py                       # world 4, all three styles (~3-5 min on 2 cores)
    python examples/three_styles.py --world 2 --styles reference --steps 2 --tiny
    python examples/three_styles.py --styles deepspeed,fairseq,gshard  # capacity-based dispatch (docs/USAGE.md)

Styles: the project's reference layer (``relay_compile.reference.AllToAllMoE``), the Megatron-style layer
(``tests.models.megatron_style``: all_gather counts, ModuleList experts, index_add_) and torchtitan 0.3.0's
``MoE`` with ``AllToAllTokenDispatcher`` (``tests.models.torchtitan_moe``; skipped when not installed);
on request (``--styles``), three capacity-based layers: DeepSpeed-style top-2 with capacity and drops
(``tests.models.deepspeed_style``; ``fairseq_style``: the same with fairseq's mm dispatch and combine) and
GShard/Tutel-style top-k with batched experts (``tests.models.gshard_style``),
whose ``(S, E, C)`` gate tensors grow with the square of the tokens: they are measured at their own sizes
(``--mem-capacity-*``); and issue 11's idiom layers (``tests.models``: ``data_dependent``, ``scores_first``,
``autograd_a2a``), at the reference layer's sizes.
Spawns ``--world`` gloo processes; on each rank, for each style:

1. Training parity: two copies of the layer from the same seed, one eager (its all-to-alls), one
   ``torch.compile(layer, backend="relaymoe", options={"inner_compiler": "aot_eager"})``, each trained for
   ``--steps`` SGD steps on the same per-rank data with loss ``mean(layer(x) ** 2)``, in lock step: each
   compiled step starts from the parameters the eager step started from (``tests.lockstep``: otherwise rounding
   drift can flip a near-tie routing decision and the two copies compute different things). Per-step losses
   side by side; the max relative difference over steps and ranks must be <= 1e-5 (fp32) or 1e-3 (torchtitan:
   bf16).
2. The token all-to-all no longer runs: one training step (forward + backward) of each copy under
   ``torch.profiler`` (CPU activity); events whose names contain "all_to_all"/"alltoall" are counted as
   all-to-alls, "send"/"recv"/"batch_isend_irecv" as P2P. The backend's report must say every region was
   rewritten, and the rewritten Dynamo graph (``dump_dir``) must hold no all_to_all_single, all_gather or
   ``.item()`` node: the counts exchange and its host syncs are gone.
3. Per-rank peak memory of the MoE block, forward + backward (``PeakMemory("cpu")``, after a warm-up), eager
   a2a vs relaymoe-compiled, at sizes where the block's expanded buffers dominate (``--mem-*``).

Rank 0 prints one table; exit status 1 if a parity or structure check fails (the memory ratio is reported,
not enforced: the bar is >= 3x, and the table says where a style falls short).

Legend: T tokens per rank, H hidden, F expert FFN width, E experts, K top-k, N ranks.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.models (the client styles)

from relay_compile.backend import compiled_reports  # noqa: E402
from relay_compile.comm_events import count_comm_events  # noqa: E402
from relay_compile.memory import PeakMemory, install_counting_cpu_allocator  # noqa: E402
from relay_compile.reference import AllToAllMoE  # noqa: E402
from tests.lockstep import load_parameters, parameters_of  # noqa: E402
from tests.models.autograd_a2a import AutogradAllToAllMoE  # noqa: E402
from tests.models.data_dependent import DataDependentMoE  # noqa: E402
from tests.models.deepspeed_style import DeepSpeedStyleMoE  # noqa: E402
from tests.models.fairseq_style import FairseqStyleMoE  # noqa: E402
from tests.models.gshard_style import GShardStyleMoE  # noqa: E402
from tests.models.megatron_style import MegatronStyleMoE  # noqa: E402
from tests.models.scores_first import ScoresFirstMoE  # noqa: E402
from tests.models.torchtitan_moe import build_torchtitan_moe, torchtitan_available  # noqa: E402

STYLES = ("reference", "megatron", "torchtitan")
CAPACITY_STYLES = ("deepspeed", "fairseq", "gshard")  # only with --styles
IDIOM_STYLES = ("data_dependent", "scores_first", "autograd_a2a")  # only with --styles (tests/models, issue 11)
ALL_STYLES = STYLES + CAPACITY_STYLES + IDIOM_STYLES
# Loss tolerance (relative, per step). fp32 styles run the same per-pair math as a2a; only summation orders
# differ (~1e-7), which the optimizer's updates carry over the steps. torchtitan's GroupedExperts casts to
# bf16 for its grouped GEMMs: the ring runs those GEMMs on other row counts (per hop) and sums each owner's
# weight gradient from per-source bf16 partials, so losses agree to bf16 rounding, not fp32.
LOSS_RTOL = {"reference": 1e-5, "megatron": 1e-5, "torchtitan": 1e-3,
             **dict.fromkeys(CAPACITY_STYLES + IDIOM_STYLES, 1e-5)}


@dataclass(frozen=True, kw_only=True)
class Sizes:
    tokens: int  # T per rank
    hidden: int
    ffn: int
    experts: int
    top_k: int
    capacity_factor: float = 1.0  # capacity styles: C = capacity_factor * S * K / E slots per expert


@dataclass(frozen=True, kw_only=True)
class Config:
    world: int
    styles: tuple[str, ...]
    steps: int
    lr: float
    train: Sizes
    mem: Sizes
    mem_torchtitan: Sizes
    mem_capacity: Sizes
    skip_memory: bool
    max_hop_rows: int = 0  # backend option for the memory measurement (0: whole hops)
    # How CPU peaks are read (relay_compile.memory): "profiler" (this thread's events; a free on a gloo thread
    # goes unseen and inflates the level) or "allocator" (a counting allocator, exact; built once, ~1 min).
    cpu_memory: str = "profiler"


@dataclass(kw_only=True)
class StyleResult:
    """One style on one rank."""

    losses_eager: list[float] = field(default_factory=list)
    losses_ring: list[float] = field(default_factory=list)
    a2a_eager: int = 0
    a2a_ring: int = 0
    p2p_eager: int = 0
    p2p_ring: int = 0
    comm_names_eager: list[str] = field(default_factory=list)
    comm_names_ring: list[str] = field(default_factory=list)
    regions_rewritten: int = 0
    regions_refused: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # forbidden node kinds found in the rewritten graph
    peak_eager: int = 0
    peak_ring: int = 0
    error: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------------------
# The three styles: a builder (same weights for the same seed) and the input shape
# ----------------------------------------------------------------------------------------------------------


def build(style: str, s: Sizes, world: int, seed: int) -> nn.Module:
    group = dist.group.WORLD
    if style == "reference":
        # fp32 compile needs the looped expert path: torch._grouped_mm's fake kernel demands bf16.
        return AllToAllMoE(s.hidden, s.ffn, s.experts, s.top_k, group=group, seed=seed, use_grouped_mm=False)
    if style == "megatron":
        return MegatronStyleMoE(s.hidden, s.ffn, s.experts, s.top_k, group, seed=seed)
    if style == "torchtitan":
        return build_torchtitan_moe(world, dim=s.hidden, hidden=s.ffn, num_experts=s.experts, top_k=s.top_k,
                                    seed=seed)
    if style == "deepspeed":  # top-2 (K ignored)
        return _Output0(DeepSpeedStyleMoE(s.hidden, s.ffn, s.experts, group, capacity_factor=s.capacity_factor,
                                          seed=seed))
    if style == "fairseq":  # the DeepSpeed-style gate and experts, fairseq's mm dispatch and combine
        return _Output0(FairseqStyleMoE(s.hidden, s.ffn, s.experts, group, capacity_factor=s.capacity_factor,
                                        seed=seed))
    if style == "gshard":
        return GShardStyleMoE(s.hidden, s.ffn, s.experts, s.top_k, group, capacity_factor=s.capacity_factor,
                              seed=seed)
    idiom = {"data_dependent": DataDependentMoE, "scores_first": ScoresFirstMoE, "autograd_a2a": AutogradAllToAllMoE}
    if style in idiom:
        return idiom[style](s.hidden, s.ffn, s.experts, s.top_k, group, seed=seed)
    raise ValueError(f"three_styles: style {style!r} is not one of {ALL_STYLES}")


class _Output0(nn.Module):
    """The block's output without DeepSpeed's auxiliary loss (``MOELayer`` returns both)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: Tensor) -> Tensor:
        return self.moe(x)[0]


def batch(style: str, s: Sizes, rank: int, step: int) -> Tensor:
    """This rank's tokens for ``step``: (T, H), or (1, T, H) for torchtitan (its MoE takes x_BLD)."""
    x_TH = torch.randn(s.tokens, s.hidden, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x_TH.unsqueeze(0) if style == "torchtitan" else x_TH


def compile_relaymoe(module: nn.Module, dump_dir: str = "", max_hop_rows: int = 0) -> Callable[[Tensor], Tensor]:
    # dynamic=False: each style/size is its own compile; automatic dynamic shapes would otherwise mark the
    # token dimension dynamic when the memory phase reuses the layer's code object with other sizes.
    return torch.compile(module, backend="relaymoe", dynamic=False, options={
        "inner_compiler": "aot_eager", "dump_dir": dump_dir, "max_hop_rows": max_hop_rows})


# ----------------------------------------------------------------------------------------------------------
# The three measurements
# ----------------------------------------------------------------------------------------------------------


def train(fn: Callable[[Tensor], Tensor], module: nn.Module, style: str, s: Sizes, cfg: Config,
          rank: int, starts: list[dict[str, Tensor]] | None = None) -> tuple[list[float], list[dict[str, Tensor]]]:
    """``cfg.steps`` SGD steps of ``mean(fn(x) ** 2)``: the per-step losses (before each update) and the
    parameters each step started from; ``starts``: start each step from these instead (``tests.lockstep``)."""
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
    losses, started = [], []
    for step in range(cfg.steps):
        if starts is not None:
            load_parameters(module, starts[step])
        started.append(parameters_of(module))
        opt.zero_grad(set_to_none=True)
        loss = fn(batch(style, s, rank, step)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, started


def count_step_events(fn: Callable[[Tensor], Tensor], x: Tensor) -> tuple[int, int, list[str]]:
    """All-to-all and P2P profiler events of one forward + backward of ``fn(x)``; the communication names."""
    events = count_comm_events(lambda: fn(x).pow(2).mean().backward())
    return events.all_to_all, events.p2p, events.names


def rewritten_graph_leftovers(dump_dir: str) -> list[str]:
    """Forbidden node kinds in the dumped rewritten graphs: the token/counts collectives and host syncs."""
    found = []
    files = sorted(Path(dump_dir).glob("*/1_rewritten_graph.py"))
    if not files:
        return ["no rewritten graph was dumped"]
    for path in files:
        text = path.read_text()
        for needle in ("all_to_all_single", "all_gather", ".item()", "_local_scalar_dense", "tolist"):
            if needle in text:
                found.append(f"{path.parent.name}: {needle}")
    return found


def block_peak(fn: Callable[[Tensor], Tensor], module: nn.Module, x: Tensor, grad_y: Tensor,
               cpu_memory: str = "profiler") -> int:
    """Peak bytes above entry of forward + backward of the block, after one warm-up call."""
    for measured in (False, True):
        module.zero_grad(set_to_none=True)
        leaf = x.detach().clone().requires_grad_()
        dist.barrier()
        with PeakMemory("cpu", cpu_method=cpu_memory) as mem:
            fn(leaf).backward(grad_y)
        del leaf
    module.zero_grad(set_to_none=True)
    return mem.peak_bytes if measured else 0


def measure_style(style: str, cfg: Config, rank: int) -> StyleResult:
    res = StyleResult()
    s = cfg.train
    # Step 1: training parity, same seed and data.
    torch._dynamo.reset()
    eager = build(style, s, cfg.world, seed=11)
    ring_module = build(style, s, cfg.world, seed=11)
    dump_dir = tempfile.mkdtemp(prefix=f"three_styles_{style}_r{rank}_")
    ring = compile_relaymoe(ring_module, dump_dir)
    n_reports = len(compiled_reports())
    res.losses_eager, starts = train(eager, eager, style, s, cfg, rank)
    res.losses_ring, _ = train(ring, ring_module, style, s, cfg, rank, starts)
    # Step 2: what the backend did, and what communication one step runs.
    for report in compiled_reports()[n_reports:]:
        for region in report.regions:
            if region.status == "rewritten":
                res.regions_rewritten += 1
            else:
                res.regions_refused.append(f"{region.anchor}: {region.status} {region.reason}")
    res.leftovers = rewritten_graph_leftovers(dump_dir)
    x = batch(style, s, rank, cfg.steps)
    res.a2a_eager, res.p2p_eager, res.comm_names_eager = count_step_events(eager, x)
    res.a2a_ring, res.p2p_ring, res.comm_names_ring = count_step_events(ring, x)
    del eager, ring_module, ring
    # Step 3: peak memory of the block at large sizes.
    if not cfg.skip_memory:
        m = {"torchtitan": cfg.mem_torchtitan, **dict.fromkeys(CAPACITY_STYLES, cfg.mem_capacity)}.get(style, cfg.mem)
        torch._dynamo.reset()
        module = build(style, m, cfg.world, seed=12)
        x = batch(style, m, rank, 0)
        grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + rank))
        res.peak_eager = block_peak(module, module, x, grad_y, cfg.cpu_memory)
        res.peak_ring = block_peak(compile_relaymoe(module, max_hop_rows=cfg.max_hop_rows), module, x, grad_y,
                                   cfg.cpu_memory)
    return res


def _worker(rank: int, cfg: Config, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if cfg.cpu_memory == "allocator" and not cfg.skip_memory:
        install_counting_cpu_allocator()  # before any tensor: blocks allocated earlier are freed unseen
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world)
    results: dict[str, StyleResult] = {}
    for style in cfg.styles:
        try:
            results[style] = measure_style(style, cfg, rank)
        except Exception:  # report it in the table; the other styles still run (every rank fails alike)
            results[style] = StyleResult(error=traceback.format_exc())
        if rank == 0:
            print(f"  measured {style}", file=sys.stderr, flush=True)
        dist.barrier()
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# Parent: spawn, then one table
# ----------------------------------------------------------------------------------------------------------


def run(cfg: Config) -> dict[int, dict[str, StyleResult]]:
    """Spawn the ranks and return every rank's results."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, queue)) for r in range(cfg.world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join(timeout=60)  # a child that reported may still abort at exit (docs/ARCHITECTURE.md section 5)
    return results


def loss_rel_diff(r: StyleResult) -> float:
    return max((abs(a - b) / max(abs(a), 1e-30) for a, b in zip(r.losses_eager, r.losses_ring)), default=0.0)


def check(cfg: Config, results: dict[int, dict[str, StyleResult]]) -> list[str]:
    """What fails the bar's hard checks (parity, no token all-to-all, no counts exchange or host sync)."""
    failures = []
    for style in cfg.styles:
        for rank in range(cfg.world):
            r = results[rank][style]
            if r.error:
                failures.append(f"{style} rank {rank}: {r.error.strip().splitlines()[-1]}")
                continue
            if not loss_rel_diff(r) <= LOSS_RTOL[style]:
                failures.append(f"{style} rank {rank}: loss rel diff {loss_rel_diff(r):.2e} > {LOSS_RTOL[style]}")
            if r.regions_rewritten < 1 or r.regions_refused:
                failures.append(f"{style} rank {rank}: rewritten {r.regions_rewritten}, refused {r.regions_refused}")
            if r.leftovers:
                failures.append(f"{style} rank {rank}: rewritten graph still has {r.leftovers}")
            if r.a2a_ring != 0 or r.p2p_ring == 0 or r.a2a_eager == 0:
                failures.append(f"{style} rank {rank}: a2a events eager {r.a2a_eager} / compiled {r.a2a_ring}, "
                                f"p2p compiled {r.p2p_ring}")
    return failures


def print_report(cfg: Config, results: dict[int, dict[str, StyleResult]]) -> None:
    mib = 2**20
    for style in cfg.styles:
        r0 = results[0][style]
        if r0.error:
            print(f"\n{style}: FAILED on rank 0:\n{r0.error}")
            continue
        print(f"\n{style}: regions rewritten {r0.regions_rewritten}; communication events, rank 0:\n"
              f"  eager    {r0.comm_names_eager}\n  relaymoe {r0.comm_names_ring}\n"
              f"losses, rank 0 (eager a2a | relaymoe) and rel diff:")
        for step, (a, b) in enumerate(zip(r0.losses_eager, r0.losses_ring)):
            print(f"  step {step}: {a:.8f} | {b:.8f}  {abs(a - b) / max(abs(a), 1e-30):.2e}")
    t, m, mt = cfg.train, cfg.mem, cfg.mem_torchtitan
    print(f"\nworld {cfg.world}, gloo, CPU, {cfg.steps} SGD steps at T={t.tokens} H={t.hidden} F={t.ffn} "
          f"E={t.experts} K={t.top_k}; memory at T={m.tokens} H={m.hidden} F={m.ffn} E={m.experts} K={m.top_k}"
          f" (torchtitan T={mt.tokens} H={mt.hidden} F={mt.ffn} E={mt.experts} K={mt.top_k}; capacity styles "
          f"T={cfg.mem_capacity.tokens} H={cfg.mem_capacity.hidden} F={cfg.mem_capacity.ffn}); max over ranks")
    header = (f"{'style':11s} | {'max loss rel diff':>17s} | {'a2a events eager/compiled':>25s} | "
              f"{'p2p events compiled':>19s} | {'peak eager MiB':>14s} | {'peak relaymoe MiB':>17s} | ratio")
    print(header)
    print("-" * len(header))
    for style in cfg.styles:
        rs = [results[rank][style] for rank in range(cfg.world)]
        if any(r.error for r in rs):
            print(f"{style:11s} | FAILED")
            continue
        diff = max(loss_rel_diff(r) for r in rs)
        a2a = f"{max(r.a2a_eager for r in rs)}/{max(r.a2a_ring for r in rs)}"
        p2p = max(r.p2p_ring for r in rs)
        pe, pr = max(r.peak_eager for r in rs), max(r.peak_ring for r in rs)
        ratio = f"{pe / pr:.2f}x" if pr else "-"
        if any(r.regions_rewritten == 0 for r in rs):  # the compiled copy is the a2a layer under aot_eager
            ratio += " (NOT rewritten: " + rs[0].regions_refused[0][:90] + ")" if rs[0].regions_refused else ""
        print(f"{style:11s} | {diff:17.2e} | {a2a:>25s} | {p2p:19d} | {pe / mib:14.1f} | {pr / mib:17.1f} | {ratio}")


def parse(argv: list[str] | None = None) -> Config:
    """The configuration of a run from command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--styles", default=",".join(STYLES),
                   help=f"comma-separated subset of {ALL_STYLES}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--tiny", action="store_true", help="tiny sizes everywhere (tests)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--max-hop-rows", type=int, default=0,
                   help="relaymoe option for the memory measurement: bounded hops (0: whole hops)")
    p.add_argument("--cpu-memory", choices=("profiler", "allocator"), default="profiler",
                   help="how CPU peaks are read: profiler events, or a counting allocator (exact)")
    p.add_argument("--mem-tokens", type=int, default=4096)
    p.add_argument("--mem-hidden", type=int, default=256)
    p.add_argument("--mem-ffn", type=int, default=128)
    p.add_argument("--mem-experts", type=int, default=16)
    p.add_argument("--mem-top-k", type=int, default=8)
    # torchtitan's bf16 grouped GEMMs are slow on CPU: fewer tokens, same expansion (K=8) and widths.
    p.add_argument("--mem-torchtitan-tokens", type=int, default=2048)
    # Capacity-based layers hold (S, E, C) gate tensors, S * E * C = S^2 * K * capacity_factor: fewer tokens.
    p.add_argument("--mem-capacity-tokens", type=int, default=256)
    p.add_argument("--mem-capacity-hidden", type=int, default=2048)
    p.add_argument("--mem-capacity-ffn", type=int, default=128)
    # Buffers of capacity_factor * S * K rows per rank: 4 * 2 holds as many rows as a top-8 layer's.
    p.add_argument("--mem-capacity-factor", type=float, default=4.0)
    a = p.parse_args(argv)
    styles = tuple(s for s in a.styles.split(",") if s)
    if unknown := [s for s in styles if s not in ALL_STYLES]:
        p.error(f"--styles {unknown} not among {ALL_STYLES}")
    if "torchtitan" in styles and not torchtitan_available():
        print("torchtitan 0.3.0 (+ triton, spmd_types) is not installed: skipping that style", flush=True)
        styles = tuple(s for s in styles if s != "torchtitan")
    if a.tiny:
        train_sizes = Sizes(tokens=24, hidden=16, ffn=8, experts=4 * a.world, top_k=2)
        mem = mem_tt = mem_cap = Sizes(tokens=64, hidden=16, ffn=8, experts=4 * a.world, top_k=4)
    else:
        train_sizes = Sizes(tokens=128, hidden=32, ffn=16, experts=4 * a.world, top_k=2)
        mem = Sizes(tokens=a.mem_tokens, hidden=a.mem_hidden, ffn=a.mem_ffn, experts=a.mem_experts, top_k=a.mem_top_k)
        mem_tt = Sizes(tokens=a.mem_torchtitan_tokens, hidden=a.mem_hidden, ffn=a.mem_ffn, experts=a.mem_experts,
                       top_k=a.mem_top_k)
        mem_cap = Sizes(tokens=a.mem_capacity_tokens, hidden=a.mem_capacity_hidden, ffn=a.mem_capacity_ffn,
                        experts=a.mem_experts, top_k=2,
                        capacity_factor=a.mem_capacity_factor)
    cfg = Config(world=a.world, styles=styles, steps=a.steps, lr=a.lr, train=train_sizes, mem=mem,
                 mem_torchtitan=mem_tt, mem_capacity=mem_cap, skip_memory=a.skip_memory, max_hop_rows=a.max_hop_rows,
                 cpu_memory=a.cpu_memory)
    for s in (cfg.train, cfg.mem):
        if s.experts % cfg.world:
            p.error(f"experts {s.experts} must be a multiple of --world {cfg.world}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    print(f"config: {cfg}", flush=True)
    results = run(cfg)
    print_report(cfg, results)
    failures = check(cfg, results)
    for f in failures:
        print(f"FAIL: {f}")
    print("bar (parity, no token all-to-all, no counts exchange/host sync): " + ("FAIL" if failures else "OK"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
