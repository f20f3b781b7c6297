"""The token-count sweep (``--preset sweep``): every way the block can run, beside the all-to-all, with the cost
model's predictions.

Per EP size and tokens per rank (Qwen3 layer by default), interleaved repeats (one step of every row per round)
of:

- ``a2a eager``: the reference layer (the baseline of every ratio);
- ``relaymoe backend``: ``torch.compile(a2a_moe, backend="relaymoe")`` with default options (what a user gets:
  ring or all-to-all as the cost model decides);
- ``relaymoe backend, dynamic T``: the same with the token count marked dynamic: one graph per EP size, its
  token switch (``runtime.token_switch``) picks the kept or the ring variant per call;
- ``ring_moe default``: the functional API with default options (no compile: each call decides, weighing the
  ring against the op's own all-to-all path, ``cost_model.choose(kept="op")``; a decision's ``call``);
- ``ring auto`` / ``ring expert`` / ``ring token``: the ring forced (``ring="always"``), each routing (``ring
  expert`` recomputing its projections, ``save_projections=False``: the ring the time model was fitted to);
- ``ring expert saved``: the expert ring forced, reading the projections its forward saved
  (``save_projections=True``); ``ring auto`` saves where the model grants it, as a user's call would;
- ``ring_moe default, link stream`` / ``ring auto, link stream``: those two on the stand-in group whose
  transfers run on a stream of their own (``standin_group(n, link_stream=True)``), beside the hops' compute as
  NCCL's are (measured: within 1% of the plain rows on an H100; run where named, ``--rows``); every other row's
  transfers are copies on the compute stream;
- ``ring auto, link stream of 16 CTAs``: ``ring auto`` on a link stream whose copies take 16 thread blocks
  (``link_ctas``), as NCCL's channels take a few SMs: a ``Tensor.copy_`` runs over a grid as large as the message
  and barely ran beside the hops' GEMMs on an H100 (run where named; not predicted); ``..., high priority``: the
  same on a stream of the device's highest priority (``link_high_priority``), as NCCL's with
  ``is_high_priority_stream``.

Besides the results of ``measure_layer`` (results.json, results.md) it writes ``sweep.json``: the measured
points in ``bench.calibrate``'s format, each beside the cost model's prediction, and the decision the model makes
for each configuration (``runtime.cost_model.choose``). ``python -m relay_compile.bench.calibrate sweep.json``
refits the model from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from relay_compile.bench.calibrate import predict, shape_of, with_calls
from relay_compile.bench.configs import QWEN3_30B, BenchOptions, LayerConfig
from relay_compile.bench.inputs import LayerInputs, make_inputs
from relay_compile.bench.measure import LayerResult
from relay_compile.bench.rows import (
    A2A_EAGER,
    LayerFn,
    RowSpec,
    build_eager_a2a,
    compiled_a2a_builder,
    link_stream_builder,
    ring_builder,
)
from relay_compile.bench.standin_group import standin_group
from relay_compile.runtime.block_shape import owner_options
from relay_compile.runtime.cost_model import H200, calibration_for, choose

# The forced ring on a stand-in whose copies leave most SMs to compute, as NCCL's channels do (``link_ctas``):
# what its transfers could overlap on this GPU, where a ``Tensor.copy_`` beside the hops' GEMMs barely does.
NCCL_LIKE_CTAS = 16
NCCL_LIKE_ROW = f"ring auto, link stream of {NCCL_LIKE_CTAS} CTAs"

# Row names as the calibration reads them (``bench.calibrate.predict``).
RING_ROWS = {"ring expert": "expert", "ring expert saved": "expert", "ring token": "token"}


def token_sweep_rows(opts: BenchOptions, only: Sequence[str] | None = None) -> list[RowSpec]:
    """The sweep's rows (module docstring); ``only``: those named, beside a2a eager (``ValueError`` naming the
    valid rows on an unknown name). Without ``only``, every row but the ``RowSpec.named_only`` ones: the stand-in's
    link-stream variants, which are ways of simulating the link, not ways the block runs (the plain link stream
    measured as the plain rows, docs/bench/link-stream/raw-1-h100) and would lengthen every sweep."""
    rows = _all_rows(opts)
    if only is None:
        return [r for r in rows if not r.named_only]
    unknown = sorted(set(only) - {r.name for r in rows})
    if unknown:
        raise ValueError(f"--rows: unknown sweep row(s) {unknown}; the sweep's rows are {[r.name for r in rows]}")
    return [r for r in rows if r.name == A2A_EAGER or r.name in only]


def standin_rows(ep: int, tokens: int, rows: Sequence[str], layer: LayerConfig = QWEN3_30B.with_(
    device="cuda", dtype="bf16")) -> tuple[LayerInputs, dict[str, LayerFn]]:
    """``layer`` (the Qwen3 layer, bf16, CUDA) on the stand-in group of ``ep`` ranks at ``tokens`` per rank, and the
    sweep's ``rows`` (``token_sweep_rows``' names) built for it, in the order given: where a script that times,
    profiles or counts rows one at a time starts (``bench.gpu_idle``, the scripts under docs/bench/)."""
    cfg = layer.with_(ep=ep, tokens=tokens)
    group = standin_group(ep)
    specs = {spec.name: spec for spec in token_sweep_rows(BenchOptions(), only=rows)}
    return make_inputs(cfg), {name: specs[name].build(cfg, group) for name in rows}


def _all_rows(opts: BenchOptions) -> list[RowSpec]:
    return [
        RowSpec(name=A2A_EAGER, build=build_eager_a2a, kind="a2a"),
        RowSpec(name="relaymoe backend", build=compiled_a2a_builder("relaymoe", opts.compile), kind="ring",
                note="torch.compile(a2a_moe, backend='relaymoe'), default options", compiles=True),
        RowSpec(name="relaymoe backend, dynamic T", build=compiled_a2a_builder("relaymoe", opts.compile, dynamic=True),
                kind="ring", note="the same with the token count marked dynamic (runtime.token_switch)", compiles=True),
        RowSpec(name="ring_moe default", build=ring_builder(), kind="ring", note="ring='auto': the cost model decides"),
        RowSpec(name="ring auto", build=ring_builder(ring="always"), kind="ring", note="ring='always', routing auto"),
        RowSpec(name="ring expert", build=ring_builder(routing="expert", ring="always", save_projections=False),
                kind="ring", note="recomputing its projections per backward hop"),
        RowSpec(name="ring expert saved", build=ring_builder(routing="expert", ring="always", save_projections=True),
                kind="ring", note="reading the projections its forward saved"),
        RowSpec(name="ring token", build=ring_builder(routing="token", ring="always"), kind="ring", routing="token",
                note="stand-in numerics: N x own-expert pairs"),
        RowSpec(name="ring_moe default, link stream", build=link_stream_builder(ring_builder()), kind="ring",
                note="transfers on a stream of their own", named_only=True),
        RowSpec(name="ring auto, link stream", build=link_stream_builder(ring_builder(ring="always")), kind="ring",
                note="transfers on a stream of their own", named_only=True),
        RowSpec(name=NCCL_LIKE_ROW, build=link_stream_builder(ring_builder(ring="always"), ctas=NCCL_LIKE_CTAS),
                kind="ring", note=f"transfers on a stream of their own, each by {NCCL_LIKE_CTAS} thread blocks",
                named_only=True),
        RowSpec(name="ring auto, gather in GEMM", build=ring_builder(ring="always", gather_in_gemm=True),
                kind="ring", note="the GEMMs read the rows at their indices (gather_in_gemm)", named_only=True),
        RowSpec(name="ring auto, add in GEMM", build=ring_builder(ring="always", add_in_gemm=True),
                kind="ring", note="the last GEMMs add into the sums (add_in_gemm)", named_only=True),
        RowSpec(name="ring auto, gather and add in GEMM",
                build=ring_builder(ring="always", gather_in_gemm=True, add_in_gemm=True),
                kind="ring", note="both (gather_in_gemm, add_in_gemm)", named_only=True),
        RowSpec(name=f"{NCCL_LIKE_ROW}, high priority",
                build=link_stream_builder(ring_builder(ring="always"), ctas=NCCL_LIKE_CTAS, high_priority=True),
                kind="ring", note="the same, the stream at the device's highest priority", named_only=True),
    ]


def layer_of(cfg: LayerConfig) -> dict[str, int]:
    return {"hidden": cfg.hidden, "ffn": cfg.ffn, "experts": cfg.experts, "top_k": cfg.top_k,
            "elem_bytes": cfg.elem_bytes}


def sweep_points(results: list[LayerResult]) -> dict[str, Any]:
    """``sweep.json``'s content: measured points, predictions and decisions (module docstring)."""
    points: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    layer: dict[str, int] = {}
    cal = H200
    for result in results:
        cfg = LayerConfig(**result.config)
        layer = layer_of(cfg)
        shape = shape_of(layer, cfg.ep, cfg.tokens)
        cal = calibration_for(torch.device(cfg.device))
        choice = choose(shape, routing="auto", ring="auto", cal=cal, saving=1)  # the default options' decision
        call = choose(shape, routing="auto", ring="auto", cal=cal, saving=1, kept="op")  # ring_moe default's call
        # What a token ring holds (``ring_options.token_partitions_per_hop``): recorded, so that sweeps from before
        # token routing stacked sources (one per hop) are still predicted as what they ran.
        sources = list(owner_options(shape).token)
        decisions.append({"ep": cfg.ep, "tokens": cfg.tokens, **choice.as_dict(),
                          "call": {"execution": call.execution, "saves_projections": call.saves,
                                   "owners_per_hop": list(call.owners), "sources_per_hop": sources}})
        for row in result.rows:
            if row.skipped or row.total_ms is None:
                continue
            point: dict[str, Any] = {"ep": cfg.ep, "tokens": cfg.tokens, "row": row.row, "ms": round(row.total_ms, 3),
                                     "spread": row.spread, "peak_bytes": row.peak_bytes,
                                     "time_ratio": row.time_ratio, "peak_ratio": row.peak_ratio}
            if row.row.startswith("ring token"):
                point["sources_per_hop"] = sources
            # A default call is predicted as the ring it runs (``calibrate.with_calls``), the others by their name.
            predicted = predict(cal, layer, with_calls({"decisions": decisions[-1:]}, [point])[0])
            if predicted is not None:
                point["predicted_ms"] = round(predicted, 3)
            points.append(point)
    return {"source": "python -m relay_compile.bench --preset sweep", "calibration": cal.name, "layer": layer,
            "rows": points, "decisions": decisions}


