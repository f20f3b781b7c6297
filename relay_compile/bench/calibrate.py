"""``python -m relay_compile.bench.calibrate SWEEP.json [...]``: fit the time model's constants to a sweep.

Reads the measured times of a sweep (``python -m relay_compile.bench --preset sweep``: ``sweep.json``, rows
``a2a eager``, ``ring expert``, ``ring token``; or the same format by hand), fits ``runtime.cost_model``'s
``Calibration`` by coordinate descent on the squared log error of every (EP, tokens, row) point, and prints the
fitted constants (paste them into the GPU kind's ``Calibration`` in ``runtime.cost_model``: ``H200``, ``H100``;
``calibration_for`` picks one by the device's name), the op's own all-to-all path's ratio to a2a eager
(``op_a2a_ratio``, from the ``ring_moe default`` rows where a call kept that path) and a table of predicted
against measured.

The layer's shape comes from the file's ``layer`` entry (hidden, ffn, experts, top_k, elem_bytes; swiglu:
three ``(F, H)`` matrices per expert).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from relay_compile.runtime.block_shape import BlockShape, grouped_owners
from relay_compile.runtime.cost_model import CALIBRATIONS, H200, Calibration, a2a_time, choose, ring_time

# The constants fitted (the link stays out: the stand-in has none), and how far one move scales them.
FITTED = ("host_hop_us", "host_hop_expert_us", "host_a2a_us", "host_a2a_peer_us", "gemm_tflops", "gemm_half_rows",
          "ring_row_bytes", "a2a_row_bytes", "gpu_hop_us", "host_chunk_us", "token_hop_pair_ns", "copy_gbps",
          "host_token_hop_us", "host_token_expert_us")


def shape_of(layer: dict[str, int], ep: int, tokens: int) -> BlockShape:
    h, f, e = layer["hidden"], layer["ffn"], layer["experts"]
    elem = layer.get("elem_bytes", 2)
    return BlockShape(tokens=tokens, hidden=h, ffn=f, top_k=layer["top_k"], experts_per_rank=e // ep,
                      group_size=ep, elem_bytes=elem, expert_bytes=3 * h * f * elem, expert_params=3 * h * f)


# Rows run on the stand-in whose transfers take a stream of their own (``standin_group(n, link_stream=True)``):
# the same calls as the row without the suffix.
LINK_STREAM = ", link stream"


def predict(cal: Calibration, layer: dict[str, int], point: dict[str, object]) -> float | None:
    """Predicted ms of one measured point (None: a row the model does not describe). A ``ring_moe default`` point
    is predicted where it carries the ring its call ran (``call``, from the sweep's decisions: ``with_calls``);
    ``ring auto`` (routing auto, forced) as ``choose`` resolves a forced call.

    A ``LINK_STREAM`` row as its plain row, copies included: a call decides alike on both stand-ins (neither has a
    link, ``transport.link_gbps``), and the copies on a stream of their own cost the step what they cost on the
    compute stream (one H100, EP 8 and 64: within 1%, docs/bench/link-stream/raw-1-h100; timing them as a link
    hidden behind the hops' compute predicted 0.74-0.81x of what EP=8 16384 measured, the raw JSONs' ``predicted_ms``)."""
    row = str(point["row"])
    if row.endswith(LINK_STREAM):
        point = {**point, "row": row.removesuffix(LINK_STREAM)}
    shape = shape_of(layer, int(point["ep"]), int(point["tokens"]))  # type: ignore[arg-type]
    row = str(point["row"])
    if row == "a2a eager":
        return a2a_time(shape, cal).total_ms
    if row in ("ring expert", "ring expert saved", "ring token"):
        routing = "token" if row == "ring token" else "expert"
        # A token ring's sources per hop as the sweep recorded them (before it did: one per hop).
        forward, backward = grouped_owners(shape) if routing == "expert" else _sources(point)
        return ring_time(shape, routing, cal, owners_per_hop=forward, backward_owners=backward,
                         saved=row == "ring expert saved").total_ms
    if row == "ring auto":  # as the forced call decides: saving where the model says (``saved_projections``)
        choice = choose(shape, routing="auto", ring="always", cal=cal, saving=1, kept="op")
        call: object = {"execution": choice.execution, "owners_per_hop": list(choice.owners),
                        "sources_per_hop": list(choice.owners), "saves_projections": choice.saves}
    else:
        call = point.get("call") if row == "ring_moe default" else None
    if isinstance(call, dict) and call.get("execution") in ("expert", "token"):
        forward, backward = (call.get("owners_per_hop") or grouped_owners(shape)) if call["execution"] == "expert" \
            else _sources(call)
        return ring_time(shape, call["execution"], cal, owners_per_hop=forward, backward_owners=backward,
                         saved=bool(call.get("saves_projections"))).total_ms
    return None


def _sources(recorded: dict[str, object]) -> tuple[int, int]:
    """The token ring's sources per forward / backward hop a point or call recorded (sweeps from before token
    routing stacked sources record none: they ran one per hop)."""
    forward, backward = recorded.get("sources_per_hop") or (1, 1)  # type: ignore[misc]
    return int(forward), int(backward)


def with_calls(sweep: dict[str, object], rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """``rows`` with each ``ring_moe default`` point given the call its sweep recorded (``call``: execution, owners
    per hop, saved projections), so that ``predict`` models the ring that ran (a larger stack, saved or not)."""
    # A call holds the stack its decision predicted (``cost_model.choose``: the traced all-to-all decides the
    # widening whatever is kept); sweeps before calls recorded their owners give the decision's.
    calls = {(int(d["ep"]), int(d["tokens"])):  # type: ignore[index]
             {"owners_per_hop": d.get("owners_per_hop"), **d["call"]}  # type: ignore[index]
             for d in sweep.get("decisions", ()) if "call" in d}  # type: ignore[union-attr]
    defaults = ("ring_moe default", "ring_moe default" + LINK_STREAM)
    return [{**r, "call": calls[key]} if r["row"] in defaults and (key := (int(r["ep"]), int(r["tokens"])))
            in calls else r for r in rows]


def op_a2a_ratios(cal: Calibration, layer: dict[str, int], points: Sequence[dict[str, object]],
                  calls: dict[tuple[int, int], str] | None = None) -> list[float]:
    """``ring_moe default`` / ``a2a eager`` at the points (of one sweep) where the call kept the op's own all-to-all
    path: what ``Calibration.op_a2a_ratio`` is the geometric mean of. ``calls``: what each (EP, tokens) call ran, as
    the sweep recorded it (``decisions[].call``); a point without one is judged by ``choose(kept="op")`` under
    ``cal`` (whose own ratio then takes part)."""
    a2a = {(int(p["ep"]), int(p["tokens"])): float(p["ms"])  # type: ignore[arg-type]
           for p in points if p["row"] == "a2a eager"}
    ratios = []
    for p in points:
        key = (int(p["ep"]), int(p["tokens"]))  # type: ignore[arg-type]
        if p["row"] != "ring_moe default" or key not in a2a:
            continue
        ran = (calls or {}).get(key) or choose(shape_of(layer, *key), routing="auto", ring="auto", cal=cal,
                                                kept="op").execution
        if ran == "all_to_all":
            ratios.append(float(p["ms"]) / a2a[key])  # type: ignore[arg-type]
    return ratios


def recorded_calls(sweep: dict[str, object]) -> dict[tuple[int, int], str]:
    """What each (EP, tokens) call of ``ring_moe default`` ran, where the sweep recorded it."""
    return {(int(d["ep"]), int(d["tokens"])): d["call"]["execution"]  # type: ignore[index]
            for d in sweep.get("decisions", ()) if "call" in d}  # type: ignore[union-attr]


def _fitted(points: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """The points the fit counts: all but link-stream rows, which are predicted as their plain rows (a sweep
    measures those beside them) and would count them twice."""
    return [p for p in points if not str(p["row"]).endswith(LINK_STREAM)]


def loss(cal: Calibration, layer: dict[str, int], points: Sequence[dict[str, object]]) -> float:
    """Squared log error over the points the model predicts (``_fitted``)."""
    total = 0.0
    for p in _fitted(points):
        got = predict(cal, layer, p)
        if got is not None:
            total += math.log(got / float(p["ms"])) ** 2  # type: ignore[arg-type]
    return total


def fit(cal: Calibration, layer: dict[str, int], points: Sequence[dict[str, object]], rounds: int = 60) -> Calibration:
    """Coordinate descent in log space: each constant scaled up or down while that lowers the loss."""
    best = loss(cal, layer, points)
    step = 1.5
    for _ in range(rounds):
        moved = False
        for name in FITTED:
            for factor in (step, 1 / step):
                trial = dataclasses.replace(cal, **{name: getattr(cal, name) * factor})
                value = loss(trial, layer, points)
                if value < best:
                    cal, best, moved = trial, value, True
        if not moved:
            step = math.sqrt(step)
            if step < 1.01:
                break
    return cal


def table(cal: Calibration, layer: dict[str, int], points: Sequence[dict[str, object]]) -> str:
    lines = ["| EP | tokens | row | measured ms | predicted ms | predicted/measured |", "|---:|---:|---|---:|---:|---:|"]
    for p in points:
        got = predict(cal, layer, p)
        if got is not None:
            lines.append(f"| {p['ep']} | {p['tokens']} | {p['row']} | {float(p['ms']):.1f} | {got:.1f} | "  # type: ignore[arg-type]
                         f"{got / float(p['ms']):.2f} |")  # type: ignore[arg-type]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweeps", nargs="+", type=Path)
    p.add_argument("--min-tokens", type=int, default=4096, help="points with fewer tokens per rank are left out")
    p.add_argument("--check", choices=[c.name for c in CALIBRATIONS], default=None,
                   help="no fit: how that calibration predicts the sweeps")
    p.add_argument("--start", choices=[c.name for c in CALIBRATIONS], default="h200",
                   help="the calibration the fit starts from")
    p.add_argument("--overlap-p", type=float, default=None,
                   help="how host and GPU time combine in the fit (cost_model.Calibration.overlap_p; default: the "
                        "starting calibration's)")
    args = p.parse_args(argv)
    layer: dict[str, int] = {}
    points: list[dict[str, object]] = []
    sweeps = []
    for path in args.sweeps:
        data = json.loads(path.read_text())
        layer = data["layer"]
        rows = with_calls(data, [r for r in data["rows"] if int(r["tokens"]) >= args.min_tokens])
        points += rows
        sweeps.append((rows, recorded_calls(data)))
    if args.check is not None:
        cal = next(c for c in CALIBRATIONS if c.name == args.check)
        print(f"{cal.name} constants, not fitted to these points")
    else:
        start = next(c for c in CALIBRATIONS if c.name == args.start)
        if args.overlap_p is not None:
            start = dataclasses.replace(start, overlap_p=args.overlap_p)
        cal = fit(start, layer, points)
        print(f"fitted (overlap_p={cal.overlap_p}):", ", ".join(f"{n}={getattr(cal, n):.4g}" for n in FITTED))
    ratios = [got / float(q["ms"]) for q in points if (got := predict(cal, layer, q)) is not None]  # type: ignore[arg-type]
    print(f"{sum(abs(math.log(r)) <= math.log(1.25) for r in ratios)} of {len(ratios)} points within 25% "
          f"(predicted/measured {min(ratios):.2f}-{max(ratios):.2f})")
    fitted = sum(predict(cal, layer, q) is not None for q in _fitted(points))
    print(f"rms log error {math.sqrt(loss(cal, layer, points) / max(1, fitted)):.3f} over the points it predicts "
          "(link-stream rows apart)")
    kept = [r for rows, calls in sweeps for r in op_a2a_ratios(cal, layer, rows, calls)]  # per sweep: its a2a rows
    if kept:
        mean = math.exp(sum(map(math.log, kept)) / len(kept))
        print(f"op_a2a_ratio {mean:.2f} (ring_moe default / a2a eager where a call keeps the op's all-to-all path: "
              f"{len(kept)} points, {min(kept):.2f}-{max(kept):.2f}; {cal.name} has {cal.op_a2a_ratio:.2f})")
    print(table(cal, layer, points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
