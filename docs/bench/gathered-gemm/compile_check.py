"""The gathered grouped GEMM's specializations compiled for Hopper on a machine without a GPU: registers, stack
(spills) and shared memory per tile config (``kernels.offline_compile``), to choose the configs a device run tries.

    python docs/bench/gathered-gemm/compile_check.py
    PYTHONPATH=/tmp/t36 python docs/bench/gathered-gemm/compile_check.py   # the device's Triton 3.6, installed with
        # pip install --no-deps --target /tmp/t36 triton==3.6.0
"""
import triton

from relay_compile.kernels import gathered_grouped_mm as gemm

ROWS = [  # (epilogue, gather, rows stored or projections saved, configs); weights contiguous along K but for g = dy @ w2
    ("store", True, False, [None, (128, 256, 32, 8, 8, 5)]),
    ("store", True, True, [None]),
    ("scatter", False, False, [None]),
    ("swiglu", True, False, [None, (128, 128, 32, 8, 8, 4), (128, 64, 64, 8, 8, 4), (64, 128, 64, 8, 8, 3)]),
    ("swiglu", True, True, [None]),
    ("swiglu_backward", True, True, [None, (128, 128, 32, 8, 8, 4), (128, 64, 64, 8, 8, 4), (64, 128, 64, 8, 8, 3),
                                     (128, 64, 64, 8, 8, 3)]),
]

print(f"triton {triton.__version__}, sm_90, bf16, K and N whole tiles")
print("| epilogue | gather | rows stored / saved | config | registers | stack bytes | shared KiB | async copy ops |")
print("|---|---|---|---|---:|---:|---:|---:|")
for epilogue, gather, store_rows, configs in ROWS:
    for config in configs:
        usage = gemm.compile_offline(epilogue, gather=gather, store_rows=store_rows and epilogue != "swiglu",
                                     save=store_rows and epilogue == "swiglu", config=config,
                                     k_contiguous=not (epilogue == "store" and store_rows))
        name = f"{config or gemm._CONFIGS[epilogue]}{'' if config else ' (default)'}"
        print(f"| {epilogue} | {gather} | {store_rows} | {name} | {usage.registers} | {usage.stack_bytes} | "
              f"{usage.shared_bytes / 1024:.0f} | {usage.async_copies} |", flush=True)
