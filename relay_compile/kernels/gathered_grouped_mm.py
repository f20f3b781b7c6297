"""``out[s] = a[idx[s]] @ b[e(s)]`` over rows sorted by expert, the row gather inside the GEMM's loads.

A hop's grouped GEMMs read their rows gathered by token (the forward's ``x[tok]`` into the first projection; the
backward's ``x[tok]`` and ``dy[tok]``). Gathered first, each is an ``(S, H)`` buffer written once and read once more
by the GEMM: on one H100 at EP=8, 65536 tokens per rank, the step's row gathers move 12.9 GB in 4.7 ms of its 51
(docs/BENCHMARKS.md, "Where the ring's last 5% goes"). This kernel reads each row straight from ``a`` at its index
instead (option ``gather_in_gemm``: 676 against 777 us for a gather and ``_grouped_mm`` at that hop's first
projection; in the backward it also stores the rows it read, ``rows_out``, for the weight gradients, which ran 1.6x
slower reading rows at their indices): a program per (expert's row tile, output tile), the tiles of every expert
laid end to end (each expert's rows from the int32 prefix sums ``offsets_E`` on the device: no host counts, no
sync), swizzled by ``GROUP_M`` row tiles so that a row tile is read from HBM about once for all output tiles. Rows past ``offsets_E[-1]`` are not written
(``torch._grouped_mm``'s contract).

Four epilogues (``Epilogue``): ``store`` the product rows; ``scatter`` add them, scaled, into an fp32 sum at the
pairs' tokens (``gathered_grouped_mm_scatter_add_``); ``swiglu`` and ``swiglu_backward`` compute a tile of both
halves of a stacked gate/up projection and apply SwiGLU's forward or backward to it (``kernels.swiglu_gemm``):
the ``(S, 2F)`` projections are never written, nor read again by a pointwise kernel.

Elsewhere (CPU tests, CI) ``reference`` computes it with ``index_select`` and one product per expert; the
kernel's logic is tested on the CPU under Triton's interpreter. Legend: T source rows, S sorted rows, E experts,
K the reduced width, N the output width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from relay_compile.kernels import interpreted as _interpreted
from relay_compile.kernels import triton_kernel


def reference(a_TK: Tensor, idx_S: Tensor | None, b_EKN: Tensor, offsets_E: Tensor, out_SN: Tensor) -> Tensor:
    """Eager: gather, then one product per expert, in the rows' dtype (fp32 accumulation where the CPU's GEMM
    has it); the definition the kernel is tested against."""
    rows_SK = a_TK if idx_S is None else torch.index_select(a_TK, 0, idx_S)
    ends = offsets_E.tolist()
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if end > start:
            torch.mm(rows_SK[start:end], b_EKN[e], out=out_SN[start:end])
    return out_SN


Epilogue = Literal["store", "scatter", "swiglu", "swiglu_backward"]


def applies(a_TK: Tensor, b_EKN: Tensor, epilogue: Epilogue = "store") -> bool:
    """Where the kernel runs: CUDA (or Triton's interpreter), 16-bit rows and weights of one dtype, unit column
    strides of the rows, Triton importable, outside of tracing (a traced graph takes the eager form), and a GPU
    whose shared memory holds the pipeline of ``epilogue``'s tile."""
    return (
        (a_TK.is_cuda and b_EKN.is_cuda or _interpreted()) and a_TK.dtype in (torch.bfloat16, torch.float16)
        and b_EKN.dtype == a_TK.dtype and a_TK.stride(-1) == 1 and not torch.compiler.is_compiling()
        and _triton_kernel() is not None and (not a_TK.is_cuda or _pipeline_fits(a_TK.device, epilogue))
    )


@functools.lru_cache(maxsize=None)
def _pipeline_fits(device: torch.device, epilogue: Epilogue) -> bool:
    """Whether ``stages`` buffers of a 16-bit A and B tile (two B tiles for ``swiglu``'s halves) fit one block's
    shared memory on ``device``: Hopper's 227 KiB hold the tiles chosen there (144 and 192 KiB), an A100's 163 KiB
    or an sm_89 card's 99 KiB do not, where the launch would fail with ``OutOfResources`` instead of falling back."""
    block_m, block_n, block_k, _, _, stages = tile_config(epilogue)
    block_n *= 2 if epilogue.startswith("swiglu") else 1
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if optin is None:  # an older torch: Hopper and later have the room
        return props.major >= 9
    return stages * (block_m + block_n) * block_k * 2 <= optin


def gathered_grouped_mm(
    a_TK: Tensor, idx_S: Tensor | None, b_EKN: Tensor, offsets_E: Tensor, out_SN: Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None, rows_out: Tensor | None = None,
) -> Tensor:
    """``out[s] = a[idx[s]] @ b[e(s)]`` (``idx_S=None``: ``a``'s own rows) for the row groups that end at the int32
    prefix sums ``offsets_E``; ``b_EKN`` any strides (a transposed view of ``(E, N, K)`` weights too). One launch
    where ``applies``, else ``reference``. ``config``: ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)``.
    ``rows_out`` ``(S, K)``: the rows ``a[idx]`` are stored there too (the rows the offsets cover; past them not
    written), for a later GEMM that reduces over them: read once, where a gather would read and write them before
    the GEMM reads them again."""
    rows = a_TK.shape[0] if idx_S is None else idx_S.shape[0]
    experts, _, width_n = b_EKN.shape
    check_offsets(offsets_E, experts)
    idx_S = as_vector(idx_S)
    if out_SN is None:
        out_SN = a_TK.new_empty((rows, width_n))
    if not (applies(a_TK, b_EKN) and out_SN.stride(-1) == 1):
        if rows_out is not None:
            store_rows(a_TK, idx_S, offsets_E, rows_out)
        return reference(a_TK, idx_S, b_EKN, offsets_E, out_SN)
    launch(a_TK, idx_S, b_EKN, offsets_E, out_SN, width_n, "store", config, rows_out=rows_out)
    return out_SN


def gathered_grouped_mm_scatter_add_(
    a_TK: Tensor, idx_S: Tensor | None, b_EKN: Tensor, offsets_E: Tensor, sum_TN: Tensor, tok_S: Tensor,
    scale_S: Tensor | None = None, *, tail_TN: Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> None:
    """``sum[tok[s]] += scale[s] * (a[idx[s]] @ b[e(s)])`` in place, in ``sum``'s dtype (fp32): the product's rows
    added into the ring's sum by the GEMM's epilogue (fp32 atomics), never written as an ``(S, N)`` buffer.
    ``tail_TN``: the sum's rows from ``len(sum_TN)`` on (``RowSum``'s two blocks). Where the kernel does not run:
    the product of the rows the offsets cover (a host read of their end), then ``scatter_add_rows``."""
    idx_S, tok_S, scale_S = as_vector(idx_S), as_vector(tok_S), as_vector(scale_S)
    if not (applies(a_TK, b_EKN, "scatter") and sum_TN.dtype == torch.float32 and sum_TN.stride(-1) == 1
            and (tail_TN is None or tail_TN.stride() == sum_TN.stride())):
        from relay_compile.kernels.scatter_add_rows import scatter_add_rows_

        # Only the rows the offsets cover (the kernel's contract; the rest of the product is not written).
        rows = int(offsets_E[-1]) if offsets_E.numel() else 0
        rows_SN = gathered_grouped_mm(a_TK, None if idx_S is None else idx_S[:rows], b_EKN, offsets_E,
                                      a_TK.new_empty((rows, b_EKN.shape[-1])))
        scatter_add_rows_(sum_TN, tok_S[:rows], rows_SN, None if scale_S is None else scale_S[:rows, None],
                          tail_TH=tail_TN)
        return
    check_offsets(offsets_E, b_EKN.shape[0])
    # The tail addressed from the sum's pointer (``scatter_add_rows``' convention): one pointer, no select.
    tail_offset = 0 if tail_TN is None else (tail_TN.data_ptr() - sum_TN.data_ptr()) // sum_TN.element_size()
    launch(a_TK, idx_S, b_EKN, offsets_E, sum_TN, b_EKN.shape[-1], "scatter", config, tok_S=tok_S, scale_S=scale_S,
           split=sum_TN.shape[0], tail_offset=tail_offset)


def store_rows(a_TK: Tensor, idx_S: Tensor | None, offsets_E: Tensor, rows_out: Tensor) -> None:
    """Eager ``rows_out``: the rows the offsets cover (a host read of their end), as the kernel stores them."""
    end = int(offsets_E[-1]) if offsets_E.numel() else 0
    rows_out[:end].copy_(a_TK[:end] if idx_S is None else torch.index_select(a_TK, 0, idx_S[:end]))


def launch(
    a_TK: Tensor, idx_S: Tensor | None, b_EKN: Tensor, offsets_E: Tensor, out: Tensor, width_n: int,
    epilogue: Epilogue, config: tuple[int, int, int, int, int, int] | None, *, tok_S: Tensor | None = None,
    scale_S: Tensor | None = None, split: int = 0, tail_offset: int = 0, g_SF: Tensor | None = None,
    score_S: Tensor | None = None, dpart_NS: Tensor | None = None, rows_out: Tensor | None = None,
    save_SU: Tensor | None = None,
) -> None:
    """One launch of the kernel over ``width_n`` output columns (each half's, for SwiGLU's epilogues) with
    ``epilogue``'s arguments: ``tok_S``, ``scale_S``, ``split``, ``tail_offset`` (``scatter``); ``g_SF``,
    ``score_S``, ``dpart_NS`` (``swiglu_backward``, ``kernels.swiglu_gemm``); ``save_SU`` (``swiglu``: the
    projections ``[h1, h3]`` stored there too). ``rows_out`` ``(S, K)``: the rows read (``a[idx]``) are stored there
    too, by each row tile's first output tile. The caller checked ``applies``."""
    assert rows_out is None or (rows_out.stride(-1) == 1 and rows_out.dtype == a_TK.dtype), (
        "gathered_grouped_mm: rows_out has the rows' dtype and unit column stride")
    rows = a_TK.shape[0] if idx_S is None else idx_S.shape[0]
    experts, width_k = b_EKN.shape[:2]
    block_m, block_n, block_k, group_m, warps, stages = config or tile_config(epilogue)
    # Every expert adds at most one partial row tile: programs past the real tiles return at once.
    tiles_m = _cdiv(rows, block_m) + experts
    grid = (tiles_m * _cdiv(width_n, block_n),)
    _triton_kernel()[grid](
        a_TK, a_TK if idx_S is None else idx_S, b_EKN, offsets_E, out, experts, width_n, width_k,
        a_TK.stride(0), b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2), out.stride(0),
        out if tok_S is None else tok_S, out if scale_S is None else scale_S, split, tail_offset,
        width_n * b_EKN.stride(2),  # SwiGLU's up half: ``width_n`` columns on
        out if g_SF is None else g_SF, 0 if g_SF is None else g_SF.stride(0), out if score_S is None else score_S,
        out if dpart_NS is None else dpart_NS, 0 if dpart_NS is None else dpart_NS.stride(0),
        a_TK if rows_out is None else rows_out, 0 if rows_out is None else rows_out.stride(0),
        a_TK if save_SU is None else save_SU, 0 if save_SU is None else save_SU.stride(0),
        GATHER=idx_S is not None, EVEN_K=width_k % block_k == 0, EVEN_N=width_n % block_n == 0, EPILOGUE=epilogue,
        SWIGLU=epilogue.startswith("swiglu"), STORE_ROWS=rows_out is not None, SAVE=save_SU is not None,
        HAS_SCALE=scale_S is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=warps, num_stages=stages,
    )


def check_offsets(offsets_E: Tensor, experts: int) -> None:
    """What the kernel's loads assume of the offsets: int32, one per weight matrix."""
    assert offsets_E.dtype == torch.int32 and offsets_E.shape == (experts,), (
        f"gathered_grouped_mm: offsets must be int32 ({experts},), got {offsets_E.dtype} {tuple(offsets_E.shape)}")


def as_vector(t: Tensor | None) -> Tensor | None:
    """An index or scale vector as the kernel loads it: contiguous (a column of ``(T, K)`` scores is not)."""
    assert t is None or t.dim() == 1, f"gathered_grouped_mm: indices and scales are vectors, got {tuple(t.shape)}"
    return t if t is None else t.contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): the fastest of eight tiles at a hop's shapes on an H100
