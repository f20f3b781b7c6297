"""The peak-memory model (``runtime.cost_model.predicted_peak_bytes``) against the peaks recorded on the GPU: every
``ring expert`` / ``ring expert saved`` point of the given sweeps (the rules' owners per hop) and every token ring
row of ``token_stacks.py`` outputs (their sources per hop). Qwen3-30B-A3B layer, bf16, default ``max_hop_rows``.

    python docs/bench/memory-model/check.py \\
        --sweeps docs/bench/h100-recheck/raw-1-h100/sweep-ep*.json docs/bench/backend-saving/raw-1-h200/sweep-ep*.json \\
        --token-stacks docs/bench/token-stacks/raw-1-h100/token-stacks-ep*.txt          # check.txt
"""
import argparse
import json
import re

from relay_compile.runtime.block_shape import BlockShape, grouped_owners, owner_options
from relay_compile.runtime.peak_memory import predicted_peak_bytes

QWEN3 = dict(hidden=2048, ffn=768, top_k=8, elem_bytes=2, expert_bytes=3 * 2048 * 768 * 2)
TOKEN_ROWS = {"ring token, 1/1": (1, 1), "ring token, 2/2": (2, 2), "ring token, rules": None}


def shape(ep: int, tokens: int) -> BlockShape:
    return BlockShape(tokens=tokens, experts_per_rank=128 // ep, group_size=ep, **QWEN3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweeps", nargs="*", default=[])
    ap.add_argument("--token-stacks", nargs="*", default=[])
    args = ap.parse_args()
    print("| EP | tokens | row | per hop | measured MiB | predicted MiB | predicted / measured |")
    print("|---:|---:|---|---|---:|---:|---:|")
    ratios = []

    def report(ep: int, tokens: int, row: str, held: tuple[int, int], measured: float, predicted: float) -> None:
        ratios.append(predicted / measured)
        print(f"| {ep} | {tokens} | {row} | {held[0]}/{held[1]} | {measured:.0f} | {predicted:.0f} | "
              f"{predicted / measured:.2f} |")

    for path in args.sweeps:
        for p in json.load(open(path))["rows"]:
            if p["row"] not in ("ring expert", "ring expert saved"):
                continue
            s = shape(p["ep"], p["tokens"])
            owners = grouped_owners(s)
            got = predicted_peak_bytes(s, "auto", owners=owners, saved=p["row"].endswith("saved"))["ring"]
            report(p["ep"], p["tokens"], p["row"], owners, p["peak_bytes"] / 2**20, got / 2**20)
    for path in args.token_stacks:
        ep = tokens = 0
        for line in open(path):
            if m := re.match(r"EP=(\d+) T=(\d+)", line):
                ep, tokens = int(m.group(1)), int(m.group(2))
            for row, held in TOKEN_ROWS.items():
                if line.startswith(f"| {row} |"):
                    s = shape(ep, tokens)
                    held = held or owner_options(s).token
                    got = predicted_peak_bytes(s, "auto", sources=held, routing="token")["ring"]
                    report(ep, tokens, row, held, float(line.split("|")[-2]), got / 2**20)
    print(f"\n{len(ratios)} points, predicted / measured {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
