"""Modeled link time of one row: the stand-in group moves no data over a link, so this model adds it.

Every measurement runs rank 0 of an N-rank stand-in group (``relay_compile.bench.standin_group``): its peers
are copies of this rank, so this rank's memory and compute are those of a real EP rank under symmetric routing,
while link time is not simulated. Link time is reported separately, from a stated model:

    a2a:   4 all-to-alls (dispatch, combine; twice in backward), each moving T*K*H*elem*(N-1)/N bytes off the rank
           modeled total = measured + 4 * a2a_bytes / BW                         (no overlap)
    ring:  per-hop bytes from ``relay_compile.routing.per_hop_bytes`` (forward, backward), BW = link GB/s
           transfers: forward N-1 (expert routing) or N (token routing: accumulators return), backward N
           sequential: modeled total = measured + sum(transfers) / BW
           overlap:    per direction, c = measured / N per hop, t = bytes / BW per transfer:
                       (N-1) * max(c, t) + c [+ t for a transfer that follows the last hop]

Everything under "model" is simulated; "measured" columns are what this device did (including the stand-in's
copies, which move data at device-memory bandwidth on the compute stream).

Legend: T tokens per rank, H hidden, K top-k, N EP size, BW link bandwidth (one direction of one link).
"""

from __future__ import annotations

from dataclasses import dataclass

from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.rows import RowSpec
from relay_compile.routing import per_hop_bytes


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Modeled link time of one row (simulated: nothing here was measured)."""

    bytes_fwd: int  # per transfer (ring: per hop; a2a: per all-to-all), bytes leaving this rank
    bytes_bwd: int
    transfers_fwd: int
    transfers_bwd: int
    link_ms: float  # all transfers of one forward+backward, back to back
    total_ms: float  # measured compute with the modeled link time, on this row's schedule


def link_model(cfg: LayerConfig, spec: RowSpec, fwd_ms: float, bwd_ms: float, gbps: float) -> LinkModel:
    """The module docstring's model, for one row's measured forward and backward times."""
    n = cfg.ep
    ms_per_byte = 1e3 / (gbps * 1e9)
    if spec.kind == "a2a":
        per = cfg.tokens * cfg.top_k * cfg.hidden * cfg.elem_bytes * (n - 1) // n
        link = 4 * per * ms_per_byte
        return LinkModel(bytes_fwd=per, bytes_bwd=per, transfers_fwd=2, transfers_bwd=2, link_ms=link,
                         total_ms=fwd_ms + bwd_ms + link)
    routing = spec.routing if spec.routing in ("expert", "token") else "expert"
    vol = per_hop_bytes(
        routing, tokens=cfg.tokens, hidden=cfg.hidden, top_k=cfg.top_k, experts_per_rank=cfg.experts_per_rank,
        expert_bytes=cfg.expert_bytes, elem_bytes=cfg.elem_bytes,
    )
    if n == 1:
        return LinkModel(bytes_fwd=0, bytes_bwd=0, transfers_fwd=0, transfers_bwd=0, link_ms=0.0,
                         total_ms=fwd_ms + bwd_ms)
    tr_fwd = n - 1 if routing == "expert" else n
    tr_bwd = n
    t_fwd, t_bwd = vol["forward"] * ms_per_byte, vol["backward"] * ms_per_byte
    link = tr_fwd * t_fwd + tr_bwd * t_bwd
    if not spec.overlap:
        total = fwd_ms + bwd_ms + link
    else:
        c_fwd, c_bwd = fwd_ms / n, bwd_ms / n
        total = (n - 1) * max(c_fwd, t_fwd) + c_fwd + (t_fwd if tr_fwd == n else 0.0)
        total += (n - 1) * max(c_bwd, t_bwd) + c_bwd + t_bwd
    return LinkModel(bytes_fwd=vol["forward"], bytes_bwd=vol["backward"], transfers_fwd=tr_fwd,
                     transfers_bwd=tr_bwd, link_ms=link, total_ms=total)
