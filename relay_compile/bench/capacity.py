"""Capacity: the largest tokens per rank whose forward+backward fits a memory budget (``capacity_search``).

One row at a time on the configuration's stand-in group; each probe is one forward+backward at a token count,
measured by ``relay_compile.bench.measure.peak_step`` on top of the resident tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.inputs import make_inputs, make_weights
from relay_compile.bench.measure import free_cached, is_oom, peak_step
from relay_compile.bench.progress import Progress, fmt_bytes
from relay_compile.bench.rows import LayerFn, RowSpec
from relay_compile.bench.standin_group import drop_pending_messages, standin_group


@dataclass(kw_only=True)
class CapacityResult:
    """The capacity of one row on one configuration (JSON-able), with every probe the search made."""

    row: str
    config: str
    budget_bytes: int
    step: int
    max_tokens: int  # 0: not even one step fits
    bytes_at_max: int | None  # resident + peak at max_tokens
    limited_by_search: bool  # max_tokens is the search's upper end, not a measured limit
    probes: list[tuple[int, int | None]] = field(default_factory=list)  # (tokens, resident + peak | None = OOM)


def capacity_search(
    cfg: LayerConfig,
    spec: RowSpec,
    budget_bytes: int,
    *,
    step: int = 4096,
    max_tokens: int = 1 << 21,
    progress: Progress | None = None,
    weights: list[Tensor] | None = None,
) -> CapacityResult:
    """Largest multiple of ``step`` tokens per rank whose forward+backward fits ``budget_bytes``.

    "Fits": resident inputs, output gradient and weights plus the step's peak above them, at most the budget
    (an out-of-memory error also means it does not fit). Doubling brackets the limit, then a binary
    search over multiples of ``step`` narrows it; one forward+backward per probe. The search starts at
    ``cfg.tokens`` and doubles (or halves) from there, up to ``max_tokens``.
    """
    progress = progress or Progress()
    group = standin_group(cfg.ep)
    weights = weights if weights is not None else make_weights(cfg)
    label = cfg.label().replace(f" T={cfg.tokens}", "")
    result = CapacityResult(row=spec.name, config=label, budget_bytes=budget_bytes, step=step,
                            max_tokens=0, bytes_at_max=None, limited_by_search=False)
    fn_cache: dict[str, LayerFn] = {}

    def used(tokens: int) -> int | None:
        inp = None
        try:
            fn = fn_cache.setdefault("fn", spec.build(cfg, group))
            inp = make_inputs(cfg.with_(tokens=tokens), weights)
            total = inp.resident_bytes() + peak_step(fn, inp, cfg.device)
        except Exception as e:
            if not is_oom(e):
                raise
            total = None
            drop_pending_messages()
        finally:
            if inp is not None:
                inp.clear_grads()
            del inp
            free_cached(cfg.device)
        result.probes.append((tokens, total))
        verdict = "OOM" if total is None else fmt_bytes(total)
        fits = total is not None and total <= budget_bytes
        progress.line(f"capacity {cfg.name} EP={cfg.ep} | {spec.name:<34} | T={tokens:>8} | {verdict} "
                      f"({'fits' if fits else 'over'} {fmt_bytes(budget_bytes)})")
        return total if fits else None

    # Step 1: bracket the limit by doubling (or halving) from the configuration's own token count.
    lo, lo_bytes = 0, None  # largest multiple of step known to fit
    hi: int | None = None  # smallest multiple of step known not to fit
    top = max(step, max_tokens // step * step)
    t = min(top, max(step, cfg.tokens // step * step))
    if (b := used(t)) is not None:
        lo, lo_bytes = t, b
        while hi is None and lo < top:
            t = min(top, lo * 2)
            if (b := used(t)) is None:
                hi = t
            else:
                lo, lo_bytes = t, b
    else:
        hi = t
        while lo == 0 and t > step:
            t = max(step, t // 2 // step * step)
            if (b := used(t)) is None:
                hi = t
            else:
                lo, lo_bytes = t, b
    if hi is None:
        result.limited_by_search = True
        hi = lo + step
    # Step 2: binary search over multiples of step inside (lo, hi).
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if (b := used(mid)) is None:
            hi = mid
        else:
            lo, lo_bytes = mid, b
    result.max_tokens, result.bytes_at_max = lo, lo_bytes
    return result
