"""program_dumps: the ring programs a region runs, written by the op when it first runs each of them.

What a call runs is decided at the call, from the counts every rank agreed on (``agreement``): the routing,
ring or all-to-all, and the owners per forward hop. A dump computed at compile time from one rank's shapes
could show another program than the one that runs (uneven token counts across ranks, a changing T), so the
backend only says where a region's dumps go (``dump_to``) and the op writes what it ran (``record``): one file
per distinct program, and one line per distinct decision in ``<prefix>_decisions.txt``. Every rank decides
alike, so every rank writes the same names.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch.fx as fx

from relay_compile.runtime.programs.schedule import Direction


@dataclass
class _Target:
    """Where one region's programs go: ``<directory>/<prefix>_...``, and what was written there already."""

    directory: Path
    prefix: str
    written: set[str] = field(default_factory=set)
    decisions: set[str] = field(default_factory=set)

    def write_once(self, name: str, text: str) -> None:
        if name in self.written:
            return
        self.written.add(name)
        (self.directory / name).write_text(text)

    def decision(self, line: str) -> None:
        if line in self.decisions:
            return
        self.decisions.add(line)
        with open(self.directory / f"{self.prefix}_decisions.txt", "a") as f:
            f.write(line + "\n")


# Spec key -> the regions registered under it (identical layers share one spec, and each has its dump).
_TARGETS: dict[str, list[_Target]] = {}
_LOCK = threading.Lock()


def dump_to(key: str, directory: str | Path, prefix: str) -> None:
    """Write the programs the op runs for spec ``key`` into ``directory`` as ``<prefix>_ring_...py``."""
    with _LOCK:
        targets = _TARGETS.setdefault(key, [])
        if not any(t.directory == Path(directory) and t.prefix == prefix for t in targets):
            targets.append(_Target(Path(directory), prefix))


def program_name(prefix: str, direction: Direction, routing: str, owners: int) -> str:
    """The file of one program: ``<prefix>_ring_<routing>_<direction>[_owners<g>].py``."""
    grouped = f"_owners{owners}" if owners > 1 else ""
    return f"{prefix}_ring_{routing}_{direction}{grouped}.py"


def record(key: str, direction: Direction, execution: str, reason: str, *, tokens_N: list[int],
           program: fx.GraphModule | None = None, owners: int = 1) -> None:
    """What one call of spec ``key`` ran: ``program`` (None: the all-to-all), with the decision behind it."""
    targets = _TARGETS.get(key)
    if not targets:
        return
    with _LOCK:
        for t in targets:
            ran = program_name(t.prefix, direction, execution, owners) if program is not None else "all_to_all"
            if program is not None:
                t.write_once(ran, f"# ring program of {t.prefix} as the op ran it first (tokens per rank "
                                  f"{tokens_N}), after remat/overlap\n{program.code}")
            t.decision(f"{direction}: {ran} ({reason})")


def clear() -> None:
    """Forget every target (tests)."""
    with _LOCK:
        _TARGETS.clear()
