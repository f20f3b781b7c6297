"""Every rank real (``bench.rank_threads``): numerics of both routings, and per-rank peaks under skewed routing.

    python -m relay_compile.bench.real_ranks numerics --ep 2 4 8 --tokens 16384 --routers qwen3 hot_expert:inf
    python -m relay_compile.bench.real_ranks imbalance --ep 8 --tokens 16384 --budget-gib 4
    python -m relay_compile.bench.real_ranks search --ep 8 --tokens 16384 --budget-gib 6 --search hot_rank

``numerics``: per EP size and router, every leaf's error (``bench.numerics``: max abs error over max abs truth)
of a2a eager and the ring (expert and token routing) against the same blocks in fp32 on the same inputs, the
largest over the ranks; each ring error also as a ratio to a2a's. Unlike the stand-in, token routing computes
the real layer here.

``imbalance``: per router, per row (a2a eager, a2a with a capacity factor of 1.25 dropping the pairs beyond it,
ring expert, ring token) every rank's peak (``RankPeak``: its
own memory pool), the group's step time (the slowest rank's fwd+bwd, median of ``--repeats`` after a warm-up;
the ranks share one GPU and one interpreter, so it is the group's time, not one GPU's), and whether the largest
peak fits ``--budget-gib``. The routers' measured shares of all pairs on the hottest expert and rank are printed.

``search``: per row, the largest skew (``--search``'s share in ``--range``) whose largest per-rank peak fits
``--budget-gib``, by bisection, with every probe's peak.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B, LayerConfig
from relay_compile.bench.numerics import BlockInputs, NumericsResult, leaf_values, relative_errors
from relay_compile.bench.rank_threads import RankPeak, run_rank_threads
from relay_compile.bench.routers import Skew, pair_shares, rank_inputs
from relay_compile.reference import a2a_moe

ROWS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "a2a eager": (a2a_moe, {}),
    "ring expert": (ring_moe, {"routing": "expert", "ring": "always"}),
    "ring token": (ring_moe, {"routing": "token", "ring": "always"}),
}
CAPACITY_FACTOR = 1.25


def capacity_kept(topk_ids_TK: Tensor, num_experts: int, factor: float) -> Tensor:
    """Which pairs a capacity factor keeps, bool ``(T, K)``: each expert takes at most
    ``ceil(factor * T * K / E)`` of this rank's pairs, first choices before second ones, then in token order
    (GShard's local capacity); the rest are dropped."""
    t, k = topk_ids_TK.shape
    capacity = math.ceil(factor * t * k / num_experts)
    ids_P = topk_ids_TK.t().reshape(-1)  # slot-major: every first choice before any second choice
    order_P = torch.argsort(ids_P, stable=True)
    counts_E = torch.bincount(ids_P, minlength=num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    position_P = torch.empty_like(order_P)
    position_P[order_P] = torch.arange(ids_P.numel(), device=ids_P.device) - starts_E[ids_P[order_P]]
    return (position_P < capacity).view(k, t).t()


def a2a_capacity(x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor, *weights: Tensor,
                 group: dist.ProcessGroup, capacity_factor: float = CAPACITY_FACTOR) -> Tensor:
    """a2a with pairs beyond an expert's capacity dropped (``capacity_kept``): the kept pairs as tokens of one
    choice each through ``a2a_moe``, summed back per token. It holds the kept pairs' rows once more than a
    dispatcher with the capacity built in would (an upper bound on such a dispatcher's peak)."""
    kept_TK = capacity_kept(topk_ids_TK, weights[0].shape[0] * group.size(), capacity_factor)
    token_P, slot_P = kept_TK.nonzero(as_tuple=True)
    y_PH = a2a_moe(x_TH[token_P], topk_ids_TK[token_P, slot_P, None], topk_scores_TK[token_P, slot_P, None],
                   *weights, group=group)
    return torch.zeros_like(x_TH).index_add(0, token_P, y_PH)


IMBALANCE_ROWS = {**ROWS, f"a2a capacity {CAPACITY_FACTOR:g}": (a2a_capacity, {})}


def _block_inputs(cfg: LayerConfig, rank: int, skew: Skew) -> BlockInputs:
    inp = rank_inputs(cfg, rank, skew)
    return BlockInputs(x_TH=inp.x_TH, topk_ids_TK=inp.topk_ids_TK, topk_scores_TK=inp.topk_scores_TK,
                       weights=inp.weights, grad_y_TH=inp.grad_y_TH)


def rank_errors(cfg: LayerConfig, skew: Skew, timeout: float = 600) -> dict[str, dict[str, float]]:
    """``{row: {leaf: error}}``, the largest over ``cfg.ep`` real ranks, against a2a in fp32 (module docstring)."""

    def step(rank: int, group: dist.ProcessGroup) -> dict[str, dict[str, float]]:
        inputs = _block_inputs(cfg, rank, skew)
        truth = leaf_values(a2a_moe, inputs.to(torch.float32), group=group)
        errors = {row: relative_errors(leaf_values(fn, inputs, group=group, **kw), truth)
                  for row, (fn, kw) in ROWS.items()}
        del truth
        return errors

    per_rank = run_rank_threads(cfg.ep, step, device=cfg.device, timeout=timeout)
    return {row: {leaf: max(r[row][leaf] for r in per_rank) for leaf in per_rank[0][row]} for row in ROWS}


# The routers the bench's ``numerics`` preset runs every rank real: random, all first choices on one expert,
# and Zipf popularity with uneven token counts across ranks.
NUMERICS_ROUTERS = ("qwen3", "hot_expert:inf", "zipf:1.2:uneven")


def real_rank_numerics(cfg: LayerConfig, router: str, timeout: float = 600) -> NumericsResult:
    """``rank_errors`` as a section of the bench's report: ``router`` is a ``Skew`` text (``_skew``)."""
    return NumericsResult(
        label=f"{cfg.label()}, every rank real, router {router}",
        truth="a2a_moe on the same inputs in fp32, every rank real (largest error over the ranks)",
        errors=rank_errors(cfg, _skew(router), timeout),
    )


def row_run(cfg: LayerConfig, skew: Skew, row: str, repeats: int = 0, timeout: float = 600) -> list[dict[str, Any]]:
    """One run of ``IMBALANCE_ROWS[row]`` on ``cfg.ep`` real ranks: per rank its routing (``ids``), its peak bytes
    over one fwd+bwd (``peak``) and, with ``repeats``, the times of that many fwd+bwd after a warm-up."""
    fn, kw = IMBALANCE_ROWS[row]

    def step(rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
        inp = rank_inputs(cfg, rank, skew)

        def fwd_bwd() -> None:
            inp.clear_grads()
            fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, **kw).backward(
                inp.grad_y_TH)

        times = []
        for _ in range(repeats + 1 if repeats else 0):  # a warm-up, then the timed steps
            dist.barrier()
            _synchronize(cfg)
            start = time.perf_counter()
            fwd_bwd()
            _synchronize(cfg)
            times.append(time.perf_counter() - start)
        dist.barrier()
        with RankPeak(cfg.device) as mem:  # a step of its own: the memory history costs host time
            fwd_bwd()
        return {"ids": inp.topk_ids_TK.cpu(), "peak": mem.peak_bytes, "times": times[1:]}

    return run_rank_threads(cfg.ep, step, device=cfg.device, timeout=timeout)


def imbalance_row(cfg: LayerConfig, skew: Skew, repeats: int = 3, timeout: float = 600) -> dict[str, Any]:
    """Per row: every rank's peak bytes and the group's step times (module docstring); and the router's shares.
    Each row is a run of its own (its memory pools are released between rows)."""
    rows, ids = {}, []
    for row in IMBALANCE_ROWS:
        per_rank = row_run(cfg, skew, row, repeats, timeout)
        ids = [r["ids"] for r in per_rank]
        group_times = [max(r["times"][i] for r in per_rank) for i in range(repeats)]
        rows[row] = {"peaks": [r["peak"] for r in per_rank], "ms": 1e3 * statistics.median(group_times)}
    expert_share, rank_share = pair_shares(cfg, ids)
    return {"skew": skew.label(), "expert_share": expert_share, "rank_share": rank_share, "rows": rows}


def largest_skew(cfg: LayerConfig, kind: str, row: str, budget: int, lo: float, hi: float, probes: int = 6,
                 uneven: bool = False, timeout: float = 600) -> dict[str, Any]:
    """The largest ``Skew(kind, share)`` in ``[lo, hi]`` whose largest per-rank peak of ``row`` fits ``budget``
    bytes, by bisection (peaks grow with the share): ``share`` (None if ``lo`` does not fit), the largest peak
    there, the hot rank's measured share of all pairs there, and every probe as ``(share, peak)``."""
    tried: list[tuple[float, int]] = []

    def probe(share: float) -> dict[str, Any] | None:
        """``share``'s result if it fits, else None."""
        per_rank = row_run(cfg, Skew(kind, share, uneven), row, timeout=timeout)
        peak = max(r["peak"] for r in per_rank)
        tried.append((share, peak))
        rank_share = pair_shares(cfg, [r["ids"] for r in per_rank])[1]
        return {"share": share, "peak": peak, "rank_share": rank_share} if peak <= budget else None

    best = probe(hi)
    if best is None:
        best = probe(lo)
        for _ in range(probes if best else 0):
            mid = (lo + hi) / 2
            found = probe(mid)
            lo, hi, best = (mid, hi, found) if found else (lo, mid, best)
    return {"row": row, "kind": kind, **(best or {"share": None, "peak": None, "rank_share": None}),
            "probes": tried}


def _synchronize(cfg: LayerConfig) -> None:
    if cfg.device == "cuda":
        torch.cuda.current_stream().synchronize()


def _skew(text: str) -> Skew:
    """``kind[:share][:uneven]``, e.g. ``hot_rank:0.5``, ``zipf:1.2:uneven``, ``hot_expert:inf``."""
    parts = text.split(":")
    uneven = parts[-1] == "uneven"
    parts = parts[:-1] if uneven else parts
    return Skew(parts[0], float(parts[1]) if len(parts) > 1 else 0.0, uneven)


def _numerics(args: argparse.Namespace) -> None:
    print("| EP | router | leaf | a2a eager | ring expert | ring token |\n|---:|---|---|---:|---:|---:|")
    for ep in args.ep:
        for text in args.routers:
            cfg = QWEN3_30B.with_(ep=ep, tokens=args.tokens, device=args.device, dtype=args.dtype)
            errors = rank_errors(cfg, _skew(text))
            for leaf in errors["a2a eager"]:  # each leaf's max metric, then its rms metric
                base = errors["a2a eager"][leaf]
                cells = [f"{errors[r][leaf]:.2e}" + ("" if r == "a2a eager" or not base else
                                                     f" ({errors[r][leaf] / base:.2f}x)") for r in ROWS]
                print(f"| {ep} | {text} | {leaf} | " + " | ".join(cells) + " |", flush=True)
            print("RAW", json.dumps({"ep": ep, "router": text, "errors": errors}), flush=True)


def _imbalance(args: argparse.Namespace) -> None:
    budget = int(args.budget_gib * 2**30)
    cfg = QWEN3_30B.with_(ep=args.ep[0], tokens=args.tokens, device=args.device, dtype=args.dtype)
    print(f"{cfg.label()}, budget {args.budget_gib:g} GiB per rank")
    print("| router | hottest expert / rank share | row | ms | peak per rank (MiB) | max / min | fits |\n"
          "|---|---|---|---:|---|---:|---|")
    for text in args.routers:
        res = imbalance_row(cfg, _skew(text), args.repeats)
        for row, r in res["rows"].items():
            peaks = r["peaks"]
            print(f"| {res['skew']} | {res['expert_share']:.3f} / {res['rank_share']:.3f} | {row} | {r['ms']:.1f} | "
                  + " ".join(f"{p / 2**20:.0f}" for p in peaks)
                  + f" | {max(peaks) / max(min(peaks), 1):.2f} | {'yes' if max(peaks) <= budget else 'no'} |",
                  flush=True)
        print("RAW", json.dumps(res), flush=True)


# The default range of each searched router's share: from balanced to the most skew it can express.
SEARCH_RANGES: dict[str, Callable[[LayerConfig], tuple[float, float]]] = {
    "hot_rank": lambda cfg: (1 / cfg.ep, 1.0),
    "hot_expert": lambda cfg: (1.0, 1000.0),
    "zipf": lambda cfg: (0.0, 3.0),
}


def _search(args: argparse.Namespace) -> None:
    budget = int(args.budget_gib * 2**30)
    cfg = QWEN3_30B.with_(ep=args.ep[0], tokens=args.tokens, device=args.device, dtype=args.dtype)
    lo, hi = args.range or SEARCH_RANGES[args.search](cfg)
    print(f"{cfg.label()}, budget {args.budget_gib:g} GiB per rank: the largest {args.search} share in "
          f"[{lo:g}, {hi:g}] each row fits ({args.probes} bisection probes)")
    print(f"| row | largest {args.search} share | hot rank's share of pairs | largest peak (MiB) | probes |\n"
          "|---|---:|---:|---:|---|")
    for row in IMBALANCE_ROWS:
        res = largest_skew(cfg, args.search, row, budget, lo, hi, args.probes, args.uneven)
        probes = ", ".join(f"{s:.3g}: {p / 2**20:.0f}" for s, p in res["probes"])
        cells = ("none", "-", "-") if res["share"] is None else (
            f"{res['share']:.3g}", f"{res['rank_share']:.3f}", f"{res['peak'] / 2**20:.0f}")
        print(f"| {row} | " + " | ".join(cells) + f" | {probes} |", flush=True)
        print("RAW", json.dumps(res), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_compile.bench.real_ranks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("numerics", "imbalance", "search"))
    parser.add_argument("--ep", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--routers", nargs="+", default=["qwen3"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--search", choices=("hot_rank", "hot_expert", "zipf"), default="hot_rank",
                        help="search: the router whose share (hot_rank, hot_expert) or exponent (zipf) is searched")
    parser.add_argument("--range", type=float, nargs=2, metavar=("LO", "HI"),
                        help="search: the share's range (default: hot_rank 1/EP (balanced) to 1 (every pair on "
                             "one rank); hot_expert 1 to 1000; zipf 0 to 3)")
    parser.add_argument("--probes", type=int, default=6, help="search: bisection steps after the range's ends")
    parser.add_argument("--uneven", action="store_true", help="search: uneven token counts across ranks too")
    args = parser.parse_args(argv)
    {"numerics": _numerics, "imbalance": _imbalance, "search": _search}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