def write_sweep(results: list[LayerResult], out: Path) -> Path:
    path = out / "sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sweep_points(results), indent=1))
    return path


def table(points: list[dict[str, Any]]) -> str:
    """Markdown: per (EP, tokens), a2a eager's ms and the time and peak against it of every row the points hold
    (the sweep's rows in their order, then any others as they come)."""
    by_config: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for p in points:
        by_config.setdefault((p["ep"], p["tokens"]), {})[p["row"]] = p
    present = list(dict.fromkeys(p["row"] for p in points if p["row"] != A2A_EAGER))
    order = [r.name for r in _all_rows(BenchOptions())]
    names = [n for n in order if n in present] + [n for n in present if n not in order]
    lines = ["| EP | tokens/rank | a2a ms | " + " | ".join(f"{n}: time / a2a peak ÷ peak" for n in names) + " |",
             "|---:|---:|---:|" + "---|" * len(names)]
    for (ep, tokens), rows in sorted(by_config.items()):
        base = rows.get(A2A_EAGER)
        if base is None:
            continue
        cells = []
        for name in names:
            r = rows.get(name)
            cells.append("-" if r is None or not r.get("time_ratio") else
                         f"{r['time_ratio']:.2f}x / {base['peak_bytes'] / r['peak_bytes']:.1f}x")
        lines.append(f"| {ep} | {tokens} | {base['ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m relay_compile.bench.sweep SWEEP.json [...]``: the table of one or more sweeps."""
    import sys

    points = [p for path in (argv if argv is not None else sys.argv[1:]) for p in json.loads(Path(path).read_text())["rows"]]
    print(table(points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
