"""What the backend did and why: one ``GraphReport`` per compiled graph, written as ``report.json``.

For every MoE region the matcher found: rewritten or refused (with the reason), the routing option and the
routing predicted from this rank's shapes with the per-hop volumes behind it (the ring resolves ``"auto"``
again at every call from the shapes all ranks exchange, ``runtime.agreement``), how the experts run at each
hop (grouped, F compiled by the inner compiler, or F eagerly, and why), and the predicted per-rank peak memory
of the block, forward + backward, for the all-to-all original and for the ring, and the cost model's choice
(ring or all-to-all, with both predicted times). The memory model is ``runtime.peak_memory``'s, the time model ``runtime.cost_model``'s.

The memory model is fitted to GPU peaks (``peak_memory``'s docstring). On the CPU reference measurement
(examples/ring_vs_a2a.py, world 4, T=4096, H=256, F=128, E=16, K=8, fp32) it predicts 256 MiB (a2a) and 43.5 MiB
(ring); measured 266.0 and 67.7 MiB (``python examples/ring_vs_a2a.py``, 2026-12-07): the CPU's eager hop paths
hold about twice a fused row's bytes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay_compile.routing import choose_routing, per_hop_bytes, summed_bytes
from relay_compile.runtime.block_shape import BlockShape, owner_options
from relay_compile.runtime.cost_model import H200, Calibration, choose
from relay_compile.runtime.peak_memory import predicted_peak_bytes
from relay_compile.runtime.ring_options import MaxHopRows

__all__ = ["BlockShape", "GraphDump", "GraphReport", "RegionReport", "predicted_peak_bytes"]


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
    # The cost model's decision for this rank's shapes (``runtime.cost_model.choose``, H200 calibration; the op
    # decides again at every call from every rank's shapes, on CUDA): what it runs as, why, and the predictions.
    ring_option: str = ""
    execution_predicted: str = ""
    decision: str = ""
    predicted_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # Partitions per forward and backward hop of the predicted ring: the expert ring's owners, the token ring's
    # sources (``cost_model.Choice.owners``)
    owners_per_hop: list[int] = field(default_factory=list)
    # The expert ring's forward saves its first projections for the backward (option ``save_projections``)
    saves_projections: bool = False
    # How the experts run at each hop: "grouped: <what F was recognized as>", "compiled (<inner compiler>): <what
    # was compiled, and why F is not grouped>" or "eager: <why neither>".
    experts: str = ""
    idiom: str = ""  # the dispatch / combine forms the matcher recognized (``Region.idiom``)
    # Option fp8 (``runtime.fp8_experts``): "on" (E4M3 weights per hop, FP8 hop GEMMs), "refused: <why>" (the
    # region's hops stay in the weights' dtype), or "" with the option off.
    fp8: str = ""

    @staticmethod
    def matched(index: int, anchor: str, group_name: str, shape: BlockShape, routing: str,
                max_hop_rows: MaxHopRows, fp32_accumulation: bool = True, ring: str = "auto",
                fp8: bool = False, grouped: bool = True, cal: Calibration = H200, saving: int = 0) -> RegionReport:
        # ``cal``: the device's constants with the link a hop crosses (``cost_model.calibration_for``,
        # ``transport.group_link_gbps``); ``saving``: the ring op can save projections (``Claims.saves``).
        # (Weights are taken to be of the tokens' dtype, as in ``shape.expert_bytes``; FP8 hops move one byte
        # per weight, the per-expert scales aside.)
        sum_elem_bytes = summed_bytes(shape.elem_bytes, fp32_accumulation)
        moved_bytes = shape.expert_bytes // shape.elem_bytes if fp8 else shape.expert_bytes
        volume_args = dict(
            tokens=shape.tokens, hidden=shape.hidden, top_k=shape.top_k,
            experts_per_rank=shape.experts_per_rank, expert_bytes=moved_bytes, elem_bytes=shape.elem_bytes,
            expert_grad_bytes=shape.expert_bytes // shape.elem_bytes * sum_elem_bytes, sum_elem_bytes=sum_elem_bytes,
        )
        return RegionReport(
            index=index, status="matched", anchor=anchor, group_name=group_name, group_size=shape.group_size,
            routing_option=routing,
            routing_predicted=choose_routing(**volume_args) if routing == "auto" else routing,
            per_hop_bytes={mode: per_hop_bytes(mode, **volume_args) for mode in ("expert", "token")},
            shape=dataclasses.asdict(shape),
            ring_option=ring, **_decision(shape, routing, ring, max_hop_rows, grouped, cal, fp8, saving),
        )


def _decision(shape: BlockShape, routing: str, ring: str, max_hop_rows: MaxHopRows, grouped: bool,
              cal: Calibration, fp8: bool, saving: int = 0) -> dict[str, Any]:
    """The report's view of ``cost_model.choose``, with the owners per hop the op will hold (``grouped``: F lowers
    onto grouped experts, ``block_shape.owner_options``; else one), by the device's constants with the link its
    hops cross (``cal``: ``cost_model.calibration_for``, ``transport.link_gbps``)."""
    if shape.tokens <= 0 or shape.expert_bytes <= 0:
        return {"decision": "no prediction: the token count is not known at compile time (decided per call)",
                "predicted_peak_bytes": predicted_peak_bytes(shape, max_hop_rows)}
    choice = choose(shape, routing=routing, ring=ring, cal=cal,
                    owners=owner_options(shape, fp8=fp8) if grouped else (1, 1), max_hop_rows=max_hop_rows,
                    saving=saving)
    return {"execution_predicted": choice.execution, "decision": f"{choice.reason} ({cal.describe()}: on CUDA)",
            "predicted_ms": {k: t.as_dict() for k, t in choice.times.items()}, "owners_per_hop": list(choice.owners),
            "predicted_peak_bytes": choice.peaks, "saves_projections": choice.saves}


@dataclass(kw_only=True)
class GraphReport:
    """Everything the backend decided for one Dynamo graph."""

    graph: str
    rank: int
    options: dict[str, Any]
    regions: list[RegionReport] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    dumps: list[str] = field(default_factory=list)
    # Tensors whose elements the graph reads on the host, now through one copy each (passes.host_reads).
    host_reads: list[str] = field(default_factory=list)
    # All-to-alls whose split lists the graph read element by element, now read by relaymoe::split_all_to_all
    # (passes.split_reads); and those left as traced, with the reason.
    split_reads: list[str] = field(default_factory=list)
    # A dynamic token count (``passes.dynamic_keep``): the symbolic T, the smallest equal T from which a region
    # runs as a ring, the regions the switch covers and how often each variant ran (updated per call);
    # ``{"none": why}`` where regions have a dynamic T but no switch.
    token_switch: dict[str, Any] = field(default_factory=dict)

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
            if r.fp8:
                lines.append(f"    fp8 hops {r.fp8}")
            if r.decision:
                lines.append(f"    runs as {r.execution_predicted or '(per call)'}: {r.decision}")
        lines += [f"  {reads}" for reads in (*self.host_reads, *self.split_reads)]
        if "tokens" in self.token_switch:
            sw = self.token_switch
            lines.append(f"  token switch on T={sw['tokens']}: regions {sw['regions']} kept per call where the cost "
                         f"model keeps them (the first ring at {sw['ring_from']} tokens per rank, equal counts)")
        elif self.token_switch:
            lines.append(f"  no token switch: {self.token_switch['none']}")
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
