"""The backward's sums in a batch of their own, posted ahead of the weights (``start_transfer``'s
``trailing_from``, waited for alone by ``RingTransfer.wait_trailing``), against one batch as before: the forced
ring on the plain stand-in and on the stand-in's 16-block link at high priority (a model of NCCL on NVLink),
interleaved rounds, a2a eager beside them. "one batch" is the same code with ``ring_start``'s
``start_transfer`` given no ``trailing_from`` (each hop then waits for the whole transfer before its first
weight-gradient GEMM).

    python docs/bench/link-stream/sums_first.py [--ep 8] [--tokens 65536] [--rounds 5]
"""
import argparse
import contextlib
from unittest import mock

from relay_compile.bench.measure import quiet_warnings, time_variants, variants_table
from relay_compile.bench.sweep import NCCL_LIKE_ROW, standin_rows
from relay_compile.runtime.programs import instructions
from relay_compile.runtime.transport import start_transfer

HIGH = f"{NCCL_LIKE_ROW}, high priority"


def one_batch():
    """``ring_start`` as before this change: the whole payload one batch (``ring_start`` looks
    ``start_transfer`` up in its module at each call)."""
    def whole(*args, trailing_from=None, **kwargs):
        return start_transfer(*args, **kwargs)

    return mock.patch.object(instructions, "start_transfer", whole)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    inp, fns = standin_rows(args.ep, args.tokens, ["a2a eager", "ring auto", HIGH])
    variants = {"a2a eager": (fns["a2a eager"], contextlib.nullcontext),
                "ring auto, one batch": (fns["ring auto"], one_batch),
                "ring auto, sums first": (fns["ring auto"], contextlib.nullcontext),
                f"{HIGH}, one batch": (fns[HIGH], one_batch),
                f"{HIGH}, sums first": (fns[HIGH], contextlib.nullcontext)}
    with quiet_warnings():
        times = time_variants(variants, inp, "cuda", args.rounds)
    print(f"EP={args.ep} T={args.tokens}, medians of {args.rounds} interleaved rounds")
    print("\n".join(variants_table(times, "a2a eager")))

if __name__ == "__main__":
    main()
