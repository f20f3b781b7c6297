"""Validated options of one compilation: ``relay_compile.config`` overridden by ``options={...}``."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from relay_compile import config

_CHOICES: dict[str, tuple[Any, ...]] = {
    "routing": ("auto", "expert", "token"),
    "inner_compiler": ("inductor", "aot_eager", "eager"),
}


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options of one compilation, validated."""

    routing: str
    overlap: bool
    remat: bool
    max_hop_rows: int
    inner_compiler: str
    dump_dir: str
    verify: bool


def _coerce(name: str, value: Any, kind: type) -> Any:
    """Environment values arrive as strings ("1"/"0" as booleans): convert them, or say what is valid."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ValueError(f"relaymoe: option {name}={value!r} must be a bool (True/False, or 1/0 in the environment)")
    if kind is int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"relaymoe: option {name}={value!r} must be an int") from None
        if number < 0:
            raise ValueError(f"relaymoe: option {name}={number} must be >= 0 (0: no bound)")
        return number
    value = "" if value is None else str(value)
    choices = _CHOICES.get(name)
    if choices and value not in choices:
        raise ValueError(f"relaymoe: option {name}={value!r} is not one of {choices}")
    return value


def resolve(options: dict[str, Any] | None = None) -> Options:
    """The module's values overridden by ``options``; raises ``ValueError`` on unknown names or bad values."""
    valid = [f.name for f in fields(Options)]
    unknown = sorted(set(options or {}) - set(valid))
    if unknown:
        raise ValueError(f"relaymoe: unknown option(s) {unknown}; valid options are {valid}")
    merged = {name: (options or {}).get(name, getattr(config, name)) for name in valid}
    if "max_hop_rows" not in (options or {}) and not config.max_hop_rows:
        merged["max_hop_rows"] = os.environ.get("RELAYMOE_MAX_HOP_ROWS", 0)
    kinds = {"overlap": bool, "remat": bool, "verify": bool, "max_hop_rows": int}
    return Options(**{name: _coerce(name, value, kinds.get(name, str)) for name, value in merged.items()})


