"""Range prover: value intervals of integer and float tensors, propagated forward from the graph itself.

Why: linearising an index `(y, x)` into `y * W + x` is exact only when `0 <= y < H` and `0 <= x < W`; an index
with `x >= W` silently reads another row, and the WebGPU shaders do no bounds check at all. "There is a Clip
somewhere upstream" is not a proof (a Clip on an offset *before* the base grid is added bounds nothing), so
every rewrite that linearises an index asks this module for a proof, and nothing else decides.

The analysis is sound, not complete: every value a tensor can take at run time lies in its interval
(`lo <= v <= hi`, or NaN where `nan` is set); where an op is not modelled, the interval is the whole range of
the element type. Integer arithmetic is exact (Python ints) and widens to the full type range where it may
wrap; float arithmetic is exact on rationals and rounded outwards to the element type. Intervals can also be
kept per position along one axis (`parts`), which is how the exporter's `Concat([y, x], axis=-1)` index keeps a
separate bound for `y` and for `x`.

Each interval carries its provenance (where its range comes from, the last node that clamped it, the
arithmetic applied since), so a refusal can say where the proof stopped. The interval type and its arithmetic
are in `intervals`; the verdict on a gather's indices, from the intervals of its components, in `index_proof`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from functools import partialmethod
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .index_proof import IndexVerdict, Status, combine, judge
from .intervals import (
    Bound,
    Interval,
    Number,
    exact,
    exact_add,
    exact_mul,
    exact_sub,
    fit_interval,
    full,
    is_float,
    is_int,
    main_operand,
    push_trail,
    round_out,
    type_range,
    union,
)

if TYPE_CHECKING:
    from ..files import Weights

TypeInfo = dict[str, tuple[int, tuple[int | str | None, ...] | None]]

_MAX_PARTS = 64


# ----------------------------------------------------------------------------------------------- the prover
_PASS_THROUGH = {"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Expand", "Tile",
                 "Dropout", "DepthToSpace", "SpaceToDepth"}


def _selected(dtype: np.dtype | None, data: Bound, selected: list[Interval]) -> Bound:
    """The bound of the parts `selected` of `data` along its part axis (a Slice or Split of it); none: the whole."""
    if not selected:
        return Bound(dtype, data.whole)
    many = len(selected) >= 2
    return Bound(dtype, union(selected), tuple(selected) if many else None, data.axis if many else None)


def _label(node: gs.Node) -> str:
    return f"{node.op} '{node.name}'"


class RangeProver:
    """Lazily computes `Bound`s of the tensors of a graph, on demand, memoised.

    Only the backward cone of the tensors asked about is visited, and initializer values are read only if
    they are in that cone, so proving the indices of a 19,000-node model touches a few hundred nodes.
    """

    def __init__(self, graph: gs.Graph, types: TypeInfo | None = None, stored: Weights | None = None) -> None:
        self.graph = graph
        self.types = types or {}
        self.stored = stored
        self._memo: dict[int, Bound] = {}
        self._inputs = {id(t) for t in graph.inputs}

    # -- tensor facts ------------------------------------------------------------------------------------
    def dtype(self, tensor: gs.Tensor) -> np.dtype | None:
        if isinstance(tensor, gs.Constant):
            return np.dtype(tensor.dtype)
        if tensor.name in self.types:
            try:
                return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.types[tensor.name][0]))
            except Exception:
                return None
        if tensor.dtype is not None:
            try:
                return np.dtype(tensor.dtype)
            except TypeError:
                return None
        return None

    def shape(self, tensor: gs.Tensor) -> tuple | None:
        if isinstance(tensor, gs.Constant):
            return tuple(tensor.shape)
        known = self.types.get(tensor.name, (None, None))[1]
        if known is not None:
            return tuple(known)
        return None if tensor.shape is None else tuple(tensor.shape)

    def static_shape(self, tensor: gs.Tensor) -> tuple[int, ...] | None:
        shape = self.shape(tensor)
        if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
            return None
        return tuple(int(d) for d in shape)

    def constant(self, tensor: gs.Tensor) -> np.ndarray | None:
        """Values of a tensor that is an initializer, a stored tensor (a graph input of a lifted region, see
        files/weights.py) or the output of a Constant node (also through Identity nodes: torch's exporter shares
        equal initializers and gives each user an Identity of the one it kept, e.g. BiRefNet's BatchNorm
        parameters), else None."""
        for _ in range(8):
            if len(tensor.inputs) != 1 or tensor.inputs[0].op != "Identity" or not tensor.inputs[0].inputs:
                break
            tensor = tensor.inputs[0].inputs[0]
        if isinstance(tensor, gs.Constant):
            return np.asarray(tensor.values)
        if not tensor.inputs and self.stored is not None and tensor.name in self.stored.tensors:
            return self.stored.read(tensor.name)
        if len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant":
            attrs = tensor.inputs[0].attrs
            for key in ("value", "sparse_value"):
                if isinstance(attrs.get(key), gs.Constant):
                    return np.asarray(attrs[key].values)
            if "value_int" in attrs:
                return np.array(attrs["value_int"], dtype=np.int64)
            if "value_ints" in attrs:
                return np.array(attrs["value_ints"], dtype=np.int64)
            if "value_float" in attrs:
                return np.array(attrs["value_float"], dtype=np.float32)
            if "value_floats" in attrs:
                return np.array(attrs["value_floats"], dtype=np.float32)
        return None

    # -- the analysis -------------------------------------------------------------------------------------
    def bound(self, tensor: gs.Tensor) -> Bound:
        """The abstract value of `tensor`, computing (iteratively, not recursively) whatever it depends on."""
        if id(tensor) in self._memo:
            return self._memo[id(tensor)]
        stack: list[tuple[gs.Tensor, bool]] = [(tensor, False)]
        while stack:
            t, expanded = stack.pop()
            if id(t) in self._memo:
                continue
            deps = self._deps(t)
            if expanded or not deps:
                self._memo[id(t)] = self._compute(t)
                continue
            stack.append((t, True))
            stack.extend((d, False) for d in deps if id(d) not in self._memo)
        return self._memo[id(tensor)]

    def _deps(self, t: gs.Tensor) -> list[gs.Tensor]:
        if isinstance(t, gs.Constant) or len(t.inputs) != 1 or self.constant(t) is not None:
            return []
        node = t.inputs[0]
        if not self._modelled(node):
            return []
        return [i for i in node.inputs if i.name != "" or isinstance(i, gs.Constant)]

    def _modelled(self, node: gs.Node) -> bool:
        return node.op in _PASS_THROUGH or hasattr(self, f"_op_{node.op}")

    def _compute(self, t: gs.Tensor) -> Bound:
        dtype = self.dtype(t)
        values = self.constant(t)
        if values is not None:
            return self._from_values(values, dtype, f"constant '{t.name}'")
        if id(t) in self._inputs or len(t.inputs) == 0:
            return Bound(dtype, full(dtype, f"graph input '{t.name}'"))
        node = t.inputs[0]
        if node.op in _PASS_THROUGH:
            src = self._memo[id(node.inputs[0])]
            keep = node.op == "Identity" or node.op == "Dropout"
            return Bound(dtype, src.whole, src.parts if keep else None, src.axis if keep else None)
        handler = getattr(self, f"_op_{node.op}", None)
        if handler is None:
            return Bound(dtype, full(dtype, f"{_label(node)} (op not modelled by the prover)"))
        index = node.outputs.index(t)
        result = handler(node, dtype, index)
        return result

    def _from_values(self, values: np.ndarray, dtype: np.dtype | None, source: str) -> Bound:
        dtype = dtype or values.dtype
        if values.size == 0:
            return Bound(dtype, Interval(0, 0, source=source))
        if is_int(values.dtype):
            span = Interval(int(values.min()), int(values.max()), source=source)
            parts = None
            if values.ndim >= 1 and 2 <= values.shape[-1] <= 8:
                cols = values.reshape(-1, values.shape[-1])
                parts = tuple(Interval(int(c.min()), int(c.max()), source=source) for c in cols.T)
            return Bound(dtype, span, parts, -1 if parts else None)
        with np.errstate(invalid="ignore"):
            nan = bool(np.isnan(values).any())
            if nan:  # NaN bounds nothing: a Clip or Min/Max with a NaN operand, or a Cast of NaN, is undefined
                return Bound(dtype, Interval(-math.inf, math.inf, nan=True, source=f"{source} (holds NaN)"))
            return Bound(dtype, Interval(float(values.min()), float(values.max()), source=source))

    def _in(self, node: gs.Node, i: int) -> Bound | None:
        if i >= len(node.inputs) or (node.inputs[i].name == "" and not isinstance(node.inputs[i], gs.Constant)):
            return None
        return self._memo[id(node.inputs[i])]

    # -- elementwise helpers -------------------------------------------------------------------------------
    def _elementwise(self, node: gs.Node, dtype: np.dtype | None, spans_fn) -> Bound:
        """Apply `spans_fn(list[Interval]) -> Interval` to the whole spans and, where all agree, per part."""
        ins = [self._in(node, i) for i in range(len(node.inputs))]
        ins = [b for b in ins if b is not None]
        whole = spans_fn([b.whole for b in ins])
        axes = {b.axis for b in ins if b.parts is not None}
        parts = None
        axis = None
        if len(axes) == 1:
            axis = axes.pop()
            counts = {len(b.parts) for b in ins if b.parts is not None}
            if len(counts) == 1:
                n = counts.pop()
                parts = tuple(
                    spans_fn([b.parts[k] if b.parts is not None else b.whole for b in ins]) for k in range(n)
                )
        return Bound(dtype, whole, parts, axis if parts else None)

    def _arith(self, node: gs.Node, dtype: np.dtype | None, _: int = 0, *, fn) -> Bound:
        label = _label(node)

        def spans(s: list[Interval]) -> Interval:
            main = main_operand(s)
            nan = any(x.nan for x in s)
            lo, hi = fn(*s)
            if isinstance(lo, float) and math.isnan(lo) or isinstance(hi, float) and math.isnan(hi):
                return replace(full(dtype, main.source), trail=main.trail, clamp=main.clamp)
            rlo, rhi, wrapped = fit_interval(lo, hi, dtype)
            source = main.source
            if wrapped:
                if (main.lo, main.hi) == type_range(dtype):  # already the whole type: the wrap adds nothing new
                    return Interval(rlo, rhi, False, main.source, main.clamp, push_trail(main.trail, label))
                return Interval(rlo, rhi, False, f"{label} (may overflow {dtype})")
            if is_float(dtype) and (math.isinf(rlo) and math.isinf(rhi)) and not nan:
                nan = True  # inf - inf
            return Interval(rlo, rhi, nan and is_float(dtype), source, main.clamp, push_trail(main.trail, label))

        return self._elementwise(node, dtype, spans)

    # -- modelled ops: arithmetic -----------------------------------------------------------------------
    _op_Add = partialmethod(_arith, fn=exact_add)
    _op_Sub = partialmethod(_arith, fn=exact_sub)
    _op_Mul = partialmethod(_arith, fn=exact_mul)
    _op_Neg = partialmethod(_arith, fn=lambda a: (-exact(a.hi), -exact(a.lo)))

    def _op_Div(self, node, dtype, _):
        def div(a: Interval, b: Interval):
            if b.lo <= 0 <= b.hi:
                return -math.inf, math.inf
            corners = []
            for x in (a.lo, a.hi):
                for y in (b.lo, b.hi):
                    if isinstance(x, float) and math.isinf(x):
                        corners.append(x if y > 0 else -x)
                    elif isinstance(y, float) and math.isinf(y):
                        corners.append(Fraction(0))
                    else:
                        corners.append(Fraction(x) / Fraction(y))
            lo, hi = min(corners), max(corners)
            if is_int(dtype):  # integer Div truncates toward zero: stays within the real corners' floor/ceil
                lo, hi = (math.floor(lo) if not isinstance(lo, float) else lo), (
                    math.ceil(hi) if not isinstance(hi, float) else hi)
            return lo, hi

        return self._arith(node, dtype, fn=div)

    def _monotone(self, node, dtype, fn) -> Bound:
        label = _label(node)

        def spans(s: list[Interval]) -> Interval:
            a = s[0]
            lo, hi = fn(a.lo), fn(a.hi)
            trail = a.trail if (lo, hi) == (a.lo, a.hi) else push_trail(a.trail, label)
            return Interval(lo, hi, a.nan, a.source, a.clamp, trail)

        return self._elementwise(node, dtype, spans)

    def _op_Floor(self, node, dtype, _):
        return self._monotone(node, dtype, lambda v: v if math.isinf(v) else float(math.floor(v)))

    def _op_Ceil(self, node, dtype, _):
        return self._monotone(node, dtype, lambda v: v if math.isinf(v) else float(math.ceil(v)))

    def _op_Round(self, node, dtype, _):
        return self._monotone(node, dtype, lambda v: v if math.isinf(v) else float(np.round(v)))

    def _op_Relu(self, node, dtype, _):
        return self._monotone(node, dtype, lambda v: max(v, 0.0 if is_float(dtype) else 0))

    # -- clamps -----------------------------------------------------------------------------------------------
    def _clamp(self, node: gs.Node, dtype, x: Interval, lo_b: Interval | None, hi_b: Interval | None) -> Interval:
        lo, hi = x.lo, x.hi
        if lo_b is not None:  # max(x, a): monotone in both
            lo, hi = max(lo, lo_b.lo), max(hi, lo_b.hi)
        if hi_b is not None:  # min(., b)
            lo, hi = min(lo, hi_b.lo), min(hi, hi_b.hi)
        nan = x.nan or (lo_b is not None and lo_b.nan) or (hi_b is not None and hi_b.nan)
        if (lo, hi) != (x.lo, x.hi) and lo >= x.lo and hi <= x.hi:
            return Interval(lo, hi, nan, x.source, _label(node), ())
        return Interval(lo, hi, nan, x.source, x.clamp, x.trail)

    def _op_Clip(self, node, dtype, _):
        attrs = node.attrs
        lo_const = Interval(attrs["min"], attrs["min"]) if "min" in attrs else None
        hi_const = Interval(attrs["max"], attrs["max"]) if "max" in attrs else None
        bx = self._in(node, 0)
        blo = self._in(node, 1)
        bhi = self._in(node, 2)
        lo_s = blo.whole if blo is not None else lo_const
        hi_s = bhi.whole if bhi is not None else hi_const
        whole = self._clamp(node, dtype, bx.whole, lo_s, hi_s)
        parts = None
        if bx.parts is not None:
            parts = tuple(self._clamp(node, dtype, p, lo_s, hi_s) for p in bx.parts)
        return Bound(dtype, whole, parts, bx.axis if parts else None)

    def _minmax(self, node, dtype, _: int = 0, *, is_max: bool) -> Bound:
        label = _label(node)

        def spans(s: list[Interval]) -> Interval:
            pick = max if is_max else min
            lo, hi = pick(x.lo for x in s), pick(x.hi for x in s)
            nan = any(x.nan for x in s)
            # the result is bounded by the tightest operand on the clamped side
            main = main_operand(s)
            if (lo, hi) != (main.lo, main.hi):
                return Interval(lo, hi, nan, main.source, label, ())
            return Interval(lo, hi, nan, main.source, main.clamp, main.trail)

        return self._elementwise(node, dtype, spans)

    _op_Max = partialmethod(_minmax, is_max=True)
    _op_Min = partialmethod(_minmax, is_max=False)

    # -- type conversion -------------------------------------------------------------------------------------
    def _op_Cast(self, node, dtype, _):
        label = _label(node)
        src_dtype = self.dtype(node.inputs[0])

        def conv(a: Interval) -> Interval:
            if dtype is None:
                return full(dtype, f"{label} (unknown target type)")
            if dtype == np.bool_:
                return Interval(0, 1, False, a.source, a.clamp, push_trail(a.trail, label))
            if is_int(dtype):
                tlo, thi = type_range(dtype)
                if a.nan or (is_float(src_dtype) and (math.isinf(a.lo) or math.isinf(a.hi))):
                    why = f"{label} (its input, {a.text()}, may be NaN or infinite: the cast is undefined there)"
                    return Interval(tlo, thi, False, why, None, ())
                lo, hi = math.trunc(a.lo), math.trunc(a.hi)
                if lo < tlo or hi > thi:
                    return Interval(tlo, thi, False, f"{label} (input may not fit {dtype})", None, ())
                return Interval(lo, hi, False, a.source, a.clamp, a.trail)
            lo = round_out(exact(a.lo), dtype, up=False)
            hi = round_out(exact(a.hi), dtype, up=True)
            trail = a.trail if (lo, hi) == (a.lo, a.hi) else push_trail(a.trail, label)
            return Interval(lo, hi, a.nan, a.source, a.clamp, trail)

        return self._elementwise(node, dtype, lambda s: conv(s[0]))

    # -- structure ---------------------------------------------------------------------------------------------
    def _op_Concat(self, node, dtype, _):
        ins = [self._in(node, i) for i in range(len(node.inputs))]
        whole = union([b.whole for b in ins])
        axis = node.attrs.get("axis", 0)
        rank = self._rank(node.outputs[0]) or next((self._rank(i) for i in node.inputs if self._rank(i)), None)
        if rank is None:
            return Bound(dtype, whole)
        neg = axis - rank if axis >= 0 else axis
        parts: list[Interval] = []
        for t, b in zip(node.inputs, ins, strict=True):
            shape = self.static_shape(t)
            if shape is None:
                return Bound(dtype, whole)
            n = shape[neg]
            if b.parts is not None and b.axis == neg and len(b.parts) == n:
                parts.extend(b.parts)
            else:
                parts.extend([b.whole] * n)
            if len(parts) > _MAX_PARTS:
                return Bound(dtype, whole)
        return Bound(dtype, whole, tuple(parts) if len(parts) >= 2 else None, neg if len(parts) >= 2 else None)

    def _rank(self, t: gs.Tensor) -> int | None:
        shape = self.shape(t)
        return None if shape is None else len(shape)

    def _op_Slice(self, node, dtype, _):
        data = self._in(node, 0)
        if data.parts is None:
            return Bound(dtype, data.whole)
        rank = self._rank(node.inputs[0])
        consts = [self.constant(node.inputs[i]) if i < len(node.inputs) and node.inputs[i].name else None
                  for i in range(1, 5)]
        starts, ends, axes, steps = consts
        if rank is None or starts is None or ends is None or (len(node.inputs) > 3 and axes is None):
            return Bound(dtype, union(data.parts))
        axes = list(range(len(starts))) if axes is None else [int(a) for a in axes]
        steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
        selected = list(data.parts)
        for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
            if (a - rank if a >= 0 else a) == data.axis:
                selected = selected[int(s):int(e):st]
        return _selected(dtype, data, selected)

    def _op_Split(self, node, dtype, index):
        data = self._in(node, 0)
        if data.parts is None:
            return Bound(dtype, data.whole)
        rank = self._rank(node.inputs[0])
        axis = node.attrs.get("axis", 0)
        if rank is None or (axis - rank if axis >= 0 else axis) != data.axis:
            return Bound(dtype, data.whole)
        sizes = None
        if len(node.inputs) > 1 and node.inputs[1].name:
            sizes = self.constant(node.inputs[1])
        elif "split" in node.attrs:
            sizes = node.attrs["split"]
        if sizes is None:
            n = len(node.outputs)
            if len(data.parts) % n:
                return Bound(dtype, union(data.parts))
            sizes = [len(data.parts) // n] * n
        start = int(sum(int(s) for s in list(sizes)[:index]))
        selected = data.parts[start:start + int(list(sizes)[index])]
        return _selected(dtype, data, selected)

    def _op_Gather(self, node, dtype, _):
        data = self._in(node, 0)
        idx = self.constant(node.inputs[1])
        rank = self._rank(node.inputs[0])
        axis = node.attrs.get("axis", 0)
        if data.parts is None or idx is None or rank is None or (axis - rank if axis >= 0 else axis) != data.axis:
            return Bound(dtype, data.whole)
        n = len(data.parts)
        picked = [data.parts[int(i)] for i in np.asarray(idx).reshape(-1) if -n <= int(i) < n]
        return Bound(dtype, union(picked) if picked else data.whole)

    def _op_Where(self, node, dtype, _):
        a, b = self._in(node, 1), self._in(node, 2)
        return Bound(dtype, union([self._taken(node, a.whole), b.whole]))

    def _taken(self, node: gs.Node, x: Interval) -> Interval:
        """The span of `Where(cond, x, y)`'s `x` where it is taken: `cond` an `And` of comparisons of `x` itself
        with constants (`x >= c`, `x <= c`, `x > c`, `x < c`) bounds it there, and excludes NaN, which every such
        comparison rejects. Element for element: each comparison reads `x` at the position `Where` reads it."""
        taken = node.inputs[1]
        lo, hi, narrowed = x.lo, x.hi, False
        stack = [node.inputs[0]]
        while stack:
            t = stack.pop()
            producer = t.inputs[0] if len(t.inputs) == 1 else None
            if producer is None:
                continue
            if producer.op == "And":
                stack.extend(producer.inputs)
                continue
            if producer.op not in _COMPARE or len(producer.inputs) != 2:
                continue
            p, q = producer.inputs
            flip = q is taken and p is not taken
            if flip:
                p, q = q, p
            c = self.constant(q) if p is taken else None
            if c is None or c.size == 0 or (np.issubdtype(c.dtype, np.floating) and np.isnan(c).any()):
                continue
            below = (producer.op in ("GreaterOrEqual", "Greater")) == flip  # x <= c (or <)
            if below:
                hi = min(hi, _number(c.max()))
            else:
                lo = max(lo, _number(c.min()))
            narrowed = True
        if not narrowed:
            return x
        return Interval(lo, hi, False, x.source, f"{_label(node)} (taken where {node.inputs[0].name} holds)", ())


_COMPARE = {"GreaterOrEqual", "Greater", "LessOrEqual", "Less"}


def _number(v: np.generic) -> Number:
    return int(v) if np.issubdtype(type(v), np.integer) else float(v)



# ------------------------------------------------------------------------------------------- gather verdicts
def gathernd_verdict(prover: RangeProver, node: gs.Node) -> IndexVerdict:
    """Prove that every index of a GatherND addresses an existing element: component i in [0, dim(b+i) - 1]."""
    data, indices = node.inputs[0], node.inputs[1]
    b = int(node.attrs.get("batch_dims", 0))
    dshape, ishape = prover.static_shape(data), prover.static_shape(indices)
    if ishape is None or dshape is None:
        which = "indices" if ishape is None else "data"
        return IndexVerdict(node.name, node.op, Status.UNPROVEN, f"{which} shape not known statically")
    r = ishape[-1]
    if len(dshape) < b + r:
        return IndexVerdict(node.name, node.op, Status.UNPROVEN, "indices address more dims than data has")
    bound = prover.bound(indices)
    parts = [judge(b + i, dshape[b + i], bound.component(i, r)) for i in range(r)]
    return combine(node.name, node.op, parts)


def gather_elements_verdict(prover: RangeProver, node: gs.Node) -> IndexVerdict:
    """Prove that every index of a GatherElements (or a Gather: the same condition) lies in [0, dim(axis) - 1]."""
    data, indices = node.inputs[0], node.inputs[1]
    dshape = prover.static_shape(data)
    if dshape is None:
        return IndexVerdict(node.name, node.op, Status.UNPROVEN, "data shape not known statically")
    axis = int(node.attrs.get("axis", 0)) % len(dshape)
    part = judge(axis, dshape[axis], prover.bound(indices).whole)
    return combine(node.name, node.op, [part])
