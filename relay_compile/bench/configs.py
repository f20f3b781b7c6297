"""What to measure: one MoE layer's configuration (``LayerConfig``), the paper's layers, and ``BenchOptions``.

``QWEN3_30B`` is the Qwen3-30B-A3B layer; ``TABLE3`` holds paper Table 3's single-layer configurations.
``GiB``/``MiB`` and ``gib`` convert sizes.

Legend: T tokens per rank, H hidden, F expert FFN width, E experts, K top-k, N EP size, E_l = E / N.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

GiB = 1 << 30
MiB = 1 << 20

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LayerConfig:
    """One SwiGLU MoE layer on one rank of an EP group of ``ep`` ranks."""

    name: str
    hidden: int
    ffn: int
    experts: int
    top_k: int
    tokens: int
    ep: int
    dtype: str = "bf16"
    device: str = "cuda"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.experts % self.ep:
            raise ValueError(f"LayerConfig {self.name}: experts={self.experts} is not a multiple of ep={self.ep}")
        if self.dtype not in DTYPES:
            raise ValueError(f"LayerConfig {self.name}: dtype={self.dtype!r} is not one of {sorted(DTYPES)}")

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.ep

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def expert_bytes(self) -> int:
        """W: one expert's weights (w1, w2, w3)."""
        return 3 * self.hidden * self.ffn * self.elem_bytes

    def label(self) -> str:
        return (f"{self.name} H={self.hidden} F={self.ffn} E={self.experts} K={self.top_k} T={self.tokens} "
                f"EP={self.ep} {self.dtype} {self.device}")

    def with_(self, **changes: Any) -> LayerConfig:
        return dataclasses.replace(self, **changes)


# Qwen3-30B-A3B's MoE layer (paper Table 3), 65536 tokens per rank.
QWEN3_30B = LayerConfig(name="Qwen3-30B-A3B", hidden=2048, ffn=768, experts=128, top_k=8, tokens=65536, ep=8)

# Paper Table 3, the single-layer scaling configurations (hidden 2048; L differs only in full models).
TABLE3: dict[str, LayerConfig] = {
    c.name: c for c in (
        QWEN3_30B.with_(name="MoE-E64", experts=64),
        QWEN3_30B.with_(name="MoE-E128", experts=128),
        QWEN3_30B.with_(name="MoE-E384", experts=384),
        QWEN3_30B.with_(name="MoE-K4", top_k=4),
        QWEN3_30B.with_(name="MoE-K12", top_k=12),
        QWEN3_30B.with_(name="MoE-K16", top_k=16),
        QWEN3_30B.with_(name="MoE-H512", ffn=512),
        QWEN3_30B.with_(name="MoE-H2048", ffn=2048),
    )
}
# MoE-K8 and MoE-H768 are MoE-E128 (E128, K8, FFN 768): measured once, under that name.


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """How to measure. Link bandwidth is one direction of one link (NVLink on H100/H200: about 450 GB/s)."""

    warmup: int = 2
    repeats: int = 5
    link_gbps: float = 450.0
    # Bound of the "bounded hops" row (rows of one expert call); None drops that row.
    max_hop_rows: int | None = 16384
    # Rows that need torch.compile (a2a with inductor, the relaymoe backend).
    compile: bool = True
    # Measure peak memory (one extra forward+backward per row).
    memory: bool = True
    # Time the rows' steps in turns (one step of every row per round) instead of each row's steps in a block:
    # a host whose speed drifts over seconds then weighs on every row alike (docs/BENCHMARKS.md, "EP=64").
    interleave: bool = False


def gib(value: float) -> int:
    """``value`` GiB in bytes (rounded down)."""
    return int(math.floor(value * GiB))
