"""What the backend did and why: one ``GraphReport`` per compiled graph, written as ``report.json``.

For every MoE region the matcher found: rewritten or refused (with the reason), the routing option and the
routing predicted from this rank's shapes with the per-hop volumes behind it (the ring resolves ``"auto"``
again at every call from the shapes all ranks exchange, ``runtime.agreement``), how the experts run at each
hop (grouped, F compiled by the inner compiler, or F eagerly, and why), and the predicted per-rank peak memory
of the block, forward + backward, for the all-to-all original and for the ring.

The memory model counts the big buffers only (element counts times bytes):

- a2a: ``P = T*K`` expanded rows; forward builds and autograd keeps the permuted send, the received rows,
  the permuted and unpermuted expert input/output and the combined rows (~``6*P*H``) plus the expert
  intermediates (~``4*P*F``); backward frees as it goes but gradients of the same sizes coexist with them.
- ring: resident ``x`` and the ``[T, H]`` output/gradient accumulators (``3*T*H``, counted at 4 bytes an
  element: an upper bound, the accumulators take the tokens' dtype), current + prefetched partition and
  two gradient buffers (``4 * E_l * W``), and one hop's (or chunk's) rows ``S``: rows in and out, their
  gradients and the recomputed intermediates (~``S*(4*H + 4*F)``).

On the CPU reference measurement (examples/ring_vs_a2a.py, world 4, T=4096, H=256, F=128, E=16, K=8, fp32)
the model predicts 256 MiB (a2a) and 65 MiB (ring); measured 266 and 67 MiB.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay_compile.routing import choose_routing, per_hop_bytes, summed_bytes
from relay_compile.runtime.ring_options import HopRows, hop_row_bound


@dataclass(frozen=True, kw_only=True)
class BlockShape:
    """Static sizes of one MoE block on one rank."""

    tokens: int
    hidden: int
    ffn: int
    top_k: int
    experts_per_rank: int
    group_size: int
    elem_bytes: int
    expert_bytes: int


def predicted_peak_bytes(shape: BlockShape, max_hop_rows: HopRows = None) -> dict[str, int]:
    """Predicted per-rank peak bytes of forward + backward of the block (see the module docstring)."""
    s = shape
    pairs = s.tokens * s.top_k
    a2a = pairs * (6 * s.hidden + 4 * s.ffn) * s.elem_bytes
    hop_rows = -(-pairs // s.group_size)
    bound = hop_row_bound(max_hop_rows, s.tokens)
    if bound:
        hop_rows = min(hop_rows, bound)
    resident = 3 * s.tokens * s.hidden * 4 + 4 * s.experts_per_rank * s.expert_bytes
    ring = resident + hop_rows * (4 * s.hidden + 4 * s.ffn) * s.elem_bytes
    return {"a2a": a2a, "ring": ring}


@dataclass(kw_only=True)
class RegionReport:
    """One MoE region: what was found, what was decided, and the numbers behind it."""

    index: int
    status: str  # "rewritten", "matched" (explain: would be rewritten) or "refused"
    anchor: str  # the node the region was found at (the token all-to-all)
    reason: str = ""
    group_name: str = ""
    group_size: int = 0
    routing_option: str = ""
    routing_predicted: str = ""
    per_hop_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    predicted_peak_bytes: dict[str, int] = field(default_factory=dict)
    shape: dict[str, int] = field(default_factory=dict)
    ring_op: str = ""
    # How the experts run at each hop: "grouped: <what F was recognized as>", "compiled (<inner compiler>): <what
    # was compiled, and why F is not grouped>" or "eager: <why neither>".
    experts: str = ""

    @staticmethod
    def matched(index: int, anchor: str, group_name: str, shape: BlockShape, routing: str,
                max_hop_rows: HopRows, fp32_accumulation: bool = True) -> RegionReport:
        # (Weights are taken to be of the tokens' dtype, as in ``shape.expert_bytes``.)
        sum_elem_bytes = summed_bytes(shape.elem_bytes, fp32_accumulation)
        volume_args = dict(
            tokens=shape.tokens, hidden=shape.hidden, top_k=shape.top_k,
            experts_per_rank=shape.experts_per_rank, expert_bytes=shape.expert_bytes, elem_bytes=shape.elem_bytes,
            expert_grad_bytes=shape.expert_bytes // shape.elem_bytes * sum_elem_bytes, sum_elem_bytes=sum_elem_bytes,
        )
        return RegionReport(
            index=index, status="matched", anchor=anchor, group_name=group_name, group_size=shape.group_size,
            routing_option=routing,
            routing_predicted=choose_routing(**volume_args) if routing == "auto" else routing,
            per_hop_bytes={mode: per_hop_bytes(mode, **volume_args) for mode in ("expert", "token")},
            predicted_peak_bytes=predicted_peak_bytes(shape, max_hop_rows),
            shape=dataclasses.asdict(shape),
        )


@dataclass(kw_only=True)
class GraphReport:
    """Everything the backend decided for one Dynamo graph."""

    graph: str
    rank: int
    options: dict[str, Any]
    regions: list[RegionReport] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    dumps: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def summary(self) -> str:
        """One line per region, for logs and ``explain``."""
        lines = [f"{self.graph} (rank {self.rank}): {len(self.regions)} MoE region(s)"]
        for r in self.regions:
            if r.status == "refused":
                lines.append(f"  region {r.index} at {r.anchor}: refused: {r.reason}")
                continue
            peak = r.predicted_peak_bytes
            lines.append(
                f"  region {r.index} at {r.anchor}: {r.status}, EP={r.group_size}, routing {r.routing_option}"
                f" -> {r.routing_predicted}, predicted peak a2a {peak['a2a'] / 2**20:.1f} MiB, ring "
                f"{peak['ring'] / 2**20:.1f} MiB ({peak['a2a'] / max(1, peak['ring']):.1f}x)"
            )
            if r.experts:
                lines.append(f"    experts {r.experts}")
        return "\n".join(lines)


class GraphDump:
    """Writes one graph's debugging artifacts under ``<dump_dir>/<graph>_rank<r>/``; a no-op without a dir."""

    def __init__(self, dump_dir: str, graph: str, rank: int) -> None:
        self.dir = Path(dump_dir) / f"{graph}_rank{rank}" if dump_dir else None
        self.files: list[str] = []
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, text: str, header: str = "") -> None:
        if self.dir is None:
            return
        path = self.dir / name
        path.write_text(f"# {header}\n{text}" if header else text)
        self.files.append(str(path))
