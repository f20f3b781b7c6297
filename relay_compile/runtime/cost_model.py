"""What a block costs, predicted from its shapes: per-rank peak memory and time of the ring and of the all-to-all.

Both models read only sizes every rank of a ring shares (``BlockShape``), so every rank that predicts from the
agreed table (``runtime.agreement``) makes the same decision (``choose``).

Memory: ``peak_memory`` (the per-rank peak of either path, which ``choose`` weighs where memory decides).

Time of one forward + backward on one rank (``Calibration`` holds the machine's constants):

    total = (host^p + gpu^p)^(1/p) + exposed link

  (``Calibration.overlap_p``; None: ``max(host, gpu)``). The host and the GPU overlap, but not perfectly: every
  call's agreement syncs them (the host waits for the device's counts), so where the two are close the step takes
  longer than either. ``p = 4`` fits the H100 sweep better than ``max`` (rms log error 0.073 against 0.090, and
  0.091 against 0.101 on a second sweep it was not fitted to; docs/BENCHMARKS.md, "Saved projections").

- host: what the CPU spends issuing the work, which the GPU overlaps as long as it has work queued. The ring
  pays a fixed cost per hop pass (its transfers, planning, ~40 launches) and a cost per expert a hop computes;
  the all-to-all a fixed cost per call and per peer (split lists, host syncs).
- gpu: grouped GEMMs, ``2 * params`` flops per expert row per pass (forward 1, backward 2, and the ring's
  per-hop recompute 1, less the first projection's share where the forward saved it: ``save_projections``),
  at an efficiency that grows with the rows one expert's GEMM sees
  (``rows / (rows + gemm_half_rows)``): a ring hop gives an expert ``T*K/E`` rows, the all-to-all ``N*T*K/E``;
  plus the memory-bound row traffic (gathers, scatters, permutes: bytes per expanded row, per path), plus what
  a hop does at a fixed cost on the GPU.
- link: the transfer at ``link_gbps``. The ring overlaps a hop's transfer with the hop's compute (only what
  exceeds the compute is exposed); the all-to-all waits for its four exchanges. Under the one-GPU stand-in
  group (``bench.standin_group``) transfers are device copies: ``link_gbps=None`` counts them as row traffic.

``choose`` (the ``ring`` option): the ring's routing with the least predicted time; under ``"auto"`` the block
keeps its all-to-all where that ring is predicted slower than the all-to-all (a model is never made slower),
after trying the expert ring with larger owner stacks than the rules' where memory allows them (``OwnerOptions``:
the rules stop a stack at a row count, and where they step down, EP=64 20480 tokens per rank, the ring they
give would lose where a larger one wins);
under ``"memory"`` only where, besides, the all-to-all's predicted peak is no higher than the ring's (the ring
then buys nothing). Where the op can save projections (``save_projections``), an expert ring that runs saves
them where it is predicted slower than the all-to-all without them, or faster by less than the model's error
(``SAVE_MARGIN``), and its peak with them stays no higher than the all-to-all's: memory is traded for time only
where the ring would otherwise lose, or might. They never decide that the ring runs: near the point where the
ring's host and GPU times meet the model underestimates the ring (each call's agreement syncs the host with the
device), and saving then predicted a ring faster than the all-to-all that measured 1.11x of it on the H100 (EP=8,
16384 tokens per rank: docs/bench/h100-saved-projections). So under ``ring="auto"`` they apply to a ring that
runs anyway and is predicted within ``SAVE_MARGIN`` of the all-to-all; under ``"memory"`` and ``"always"`` (and a
forced ``ring_moe``) wherever the rule grants them.

Which all-to-all is kept (``Kept``): a region the backend keeps at compile time runs the all-to-all traced from
the model, compiled: about a2a eager's time at EP=8 and 64 (0.97-1.05x measured) since its all-to-alls read their
split sizes as tensors (``passes.split_reads``; 1.15-1.30x at EP=64 before, with 2N unbacked SymInts per call;
``Calibration.kept_a2a_ratio``); a call of the ring op that does not run the ring runs the op's own path
(``runtime.all_to_all``), which recomputes its experts in backward and dispatches the rows twice: 1.30-1.85x the
traced all-to-all on every sweep point measured (``Calibration.op_a2a_ratio``). A call (``agreement``) therefore
weighs the ring against that path, not against an all-to-all it cannot run: at EP=8 and 16384 tokens per rank the
ring measured 1.02-1.11x a2a eager where the op's path measured 1.45-1.50x.

Legend: T tokens per rank, H hidden, F expert width, K top-k, E experts, E_l = E / N, N ranks, P = T*K.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

import torch

from relay_compile.routing import Routing, per_hop_bytes
from relay_compile.runtime.block_shape import (
    BlockShape,
    OwnerOptions,
    hop_shape,
    owner_options,
    projection_width,
    saved_projection_bytes,
    token_partitions,
)
from relay_compile.runtime.peak_memory import predicted_peak_bytes
from relay_compile.runtime.ring_options import MaxHopRows, hop_row_bound

Execution = Literal["expert", "token", "all_to_all"]
# Which all-to-all a block keeps: the one traced from the model (a region the backend keeps as it is), or the
# ring op's own path (``runtime.all_to_all``: a call of ``relaymoe::ring_moe`` that does not run the ring).
Kept = Literal["traced", "op"]


# Device types whose time ``H200`` predicts: the backend decides at compile time (or per call, a dynamic token
# count) only there. (CPU tests add "cpu" to exercise those decisions.)
CALIBRATED_DEVICES = {"cuda"}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A machine's constants for the time model (``H200``: how they were measured is in its comment)."""

    name: str
    host_hop_us: float  # expert routing: host time of one hop pass (forward or backward), whatever it computes
    host_hop_expert_us: float  # expert routing: host time per expert a hop pass computes
    host_token_hop_us: float  # token routing: the same two (its hop also plans the visiting partition's pairs)
    host_token_expert_us: float
    host_chunk_us: float  # ring: host time per chunk of a hop (bounded hops: ``max_hop_rows``)
    host_a2a_us: float  # all-to-all: host time of one forward + backward
    host_a2a_peer_us: float  # all-to-all: host time per peer (split lists, per-source bookkeeping)
    gemm_tflops: float  # grouped-GEMM throughput at large rows per expert
    gemm_half_rows: float  # rows per expert at which a GEMM runs at half that throughput
    hbm_gbps: float  # device memory bandwidth the row traffic sees
    ring_row_bytes: float  # ring: bytes moved per expanded row and hidden element (gathers, scatter-adds)
    a2a_row_bytes: float  # all-to-all: the same (permutes, the exchanges' buffers, combine)
    gpu_hop_us: float  # ring: GPU time of a hop pass besides its GEMMs and rows (small kernels)
    token_hop_pair_ns: float  # token routing: GPU time per visiting pair of a hop (its sort, masks, gathers)
    copy_gbps: float  # the stand-in's transfers: device copies at this bandwidth
    link_gbps: float | None = None  # one direction of one link; None: transfers are device copies (stand-in)
    overlap_p: float | None = None  # how host and GPU time combine (module docstring); None: their max
    # The op's own all-to-all path (``runtime.all_to_all``: experts recomputed in backward, the rows dispatched
    # twice, ten exchanges) against the traced all-to-all: its measured time ratio (``Kept``).
    op_a2a_ratio: float = 1.0
    # A region kept at compile time runs the traced all-to-all compiled: against a2a eager ``kept_a2a_base +
    # N * kept_a2a_per_rank``, fitted with its split sizes read as tensors (``passes.split_reads``, the default;
    # with option ``split_reads`` off, or a region the pass leaves as traced, its 2N unbacked SymInts make it
    # 1.15-1.30x at EP=64, which this does not know: docs/BENCHMARKS.md, "Kept regions").
    kept_a2a_base: float = 1.0
    kept_a2a_per_rank: float = 0.0

    def kept_a2a_ratio(self, ranks: int) -> float:
        """The compiled (kept) all-to-all's time over a2a eager's in a group of ``ranks``; outside the groups it
        was measured at (``KEPT_A2A_RANKS``) those groups' (a line is no measurement beyond them)."""
        lo, hi = KEPT_A2A_RANKS
        return self.kept_a2a_base + min(max(ranks, lo), hi) * self.kept_a2a_per_rank

    def combined(self, host_ms: float, gpu_ms: float) -> float:
        """A step's time from its host and GPU times (module docstring: ``overlap_p``)."""
        p = self.overlap_p
        if p is None:
            return max(host_ms, gpu_ms)
        return (host_ms**p + gpu_ms**p) ** (1 / p)

    def with_link(self, gbps: float | None) -> Calibration:
        return self if gbps == self.link_gbps else _linked(self, gbps)

    def describe(self) -> str:
        """The model in words, for reports: its name, and the link where transfers cross one."""
        return f"{self.name} model" + ("" if self.link_gbps is None else f", {self.link_gbps:g} GB/s link")


