"""Validated options of one compilation: ``relay_compile.config`` overridden by ``options={...}``.

The ring's own options (routing, overlap, remat, max_hop_rows) become a ``RingOptions``, which validates them;
this module adds the backend's (inner compiler, dumps, verify) and the conversions from the config's
spellings (environment strings, ``0`` for "no bound on hop rows").
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from relay_compile import config
from relay_compile.runtime.ring_options import InvalidRingOption, RingOptions

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
_RING_FIELDS = tuple(f.name for f in dataclasses.fields(RingOptions))
_BACKEND_FIELDS = ("inner_compiler", "dump_dir", "verify")
# Every option name, in the order the README lists them.
OPTION_NAMES = (*_RING_FIELDS, *_BACKEND_FIELDS)


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options of one compilation, validated: the ring's, and the backend's own."""

    ring: RingOptions
    inner_compiler: str
    dump_dir: str
    verify: bool

    def as_dict(self) -> dict[str, Any]:
        """Flat ``{option: value}`` as the user spells them (``max_hop_rows`` None: no bound)."""
        return {**dataclasses.asdict(self.ring), "inner_compiler": self.inner_compiler,
                "dump_dir": self.dump_dir, "verify": self.verify}


def _bool(name: str, value: Any) -> bool:
    """Environment values arrive as strings ("1"/"0" as booleans)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError(f"relaymoe: option {name}={value!r} must be a bool (True/False, or 1/0 in the environment)")


def _hop_bound(value: Any) -> int | None:
    """``max_hop_rows`` as the ring takes it: a positive int, or None for the config's 0 (no bound)."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"relaymoe: option max_hop_rows={value!r} must be an int") from None
    if number < 0:
        raise ValueError(f"relaymoe: option max_hop_rows={number} must be >= 0 (0: no bound)")
    return number or None


def resolve(options: dict[str, Any] | None = None) -> Options:
    """The module's values overridden by ``options``; raises ``ValueError`` on unknown names or bad values."""
    options = options or {}
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"relaymoe: unknown option(s) {unknown}; valid options are {list(OPTION_NAMES)}")
    merged = {name: options.get(name, getattr(config, name)) for name in OPTION_NAMES}
    if "max_hop_rows" not in options and not config.max_hop_rows:
        # Read here, not by the config module: torch config entries read from the environment are bool or str.
        merged["max_hop_rows"] = os.environ.get("RELAYMOE_MAX_HOP_ROWS", 0)
    inner = "" if merged["inner_compiler"] is None else str(merged["inner_compiler"])
    if inner not in INNER_COMPILERS:
        raise ValueError(f"relaymoe: option inner_compiler={inner!r} is not one of {INNER_COMPILERS}")
    try:
        ring = RingOptions(
            routing=str(merged["routing"]), overlap=_bool("overlap", merged["overlap"]),
            remat=_bool("remat", merged["remat"]), max_hop_rows=_hop_bound(merged["max_hop_rows"]),
        )
    except InvalidRingOption as e:
        raise ValueError(f"relaymoe: option {e.problem}") from None
    return Options(ring=ring, inner_compiler=inner, dump_dir=str(merged["dump_dir"] or ""),
                   verify=_bool("verify", merged["verify"]))
