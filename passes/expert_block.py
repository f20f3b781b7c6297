"""expert_block: recognize F as a feed-forward network of experts, structurally, whatever idiom wrote it.

F (``expert_fn``) is the block between a region's two all-to-alls. Codebases write it in many idioms
(torchtitan's ``torch._grouped_mm`` over offsets with a permute and a ``setitem`` unpermute; the project's
reference layer's argsort permute; Megatron's ``torch.split`` into (source, expert) chunks and a loop over a
``ModuleList`` of ``nn.Linear`` experts; weights ``(E, F, H)``, ``(E, H, F)`` or ``Linear``'s ``(out, in)``),
but what each row goes through is the same small program. ``recognize_expert_ffn`` finds that program by
abstract interpretation of F's graph:

- every value is *rows* (with the expression of one row's content, and the local expert whose rows these are
  when the idiom loops over experts), a *weight* (a placeholder, maybe transposed, cast or indexed), a tuple
  of row pieces, or *opaque* (indices, counts, sizes: what decides the row order, never a row's content);
- ops that only move rows (gathers by index, ``split``, ``cat``, ``setitem`` into a fresh buffer, views that
  keep ``(rows, features)``) keep the content expression; ops that compute on rows extend it: grouped GEMM /
  ``linear`` / ``@`` with a weight, the activation, the gating product, ``chunk`` of a fused projection, casts;
- anything else that touches rows or weights means F is not (only) an FFN of experts: not recognized, with the
  node named.

The content expression of F's output is then matched against the FFN templates (``ffn_template``:
``down(act(gate(x)) [* up(x)])``, squared ReLU; each projection ``x W_e^T [+ b_e]``, a bias being a row of the
expert's own: ``linear(x, w, b)``, ``x @ w + b[e]`` on one expert's rows, or a stacked ``(E_l, 1, F)`` bias added to
batched ``(E_l, C, F)`` rows), giving an ``ExpertFFN`` record. What moves rows is *not* proven here: that F
puts each row's result back in its place and groups rows by the right expert is checked by ``expert_lowering``
on probe inputs before the recognized program replaces F.

Legend: S rows, H hidden, F expert FFN width, E_l experts per rank.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn.functional as nnf

from relay_compile.passes.ffn_template import Expr, NotAnFFN, match_ffn
from relay_compile.passes.fx_nodes import (
    arg,
    as_list,
    describe,
    dtype_of,
    is_call,
    is_item,
    is_method_call,
    node_value,
    qualname,
    same_shape,
    same_size,
    shape_of,
)
from relay_compile.passes.roles import flat_index_of_item
from relay_compile.runtime.ffn_plan import ExpertFFN, Layout
from relay_compile.runtime.region_fn import ExpertFnBinding

# ----------------------------------------------------------------------------------------------------------
# Abstract values
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rows:
    expr: Expr
    expert: int | None  # rows of one local expert (loop idioms); None: rows of any expert


@dataclass(frozen=True)
class _Weight:
    position: int
    stacked: bool  # (E_l, a, b) as F reads it
    transposed: bool = False
    index: int | None = None  # weights[position][index]
    dtype: torch.dtype | None = None  # cast to
    gathered: bool = False  # b[idx] of an (E_l, F) bias by an index per row (the probe proves it is the expert's)


@dataclass(frozen=True)
class _Pieces:
    items: tuple[_Rows, ...]


@dataclass(frozen=True)
class _Ones:
    """An opaque tensor of ones (``ones_like``, ``new_ones``), through views and gathers: scaling rows by it is
    no scaling (transformers' experts take per-row weights, and its EP hands them ones)."""


_Value = _Rows | _Weight | _Pieces | _Ones | None  # None: opaque (indices, counts, sizes)

_CAST_METHODS = {"bfloat16": torch.bfloat16, "float": torch.float32, "half": torch.float16, "double": torch.float64}
_MOVE_METHODS = ("contiguous", "clone")
_FRESH_BUFFERS = ("new_empty", "new_zeros", "empty_like", "zeros_like")
_ACTIVATIONS = {nnf.silu: "silu", nnf.relu: "relu", torch.relu: "relu"}
# Reading a tensor's metadata is opaque: it decides sizes, not a row's content.
_METADATA_METHODS = ("size", "dim", "numel", "stride", "get_device")
# Grouped GEMMs ``op(rows, stacked_weights, offs=...)``: torch's, and the fallback op transformers registers for
# the dtypes and devices torch._grouped_mm does not cover (its ``grouped_mm_experts_forward``).
_GROUPED_MM_OPS = ("transformers::grouped_mm_fallback",)
_ONES_VIEWS = ("view", "reshape", "unsqueeze", "expand", "expand_as", "flatten", "to", "float", "contiguous")


def _sums_size_one(n: fx.Node) -> bool:
    """``t.sum(dim)`` over a dimension of size 1 (no keepdim): a view, content-wise."""
    dim, shape = arg(n, 1, "dim"), shape_of(n.args[0])
    if not isinstance(dim, int) or shape is None or n.kwargs.get("keepdim", False) or len(n.args) > 2:
        return False
    return len(shape) >= 3 and shape[dim] == 1 and shape[-1] == (shape_of(n) or (None,))[-1]


def _ndim(n: object) -> int:
    return getattr(node_value(n), "dim", lambda: 0)()


def _is_feature_dim(n: object, dim: object) -> bool:
    """``dim`` of ``n`` is its last (the features of each row)."""
    ndim = _ndim(n)
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


def _weight_key(w: _Weight, layout: Layout, expert: int | None) -> tuple:
    """A GEMM's weight inside an expression: stacked, or one expert's tensor (merged across experts by cat)."""
    if w.stacked and w.index is None:
        return ("w", ("stacked", w.position), layout, w.dtype)
    if expert is None:
        raise NotAnFFN(f"weights[{w.position}] is one expert's weight, applied to rows of no single expert")
    return ("w", (("expert", expert, w.position, w.index),), layout, w.dtype)


def _bias_key(w: _Weight, expert: int | None) -> tuple:
    """A bias inside an expression: stacked ``(E_l, 1, F)`` (batched rows), or one expert's row (merged by cat)."""
    if expert is None:
        return ("b", ("stacked", w.position), w.dtype)
    return ("b", (("expert", expert, w.position, w.index),), w.dtype)


def _is_add(n: fx.Node) -> bool:
    return is_call(n, operator.add, operator.iadd, torch.add) or is_method_call(n, "add", "add_")


def _merge(a: Expr, b: Expr) -> Expr:
    """One expression for rows of two experts: equal up to which expert's weights (biases) each GEMM reads."""
    if a == b:
        return a
    if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and a[:1] == b[:1]):
        raise NotAnFFN(f"rows of different experts go through different programs: {a} vs {b}")
    if a[0] in ("w", "b"):
        if a[2:] != b[2:] or a[1][0] == "stacked" or b[1][0] == "stacked":
            raise NotAnFFN(f"experts read weights of different kinds: {a} vs {b}")
        return (a[0], tuple(sorted(set(a[1]) | set(b[1]))), *a[2:])
    return tuple(_merge(x, y) if isinstance(x, tuple) else _same(x, y) for x, y in zip(a, b))