@functools.lru_cache(maxsize=64)
def _linked(cal: Calibration, gbps: float | None) -> Calibration:
    """``cal`` over another link, made once per pair (every op call asks: ``dataclasses.replace`` costs ~15 us)."""
    return dataclasses.replace(cal, link_gbps=gbps)


# The kept (compiled) all-to-all against a2a eager, a line in N through the geometric means of the backend rows
# recorded where the region was kept, since its all-to-alls take their split sizes as tensors (passes.split_reads;
# inductor inside, Qwen3 layer, stand-in EP): EP=64 1.015 (H100, 2026-12-07: 0.98-0.99x, 0.99-1.05x at 4096 and
# 8192 over three runs), EP=8 0.984 (H100 0.97-1.02x at 4096-16384; H200 0.965x at 4096, 1.002x and 0.98x at 16384
# before the pass, which reads 16 sizes there): docs/BENCHMARKS.md, "Kept regions read their split sizes as
# tensors". Before the pass the EP=64 end was 1.214 (1.15-1.30x: 128 unbacked reads per call). Both kinds alike
# (no H200 kept row since the pass).
KEPT_A2A_RANKS = (8, 64)
KEPT_A2A_PER_RANK = (1.015 - 0.984) / (64 - 8)
KEPT_A2A_BASE = 0.984 - 8 * KEPT_A2A_PER_RANK
# Fitted to H200 measurements (torch 2.11, bf16, Qwen3-30B-A3B layer, stand-in EP 8 and 64, 4096-131072 tokens per
# rank, 2026-12-06, today's ring: grouped owners per hop, saved projections, the backward's agreement beside the
# compute stream): docs/bench/backend-saving/raw-1-h200/, host and GPU time combined by ``overlap_p=4``; refitted
# 2026-12-07 to the stand-in's transfers as the programs send them (``ring_traffic``) and with the ``ring_moe
# default`` points (the ring each call ran): rms log error 0.060, 56 of 56 points within 25%, 0.86-1.16x (0.070
# over 48 before; the constants of 2026-12-02, fitted to the ring before grouped owners, predicted it up to 1.86x
# slow, 33 of 48 within 25%). Redo on the device with ``bash
# docs/bench/backend-saving/run.sh OUT``, then ``python -m relay_compile.bench.calibrate OUT/sweep-ep8.json
# OUT/sweep-ep64.json --start h200 --overlap-p 4``. ``op_a2a_ratio``: 16 points of earlier sweeps (1.46); that
# sweep's 4 kept points read 1.54-1.68 (the lower value keeps a call's decision conservative).
H200 = Calibration(
    name="h200", host_hop_us=120.1, host_hop_expert_us=25.87, host_chunk_us=203.6, host_token_hop_us=349.6,
    host_token_expert_us=26.37, host_a2a_us=5200.0, host_a2a_peer_us=53.98, gemm_tflops=440.0, gemm_half_rows=0.0,
    hbm_gbps=3000.0, ring_row_bytes=0.0, a2a_row_bytes=43.84, gpu_hop_us=0.0, token_hop_pair_ns=0.03481,
    copy_gbps=837.6, overlap_p=4.0, op_a2a_ratio=1.46, kept_a2a_base=KEPT_A2A_BASE, kept_a2a_per_rank=KEPT_A2A_PER_RANK,
)
# Fitted to H100 measurements (torch 2.11, bf16, Qwen3-30B-A3B layer, stand-in EP 8 and 64, 4096-131072 tokens per
# rank, 2026-12-06, after the backward's agreement moved beside the compute stream):
# docs/bench/h100-backward-agreement/raw-2-h100/, host and GPU time combined by ``overlap_p=4``, refitted as the
# H200's on 2026-12-07 (rms log error 0.067, 48 of 48 points within 25%, 0.86-1.13x, saved-projection rows
# included; 0.078 before; on docs/bench/larger-stacks/raw-1-h100, not fitted to, 0.070 over 44 points). Redo
# (the fit starts from the committed constants, so a refit of the same sweeps lands near them, not on them): ``python -m
# relay_compile.bench.calibrate A B --start h100 --overlap-p 4``; ``--check h100`` reports how they predict another
# sweep. (The previous fit, to docs/bench/h200-sweep-2/raw-1-h100/, predicted this sweep's rings up to 1.38x slow.)
H100 = dataclasses.replace(
    H200, name="h100", host_hop_us=232.0, host_hop_expert_us=21.39, host_chunk_us=211.5, host_token_hop_us=573.0,
    host_token_expert_us=16.72, host_a2a_us=5334.0, host_a2a_peer_us=90.73, gemm_tflops=397.6, gemm_half_rows=0.0,
    ring_row_bytes=0.0, a2a_row_bytes=49.76, gpu_hop_us=0.0, token_hop_pair_ns=0.05778, copy_gbps=633.6,
    overlap_p=4.0, op_a2a_ratio=1.50,
)
# ``op_a2a_ratio``: the geometric mean of ``ring_moe default`` / a2a eager over the sweeps' points where the op kept
# its all-to-all (docs/BENCHMARKS.md, "The op's own all-to-all path"): H200 1.46 (16 points, 1.30-1.85x), H100
# 1.50 (21 points, 1.35-1.80x). ``python -m relay_compile.bench.calibrate`` prints it for the sweeps it reads.
# Every calibration, by the code the agreement header carries (``calibration_code``).
CALIBRATIONS = (H200, H100)