# (docs/bench/gathered-gemm/raw-1-h100/gathered-gemm-8configs.txt, EP=8 65536 tokens): 128 x 256 x 64 with 8 warps,
# 3 stages for the products (h13 = x[tok] @ w13^T: 676 us against 777 for a gather and ``_grouped_mm``), 4 for the
# scatter epilogue, whose atomics a deeper pipeline hides better (y += s * act @ w2^T: 641 against 740 us at 3).
# SwiGLU's tiles hold both halves: 128 x (2 x 128), the products' accumulator and shared memory (not measured).
_CONFIGS: dict[str, tuple[int, int, int, int, int, int]] = {
    "store": (128, 256, 64, 8, 8, 3),
    "scatter": (128, 256, 64, 8, 8, 4),
    "swiglu": (128, 128, 64, 8, 8, 3),
    "swiglu_backward": (128, 128, 64, 8, 8, 3),
}


def tile_config(epilogue: Epilogue = "store") -> tuple[int, int, int, int, int, int]:
    if _interpreted():  # the interpreter runs each program in numpy: small tiles keep the CPU tests quick
        return (16, 16, 16, 2, 1, 1)
    return _CONFIGS[epilogue]


def compile_offline(
    epilogue: Epilogue, *, gather: bool = True, store_rows: bool = False, save: bool = False, even: bool = True,
    config: tuple[int, int, int, int, int, int] | None = None, k_contiguous: bool = True, arch: int = 90,
) -> Any:
    """One specialization of the kernel compiled for CUDA ``sm_{arch}`` without a GPU (``kernels.offline_compile``):
    bf16 rows, int64 indices, ``epilogue``'s tile (or ``config``), K and N whole tiles where ``even``; weights
    contiguous along K (``k_contiguous``: a transposed view of ``(E, N, K)`` weights, as ``w13`` for the first
    projection and ``w2`` for the down projection) or along N (``w2`` for ``dy @ w2``, ``w13`` for ``dx``), the unit
    stride a constant as Triton's launcher specializes an argument equal to 1 (without it the weights load an
    element at a time). Returns its ``ResourceUsage``; raises where it does not compile."""
    from relay_compile.kernels import offline_compile

    block_m, block_n, block_k, group_m, warps, stages = config or _CONFIGS[epilogue]
    pointers = {"a_ptr": "*bf16", "idx_ptr": "*i64", "b_ptr": "*bf16", "offs_ptr": "*i32",
                "out_ptr": "*fp32" if epilogue == "scatter" else "*bf16", "tok_ptr": "*i64", "scale_ptr": "*fp32",
                "g_ptr": "*bf16", "score_ptr": "*fp32", "dpart_ptr": "*fp32", "rows_out_ptr": "*bf16",
                "save_ptr": "*bf16"}
    kernel = _triton_kernel()
    types = {name: pointers.get(name, "i32") for name in kernel.arg_names}
    constexprs = dict(GATHER=gather, EVEN_K=even, EVEN_N=even, EPILOGUE=epilogue, SWIGLU=epilogue.startswith("swiglu"),
                      STORE_ROWS=store_rows, SAVE=save, HAS_SCALE=epilogue == "scatter", BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                      **{"stride_bk" if k_contiguous else "stride_bn": 1})
    # The widths and strides a hop's shapes give (multiples of 16), as Triton's launcher specializes them.
    aligned = [name for name in types if name.startswith(("width_", "stride_"))
               or name in ("up_offset", "split", "tail_offset")]
    return offline_compile.compile_for(kernel, types, constexprs, num_warps=warps, num_stages=stages, aligned=aligned,
                                       arch=arch)


