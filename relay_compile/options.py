"""Validated options of one compilation: ``relay_compile.config`` overridden by ``options={...}``.

The ring's own options (routing, overlap, remat, max_hop_rows, fp32_accumulation, chunk_graphs, ring, fp8,
link_gbps, save_projections, gather_in_gemm, add_in_gemm) become a
``RingOptions``, which validates them; this module adds the backend's (inner compiler, dumps, verify, activation
memory budget) and the conversions from the config's spellings (environment strings, ``0`` for "no bound on hop
rows").

Two sources, two parsers. ``options={...}`` is Python: a value must have its option's type (``max_hop_rows``
an int, never ``2.7`` or ``True``; ``overlap`` a bool, never ``"false"``). A config value may come from the
environment (``RELAYMOE_*``), whose strings are parsed strictly: booleans ``true``/``false``/``1``/``0``,
``RELAYMOE_MAX_HOP_ROWS`` a decimal count, ``RELAYMOE_DUMP_DIR`` a directory (a switch such as ``0`` or
``False`` is refused, not taken as a directory named ``False``). The config module reads ``1`` and ``0`` as
True and False before we see them, so a str option holding a bool names that spelling. Every error is a
``ValueError`` naming the option.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relay_compile import config
from relay_compile.runtime.ring_options import (
    ChunkGraphs,
    InvalidRingOption,
    LinkGbps,
    MaxHopRows,
    RingOptions,
    SaveProjections,
)

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
_RING_FIELDS = tuple(f.name for f in dataclasses.fields(RingOptions))
_BACKEND_FIELDS = ("dynamic_keep", "split_reads", "inner_compiler", "dump_dir", "verify", "activation_memory_budget")
# Every option name, in the order docs/USAGE.md lists them.
OPTION_NAMES = (*_RING_FIELDS, *_BACKEND_FIELDS)


@dataclass(frozen=True, kw_only=True)
class Options:
    """The options of one compilation, validated: the ring's, and the backend's own."""

    ring: RingOptions
    dynamic_keep: bool
    split_reads: bool
    inner_compiler: str
    dump_dir: str
    verify: bool
    activation_memory_budget: float | None

    def as_dict(self) -> dict[str, Any]:
        """Flat ``{option: value}`` as the user spells them (``max_hop_rows`` None: no bound)."""
        return {**dataclasses.asdict(self.ring), "dynamic_keep": self.dynamic_keep, "split_reads": self.split_reads,
                "inner_compiler": self.inner_compiler,
                "dump_dir": self.dump_dir, "verify": self.verify,
                "activation_memory_budget": self.activation_memory_budget}


# Environment spellings of a bool (any case).
_FLAGS = {"true": True, "1": True, "false": False, "0": False}


def _bool(name: str, value: Any, parse: bool) -> bool:
    """A bool; with ``parse`` (a config value, maybe an environment string) also true/false/1/0."""
    if isinstance(value, bool):
        return value
    if parse and isinstance(value, str) and value.strip().lower() in _FLAGS:
        return _FLAGS[value.strip().lower()]
    raise ValueError(f"relaymoe: option {name}={value!r} must be a bool (True/False; true/false/1/0 in the "
                     "environment)")


def _str(name: str, value: Any, parse: bool) -> str:
    if isinstance(value, str):
        return value
    spelling = " (the environment's 1 and 0 read as True and False)" if parse and isinstance(value, bool) else ""
    raise ValueError(f"relaymoe: option {name}={value!r} must be a str{spelling}")


def _hop_bound(value: Any, parse: bool) -> MaxHopRows:
    """``max_hop_rows`` as the ring takes it: a positive int, ``"auto"``, or None for the config's 0 (no bound)."""
    if value == "auto":
        return "auto"
    if parse and isinstance(value, str):
        if not re.fullmatch(r"[0-9]+", value.strip()):
            raise ValueError(f"relaymoe: option max_hop_rows={value!r} (RELAYMOE_MAX_HOP_ROWS) must be 'auto' or a "
                             "decimal row count (0: no bound)")
        value = int(value)
    if value is None:
        return None
    try:
        # operator.index: ints and int-likes (numpy), never floats; bools are ints to Python, not row counts.
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None:
        raise ValueError(f"relaymoe: option max_hop_rows={value!r} must be an int (0 or None: no bound) or 'auto'")
    if number < 0:
        raise ValueError(f"relaymoe: option max_hop_rows={number} must be >= 0 (0: no bound)")
    return number or None


def _graphs(value: Any, parse: bool) -> ChunkGraphs:
    """``chunk_graphs``: a bool or ``"auto"`` (from the environment also true/false/1/0)."""
    if value == "auto":
        return "auto"
    return _bool("chunk_graphs", value, parse)