def calibration_for(device: torch.device) -> Calibration:
    """The constants for ``device``: a GPU of a measured kind (its name holds ``H100``) gets its own; any other
    device the model decides on gets ``H200`` (the first measured, and the closest for other Hopper parts)."""
    if device.type == "cuda" and "H100" in _device_name(device.index):
        return H100
    return H200


@functools.lru_cache(maxsize=None)
def _device_name(index: int | None) -> str:
    # No GPU here (a sweep's record read on a laptop, a graph traced with fake CUDA tensors): no name.
    return torch.cuda.get_device_name(index) if torch.cuda.is_available() else ""


def calibration_code(cal: Calibration) -> int:
    """``cal``'s code in ``CALIBRATIONS`` (1-based: 0 in a header is no calibrated device)."""
    return 1 + CALIBRATIONS.index(cal)


# NVLink-class link (H100/H200: ~450 GB/s a direction), the default for planning with a real link.
NVLINK_GBPS = 450.0
# An inter-node network's bandwidth per GPU (one 400 Gb/s NIC: 50 GB/s a direction), for a ring spanning nodes.
INTER_NODE_GBPS = 50.0


@dataclass(frozen=True, kw_only=True)
class TimeEstimate:
    """Predicted milliseconds of one forward + backward: the parts and the total."""

    host_ms: float
    gpu_ms: float
    link_ms: float
    total_ms: float
    hops: int = 0  # hop passes (ring), forward and backward

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


