"""Does Python inside a custom op run slower when the op is called from a compiled graph (forward) or its compiled
backward, than called eagerly? A pure-Python loop timed inside a forward op and inside its backward op, eager and
under torch.compile (aot_eager, inductor), on the device's Python and torch (issue 24: the backend's ring phases
ran ~1.4x the eager ring's host time on an H100, with the same kernels).

    python docs/bench/h100-backward-agreement/frame_overhead.py
"""
import sys
import time

import torch

TIMES: dict[str, list[float]] = {"forward": [], "backward": []}


def work(direction: str) -> None:
    t = time.perf_counter()
    s = 0

    def f(i):
        return i + 1

    for _ in range(20000):
        s = f(s)
    TIMES[direction].append(time.perf_counter() - t)


@torch.library.custom_op("frame_overhead::fwd", mutates_args=())
def fwd(x: torch.Tensor) -> torch.Tensor:
    work("forward")
    return x.clone()


@torch.library.custom_op("frame_overhead::bwd", mutates_args=())
def bwd(g: torch.Tensor) -> torch.Tensor:
    work("backward")
    return g.clone()


fwd.register_fake(lambda x: torch.empty_like(x))
bwd.register_fake(lambda g: torch.empty_like(g))
fwd.register_autograd(lambda ctx, g: bwd(g), setup_context=lambda ctx, inputs, output: None)


def measure(fn, device: str) -> dict[str, float]:
    x = torch.randn(64, device=device, requires_grad=True)
    for _ in range(5):
        fn(x).sum().backward()
    for v in TIMES.values():
        v.clear()
    for _ in range(20):
        fn(x).sum().backward()
    return {k: min(v) * 1e3 for k, v in TIMES.items()}


device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"python {sys.version_info[:2]}, torch {torch.__version__}, {device}")
rows = {"eager": lambda x: fwd(x) * 2}
for backend in ("aot_eager", "inductor"):
    rows[backend] = torch.compile(lambda x: fwd(x) * 2, backend=backend)
for name, fn in rows.items():
    ms = measure(fn, device)
    print(f"  {name:<10} forward op body {ms['forward']:.3f} ms, backward op body {ms['backward']:.3f} ms")