def _same(x: object, y: object) -> object:
    if x != y:
        raise NotAnFFN(f"rows of different experts differ in {x!r} vs {y!r}")
    return x


# ----------------------------------------------------------------------------------------------------------
# Abstract interpretation of F
# ----------------------------------------------------------------------------------------------------------


class _Interpreter:
    def __init__(self, fn: fx.GraphModule, binding: ExpertFnBinding, experts_per_rank: int) -> None:
        self.fn, self.binding, self.experts_per_rank = fn, binding, experts_per_rank
        self.env: dict[fx.Node, _Value] = {}
        self.expert_of_split: dict[fx.Node, int] = {}
        self.counts: fx.Node | None = None  # the received counts' placeholder, (N * E_l,) source-major
        self.counts_numel = 0

    def run(self) -> _Rows:
        placeholders = self.fn.graph.find_nodes(op="placeholder")
        weight_positions = {pos: i for i, pos in enumerate(self.binding.weights)}
        for s, row in enumerate(self.binding.splits):
            for e, pos in enumerate(row):
                if pos is not None and self.binding.split_kind == "source_expert":
                    self.expert_of_split[placeholders[pos]] = e
        if self.binding.counts is not None:
            self.counts = placeholders[self.binding.counts]
            self.counts_numel = len(self.binding.splits) * self.experts_per_rank
        for pos, ph in enumerate(placeholders):
            if pos == self.binding.rows:
                self.env[ph] = _Rows(("x",), None)
            elif pos in weight_positions:
                val = node_value(ph)
                self.env[ph] = _Weight(weight_positions[pos], stacked=getattr(val, "dim", lambda: 0)() == 3)
            else:
                self.env[ph] = None
        for n in self.fn.graph.nodes:
            if n.op in ("call_function", "call_method"):
                self.env[n] = self.step(n)
            elif n.op == "output":
                out = self.value(n.args[0])
                if not isinstance(out, _Rows):
                    raise NotAnFFN("F's output is not rows computed from the received rows")
                return out
            elif n.op == "get_attr":
                self.env[n] = None
        raise NotAnFFN("F has no output")

    def value(self, a: object) -> _Value:
        return self.env.get(a) if isinstance(a, fx.Node) else None

    def step(self, n: fx.Node) -> _Value:
        args = [self.value(a) for a in n.args] + [self.value(a) for a in n.kwargs.values()]
        lists = [self.value(x) for a in n.args if isinstance(a, (list, tuple)) for x in a]
        if is_call(n, torch.ones_like, torch.ones) or is_method_call(n, "new_ones"):
            return _Ones()
        if n.args and isinstance(self.value(n.args[0]), _Ones):
            moves = is_method_call(n, *_ONES_VIEWS) or is_call(n, operator.getitem, torch.reshape, torch.unsqueeze)
            return _Ones() if moves else None
        if all(v is None or isinstance(v, _Ones) for v in args + lists):
            return None  # index / size arithmetic: decides where rows go, not what they hold
        if is_call(n, torch.einsum, torch.functional.einsum):
            return self.batched_einsum(n)
        if _is_add(n):
            return self.bias_add(n)
        first = self.value(n.args[0]) if n.args else None
        if is_call(n, operator.setitem) or is_method_call(n, "index_copy_", "index_put_"):
            self.write_rows(n)
            return None
        if isinstance(first, _Pieces) and is_call(n, operator.getitem) and isinstance(n.args[1], int):
            return first.items[n.args[1]]
        if isinstance(first, _Weight):
            return self.weight_op(n, first)
        if isinstance(first, _Rows):
            return self.rows_op(n, first)
        if is_call(n, torch.cat):
            return self.cat(n)
        if is_call(n, torch._grouped_mm, torch.matmul, operator.matmul, torch.nn.functional.linear):
            raise NotAnFFN(f"{describe(n)} multiplies a weight by rows in an unsupported order")
        raise NotAnFFN(f"{describe(n)} computes on rows or weights in a way the FFN templates do not cover")

    # --- weights ---

    def weight_op(self, n: fx.Node, w: _Weight) -> _Value:
        dtype = n.args[1] if is_method_call(n, "to") and len(n.args) > 1 else None
        if is_method_call(n, *_CAST_METHODS) and not n.args[1:]:
            dtype = _CAST_METHODS[str(n.target)]
        if isinstance(dtype, torch.dtype):
            before = node_value(n.args[0])
            if before is not None and before.dtype == dtype:
                return w  # a cast to the dtype the weight has is no cast (as for rows: torchtitan's bf16 weights)
            return replace(w, dtype=dtype)
        if is_method_call(n, *_MOVE_METHODS):
            return w
        if w.gathered:
            raise NotAnFFN(f"{describe(n)} uses weights[{w.position}] gathered by an index other than as a bias")
        if self.gathers_bias_rows(n, w):  # b[expert_of_row]: an (E_l, F) bias expanded over rows of every expert
            return replace(w, gathered=True)
        dims = [d for d in n.args[1:3] if isinstance(d, int)]
        batch_transpose = is_method_call(n, "transpose") and len(dims) == 2 and sorted(d % 3 for d in dims) == [1, 2]
        if w.stacked and (batch_transpose or is_call(n, getattr) and n.args[1] == "mT"):
            return replace(w, transposed=not w.transposed)
        transpose_2d = is_method_call(n, "t", "transpose") or is_call(n, getattr) and n.args[1] in ("T", "mT")
        if transpose_2d and not w.stacked:
            return replace(w, transposed=not w.transposed)
        if is_call(n, operator.getitem) and isinstance(n.args[1], int) and w.index is None:
            if w.stacked or (_ndim(n.args[0]) == 2 and not w.transposed):  # w[e], or one expert's bias b[e]
                return replace(w, stacked=False, index=n.args[1])
        if self.bias_view(n, w):  # b[:, None], b.unsqueeze(1), b.view(E_l, 1, F): size-1 dims only
            return replace(w, stacked=_ndim(n) == 3)
        raise NotAnFFN(f"{describe(n)} uses weights[{w.position}] in a way the FFN templates do not cover")

    def gathers_bias_rows(self, n: fx.Node, w: _Weight) -> bool:
        """``b[idx]`` / ``b.index_select(0, idx)`` of a 2-D ``(E_l, F)`` tensor by an opaque index (rows' order)."""
        if w.stacked or w.index is not None or w.transposed or _ndim(n.args[0]) != 2:
            return False
        if is_call(n, operator.getitem):
            index = n.args[1]
            if isinstance(index, tuple) and index and all(i == slice(None) for i in index[1:]):
                index = index[0]
            return isinstance(index, fx.Node) and self.value(index) is None
        is_select = is_method_call(n, "index_select") or is_call(n, torch.index_select)
        return is_select and arg(n, 1, "dim") == 0 and self.value(arg(n, 2, "index")) is None

    def bias_view(self, n: fx.Node, w: _Weight) -> bool:
        """A view of a bias (at most 2-D) that only adds or drops dimensions of size 1."""
        view = is_method_call(n, "unsqueeze", "view", "reshape") or is_call(n, torch.unsqueeze, torch.reshape) or (
            is_call(n, operator.getitem) and isinstance(n.args[1], tuple)
            and all(i is None or i == slice(None) or i is Ellipsis for i in n.args[1]))
        before, after = node_value(n.args[0]), node_value(n)
        if not (view and not w.transposed and before is not None and after is not None and before.dim() <= 2):
            return False
        return [d for d in before.shape if d != 1] == [d for d in after.shape if d != 1] and after.dim() <= 3

    def bias_add(self, n: fx.Node) -> _Rows:
        """``rows + b`` (or ``b + rows``, ``rows += b``): a bias, when ``b`` is one bias row per expert."""
        a, b = n.args[0], arg(n, 1, "other")
        if len(n.args) > 2 or n.kwargs.get("alpha", 1) != 1:
            raise NotAnFFN(f"{describe(n)} adds a scaled tensor (alpha)")
        rows_node, bias_node = (a, b) if isinstance(self.value(a), _Rows) else (b, a)
        r, w = self.value(rows_node), self.value(bias_node)
        if not (isinstance(r, _Rows) and isinstance(w, _Weight)):
            raise NotAnFFN(f"{describe(n)} adds something other than a bias to rows")
        if not same_shape(shape_of(n), shape_of(rows_node)) or dtype_of(n) != dtype_of(rows_node):
            raise NotAnFFN(f"{describe(n)} makes rows {shape_of(rows_node)} {dtype_of(rows_node)} into "
                           f"{shape_of(n)} {dtype_of(n)} (broadcast or promoted by what it adds)")
        out = self.biased(n, r, w, bias_node)
        if rows_node is a and isinstance(a, fx.Node) and (is_call(n, operator.iadd) or is_method_call(n, "add_")):
            self.env[a] = out  # in place: the rows now hold the biased values
        return out

    def biased(self, n: fx.Node, r: _Rows, w: _Value, bias_node: object) -> _Rows:
        """``r + b`` with output ``n``: b one bias row of ``r``'s expert (any shape of ones but the features), or
        a stacked ``(E_l, 1, F)`` bias on batched ``(E_l, C, F)`` rows (a batched GEMM's, of every expert)."""
        rows, bias = node_value(n), node_value(bias_node)
        if not isinstance(w, _Weight) or w.transposed or rows is None or bias is None:
            raise NotAnFFN(f"{describe(n)} adds something other than a bias to rows")
        if bias.dtype != rows.dtype:
            raise NotAnFFN(f"{describe(n)} adds a {bias.dtype} bias to {rows.dtype} rows")
        features, shape = rows.shape[-1], tuple(bias.shape)
        if w.gathered:  # rows of every expert, each with its expert's bias row (the probe proves the index)
            if r.expert is not None or rows.dim() != 2 or not same_shape(shape, tuple(rows.shape)):
                raise NotAnFFN(f"{describe(n)} adds gathered bias rows {list(shape)} to rows {list(rows.shape)}")
            return _Rows(("bias", _bias_key(w, None), r.expr), None)
        one_row = len(shape) <= rows.dim() and all(d == 1 for d in shape[:-1]) and same_size(shape[-1], features)
        if r.expert is not None and one_row:
            return _Rows(("bias", _bias_key(w, r.expert), r.expr), r.expert)
        stacked = len(shape) == 3 and shape[:2] == (self.experts_per_rank, 1) and same_size(shape[2], features)
        if r.expert is None and rows.dim() == 3 and stacked and same_size(rows.shape[0], shape[0]) and w.index is None:
            return _Rows(("bias", _bias_key(w, None), r.expr), None)
        raise NotAnFFN(f"{describe(n)} adds a {list(shape)} tensor to rows {list(rows.shape)}: not one bias row "
                       f"per expert (one expert's rows + (F,), or batched (E_l, C, F) rows + (E_l, 1, F))")

    # --- rows ---

    def rows_op(self, n: fx.Node, r: _Rows) -> _Value:
        if self.moves_rows(n):
            return r
        if is_method_call(n, *_METADATA_METHODS) or is_call(n, getattr) and n.args[1] in ("shape", "dtype", "device"):
            return None
        if is_method_call(n, *_FRESH_BUFFERS) or is_call(n, torch.empty_like, torch.zeros_like):
            return _Rows(("fresh",), None)
        if is_method_call(n, *_CAST_METHODS, "to", "type_as"):
            return self.cast(n, r)
        if is_call(n, torch.functional.split, torch.split) or is_method_call(n, "split"):
            return self.split(n)
        if is_method_call(n, "chunk") and arg(n, 1, "chunks") == 2 and _is_feature_dim(n.args[0], arg(n, 2, "dim", 0)):
            return _Pieces(tuple(_Rows(("chunk", i, 2, r.expr), r.expert) for i in range(2)))
        if is_method_call(n, "chunk") or is_call(n, torch.chunk):
            return self.expert_chunks(n, r)
        if is_call(n, torch._grouped_mm) or n.op == "call_function" and qualname(n.target) in _GROUPED_MM_OPS:
            return self.gemm(n, r, self.value(n.args[1]), grouped=True)
        if is_method_call(n, "masked_fill", "masked_fill_") and self.value(n.args[1]) is None and n.args[2] == 0:
            # Rows an index marks (a sentinel for padding rows, ``ids >= E_l``) are zeroed: rows the ExpertFn
            # contract never hands F; the lowering's probe proves F unchanged without it.
            return r
        if (is_method_call(n, "sum") or is_call(n, torch.sum)) and _sums_size_one(n):
            return r  # view(R, 1, H).sum(1): each row's one route (transformers' top-1 sum on the experts' side)
        if is_call(n, torch.nn.functional.linear, torch._C._nn.linear):
            out = self.gemm(n, r, self.value(arg(n, 1, "weight")), grouped=False, linear=True)
            bias = arg(n, 2, "bias")
            return out if bias is None else self.biased(n, out, self.value(bias), bias)
        if is_call(n, torch.matmul, operator.matmul, torch.bmm, torch.mm) or is_method_call(n, "matmul", "bmm", "mm"):
            # (E_l, rows, H) @ (E_l, H, F): one GEMM per expert, like a grouped GEMM over equal groups.
            batched = _ndim(n.args[0]) == 3 and _ndim(n.args[1]) == 3
            return self.gemm(n, r, self.value(n.args[1]), grouped=batched)
        if is_call(n, *_ACTIVATIONS) or is_method_call(n, "relu"):
            name = next((v for k, v in _ACTIVATIONS.items() if n.target is k), "relu")  # call_method: relu
            return _Rows(("act", name, r.expr), r.expert)
        if is_call(n, torch.sigmoid, nnf.sigmoid) or is_method_call(n, "sigmoid"):
            return _Rows(("sigmoid", r.expr), r.expert)  # SiLU written out: h * sigmoid(h) (see ``product``)
        if is_call(n, nnf.gelu, torch.nn.functional.gelu):
            approximate = arg(n, 1, "approximate", "none")
            return _Rows(("act", "gelu_tanh" if approximate == "tanh" else "gelu", r.expr), r.expert)
        if is_call(n, operator.mul, torch.mul) or is_method_call(n, "mul"):
            return self.product(n)
        if (is_call(n, operator.pow, torch.pow) or is_method_call(n, "pow")) and n.args[1] == 2:
            return _Rows(("square", r.expr), r.expert)
        if is_method_call(n, "square") or is_call(n, torch.square):
            return _Rows(("square", r.expr), r.expert)
        raise NotAnFFN(f"{describe(n)} computes on rows in a way the FFN templates do not cover")

    def moves_rows(self, n: fx.Node) -> bool:
        """Gathers of whole rows by an index, and views that keep (rows, features)."""
        if is_call(n, operator.getitem):
            index = n.args[1]
            if isinstance(index, tuple) and index and all(i == slice(None) for i in index[1:]):
                index = index[0]
            return isinstance(index, fx.Node) and self.value(index) is None
        if is_method_call(n, "index_select") or is_call(n, torch.index_select):
            return arg(n, 1, "dim") == 0 and self.value(arg(n, 2, "index")) is None
        if is_method_call(n, *_MOVE_METHODS, "view", "reshape") or is_call(n, torch.reshape):
            # Views that keep each row's features together: (R, H) <-> (N, E_l, C, H) and the like.
            before, after = node_value(n.args[0]), node_value(n)
            return _ndim(n.args[0]) >= 2 and _ndim(n) >= 2 and before.shape[-1] == after.shape[-1]
        if is_method_call(n, "transpose") or is_call(n, torch.transpose):
            dims = [d for d in n.args[1:3] if isinstance(d, int)]
            last = _ndim(n.args[0]) - 1
            return len(dims) == 2 and last not in {d % (last + 1) for d in dims}
        if is_method_call(n, "permute"):
            order = as_list(n.args[1]) if len(n.args) == 2 else list(n.args[1:])
            return bool(order) and isinstance(order[-1], int) and order[-1] % len(order) == len(order) - 1
        return False

    def cast(self, n: fx.Node, r: _Rows) -> _Rows:
        before, after = node_value(n.args[0]), node_value(n)
        if before is None or after is None or before.dtype == after.dtype:
            return r
        return _Rows(("cast", after.dtype, r.expr), r.expert)

    def split(self, n: fx.Node) -> _Pieces:
        if arg(n, 2, "dim", 0) != 0:
            raise NotAnFFN(f"{describe(n)} splits rows along features")
        sizes = as_list(arg(n, 1, "split_size_or_sections"))
        if not sizes:
            raise NotAnFFN(f"{describe(n)} splits rows into equal sizes, not by expert")
        r = self.value(n.args[0])
        assert isinstance(r, _Rows)
        experts = [self._expert_of_size(s) for s in sizes]
        return _Pieces(tuple(_Rows(r.expr, e if e is not None else r.expert) for e in experts))

    def _expert_of_size(self, size: object) -> int | None:
        """The local expert whose rows a split piece holds, when its size says so: a (source, expert) split
        SymInt of F's binding, ``counts_L[e].item()`` of a per-expert count vector, or element ``s * E_l + e``
        of the received counts themselves (source-major ``(N * E_l,)``: a loop over every (source, expert)
        chunk, ``e = i % E_l``, as the scores-first layer of tests/models writes it)."""
        if not isinstance(size, fx.Node):
            return None
        if size in self.expert_of_split:
            return self.expert_of_split[size]
        flat = flat_index_of_item(size) if is_item(size) else None
        if flat is not None and shape_of(flat[0]) == (self.experts_per_rank,):
            return flat[1]
        if flat is not None and flat[0] is self.counts and shape_of(flat[0]) == (self.counts_numel,):
            return flat[1] % self.experts_per_rank
        return None

    def cat(self, n: fx.Node) -> _Rows:
        if _is_feature_dim(n, arg(n, 1, "dim", 0)):
            raise NotAnFFN(f"{describe(n)} concatenates along features")
        parts = [self.value(a) for a in as_list(n.args[0])]
        if not parts or not all(isinstance(p, _Rows) for p in parts):
            raise NotAnFFN(f"{describe(n)} concatenates rows with something else")
        rows = [p for p in parts if isinstance(p, _Rows)]
        expr = rows[0].expr
        for p in rows[1:]:
            expr = _merge(expr, p.expr)
        experts = {p.expert for p in rows}
        return _Rows(expr, experts.pop() if len(experts) == 1 else None)

    def expert_chunks(self, n: fx.Node, r: _Rows) -> _Pieces:
        """``rows.chunk(E_l, dim)`` along a dimension other than features (DeepSpeed's ``Experts`` on
        ``(N, E_l, C, H)``): piece ``e`` holds local expert ``e``'s rows (the probe checks the dimension)."""
        if arg(n, 1, "chunks") != self.experts_per_rank or _is_feature_dim(n.args[0], arg(n, 2, "dim", 0)):
            raise NotAnFFN(f"{describe(n)} chunks rows into pieces that are not one per local expert")
        if r.expert is not None:
            raise NotAnFFN(f"{describe(n)} chunks the rows of one expert again")
        return _Pieces(tuple(_Rows(r.expr, e) for e in range(self.experts_per_rank)))

    def batched_einsum(self, n: fx.Node) -> _Rows:
        """``einsum("ecm,emf->ecf", rows, w)`` (or ``"ecm,efm->ecf"``): a batched GEMM over stacked weights."""
        operands = list(n.args[1:])
        equation = n.args[0].replace(" ", "") if isinstance(n.args[0], str) else ""
        terms = equation.split("->")[0].split(",") if "->" in equation else []
        if len(operands) != 2 or len(terms) != 2:
            raise NotAnFFN(f"{describe(n)} is not a two-operand einsum of rows and a weight")
        (x_t, w_t), out = terms, equation.split("->")[1]
        r, w = self.value(operands[0]), self.value(operands[1])
        if not (isinstance(r, _Rows) and isinstance(w, _Weight) and len(x_t) == 3 and len(w_t) == 3
                and x_t[0] == w_t[0] == out[0]):
            raise NotAnFFN(f"{describe(n)} is not einsum('ecm,emf->ecf', rows, stacked weights)")
        contracted, kept = x_t[2], (set(w_t[1:]) - {x_t[2]})
        if contracted not in w_t[1:] or len(kept) != 1 or out != x_t[:2] + kept.pop():
            raise NotAnFFN(f"{describe(n)} does not contract the rows' features with one weight dimension")
        # w_t = e, in, out: the stored (in, out) layout of a @ w; e, out, in: transposed.
        as_matmul = w if w_t[1] == contracted else replace(w, transposed=not w.transposed)
        return self.gemm(n, r, as_matmul, grouped=True)

    def write_rows(self, n: fx.Node) -> None:
        """``buf[idx] = rows`` into a fresh buffer: ``buf`` now holds those rows (in the order idx gives)."""
        target, src = n.args[0], self.value(n.args[-1])
        if not (isinstance(target, fx.Node) and self.value(target) == _Rows(("fresh",), None)):
            raise NotAnFFN(f"{describe(n)} writes rows into a buffer that is not fresh")
        if not isinstance(src, _Rows):
            raise NotAnFFN(f"{describe(n)} writes something other than rows")
        self.env[target] = src
        return None

    def gemm(self, n: fx.Node, r: _Rows, w: _Value, *, grouped: bool, linear: bool = False) -> _Rows:
        if not isinstance(w, _Weight) or w.gathered or (grouped and not (w.stacked and w.index is None)):
            raise NotAnFFN(f"{describe(n)} multiplies rows by something other than an expert weight")
        if not grouped and w.stacked and w.index is None:
            raise NotAnFFN(f"{describe(n)} multiplies rows by all experts' stacked weights at once")
        # grouped_mm(a, b[e]) and a @ b compute a @ b: b stored (in, out) unless transposed; linear(a, b) is a @ b.T.
        stored_out_in = w.transposed != linear
        layout: Layout = "out_in" if stored_out_in else "in_out"
        return _Rows(("gemm", _weight_key(w, layout, r.expert), r.expr), r.expert)

    def product(self, n: fx.Node) -> _Rows:
        a, b = self.value(n.args[0]), self.value(n.args[1])
        for rows, other in ((a, b), (b, a)):
            if isinstance(rows, _Rows) and isinstance(other, _Ones) and same_shape(shape_of(n), shape_of(
                    n.args[0] if rows is a else n.args[1])):
                return rows  # rows * ones
        if not (isinstance(a, _Rows) and isinstance(b, _Rows)):
            raise NotAnFFN(f"{describe(n)} scales rows by something other than rows (a constant or a score)")
        experts = {a.expert, b.expert}
        expert = experts.pop() if len(experts) == 1 else None
        if a.expr == b.expr:  # relu(h) * relu(h): squared ReLU
            return _Rows(("square", a.expr), expert)
        for h, other in ((a.expr, b.expr), (b.expr, a.expr)):
            if other == ("sigmoid", h):  # h * sigmoid(h): SiLU
                return _Rows(("act", "silu", h), expert)
        return _Rows(("mul", *sorted((a.expr, b.expr), key=repr)), expert)


def recognize_expert_ffn(fn: fx.GraphModule, binding: ExpertFnBinding, experts_per_rank: int) -> ExpertFFN:
    """The FFN program F runs on each row (see the module docstring); raises ``NotAnFFN`` with the reason."""
    out = _Interpreter(fn, binding, experts_per_rank).run()
    plan = match_ffn(out.expr, experts_per_rank)
    used = set().union(*(r.positions() for r in plan.roles()))
    if used != set(range(len(binding.weights))):
        raise NotAnFFN(f"F reads weights {sorted(set(range(len(binding.weights))) - used)} outside the FFN")
    if sum(len(r.positions()) for r in plan.roles()) != len(used):  # each gradient has one home
        raise NotAnFFN(f"a weight of F plays two roles in the FFN ({plan.describe()})")
    return plan