def _saves(value: Any, parse: bool) -> SaveProjections:
    """``save_projections``: a bool or ``"auto"`` (from the environment also true/false/1/0)."""
    if value == "auto":
        return "auto"
    try:
        return _bool("save_projections", value, parse)
    except ValueError:
        raise ValueError(f"relaymoe: option save_projections={value!r} must be True, False or 'auto' "
                         "(true/false/1/0/auto in the environment)") from None


def _link(value: Any, parse: bool) -> LinkGbps:
    """``link_gbps``: ``"auto"`` or GB/s (from the environment, ``auto`` or a decimal number); ``RingOptions``
    checks the range."""
    if parse and isinstance(value, str) and value.strip() != "auto":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"relaymoe: option link_gbps={value!r} (RELAYMOE_LINK_GBPS) must be 'auto' or a number "
                             "of GB/s") from None
    return value.strip() if isinstance(value, str) else value


def _dump_dir(value: Any, parse: bool) -> str:
    """A directory (``""`` or None: no dumps); from the environment, never a switch such as 0 or False."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if path is None:
        return ""
    switch = isinstance(path, bool) or (isinstance(path, str) and path.strip().lower() in _FLAGS)
    if parse and switch:
        raise ValueError(f"relaymoe: option dump_dir={value!r} is a switch, not a directory (RELAYMOE_DUMP_DIR=0 "
                         "and =1 read as False and True): give a directory, or leave it empty for no dumps")
    if not isinstance(path, str):
        raise ValueError(f"relaymoe: option dump_dir={value!r} must be a directory (str or os.PathLike; '' for "
                         "no dumps)")
    return path


def _memory_budget(value: Any, parse: bool) -> float | None:
    """A fraction in [0, 1] (torch's ``activation_memory_budget``), or None to leave torch's setting alone."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"relaymoe: option activation_memory_budget={value!r} must be a number in [0, 1] (1: save "
                         "what runs fastest, 0: recompute all but the graph's inputs) or None (torch's setting)")
    return float(value)


def _given(options: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``options={...}`` checked for shape: a mapping of known option names."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(f"relaymoe: options must be a dict {{option: value}}, got {type(options).__name__} "
                         f"{options!r}; valid options are {list(OPTION_NAMES)}")
    unknown = sorted(map(repr, set(options) - set(OPTION_NAMES)))
    if unknown:
        raise ValueError(f"relaymoe: unknown option(s) [{', '.join(unknown)}]; valid options are "
                         f"{list(OPTION_NAMES)}")
    return options


_NUMERIC_ENV = {"max_hop_rows": "RELAYMOE_MAX_HOP_ROWS", "link_gbps": "RELAYMOE_LINK_GBPS"}


def _config_numeric(name: str) -> Any:
    """The config's value of a numeric option, or its environment variable where the config leaves it "auto"."""
    value = getattr(config, name)
    if value == "auto":
        # Read here, not by the config module: torch config entries read from the environment are bool or str,
        # and "1" reads as True.
        return os.environ.get(_NUMERIC_ENV[name], "auto")
    return value


def resolve(options: Mapping[str, Any] | None = None) -> Options:
    """The config's values overridden by ``options``; ``ValueError`` naming the option on a bad name, type or value."""
    given = _given(options)

    def pick(name: str) -> tuple[Any, bool]:
        """``(value, parse)``: ``parse`` for config values, which may be environment strings."""
        if name in given:
            return given[name], False
        return (_config_numeric(name) if name in _NUMERIC_ENV else getattr(config, name)), True

    inner = _str("inner_compiler", *pick("inner_compiler"))
    if inner not in INNER_COMPILERS:
        raise ValueError(f"relaymoe: option inner_compiler={inner!r} is not one of {INNER_COMPILERS}")
    try:
        ring = RingOptions(
            routing=_str("routing", *pick("routing")), overlap=_bool("overlap", *pick("overlap")),
            remat=_bool("remat", *pick("remat")), max_hop_rows=_hop_bound(*pick("max_hop_rows")),
            fp32_accumulation=_bool("fp32_accumulation", *pick("fp32_accumulation")),
            chunk_graphs=_graphs(*pick("chunk_graphs")), ring=_str("ring", *pick("ring")),
            fp8=_bool("fp8", *pick("fp8")), link_gbps=_link(*pick("link_gbps")),
            save_projections=_saves(*pick("save_projections")),
            gather_in_gemm=_bool("gather_in_gemm", *pick("gather_in_gemm")),
            add_in_gemm=_bool("add_in_gemm", *pick("add_in_gemm")),
        )
    except InvalidRingOption as e:
        raise ValueError(f"relaymoe: option {e.problem}") from None
    return Options(ring=ring, dynamic_keep=_bool("dynamic_keep", *pick("dynamic_keep")),
                   split_reads=_bool("split_reads", *pick("split_reads")), inner_compiler=inner,
                   dump_dir=_dump_dir(*pick("dump_dir")),
                   verify=_bool("verify", *pick("verify")),
                   activation_memory_budget=_memory_budget(*pick("activation_memory_budget")))
