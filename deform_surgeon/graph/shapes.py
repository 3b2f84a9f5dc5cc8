"""Static shapes and element types of a lifted region's tensors: analysis the split and bands passes ask (beside the
range prover, not a pass).

Why more than ONNX shape inference: inference loses shapes in real exports (BiRefNet's current export computes its
image-patch sizes through Shape -> Gather -> Div -> Cast, and every shape after that is unknown to it), and the
passes create tensors (the float32 index chains, the Add chains) whose shapes follow from their inputs. `Shapes`
asks the prover (the whole model's inference, the tensor's own declaration) first and otherwise derives a shape
through the ops whose output shape follows from their inputs', memoised per tensor for one pass's run.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .ops import ELEMENTWISE_NARY, ELEMENTWISE_UNARY, SHAPE_OPS
from .pipeline import Context

# ops whose output has their first input's element type (as far as the passes' tensors go)
_SAME_DTYPE = ELEMENTWISE_UNARY | ELEMENTWISE_NARY | SHAPE_OPS | {"Transpose", "Gather", "GatherND", "Concat", "Slice"}


def nbytes(shape: tuple[int, ...] | None, dtype: np.dtype | None) -> int | None:
    if shape is None or dtype is None:
        return None
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = {s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def along_rows(shape: tuple[int, ...], side: tuple[int, ...], axis: int = 2) -> bool:
    """True when a constant of shape `side` broadcasts to `shape` without varying along its rows (axis `axis`: H of
    [N, C, H, ...], T of a token-major [N, T, C]): the same value for every row, so an op with it (a bias Add, a
    scale Mul) can be carried per row chunk."""
    return broadcast([shape, side]) == shape and (len(side) < len(shape) - axis or
                                                  side[len(side) - len(shape) + axis] == 1)


class Shapes:
    """Static shapes and dtypes of tensors, also of tensors the earlier passes created without shape info."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._shape: dict[int, tuple[int, ...] | None] = {}
        self._dtype: dict[int, np.dtype | None] = {}

    def shape(self, t: gs.Tensor) -> tuple[int, ...] | None:
        key = id(t)
        if key not in self._shape:
            self._shape[key] = None  # guards against cycles in a malformed graph
            self._shape[key] = self._infer_shape(t)
        return self._shape[key]

    def dtype(self, t: gs.Tensor) -> np.dtype | None:
        key = id(t)
        if key not in self._dtype:
            self._dtype[key] = None
            self._dtype[key] = self._infer_dtype(t)
        return self._dtype[key]

    def nbytes(self, t: gs.Tensor) -> int | None:
        return nbytes(self.shape(t), self.dtype(t))

    def learn(self, t: gs.Tensor, shape: tuple[int, ...], dtype: np.dtype | None) -> None:
        """Record what a pass derived about a tensor inference left unknown (e.g. a Conv's input from its output)."""
        self._shape[id(t)] = tuple(shape)
        if self.dtype(t) is None:
            self._dtype[id(t)] = dtype

    def _infer_dtype(self, t: gs.Tensor) -> np.dtype | None:
        d = self.ctx.prover.dtype(t)
        if d is not None or len(t.inputs) != 1:
            return d
        node = t.inputs[0]
        if node.op == "Cast":
            try:
                return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["to"])))
            except Exception:
                return None
        if node.op in _SAME_DTYPE:
            return self.dtype(node.inputs[0]) if node.inputs else None
        return None

    def _infer_shape(self, t: gs.Tensor) -> tuple[int, ...] | None:
        s = self.ctx.prover.static_shape(t)
        if s is not None or len(t.inputs) != 1:
            return s
        node = t.inputs[0]
        ins = [self.shape(i) if i.name else None for i in node.inputs]
        try:
            if node.op in ELEMENTWISE_UNARY:
                return ins[0]
            if node.op in ELEMENTWISE_NARY:
                return None if any(s is None for s in ins) else broadcast(ins)
            if node.op == "Transpose" and ins[0] is not None:
                perm = node.attrs.get("perm") or list(reversed(range(len(ins[0]))))
                return tuple(ins[0][p] for p in perm)
            if node.op == "Reshape" and ins[0] is not None:
                target = self.ctx.prover.constant(node.inputs[1])
                return None if target is None else _resolve_reshape(ins[0], target, node.attrs.get("allowzero", 0))
            if node.op == "Gather" and ins[0] is not None and ins[1] is not None:
                ax = int(node.attrs.get("axis", 0)) % len(ins[0])
                return ins[0][:ax] + ins[1] + ins[0][ax + 1:]
            if node.op == "GatherND" and ins[0] is not None and ins[1] is not None:
                b = int(node.attrs.get("batch_dims", 0))
                return ins[1][:-1] + ins[0][b + ins[1][-1]:]
            if node.op == "Concat" and all(s is not None for s in ins):
                ax = int(node.attrs["axis"]) % len(ins[0])
                out = list(ins[0])
                out[ax] = sum(s[ax] for s in ins)
                return tuple(out)
        except (IndexError, KeyError, ValueError):
            return None
        return None


def _resolve_reshape(in_shape: tuple[int, ...], target: np.ndarray, allowzero: int) -> tuple[int, ...] | None:
    dims = [int(v) for v in target.reshape(-1)]
    out = []
    for k, d in enumerate(dims):
        out.append(in_shape[k] if d == 0 and not allowzero else d)
    total = math.prod(in_shape)
    if out.count(-1) == 1:
        known = math.prod(d for d in out if d != -1)
        if known == 0 or total % known:
            return None
        out[out.index(-1)] = total // known
    if -1 in out or math.prod(out) != total:
        return None
    return tuple(out)
