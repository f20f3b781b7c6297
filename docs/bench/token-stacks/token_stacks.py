"""Token routing with several sources' tokens per hop (``ring_options.token_partitions_per_hop``: stacked
partitions, their sums trailing them home) against one source per hop, the forced token ring on the stand-in,
a2a eager and the forced expert ring beside them; interleaved rounds, then one peak per row. "rules" is what
the ring holds by default (Qwen3 layer, bf16: 2 / 1 sources per forward / backward hop at EP=64 up to 65536
tokens per rank); "1/1" patches both rules to one; "2/2" forces two per backward hop too (past the rules' memory
budget: what the backward would gain); "sums beside" runs the token programs without ``sum_in_place`` (a hop's
partial added to the arriving sums after it, as before this change). Under the stand-in a token ring computes
N x rank 0's pairs (time and memory only).

    python docs/bench/token-stacks/token_stacks.py [--ep 64] [--tokens 4096 8192 16384] [--rounds 5]
    python docs/bench/token-stacks/token_stacks.py --cpu --ep 8 --tokens 64 --rounds 1   # the script's smoke test
"""
import argparse
import contextlib
import functools
from unittest import mock

from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.measure import peak_step, quiet_warnings, time_variants, variants_table
from relay_compile.bench.sweep import standin_rows
from relay_compile.runtime.programs import pipeline


@functools.cache
def _shaped_beside(sched, overlap: bool, remat: bool):
    """``pipeline.shaped_program`` without ``sum_in_place`` for token routing (cached apart from it)."""
    if sched.routing != "token":
        return _SHAPED(sched, overlap, remat)
    with mock.patch.object(pipeline, "sum_in_place_pass", lambda gm: gm):
        return _SHAPED.__wrapped__(sched, overlap, remat)


_SHAPED = pipeline.shaped_program


def sources(forward: int | None = None, backward: int | None = None, beside: bool = False):
    """Patch the token rules to ``forward`` / ``backward`` sources per hop (None: the rule's own); ``beside``:
    token programs without ``sum_in_place`` (each hop's partial added to the arriving sums after the hop, as
    before token routing summed in place)."""
    stack = contextlib.ExitStack()
    if beside:  # its own cache of programs: the shared one keeps every other row's (building them is not timed)
        stack.enter_context(mock.patch.object(pipeline, "shaped_program", _shaped_beside))
    if forward is not None:
        stack.enter_context(mock.patch.object(pipeline, "token_partitions_per_hop", lambda shape: forward))
    if backward is not None:
        stack.enter_context(mock.patch.object(pipeline, "token_backward_partitions_per_hop", lambda shape: backward))
    return stack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="a tiny fp32 layer on the CPU (checks the script only)")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    layer = (QWEN3_30B.with_(device="cpu", dtype="fp32", hidden=16, ffn=8) if args.cpu
             else QWEN3_30B.with_(device="cuda", dtype="bf16"))
    for tokens in args.tokens:
        inp, fns = standin_rows(args.ep, tokens, ["a2a eager", "ring expert", "ring token"], layer)
        patches = {"a2a eager": ("a2a eager", ()), "ring expert": ("ring expert", ()),
                   "ring token, 1/1": ("ring token", (1, 1)), "ring token, rules": ("ring token", ()),
                   "ring token, rules, sums beside": ("ring token", (None, None, True)),
                   "ring token, 2/2": ("ring token", (2, 2))}
        variants = {name: (fns[row], functools.partial(sources, *patch)) for name, (row, patch) in patches.items()}
        with quiet_warnings():
            times = time_variants(variants, inp, device, args.rounds)
            peaks = {}
            for name, (fn, context) in variants.items():
                with context():
                    peaks[name] = peak_step(fn, inp, device)
        print(f"\nEP={args.ep} T={tokens}, medians of {args.rounds} interleaved rounds")
        print("\n".join(variants_table(times, "a2a eager", peaks)), flush=True)

if __name__ == "__main__":
    main()
