"""Expert functions keyed by what they compute, not by the object that happens to hold them.

``ring_moe_experts`` registers a ring spec per expert function. Code that builds a closure (or takes a bound
method, or a ``functools.partial``) at every step hands it a new object each time; keying specs by object
identity grew the registry by one spec (and everything the closure captured) per step. ``identify`` gives two
strings instead:

- ``key``: the spec key's function part in this process. Functions: module, qualified name and a digest of
  their code, plus what they capture (closure cells, defaults; for a bound method its ``self``; for a partial
  its arguments). Captured values of plain types (numbers, strings, dtypes, tuples of them) count by value,
  functions recursively, anything else by identity (``<type>@<id>``: that object is alive as long as the spec
  holding the function is, so the id cannot be reused meanwhile). A new closure over equal values therefore
  gets the same key, and the registry stays as it was.
- ``identity``: what every rank of the group must agree on (``runtime.agreement``): the same without the
  captured values, so no object id (different in every process) and no per-rank value (a captured rank or
  device) enters it. Two ranks running different code under one ring are told so before any transfer.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable

import torch

# Captured values that count by value (their repr is stable across processes).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# Nesting depth beyond which captured functions count by identity.
_MAX_DEPTH = 4


@functools.lru_cache(maxsize=1024)
def _code_digest(code: types.CodeType) -> str:
    """A digest of a code object: bytecode, names and constants (nested code objects by their own digest)."""
    consts = tuple(_code_digest(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    text = repr((code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _value_key(value: object, path: tuple[int, ...]) -> str:
    """A captured value: plain values by repr, functions by their key, anything else by identity.

    ``path``: ids of the functions being described around this one; a function capturing one of them (itself,
    recursively) names it by its distance up the path.
    """
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, frozenset)) and all(isinstance(v, _PLAIN) for v in value):
        return repr(value)
    if id(value) in path:
        return f"<up {len(path) - path.index(id(value))}>"
    if callable(value) and len(path) < _MAX_DEPTH:
        return _describe(value, path)[0]
    return f"{type(value).__qualname__}@{id(value):x}"


def _function(fn: types.FunctionType, path: tuple[int, ...]) -> tuple[str, str]:
    identity = f"{fn.__module__}.{fn.__qualname__}[{_code_digest(fn.__code__)}]"
    cells = [_cell_value(c) for c in (fn.__closure__ or ())]
    captured = [_value_key(v, path) for v in (*cells, *(fn.__defaults__ or ()))]
    captured += _keywords(fn.__kwdefaults__ or {}, path)
    return (f"{identity}({', '.join(captured)})" if captured else identity), identity


def _keywords(values: dict[str, object], path: tuple[int, ...]) -> list[str]:
    return [f"{name}={_value_key(v, path)}" for name, v in sorted(values.items())]


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a free variable not yet assigned
        return None


def _describe(fn: Callable[..., object], path: tuple[int, ...]) -> tuple[str, str]:
    path = (*path, id(fn))
    if isinstance(fn, types.FunctionType):
        return _function(fn, path)
    if isinstance(fn, types.MethodType):
        key, identity = _describe(fn.__func__, path)
        return f"{key}.bound({_value_key(fn.__self__, path)})", identity
    if isinstance(fn, functools.partial):
        key, identity = _describe(fn.func, path)
        args = [_value_key(v, path) for v in fn.args] + _keywords(fn.keywords, path)
        return f"partial({key}, {', '.join(args)})", f"partial({identity})"
    # Any other callable object: its type (and its own name, if it gives one), and itself.
    kind = type(fn)
    identity = f"{kind.__module__}.{kind.__qualname__}:{getattr(fn, '__qualname__', '')}"
    return f"{identity}@{id(fn):x}", identity


def identify(fn: Callable[..., object]) -> tuple[str, str]:
    """``(key, identity)`` of an expert function (see the module docstring)."""
    return _describe(fn, ())


def identity_code(identity: str) -> int:
    """A 62-bit code of an identity string, equal in every process (no salted ``hash``)."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "little") >> 2