def _build(triton: Any, tl: Any) -> Callable:
    """The Triton kernel (``kernels.triton_kernel`` compiles it on first use)."""

    @triton.jit
    def gathered_grouped_mm_kernel(a_ptr, idx_ptr, b_ptr, offs_ptr, out_ptr, experts, width_n, width_k,
                                   stride_a, stride_be, stride_bk, stride_bn, stride_o, tok_ptr, scale_ptr,
                                   split, tail_offset, up_offset, g_ptr, stride_g, score_ptr, dpart_ptr,
                                   stride_dpart, rows_out_ptr, stride_ro, save_ptr, stride_save, GATHER: tl.constexpr,
                                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EPILOGUE: tl.constexpr,
                                   SWIGLU: tl.constexpr, STORE_ROWS: tl.constexpr, SAVE: tl.constexpr,
                                   HAS_SCALE: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(width_n, BLOCK_N)
        tiles_m = tl.num_programs(0) // tiles_n
        # GROUP_M row tiles take every output tile before the next ones start: their rows stay in L2.
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % per_group) % size_m
        tile_n = (pid % per_group) // size_m
        # The expert whose rows hold row tile ``tile_m`` (each expert's tiles start at its first row).
        zero = pid * 0  # int32 scalars, as the loop's offsets are
        expert = zero - 1
        row0 = zero
        row_end = zero
        start = zero
        tiles_before = zero
        for e in range(experts):
            end = tl.load(offs_ptr + e)
            tiles = tl.cdiv(end - start, BLOCK_M)
            hit = (tile_m >= tiles_before) & (tile_m < tiles_before + tiles)
            expert = tl.where(hit, e, expert)
            row0 = tl.where(hit, start + (tile_m - tiles_before) * BLOCK_M, row0)
            row_end = tl.where(hit, end, row_end)
            tiles_before += tiles
            start = end
        if expert >= 0:
            rows = row0 + tl.arange(0, BLOCK_M)
            mask_m = rows < row_end
            # Rows past the expert's end read its last row (a valid index): they are computed, not stored, so the
            # loads need no row mask.
            rows_in = tl.minimum(rows, row_end - 1)
            if GATHER:
                src = tl.load(idx_ptr + rows_in).to(tl.int64)
            else:
                src = rows_in.to(tl.int64)
            cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = cols_n < width_n
            ks = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + src[:, None] * stride_a + ks[None, :]
            b_ptrs = (b_ptr + expert.to(tl.int64) * stride_be + ks[:, None].to(tl.int64) * stride_bk
                      + cols_n[None, :].to(tl.int64) * stride_bn)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SwiGLU's up half (unused otherwise)
            # STORE_ROWS: the row tile's first output tile also writes the rows it read (a masked store, not a
            # branch, so that every program's loop pipelines alike).
            ro_ptrs = rows_out_ptr + rows[:, None].to(tl.int64) * stride_ro + ks[None, :]
            ro_mask = (rows < tl.where(tile_n == 0, row_end, 0))[:, None]
            for k0 in range(0, width_k, BLOCK_K):
                if EVEN_K:
                    mask_kn = mask_n[None, :]
                    a = tl.load(a_ptrs)
                    if STORE_ROWS:
                        tl.store(ro_ptrs, a, mask=ro_mask)
                else:
                    mask_k = k0 + ks < width_k
                    mask_kn = mask_k[:, None] & mask_n[None, :]
                    a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
                    if STORE_ROWS:
                        tl.store(ro_ptrs, a, mask=ro_mask & mask_k[None, :])
                ro_ptrs += BLOCK_K
                if EVEN_K and EVEN_N:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=mask_kn, other=0.0)
                acc = tl.dot(a, b, acc)
                if SWIGLU:
                    if EVEN_K and EVEN_N:
                        b_up = tl.load(b_ptrs + up_offset)
                    else:
                        b_up = tl.load(b_ptrs + up_offset, mask=mask_kn, other=0.0)
                    acc_up = tl.dot(a, b_up, acc_up)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K * stride_bk
            mask = mask_m[:, None] & mask_n[None, :]
            if SWIGLU:
                # Rounded as the unfused forms round: each projection to the rows' dtype (the GEMM's output).
                h1 = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
                h3 = acc_up.to(a_ptr.dtype.element_ty).to(tl.float32)
            if EPILOGUE == "swiglu":
                if SAVE:  # the projections, for a backward that does not recompute them
                    saved = save_ptr + rows[:, None].to(tl.int64) * stride_save + cols_n[None, :]
                    tl.store(saved, h1.to(save_ptr.dtype.element_ty), mask=mask)
                    tl.store(saved + width_n, h3.to(save_ptr.dtype.element_ty), mask=mask)
                silu = (h1 / (1.0 + tl.exp(-h1))).to(a_ptr.dtype.element_ty)  # rounded: the pointwise kernel's
                act = silu.to(tl.float32) * h3
                out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols_n[None, :]
                tl.store(out, act.to(out_ptr.dtype.element_ty), mask=mask)
            elif EPILOGUE == "swiglu_backward":
                # ``kernels.swiglu_backward``'s arithmetic on this tile: g becomes score * act in place, dh13 is
                # stored, and <g, act> over the tile's columns goes to its row of the score-gradient partials.
                g_ptrs = g_ptr + rows[:, None].to(tl.int64) * stride_g + cols_n[None, :]
                g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
                score = tl.load(score_ptr + rows_in).to(tl.float32)[:, None]
                sig = tl.sigmoid(h1)
                silu = h1 * sig
                act = silu * h3
                tl.store(dpart_ptr + tile_n.to(tl.int64) * stride_dpart + rows, tl.sum(g * act, axis=1),
                         mask=mask_m)
                g = g * score
                tl.store(g_ptrs, (act * score).to(g_ptr.dtype.element_ty), mask=mask)
                out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols_n[None, :]
                tl.store(out, (g * h3 * (sig * (1 + h1 * (1 - sig)))).to(out_ptr.dtype.element_ty), mask=mask)
                tl.store(out + width_n, (g * silu).to(out_ptr.dtype.element_ty), mask=mask)
            elif EPILOGUE == "scatter":
                # Added into the sum's rows of the pairs' tokens: rows from ``split`` on live in the tail,
                # ``tail_offset`` elements from the sum's start.
                if HAS_SCALE:
                    acc = acc * tl.load(scale_ptr + rows_in).to(tl.float32)[:, None]
                token = tl.load(tok_ptr + rows_in).to(tl.int64)
                dest = tl.where(token < split, token * stride_o, tail_offset + (token - split) * stride_o)
                tl.atomic_add(out_ptr + dest[:, None] + cols_n[None, :], acc, mask=mask, sem="relaxed")
            else:
                out = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols_n[None, :]
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return gathered_grouped_mm_kernel  # named for profiles: every kernel of the package shows as its module


_triton_kernel = triton_kernel(_build)
