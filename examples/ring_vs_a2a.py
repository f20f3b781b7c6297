"""ring_moe beside the all-to-all MoE block on CPU ranks: same outputs, and per-rank peak memory of each.

    python examples/ring_vs_a2a.py                      # world 4, T=4096, H=256, F=128, E=16, K=8, fp32
    python examples/ring_vs_a2a.py --world 2 --tokens 1024

Spawns ``--world`` gloo processes. Each rank routes its own tokens (random top-k over all experts), then runs
forward + backward of one MoE block, first through ``a2a_moe`` (the reference all-to-all layer), then through
``ring_moe`` in several variants, with the same weights and output gradient. It checks that outputs and all
gradients agree, and measures each variant's peak memory above its inputs (``relay_compile.memory``:
allocator events of the CPU profiler, exact on CPU). Rank 0 prints one row per variant with the per-rank
peaks and the ratio to all-to-all.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relay_compile import ring_moe
from relay_compile.memory import PeakMemory
from relay_compile.reference import a2a_moe, moe_weights

# (label, ring_moe options); None is the all-to-all baseline.
VARIANTS: list[tuple[str, dict | None]] = [
    ("a2a (reference)", None),
    ("ring expert", dict(routing="expert")),
    ("ring expert, sequential", dict(routing="expert", overlap=False)),
    ("ring expert, bounded hops", dict(routing="expert", max_hop_rows=1024)),
    ("ring token", dict(routing="token")),
    ("ring expert, no remat", dict(routing="expert", remat=False)),
]


@dataclass(frozen=True)
class Config:
    world: int
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    dtype: torch.dtype


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(cfg: Config, rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(cfg.dtype)
    logits = torch.randn(cfg.tokens, cfg.experts, generator=gen)
    scores, ids = torch.softmax(logits, -1).topk(cfg.top_k, dim=-1)
    grad_y = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(cfg.dtype)
    return x, ids, scores.to(cfg.dtype), grad_y


def _run(fn, x, ids, scores, weights, grad_y, **kw) -> tuple[list[torch.Tensor], int, float]:
    """Outputs/gradients, peak bytes above entry, and seconds of one forward + backward."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, scores, *weights)]
    dist.barrier()
    start = time.perf_counter()
    with PeakMemory("cpu") as mem:
        y = fn(leaves[0], ids, leaves[1], *leaves[2:], **kw)
        grads = torch.autograd.grad(y, leaves, grad_y)
    seconds = time.perf_counter() - start
    return [y.detach(), *grads], mem.peak_bytes, seconds


def _max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want))


def _worker(rank: int, cfg: Config, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.world)
    e_l = cfg.experts // cfg.world
    w = moe_weights(0, cfg.hidden, cfg.ffn, cfg.experts, experts=range(rank * e_l, (rank + 1) * e_l), dtype=cfg.dtype)
    weights = [w["w1"], w["w2"], w["w3"]]
    x, ids, scores, grad_y = _inputs(cfg, rank)
    rows, reference = [], None
    for label, kw in VARIANTS:
        fn = a2a_moe if kw is None else ring_moe
        _run(fn, x, ids, scores, weights, grad_y, **(kw or {}))  # warm-up: first-call checks, allocator
        out, peak, seconds = _run(fn, x, ids, scores, weights, grad_y, **(kw or {}))
        reference = reference or out
        rows.append((label, peak, seconds, _max_rel_err(out, reference)))
        if rank == 0:
            print(f"  measured {label}", file=sys.stderr, flush=True)
    queue.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = p.parse_args()
    cfg = Config(a.world, a.tokens, a.hidden, a.ffn, a.experts, a.top_k, getattr(torch, a.dtype))
    if cfg.experts % cfg.world:
        p.error(f"--experts {cfg.experts} must be a multiple of --world {cfg.world}")
    print(f"config: {cfg}", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, queue)) for r in range(cfg.world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    _print_table(cfg, results)


def _print_table(cfg: Config, results: dict[int, list]) -> None:
    base = [results[r][0][1] for r in range(cfg.world)]
    print(f"\nper-rank peak memory of forward+backward, MiB (world {cfg.world}, gloo, CPU)")
    print(f"{'variant':28s} {'peak per rank':>32s} {'max':>8s} {'a2a/this':>9s} {'time s':>7s} {'max rel err':>12s}")
    for i, (label, *_) in enumerate(results[0]):
        peaks = [results[r][i][1] for r in range(cfg.world)]
        secs = max(results[r][i][2] for r in range(cfg.world))
        err = max(results[r][i][3] for r in range(cfg.world))
        per_rank = " ".join(f"{b / 2**20:7.1f}" for b in peaks)
        print(f"{label:28s} {per_rank:>32s} {max(peaks) / 2**20:8.1f} {max(base) / max(peaks):8.2f}x "
              f"{secs:7.2f} {err:12.2e}")


if __name__ == "__main__":
    main()
