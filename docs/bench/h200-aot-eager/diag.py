"""Where the train_moe model's compiled backward fails on CUDA under aot_eager (issue 28, 2026-12-05).

Runs examples/train_moe.py in this process (--simulate-ep 2, a few steps) with each backend given on the command
line; on a failure, prints the failing line of the compiled graph with the lines before it and the shape, stride
and storage offset of every tensor those lines name.

    python docs/bench/h200-aot-eager/diag.py relaymoe:aot_eager aot_eager relaymoe:eager
"""

from __future__ import annotations

import linecache
import re
import sys
import traceback

import torch

sys.path.insert(0, "examples")
import train_moe  # noqa: E402

COMMON = ("--device cuda --dtype float32 --steps 3 --hidden 256 --ffn 128 --experts 32 --top-k 4 --batch 4 "
          "--seq-len 256 --layers 2 --heads 4 --plot none.png --simulate-ep 2 --routing expert").split()


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} stride {value.stride()} offset {value.storage_offset()} {value.dtype}"
    return repr(value)[:80]


def _graph_frames(tb) -> None:
    for frame, lineno in traceback.walk_tb(tb):
        name = frame.f_code.co_filename
        if not name.startswith("<eval_with_key>"):
            continue
        lines = [linecache.getline(name, n).rstrip() for n in range(max(1, lineno - 12), lineno + 1)]
        print(f"--- {name} line {lineno}")
        print("\n".join(lines))
        names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", "\n".join(lines)))
        for var in sorted(names & set(frame.f_locals)):
            print(f"    {var}: {_describe(frame.f_locals[var])}")


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name())
    for variant in sys.argv[1:]:
        backend, _, inner = variant.partition(":")
        argv = COMMON + ["--backend", backend] + (["--inner-compiler", inner] if inner else [])
        print(f"=== {variant}: {' '.join(argv)}", flush=True)
        torch._dynamo.reset()
        try:
            print("exit status", train_moe.main(argv))
        except Exception as error:  # noqa: BLE001 - the diagnosis is the point
            print(f"FAILED: {type(error).__name__}: {str(error)[:300]}")
            _graph_frames(error.__traceback__)


if __name__ == "__main__":
    main()
