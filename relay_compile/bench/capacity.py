"""Capacity: the largest tokens per rank whose forward+backward fits a memory budget (``capacity_search``).

One row at a time on the configuration's stand-in group; each probe is one forward+backward at a token count,
measured by ``relay_compile.bench.measure.peak_step`` on top of the resident tensors.
"""

from __future__ import annotations

from collections.abc import Callable
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

    lo, result.limited_by_search = largest_fitting(lambda t: used(t) is not None, start=cfg.tokens, step=step,
                                                   top=max_tokens)
    result.max_tokens = lo
    result.bytes_at_max = next((b for t, b in result.probes if t == lo), None) if lo else None
    return result


def largest_fitting(
    fits: Callable[[int], bool], *, start: int, step: int, top: int, rel_tol: float = 0.0
) -> tuple[int, bool]:
    """Largest multiple of ``step`` in ``[step, top]`` for which ``fits`` holds (0: none), assuming monotonicity.

    Doubling (or halving) from ``start`` brackets the limit, then a binary search over multiples of ``step``
    narrows it until the gap is one ``step`` or at most ``rel_tol`` of the answer (fewer probes when each is
    expensive); ``fits`` is called once per length tried. Returns ``(tokens, limited)``: ``limited`` when
    ``top`` itself fits (the limit lies beyond the search).
    """
    top = max(step, top // step * step)
    # Step 1: bracket the limit by doubling (or halving) from start.
    lo = 0  # largest multiple of step known to fit
    hi: int | None = None  # smallest multiple of step known not to fit
    t = min(top, max(step, start // step * step))
    if fits(t):
        lo = t
        while hi is None and lo < top:
            t = min(top, lo * 2)
            if fits(t):
                lo = t
            else:
                hi = t
    else:
        hi = t
        while lo == 0 and t > step:
            t = max(step, t // 2 // step * step)
            if fits(t):
                lo = t
            else:
                hi = t
    if hi is None:
        return lo, True
    # Step 2: binary search over multiples of step inside (lo, hi).
    while hi - lo > max(step, rel_tol * lo):
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False
