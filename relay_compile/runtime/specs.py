"""Ring specs: everything about a ring that is not a tensor, registered under a string key.

The ``relaymoe`` custom ops take a spec *key* (custom ops cannot take callables, and a string keeps compiled
graphs printable and cacheable). ``register_spec`` derives the key from the spec and the expert function's
name, so every process that registers the same ring gets the same key, whichever entry point made it. The key
is a key of this process's registry only: nothing about it has to match across ranks (``max_hop_rows`` is in
it and may differ per rank). What the ranks must agree on is checked at every call by ``runtime.agreement``,
from the spec's options and its ``identity`` (the expert function's, from ``fn_identity``).

Two kinds of registrations:

- *pinned* (the rewrite pass, and ``ring_moe_experts`` while torch.compile traces it): a compiled graph
  keeps the key for its lifetime, so these are never evicted. The rewrite pass's re-registering a key with
  another spec raises.
- *functional* (``ring_moe_experts``): a call registers and runs at once, so re-registering a key replaces
  its spec (the latest expert function wins: the key says it computes the same). Called eagerly, at most
  ``MAX_FUNCTIONAL_SPECS`` stay registered, least recently used evicted first. A forward's autograd context
  holds its spec, and its backward runs with that one (``holding``), evicted or replaced since or not.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from relay_compile.experts import ExpertFn, as_grouped
from relay_compile.runtime.cost_model import Choice, Execution
from relay_compile.runtime.fn_identity import identity_code
from relay_compile.runtime.fp8_experts import fp8_experts
from relay_compile.runtime.ring_options import RingOptions
from relay_compile.runtime.transport import RingGroup, link_gbps

# Functional registrations kept at once (one per live expert function and max_hop_rows, typically a few).
MAX_FUNCTIONAL_SPECS = 64

# Where the router's scores multiply: F's output rows (``y[t] += s F(x[t])``, the all-to-all reference) or
# its input rows (``y[t] += F(s x[t])``: DeepSpeed, Megatron's ``moe_apply_probs_on_input``).
ScoresApplied = Literal["after", "before"]
SCORES_APPLIED: tuple[ScoresApplied, ...] = ("after", "before")


@dataclass(frozen=True, kw_only=True)
class RingSpec:
    """Everything about a ring that is not a tensor."""

    expert_fn: ExpertFn
    experts_per_rank: int
    group_name: str
    options: RingOptions
    scores_applied: ScoresApplied = "after"

    def __post_init__(self) -> None:
        if self.options.fp8:
            _ = self.ring_fn  # the option's error now, where the spec is made, not at its first call

    def key(self, fn_name: str) -> str:
        """``<fn_name>|group=<g>|E_l=<n>|scores=<after|before>|routing=...|overlap=...|remat=...|max_hop_rows=...``."""
        return (f"{fn_name}|group={self.group_name}|E_l={self.experts_per_rank}|scores={self.scores_applied}|"
                f"{self.options.key()}")

    @functools.cached_property
    def ring_fn(self) -> ExpertFn:
        """What the ring's hops call: the expert function, with FP8 hops where the options ask for them
        (``runtime.fp8_experts``; ``ValueError`` naming the option where the function cannot run so)."""
        return fp8_experts(self.expert_fn) if self.options.fp8 else self.expert_fn

    def circulating_weights(self, num_weights: int) -> int:
        """How many weight tensors circulate for ``num_weights`` given ones (the expert function's packing)."""
        fn = self.ring_fn
        grouped = as_grouped(fn)
        return grouped.num_packed(num_weights) if grouped is not None else num_weights

    def circulating_grads(self, num_weights: int) -> int:
        """How many weight-gradient tensors trail them (``grads_like``: fewer where scales circulate beside
        FP8 weights)."""
        fn = self.ring_fn
        count = getattr(fn, "num_grads", None)
        return count(num_weights) if count is not None else self.circulating_weights(num_weights)


@dataclass(kw_only=True)
class SpecState:
    """A registered spec (per process) and what its last call resolved."""

    key: str
    spec: RingSpec
    ring: RingGroup
    # What every rank must agree on about the expert function (a name equal in every process).
    identity: str
    resolved: Execution | None = None
    volumes: dict[str, dict[str, int]] = field(default_factory=dict)
    choice: Choice | None = None  # the cost model's, at the last call (CUDA)

    @functools.cached_property
    def identity_code(self) -> int:
        return identity_code(self.identity)

    @functools.cached_property
    def link_gbps(self) -> float | None:
        """``transport.link_gbps`` of the spec's group and option: resolved once per group, not per call."""
        return link_gbps(self.ring.group, self.spec.options.link_gbps)

    def rebind(self, ring: RingGroup) -> None:
        """The group behind the name was destroyed and created anew (tests, elastic restarts): forget what was
        resolved from the old one."""
        self.ring = ring
        self.__dict__.pop("link_gbps", None)


_PINNED: dict[str, SpecState] = {}
_FUNCTIONAL: OrderedDict[str, SpecState] = OrderedDict()
# The spec a backward runs with: its forward's, held by the autograd context.
_HELD: contextvars.ContextVar[SpecState | None] = contextvars.ContextVar("relaymoe_held_spec", default=None)
# Ranks run as threads of one process (``bench.rank_threads``) share the specs (a compiled graph registers its
# spec on the thread that traced it) but not what a spec resolves: each thread's ``states`` holds its own
# rank's ring (a group's name is the same on every thread) and its calls' resolutions.
_THREAD = threading.local()


def per_thread_states() -> None:
    """This thread resolves every spec for itself from now on (one rank of ranks run as threads)."""
    _THREAD.states = {}


def _this_thread(state: SpecState) -> SpecState:
    """``state`` as this thread holds it (``per_thread_states``), or ``state`` itself where threads share it."""
    states: dict[str, SpecState] | None = getattr(_THREAD, "states", None)
    if states is None:
        return state
    mine = states.get(state.key)
    if mine is None or mine.spec is not state.spec:
        if state.spec.options.chunk_graphs:
            raise ValueError(f"relaymoe: ring spec {state.key!r}: option chunk_graphs keeps CUDA graph arenas "
                             "shared by the process, which ranks run as threads would share; turn it off there")
        mine = states[state.key] = SpecState(key=state.key, spec=state.spec,
                                              ring=RingGroup.resolve(state.spec.group_name), identity=state.identity)
    return mine


def register_spec(
    spec: RingSpec, fn_name: str, *, identity: str | None = None, functional: bool = False, pinned: bool = True
) -> str:
    """Register ``spec`` under its key; returns the key.

    ``identity``: the expert function's cross-rank identity (default ``fn_name``, which must then be the same
    in every process). ``functional``: a re-registration replaces the spec; otherwise it is idempotent for an
    equal spec and a different spec under the key raises ``ValueError``. ``pinned=False``: evicted least
    recently used (see the module docstring).
    """
    key = spec.key(fn_name)
    identity = fn_name if identity is None else identity
    table = _PINNED if pinned else _FUNCTIONAL
    state = table.get(key)
    if state is not None and state.spec != spec and not functional:
        raise ValueError(f"relaymoe: ring spec {key!r} is already registered with other settings")
    if state is None or state.spec != spec:
        ring = RingGroup.resolve(spec.group_name) if state is None else state.ring
        table[key] = SpecState(key=key, spec=spec, ring=ring, identity=identity)
    if not pinned:
        _FUNCTIONAL.move_to_end(key)
        while len(_FUNCTIONAL) > MAX_FUNCTIONAL_SPECS:
            _FUNCTIONAL.popitem(last=False)
    return key


def spec_state(key: str) -> SpecState:
    """The registered state of ``key``; ``KeyError`` naming it when this process has none."""
    held = _HELD.get()
    if held is not None and held.key == key:
        return held
    state = _PINNED.get(key)
    if state is not None:
        return _this_thread(state)
    try:
        state = _FUNCTIONAL[key]
    except KeyError:
        raise KeyError(f"relaymoe: no ring spec {key!r} registered in this process") from None
    _FUNCTIONAL.move_to_end(key)
    return _this_thread(state)


def spec_held(key: str) -> SpecState | None:
    """The state ``spec_state`` gives now, or None where this process has none (yet)."""
    try:
        return spec_state(key)
    except KeyError:
        return None


def registered() -> int:
    """How many specs this process holds (pinned and functional)."""
    return len(_PINNED) + len(_FUNCTIONAL)


@contextlib.contextmanager
def holding(state: SpecState) -> Iterator[None]:
    """Within: ``spec_state(state.key)`` is ``state`` (a backward runs with its forward's spec)."""
    token = _HELD.set(state)
    try:
        yield
    finally:
        _HELD.reset(token)
