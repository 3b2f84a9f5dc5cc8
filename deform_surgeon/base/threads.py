"""Which ORT CPU intra-op thread counts can give a Conv, MatMul or Gemm other bytes, read from how MLAS splits them.

Why: a rewrite that changes a kernel's extent (row bands, chunks, channel groups) is exact only if every output
element is summed in the same order as in the whole node, and on ORT CPU that order depends on the thread count.
MLAS (onnxruntime/core/mlas/lib: convolve.cpp `MlasConvPrepare`/`MlasConvOperation`, sgemm.cpp
`MlasGemmBatch`/`MlasSgemmOperation`) splits the output columns of a float32 Conv or GEMM between threads, and each
thread's SGEMM sums K in blocks whose size (`StrideK`) grows when the thread's column count is small: an element
then gets other partial sums. The values never decide it; the thread count, the shapes and whether B is a
constant (prepacked: fixed blocks of 256, no dependence) do. So two thread counts that give every modelled node the
same blocking of every element give the same bytes, and a proof run at one thread count of each such class holds
at all of them (docs/runtime-facts.md, "Threads": the model is checked element by element against ORT in
tests/base/test_threads.py).

The model covers the float32 NCHW Conv at batch x group 1 (other batch/group counts give each thread whole
images: no dependence), the Conv computed as a GEMM (1x1, or more filters than output pixels) and MatMul/Gemm of
rank-2 problems. A Conv splits over at most `MLAS_MAXIMUM_THREAD_COUNT` (16) threads, so 1-16 stand for every
count; a GEMM splits over as many threads as it has 16-column blocks or rows, so counts up to `MAX_THREADS` are
read. Any other kernel with a sum (a node this does not model, e.g. ConvTranspose) is given every count 1-16.
Elementwise, data-movement and row-wise kernels (Add, Relu, Concat, Slice, Resize, Softmax, ...) compute each
element alone and do not depend on the thread count.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

MLAS_MAXIMUM_THREAD_COUNT = 16
_STRIDE_N = _STRIDE_K = 128  # MLAS_SGEMM_STRIDEN / MLAS_SGEMM_STRIDEK
_THREAD_ALIGN = 16  # MLAS_SGEMM_STRIDEN_THREAD_ALIGN
_THREAD_COMPLEXITY = 64 * 1024  # MLAS_SGEMM_THREAD_COMPLEXITY
MAX_THREADS = 64  # the largest intra-op count read for a GEMM (a Conv stops changing at 16)
_SUMMING = {"Conv", "ConvTranspose", "MatMul", "Gemm", "FusedConv", "FusedMatMul", "FusedGemm", "ConvInteger",
            "MatMulInteger", "QLinearConv", "QLinearMatMul", "Einsum"}


@dataclass(frozen=True)
class Kernel:
    """One node as MLAS sees it: `op`, its attributes, the shapes of its inputs (None: unknown) and whether its
    second input is a constant (a GEMM's prepacked B)."""

    op: str
    attrs: dict
    shapes: tuple[tuple[int, ...] | None, ...]
    constant_b: bool = False
    output: tuple[int, ...] | None = None


def thread_counts(kernels: Iterable[Kernel], default: int) -> tuple[int, ...]:
    """One intra-op thread count for each class of counts that split `kernels` alike (every count from 1 to
    `MAX_THREADS` is in one class; counts above stand with the largest where nothing changes past it), `default`
    standing for its own class: a proof run at these counts holds at every count."""
    kernels = [k for k in kernels if k.op in _SUMMING]
    if not kernels:
        return (default,)
    classes: dict[Hashable, list[int]] = {}
    for t in range(1, MAX_THREADS + 1):
        classes.setdefault(tuple(_signature(k, t) for k in kernels), []).append(t)
    return tuple(sorted(default if default in ts else ts[0] for ts in classes.values()))


def _signature(k: Kernel, t: int) -> Hashable:
    """How `k` blocks the sums of its output elements at `t` threads: equal signatures, equal orders."""
    if k.op in ("Conv", "FusedConv"):
        return _conv(k, t)
    if k.op in ("MatMul", "Gemm", "FusedMatMul", "FusedGemm"):
        return _gemm_node(k, t)
    return min(t, MLAS_MAXIMUM_THREAD_COUNT)  # not modelled: every count to 16 its own class


def _conv(k: Kernel, t: int) -> Hashable:
    x, w = (k.shapes + (None, None))[:2]
    if x is None or w is None or len(x) != 4 or len(w) != 4:
        return ("unknown", min(t, MLAS_MAXIMUM_THREAD_COUNT))
    group = int(k.attrs.get("group", 1))
    kernel = tuple(w[2:])
    strides = tuple(k.attrs.get("strides", (1, 1)))
    dilations = tuple(k.attrs.get("dilations", (1, 1)))
    pads = tuple(k.attrs.get("pads", (0, 0, 0, 0)))
    out_hw = list(k.output[2:]) if k.output is not None and len(k.output) == 4 else \
        [(x[2 + d] + pads[d] + pads[d + 2] - dilations[d] * (kernel[d] - 1) - 1) // strides[d] + 1 for d in range(2)]
    filters, channels = w[0] // group, x[1] // group
    size, depth = out_hw[0] * out_hw[1], channels * kernel[0] * kernel[1]
    if all(s == 1 for s in strides) and not any(pads) and depth == channels:  # 1x1: MLAS's GemmDirect
        return ("gemm", *_gemm(filters, size, depth, t, False)) if x[0] * group == 1 else "whole images"
    if filters > size:  # ExpandThenGemm: one threaded GEMM per image and group
        return ("gemm", *_gemm(filters, size, depth, t, False))
    if x[0] * group > 1:  # each thread takes whole images (or groups)
        return "whole images"
    return ("segments", *_segments(filters, size, depth, t))


def _segments(filters: int, size: int, depth: int, t: int) -> tuple:
    """MlasConvPrepare's thread segments of the output pixels and each one's K block (runs of equal blocks)."""
    complexity = filters * size * depth
    target = (complexity // _THREAD_COMPLEXITY + 1 if complexity < _THREAD_COMPLEXITY * MLAS_MAXIMUM_THREAD_COUNT
              else MLAS_MAXIMUM_THREAD_COUNT)
    target = min(target, t)
    stride = -(-size // target)
    if target > 1:
        stride = -(-stride // _THREAD_ALIGN) * _THREAD_ALIGN
        if stride >= size:
            target = 1
        elif stride * (target - 1) >= size:
            target -= 1
    if target == 1 or stride >= size:
        return _runs([(size, _block_k(size, depth))])
    return _runs([(min(stride, size - s), _block_k(min(stride, size - s), depth)) for s in range(0, size, stride)])


def _gemm_node(k: Kernel, t: int) -> Hashable:
    a, b = (k.shapes + (None, None))[:2]
    if a is None or b is None or len(b) != 2 or not a:
        return ("unknown", min(t, MAX_THREADS))
    trans_a, trans_b = int(k.attrs.get("transA", 0)), int(k.attrs.get("transB", 0))
    if k.op in ("Gemm", "FusedGemm"):
        m, depth = (a[1], a[0]) if trans_a else (a[0], a[1])
    else:
        m, depth = _prod(a[:-1]), a[-1]
    n = b[0] if trans_b else b[1]
    return _gemm(m, n, depth, t, k.constant_b)


def _gemm(m: int, n: int, depth: int, t: int, packed: bool) -> tuple:
    """MlasGemmBatch's split (columns in 16-blocks when N > M, else rows) and each part's K blocking. A prepacked
    B is summed in fixed blocks of 256 (MLAS_SGEMM_PACKED_STRIDEK) whatever the split; a part of one row takes the
    single-row kernel (one pass over K)."""
    if packed:
        return ("packed",)
    target = min(m * n * depth // _THREAD_COMPLEXITY + 1, t)
    if n > m:
        blocks = -(-n // _THREAD_ALIGN)
        parts = [min(c * _THREAD_ALIGN, n - s * _THREAD_ALIGN) for s, c in _partition(min(target, blocks), blocks)]
        return ("columns", *_runs([(c, "row" if m == 1 else _block_k(c, depth)) for c in parts]))
    rows = [c for _, c in _partition(min(target, m), m)]
    return ("rows", _block_k(n, depth), *_runs([(c, c == 1) for c in rows]))


def _partition(parts: int, total: int) -> list[tuple[int, int]]:
    """MlasPartitionWork: (start, count) of each part, the first `total % parts` one larger."""
    per, extra = divmod(total, parts)
    return [((per + 1) * i, per + 1) if i < extra else (per * i + extra, per) for i in range(parts)]


def _block_k(columns: int, depth: int) -> int:
    """The K block MlasSgemmOperation (and MlasConvOperation) sums `columns` output columns in; 0 where it is all
    of K (one block: no partial sums)."""
    stride_n, stride_k = _STRIDE_N, _STRIDE_K
    if columns >= depth:
        while stride_k // 2 >= depth:
            stride_k //= 2
            stride_n *= 2
    else:
        while stride_n > 16 and stride_n // 2 >= columns:
            stride_k *= 2
            stride_n //= 2
    return stride_k if stride_k < depth else 0


def _runs(parts: list[tuple[int, object]]) -> tuple:
    """(count, block) runs along the output, adjacent equal blocks merged: where the split falls does not matter
    when both sides of it sum alike."""
    merged: list[list] = []
    for count, block in parts:
        if merged and merged[-1][1] == block:
            merged[-1][0] += count
        else:
            merged.append([count, block])
    return tuple((c, b) for c, b in merged)


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
