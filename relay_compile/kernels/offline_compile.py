"""The package's Triton kernels compiled for a GPU on a machine without one: whether they compile, and what they use.

CI and the development machines have no GPU, and the device machine's time is scarce: a kernel that runs under
Triton's interpreter (``kernels.interpreted``) can still fail to compile for the GPU, or spill its registers there.
Triton compiles to PTX and runs the ``ptxas`` its wheel bundles without a device, so ``compile_for`` builds one
specialization of a kernel for a target (Hopper, ``sm_90``, by default) and reads its resource usage with the bundled
``cuobjdump``: registers per thread, stack bytes per thread (spills), shared memory per block. The pointers and the
integer arguments named ``aligned`` are marked divisible by 16, as Triton's launcher specializes them at run time
(without the mark the loads neither vectorize nor pipeline, and the resource usage says nothing of the real one).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResourceUsage:
    """What one compiled kernel holds per thread and block."""

    registers: int
    stack_bytes: int  # spills (and any local arrays) per thread
    shared_bytes: int  # dynamic shared memory per block (the pipeline's buffers)
    async_copies: int  # asynchronous global-to-shared copy ops in the kernel's IR: 0 means its loads did not pipeline


def compile_for(
    kernel: Any, types: Mapping[str, str], constexprs: Mapping[str, Any], *, num_warps: int, num_stages: int,
    aligned: Collection[str] = (), arch: int = 90,
) -> ResourceUsage:
    """Compile ``kernel`` (a ``triton.jit`` function) for CUDA ``sm_{arch}``: ``types`` the runtime arguments'
    Triton types (``"*bf16"``, ``"i32"``), ``constexprs`` the ``tl.constexpr`` ones' values and the integer arguments
    that Triton's launcher specializes as constants (those equal to 1: a unit stride). Raises what Triton's compiler
    raises where the kernel does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name].startswith("*") or name in aligned}
    compiled = triton.compile(ASTSource(kernel, signature, dict(constexprs), attrs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    usage = _cubin_usage(compiled.asm["cubin"], os.path.dirname(triton.__file__))
    return ResourceUsage(usage["REG"], usage["STACK"], compiled.metadata.shared,
                         compiled.asm["ttgir"].count("async_copy_global_to_local"))


def _cubin_usage(cubin: bytes, triton_dir: str) -> dict[str, int]:
    """``cuobjdump -res-usage``'s numbers of the kernel in ``cubin`` (``REG``, ``STACK``, ``SHARED``, ...)."""
    tool = os.path.join(triton_dir, "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    line = next((line for line in done.stdout.splitlines() if "REG:" in line), None)
    if done.returncode or line is None:
        raise RuntimeError(f"offline_compile: cuobjdump -res-usage gave no resource line (exit {done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {key: int(value) for key, value in re.findall(r"(\w+):(\d+)", line)}


# The Triton releases whose compile entry points, IR op names and bundled tools ``compile_for`` was written against
# (3.6 on the device machine, 3.9 in CI): another one is reported as unavailable, not as a kernel that fails.
TESTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))


def available() -> bool:
    """Whether ``compile_for`` can run here: a tested Triton (``TESTED_TRITON``) with its NVIDIA backend's bundled
    ``ptxas`` and ``cuobjdump``, kernels not interpreted (``TRITON_INTERPRET=1`` makes them Python functions). Not
    whether a GPU is present."""
    from relay_compile.kernels import interpreted

    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return (version in TESTED_TRITON and not interpreted()
            and all(os.access(os.path.join(tools, tool), os.X_OK) for tool in ("ptxas", "cuobjdump")))
