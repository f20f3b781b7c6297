"""Ring specs: everything about a ring that is not a tensor, registered under a string key.

The ``relaymoe`` custom ops take a spec *key* (custom ops cannot take callables, and a string keeps compiled
graphs printable and cacheable). ``register_spec`` derives the key from the spec, so every rank that
registers the same ring gets the same key, whichever entry point (``ring_moe``, the rewrite pass) made it.

At the first call of a spec, ``agree_on_first_call`` checks once, with one small all-gather, that all ranks
pass tokens and weights of the same shapes and dtype (a mismatch would make the ring's receives wrong), and
resolves ``routing="auto"`` from the shapes of all ranks, so every rank takes the same decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from relay_compile.experts import ExpertFn, GroupedExperts
from relay_compile.routing import Routing, choose_routing, per_hop_bytes
from relay_compile.runtime.ring_options import RingOptions
from relay_compile.runtime.transport import RingGroup, all_gather_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RingSpec:
    """Everything about a ring that is not a tensor. Identical on every rank."""

    expert_fn: ExpertFn
    experts_per_rank: int
    group_name: str
    options: RingOptions

    def key(self, fn_name: str) -> str:
        """``<fn_name>|group=<g>|E_l=<n>|routing=...|overlap=...|remat=...|max_hop_rows=...``."""
        return f"{fn_name}|group={self.group_name}|E_l={self.experts_per_rank}|{self.options.key()}"

    def circulating_weights(self, num_weights: int) -> int:
        """How many weight tensors circulate for ``num_weights`` given ones (the expert function's packing)."""
        fn = self.expert_fn
        return fn.num_packed(num_weights) if isinstance(fn, GroupedExperts) else num_weights


@dataclass(kw_only=True)
class SpecState:
    """A registered spec and what its first call resolved (per process)."""

    spec: RingSpec
    ring: RingGroup
    resolved: Routing | None = None
    volumes: dict[str, dict[str, int]] = field(default_factory=dict)


_SPECS: dict[str, SpecState] = {}


def register_spec(spec: RingSpec, fn_name: str) -> str:
    """Register ``spec`` under its key (idempotent for an equal spec); returns the key."""
    key = spec.key(fn_name)
    state = _SPECS.get(key)
    if state is not None and state.spec != spec:
        raise ValueError(f"relaymoe: ring spec {key!r} is already registered with other settings")
    if state is None:
        _SPECS[key] = SpecState(spec=spec, ring=RingGroup.resolve(spec.group_name))
    return key


def spec_state(key: str) -> SpecState:
    """The registered state of ``key``; ``KeyError`` naming it when this process has none."""
    try:
        return _SPECS[key]
    except KeyError:
        raise KeyError(f"relaymoe: no ring spec {key!r} registered in this process") from None


# Dtypes as small ints for the shape check (any fixed numbering works: every rank uses this table).
_DTYPE_CODES = {dt: i for i, dt in enumerate(
    (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2))}
_SIGNATURE_LEN = 24


def _signature(x: Tensor, topk_ids: Tensor, weights: list[Tensor]) -> Tensor:
    """``[T, H, K, dtype, nweights, *shapes]`` as a fixed-length int64 row (T is the only per-rank size)."""
    row = [x.shape[0], x.shape[1], topk_ids.shape[1], _DTYPE_CODES.get(x.dtype, 99), len(weights)]
    for w in weights:
        row += [w.dim(), *w.shape, _DTYPE_CODES.get(w.dtype, 99)]
    if len(row) > _SIGNATURE_LEN:
        row = row[:5] + [hash(tuple(row[5:])) % (1 << 62)]
    return torch.tensor(row + [0] * (_SIGNATURE_LEN - len(row)), dtype=torch.int64, device=x.device)


def agree_on_first_call(state: SpecState, x: Tensor, topk_ids: Tensor, weights: list[Tensor]) -> Routing:
    """First call of a spec: check shapes across ranks and pick the routing, identically on every rank."""
    if state.resolved is not None:
        return state.resolved
    table = all_gather_rows(state.ring, _signature(x, topk_ids, weights)).tolist()
    for rank, row in enumerate(table):
        if row[1:] != table[state.ring.rank][1:]:
            raise ValueError(
                f"ring_moe: rank {rank} of the EP group passes hidden size, top-k, dtype or weight shapes "
                f"{row[1:]} that differ from rank {state.ring.rank}'s {table[state.ring.rank][1:]}; every rank "
                "must hold expert partitions of one shape"
            )
    spec = state.spec
    volume_args = dict(
        tokens=max(row[0] for row in table), hidden=x.shape[1], top_k=topk_ids.shape[1],
        experts_per_rank=spec.experts_per_rank, elem_bytes=x.element_size(),
        expert_bytes=sum(w.numel() * w.element_size() for w in weights) // spec.experts_per_rank,
    )
    state.volumes = {mode: per_hop_bytes(mode, **volume_args) for mode in ("expert", "token")}
    asked = spec.options.routing
    resolved: Routing = "token" if asked == "token" else "expert"
    if asked == "auto":
        resolved = choose_routing(**volume_args)
    state.resolved = resolved
    log.info("ring_moe: routing %s (asked %s), per-hop bytes %s", resolved, asked, state.volumes)
    return resolved
