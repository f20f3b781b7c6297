"""Hand-written device kernels of the hop loop, and the stand-in's link copies (Triton on CUDA; every kernel has
an eager reference)."""

from __future__ import annotations

import functools
import os
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


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``): then the kernels run on CPU
    tensors too, which is how their logic is tested without a GPU (``tests/triton_interpreter.py``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
