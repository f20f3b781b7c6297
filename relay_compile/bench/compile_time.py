"""Compile time of compiled rows: the first forward+backward's wall time minus a steady step's (``measure_compile_time``).

Per row: ``torch._dynamo.reset()`` (fresh Dynamo state: no graph compiled before counts), Inductor's caches off
(``force_disable_caches``: no FX-graph or kernel cache from an earlier row or run), the row built, one
forward+backward timed on the wall clock (device synchronized before and after: Dynamo's trace, the backend's
passes, the inner compiler's forward and backward graphs, and the step itself), then ``steps`` more; compile
time = first call - median of the rest. Kernels the runtime JIT-compiles once per process (the ring's Triton
kernels) are not the model's compilation: warm them first (run the engine's rows before).

Legend: T tokens per rank, H hidden, E experts, K top-k, N EP size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._inductor import config as inductor_config

from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.inputs import LayerInputs, make_inputs
from relay_compile.bench.measure import after_row, clear_grads, forward_backward, row_failure
from relay_compile.bench.progress import Progress
from relay_compile.bench.rows import LayerFn, RowSpec
from relay_compile.bench.standin_group import standin_group


@dataclass(kw_only=True)
class CompileTime:
    """One row's compile time (JSON-able). Seconds of wall time; None where not measured."""

    row: str
    first_call_s: float | None = None  # the first forward+backward: compiles, then runs
    step_s: float | None = None  # median of the steady forward+backward steps after it
    compile_s: float | None = None  # first_call_s - step_s
    skipped: str = ""


def _wall_step(fn: LayerFn, inp: LayerInputs, device: str) -> float:
    """Seconds of one forward+backward on the wall clock, the device synchronized on both sides."""
    clear_grads(fn, inp)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    forward_backward(fn, inp)
    sync()
    return time.perf_counter() - t0


def measure_compile_time(
    cfg: LayerConfig, specs: Sequence[RowSpec], *, steps: int = 3, progress: Progress | None = None
) -> list[CompileTime]:
    """Compile time of each row in ``specs`` on ``cfg`` (module docstring). A failing row keeps its place."""
    progress = progress or Progress()
    group = standin_group(cfg.ep)
    inp = make_inputs(cfg)
    out = []
    for spec in specs:
        res = CompileTime(row=spec.name)
        out.append(res)
        torch._dynamo.reset()
        fn: LayerFn | None = None
        try:
            with inductor_config.patch(force_disable_caches=True):
                fn = spec.build(cfg, group)
                res.first_call_s = _wall_step(fn, inp, cfg.device)
                res.step_s = statistics.median(_wall_step(fn, inp, cfg.device) for _ in range(max(1, steps)))
            res.compile_s = res.first_call_s - res.step_s
            progress.line(f"{cfg.name} EP={cfg.ep} T={cfg.tokens} | compile time {spec.name:<30} | first call "
                          f"{res.first_call_s:.1f} s - step {res.step_s * 1e3:.1f} ms = {res.compile_s:.1f} s")
        except Exception as e:  # one failing row must not lose the others
            res.skipped = row_failure(spec, e)
        finally:
            after_row(fn, inp, cfg.device)
        if res.skipped:
            progress.line(f"{cfg.name} EP={cfg.ep} T={cfg.tokens} | compile time {spec.name:<30} | skipped: "
                          f"{res.skipped}")
    torch._dynamo.reset()
    return out
