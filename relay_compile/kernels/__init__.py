"""Hand-written device kernels of the hop loop (Triton on CUDA; every kernel has an eager reference)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def triton_kernel(build: Callable[[Any, Any], Callable]) -> Callable[[], Callable | None]:
    """``build(triton, triton.language)`` compiled on first use, cached: the kernel, or None where Triton is not
    installed (the caller then runs its eager reference)."""

    @functools.cache
    def compiled() -> Callable | None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    return compiled