def _gemm_ms(rows: float, params: int, passes: float, rows_per_expert: float, cal: Calibration) -> float:
    efficiency = rows_per_expert / (rows_per_expert + cal.gemm_half_rows) if rows_per_expert > 0 else 0.0
    flops = 2.0 * rows * params * passes
    return flops / (cal.gemm_tflops * 1e12 * max(efficiency, 1e-6)) * 1e3


def _bytes_ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e3


def _chunks(rows: int, bound: int | None) -> int:
    return max(1, -(-rows // bound)) if bound else 1


def _hops(n: int, g: int) -> int:
    """Hop passes of a ring of ``n`` holding ``g`` owners per hop (``programs.build``: ``n / g`` stacks)."""
    return n // g


@dataclass(frozen=True)
class RingTraffic:
    """Bytes one rank sends in one forward + backward of a ring: ``total``; ``exposed``, what no compute hides (the
    first owner stacks' gather, the gradient sums' last trip home); and the transfers hidden behind hop passes:
    ``forward_transfers`` of ``forward_hop`` bytes and ``backward_transfers`` of ``backward_hop``. They add up:
    ``exposed + forward_transfers * forward_hop + backward_transfers * backward_hop == total``."""

    total: float
    exposed: float
    forward_hop: float
    backward_hop: float
    forward_transfers: int
    backward_transfers: int


def ring_traffic(routing: Routing, n: int, g: int, g_b: int, volumes: dict[str, int]) -> RingTraffic:
    """What the ring's programs send (``programs.build``), from one partition's per-hop ``volumes``
    (``routing.per_hop_bytes``) and the owners per forward / backward hop ``g`` / ``g_b``.

    Expert routing: every partition but this rank's own visits once each way, whatever the stacks (a stack of
    ``g`` gathers ``g - 1`` partitions before its first compute, then moves ``g`` after each of the ``n / g - 1``
    passes but the last), and the gradient sums of all ``n`` partitions travel (one hop behind their weights, the
    last ``g_b`` home after the last compute): ``(n - 1) W`` forward, ``(n - 1) W + n G`` backward.
    Token routing: ``n`` hop volumes each way, each behind a hop (an upper bound: the tokens make ``n - 1`` trips,
    the sums ``n``). With ``g`` sources per hop, the first stack's ``g - 1`` gathered partitions and the sums'
    last trip home are exposed, and ``n / g - 1`` transfers of ``g`` partitions hide behind the passes.
    """
    if routing == "token":
        def direction(g: int, volume: float) -> tuple[float, int]:  # (exposed bytes, hidden transfers)
            return (0.0, n) if g == 1 else (g * volume, n // g - 1)

        (exposed_f, transfers_f), (exposed_b, transfers_b) = direction(g, volumes["forward"]), direction(
            g_b, volumes["backward"])
        return RingTraffic(total=n * (volumes["forward"] + volumes["backward"]), exposed=exposed_f + exposed_b,
                           forward_hop=g * volumes["forward"], backward_hop=g_b * volumes["backward"],
                           forward_transfers=transfers_f, backward_transfers=transfers_b)
    w = volumes["forward"]
    grad = volumes["backward"] - w
    return RingTraffic(total=(n - 1) * w + (n - 1) * w + n * grad, exposed=((g - 1) + (g_b - 1)) * w + g_b * grad,
                       forward_hop=g * w, backward_hop=g_b * (w + grad), forward_transfers=n // g - 1,
                       backward_transfers=n // g_b - 1)


def ring_time(shape: BlockShape, routing: Routing, cal: Calibration, *, owners_per_hop: int = 1,
              backward_owners: int = 1, max_hop_rows: MaxHopRows = "auto", saved: bool = False) -> TimeEstimate:
    """Predicted time of the ring in ``routing`` (``owners_per_hop`` / ``backward_owners``: the grouped forward
    / backward; a stack's hop computes ``g`` hops' rows, on ``g`` owners' experts in expert routing, on this
    rank's in token routing; ``saved``: the backward reads the forward's first projections instead of
    recomputing them)."""
    s, n = shape, shape.group_size
    pairs = s.tokens * s.top_k
    g, g_b = owners_per_hop, backward_owners
    hops_f, hops_b = _hops(n, g), _hops(n, g_b)
    hop_rows = -(-pairs // n)
    chunk_calls = (hops_f * _chunks(hop_rows * g, hop_row_bound(max_hop_rows, s.tokens, forward=True))
                   + hops_b * _chunks(hop_rows * g_b, hop_row_bound(max_hop_rows, s.tokens)))
    per_hop, per_expert = ((cal.host_hop_us, cal.host_hop_expert_us) if routing == "expert"
                           else (cal.host_token_hop_us, cal.host_token_expert_us))
    # The experts a hop computes: a stack's owners' (expert routing) or this rank's (token routing).
    experts_f, experts_b = ((g, g_b) if routing == "expert" else (1, 1))
    host = (hops_f * (per_hop + experts_f * s.experts_per_rank * per_expert)
            + hops_b * (per_hop + experts_b * s.experts_per_rank * per_expert) + chunk_calls * cal.host_chunk_us)
    rows_per_expert = pairs / (n * s.experts_per_rank)
    width = projection_width(s)
    # forward, recompute, two backward GEMMs; saved projections: the first projection's share of the recompute
    # goes, and the forward writes them once more than it would (the backward reads them instead of a GEMM's)
    passes = 4.0 - (width / (width + s.ffn) if saved and width else 0.0)
    gemm = _gemm_ms(pairs, s.params, passes, rows_per_expert, cal)
    rows = _bytes_ms(pairs * s.hidden * s.elem_bytes * cal.ring_row_bytes, cal.hbm_gbps)
    if saved:
        rows += _bytes_ms(saved_projection_bytes(s), cal.hbm_gbps)
    volumes = per_hop_bytes(routing, tokens=s.tokens, hidden=s.hidden, top_k=s.top_k,
                            experts_per_rank=s.experts_per_rank, expert_bytes=s.expert_bytes, elem_bytes=s.elem_bytes,
                            expert_grad_bytes=s.expert_bytes // s.elem_bytes * 4, sum_elem_bytes=4)
    moved = ring_traffic(routing, n, g, g_b, volumes)
    gpu = gemm + rows + (hops_f + hops_b) * cal.gpu_hop_us / 1e3
    if routing == "token":  # every hop sorts and masks the visiting partition's (a stack's: g partitions') pairs
        gpu += (hops_f * g + hops_b * g_b) * pairs * cal.token_hop_pair_ns / 1e6
    if cal.link_gbps is None:  # stand-in: the transfers are copies on the device
        gpu += _bytes_ms(moved.total, cal.copy_gbps)
        link = 0.0
    else:  # a hop's transfer hides behind the hop's compute; what exceeds it is exposed
        per_hop_gpu = gpu / (hops_f + hops_b)
        link = (moved.forward_transfers * max(0.0, _bytes_ms(moved.forward_hop, cal.link_gbps) - per_hop_gpu)
                + moved.backward_transfers * max(0.0, _bytes_ms(moved.backward_hop, cal.link_gbps) - per_hop_gpu)
                + _bytes_ms(moved.exposed, cal.link_gbps))
    host_ms = host / 1e3
    return TimeEstimate(host_ms=host_ms, gpu_ms=gpu, link_ms=link, total_ms=cal.combined(host_ms, gpu) + link,
                        hops=hops_f + hops_b)


def a2a_time(shape: BlockShape, cal: Calibration) -> TimeEstimate:
    """Predicted time of the all-to-all block (dispatch, experts, combine; autograd saves, nothing recomputed)."""
    s, n = shape, shape.group_size
    pairs = s.tokens * s.top_k
    host = (cal.host_a2a_us + n * cal.host_a2a_peer_us) / 1e3
    gemm = _gemm_ms(pairs, s.params, 3, pairs / s.experts_per_rank, cal)  # an owner's expert sees every rank's rows
    rows = _bytes_ms(pairs * s.hidden * s.elem_bytes * cal.a2a_row_bytes, cal.hbm_gbps)
    exchanged = 4 * pairs * s.hidden * s.elem_bytes * (n - 1) / n  # dispatch and combine, forward and backward
    link = 0.0 if cal.link_gbps is None else _bytes_ms(exchanged, cal.link_gbps)
    gpu = gemm + rows + (_bytes_ms(exchanged, cal.hbm_gbps) if cal.link_gbps is None else 0.0)
    return TimeEstimate(host_ms=host, gpu_ms=gpu, link_ms=link, total_ms=cal.combined(host, gpu) + link)


def _scaled(t: TimeEstimate, ratio: float) -> TimeEstimate:
    return TimeEstimate(host_ms=t.host_ms * ratio, gpu_ms=t.gpu_ms * ratio, link_ms=t.link_ms * ratio,
                        total_ms=t.total_ms * ratio, hops=t.hops)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What a block runs as, and the predictions behind it."""

    execution: Execution
    reason: str
    # "expert", "token" (the ring's routings considered), "a2a" (eager), "kept_a2a" or "op_a2a" (``choose``'s kept)
    times: dict[str, TimeEstimate]
    peaks: dict[str, int]  # predicted_peak_bytes
    # Partitions per forward and per backward hop of the ring that runs: the expert ring's owners (a larger stack
    # than the rules' where ``choose`` took one), the token ring's sources; where the all-to-all runs, the expert
    # rules'.
    owners: tuple[int, int] = (1, 1)
    saves: bool = False  # the expert ring saves its first projections (``times["expert"]``, ``peaks`` with them)

    def as_dict(self) -> dict[str, object]:
        return {"execution": self.execution, "reason": self.reason, "owners_per_hop": list(self.owners),
                "saves_projections": self.saves,
                "predicted_ms": {k: t.as_dict() for k, t in self.times.items()}, "predicted_peak_bytes": self.peaks}


# How close to the all-to-all a ring predicted without saved projections may come before ``"auto"`` saves them:
# the time model's error on sweeps it was not fitted to (rms log error 0.09-0.10 on the H100, docs/BENCHMARKS.md,
# "Saved projections"). A ring predicted 0.98x (now 1.12x) measured 1.06x (EP=64, 16384 tokens, H100) and 0.98x
# with them; rings predicted 0.85x or less won without them, and at 65536 tokens they bought no time for 2-4x the
# ring's peak.
SAVE_MARGIN = 0.10


def _saves(shape: BlockShape, unsaved: TimeEstimate, a2a: TimeEstimate, saving: int, owners: tuple[int, int],
           max_hop_rows: MaxHopRows) -> bool:
    """Whether the expert ring saves its projections: wherever the op can and the option says True
    (``saving`` 2); under ``"auto"`` (1) where, without them, it is predicted slower than the all-to-all or
    faster by less than ``SAVE_MARGIN`` (the model cannot tell it from the all-to-all) and, with them, its peak is
    no higher than the all-to-all's."""
    if saving != 1:
        return saving == 2
    peaks = predicted_peak_bytes(shape, max_hop_rows, owners=owners, saved=True)
    return unsaved.total_ms > (1.0 - SAVE_MARGIN) * a2a.total_ms and peaks["ring"] <= peaks["a2a"]


def _fastest_larger_stack(shape: BlockShape, cal: Calibration, larger: tuple[tuple[int, int], ...],
                          max_hop_rows: MaxHopRows) -> tuple[TimeEstimate, tuple[int, int]] | None:
    """The fastest expert ring among the ``larger`` owner stacks, and its owners (None: none given)."""
    rings = [(ring_time(shape, "expert", cal, owners_per_hop=f, backward_owners=b, max_hop_rows=max_hop_rows),
              (f, b)) for f, b in larger]
    return min(rings, key=lambda r: r[0].total_ms, default=None)


def choose(shape: BlockShape, *, routing: str, ring: str, cal: Calibration,
           owners: tuple[int, int] | OwnerOptions | None = None, max_hop_rows: MaxHopRows = "auto", saving: int = 0,
           kept: Kept = "traced") -> Choice:
    """The ``routing`` (``"auto"``: the faster one) and ``ring`` options resolved for ``shape``.

    ``owners``: owners per forward and per backward hop of the expert ring (``(1, 1)``: an expert function
    without grouped entry points; the token ring then holds its rules' sources); ``OwnerOptions``: the rules'
    owners, larger stacks and the token ring's sources; None: those of grouped experts (``owner_options``).
    Under ``ring="auto"``, where every ring with the rules' owners is predicted slower than a2a eager's predicted
    time (``times["a2a"]``), the expert ring is predicted with the fastest of the larger stacks instead (where that is faster): a ring that then wins runs where the block would otherwise
    keep an all-to-all that holds several times its memory. That time decides this whatever ``kept``, so a region's
    compile-time prediction and its calls hold the same owners (``Choice.owners``: what the op holds).
    ``"memory"`` and ``"always"`` keep the rules' owners: memory first. ``saving``: the op can save the expert
    ring's projections (``agreement.Claims.saves``: 1 the model decides, 2 the option says so).

    ``ring``: ``"auto"`` runs the ring where it is predicted no slower than the all-to-all; ``"memory"`` also
    where it is slower but the all-to-all's predicted peak is higher (the ring buys memory with time);
    ``"always"``; ``"never"``. ``kept``: the all-to-all the block runs where it does not run the ring: the traced
    one as a kept region runs it, compiled (``times["kept_a2a"]``: a2a eager's predicted time, ``times["a2a"]``,
    times ``cal.kept_a2a_ratio(N)``), or the op's own path (``"op"``, a call's decision: ``times["op_a2a"]``, times
    ``cal.op_a2a_ratio``). Saved projections are weighed against a2a eager either way: it is the time a model
    without the backend takes.
    """
    routings: tuple[Routing, ...] = ("expert", "token") if routing == "auto" else (routing,)  # type: ignore[assignment]
    # A tuple of expert owners (an expert function without grouped entry points): token routing's sources per hop
    # still follow its rules (any expert function).
    stacks = (owner_options(shape) if owners is None else owners if isinstance(owners, OwnerOptions)
              else OwnerOptions(owners, token=token_partitions(hop_shape(shape))))
    forward, backward = stacks.rules
    held_by = {"expert": stacks.rules, "token": stacks.token}
    times = {r: ring_time(shape, r, cal, owners_per_hop=held_by[r][0], backward_owners=held_by[r][1],
                          max_hop_rows=max_hop_rows)
             for r in routings}
    times["a2a"] = a2a_time(shape, cal)
    # What the block runs where it keeps an all-to-all: the traced one compiled, or the op's own path.
    alternative = "op_a2a" if kept == "op" else "kept_a2a"
    times[alternative] = _scaled(times["a2a"], cal.op_a2a_ratio if kept == "op"
                                 else cal.kept_a2a_ratio(shape.group_size))
    widened = ""
    if ring == "auto" and "expert" in routings and min(times[r].total_ms for r in routings) > times["a2a"].total_ms:
        wider = _fastest_larger_stack(shape, cal, stacks.larger, max_hop_rows)
        if wider is not None and wider[0].total_ms < times["expert"].total_ms:
            widened = (f", beyond the rules' {forward}/{backward}, with which it is predicted "
                       f"{times['expert'].total_ms:.2f} ms")
            times["expert"], (forward, backward) = wider
    best: Routing = min(routings, key=lambda r: times[r].total_ms)
    peaks = predicted_peak_bytes(shape, max_hop_rows, owners=(forward, backward), sources=stacks.token, routing=best)
    ring_ms, a2a_ms = times[best].total_ms, times[alternative].total_ms
    against = "the kept all-to-all's" if kept == "traced" else "the op's all-to-all path's"
    mib = {k: v / 2**20 for k, v in peaks.items()}
    grouped = best == "expert" and forward * backward > 1
    held = f" ({forward}/{backward} owners per forward/backward hop{widened})" if grouped else ""
    if best == "token" and stacks.token != (1, 1):
        held = f" ({stacks.token[0]}/{stacks.token[1]} sources per forward/backward hop)"
    if ring == "never":
        return Choice(execution="all_to_all", reason="option ring='never'", times=times, peaks=peaks,
                      owners=stacks.rules)
    faster = ring_ms <= a2a_ms
    if faster:
        why = f"predicted {ring_ms:.2f} ms against {against} {a2a_ms:.2f} ms"
    elif ring == "memory" and peaks["a2a"] > peaks["ring"]:  # (the op's own path: peaks of the traced one)
        why = (f"ring='memory': predicted peak {mib['ring']:.0f} MiB against the all-to-all's {mib['a2a']:.0f} MiB, "
               f"for {ring_ms:.2f} ms against {against} {a2a_ms:.2f} ms")
    elif ring == "always":
        why = f"option ring='always' (predicted {ring_ms:.2f} ms against {against} {a2a_ms:.2f} ms)"
    else:
        return Choice(execution="all_to_all", times=times, peaks=peaks, owners=stacks.rules, reason=(
            f"the {best} ring{held} is predicted slower ({ring_ms:.2f} ms against {against} {a2a_ms:.2f} ms; peak "
            f"{mib['ring']:.0f} MiB against {mib['a2a']:.0f} MiB); ring='memory' or 'always' runs it"))
    # Saved projections speed up a ring that runs; they never decide that it runs (module docstring).
    saves = best == "expert" and _saves(shape, times["expert"], times["a2a"], saving, (forward, backward),
                                        max_hop_rows)
    if saves:
        times["expert"] = ring_time(shape, "expert", cal, owners_per_hop=forward, backward_owners=backward,
                                    max_hop_rows=max_hop_rows, saved=True)
        peaks = predicted_peak_bytes(shape, max_hop_rows, owners=(forward, backward), saved=True)
        held += ", projections saved"
        why += f"; saved, predicted {times['expert'].total_ms:.2f} ms"
    return Choice(execution=best, reason=f"{best} ring{held}: {why}", times=times, peaks=peaks,
                  owners=(forward, backward) if best == "expert" else stacks.token, saves=saves)
