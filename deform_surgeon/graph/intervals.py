"""Intervals: the abstract value the range prover (`ranges`) gives a tensor, and exact arithmetic on them.

An `Interval` bounds every value a tensor can take at run time (`lo <= v <= hi`, or NaN where `nan` is set) and
carries its provenance (where its range comes from, the last node that clamped it, the arithmetic applied since),
so that a refusal can say where a proof stopped. Integer arithmetic is exact (Python ints) and widens to the full
type range where it may wrap; float arithmetic is exact on rationals and rounded outwards to the element type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

Number = int | float

_MAX_TRAIL = 6


# ----------------------------------------------------------------------------------------------- intervals
@dataclass(frozen=True)
class Interval:
    """An interval `[lo, hi]` bounding a tensor's values (plus `nan` if NaN is possible) and where it comes from."""

    lo: Number
    hi: Number
    nan: bool = False
    source: str = ""
    clamp: str | None = None
    trail: tuple[str, ...] = ()

    def within(self, lo: Number, hi: Number) -> bool:
        return not self.nan and lo <= self.lo and self.hi <= hi

    def disjoint(self, lo: Number, hi: Number) -> bool:
        return self.hi < lo or self.lo > hi

    def text(self) -> str:
        return f"[{_fmt(self.lo)}, {_fmt(self.hi)}]" + (" or NaN" if self.nan else "")

    def history(self) -> str:
        """Human-readable provenance: origin, last clamp, arithmetic after it."""
        words = [f"range from {self.source}"] if self.source and self.source != self.stop_node() else []
        if self.clamp:
            words.append(f"bounded by {self.clamp}")
        if self.trail:
            words.append(("then " if self.clamp else "via ") + " -> ".join(self.trail))
        return ", ".join(words)

    def stop_node(self) -> str:
        """The node where a proof of this span stops: the first operation after the last clamp, or the origin."""
        if self.clamp and self.trail:
            return self.trail[0]
        if self.clamp:
            return self.clamp
        return self.source


@dataclass(frozen=True)
class Bound:
    """Abstract value of a tensor: one `whole` span, optionally a span per position along `axis` (negative)."""

    dtype: np.dtype | None
    whole: Interval
    parts: tuple[Interval, ...] | None = None
    axis: int | None = None

    def component(self, i: int, count: int) -> Interval:
        """Interval of position `i` along the last axis, when the last axis has `count` positions."""
        if self.parts is not None and self.axis == -1 and len(self.parts) == count:
            return self.parts[i]
        return self.whole


def _fmt(v: Number) -> str:
    if isinstance(v, int) and abs(v) >= 2**31:
        for bits in (31, 63):
            if v == -(2**bits):
                return f"-2^{bits}"
            if v == 2**bits - 1:
                return f"2^{bits}-1"
    if isinstance(v, float):
        if math.isinf(v):
            return "+inf" if v > 0 else "-inf"
        if v.is_integer() and abs(v) < 2**53:
            return str(int(v))
    return str(v)


def is_int(dtype: np.dtype | None) -> bool:
    return dtype is not None and (np.issubdtype(dtype, np.integer) or dtype == np.bool_)


def is_float(dtype: np.dtype | None) -> bool:
    return dtype is not None and np.issubdtype(dtype, np.floating)


def type_range(dtype: np.dtype | None) -> tuple[Number, Number]:
    if dtype is not None and dtype == np.bool_:
        return 0, 1
    if is_int(dtype):
        info = np.iinfo(dtype)
        return int(info.min), int(info.max)
    return -math.inf, math.inf


def full(dtype: np.dtype | None, source: str) -> Interval:
    lo, hi = type_range(dtype)
    return Interval(lo, hi, nan=not is_int(dtype), source=source)


def round_out(x: Fraction | float, dtype: np.dtype | None, up: bool) -> Number:
    """The nearest value of `dtype` at or beyond `x` in the given direction (ints: exact; floats: outward)."""
    if isinstance(x, float) and math.isinf(x):
        return x
    if is_int(dtype):
        return math.ceil(x) if up else math.floor(x)
    ftype = np.dtype(dtype if is_float(dtype) else np.float64).type
    try:
        approx = float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf
    with np.errstate(over="ignore"):
        y = ftype(approx)
    target = Fraction(x)
    if np.isinf(y):
        if (y > 0) == up:
            return float(y)
        y = ftype(np.finfo(ftype).max) * (1 if y > 0 else -1)
    while (Fraction(float(y)) < target) if up else (Fraction(float(y)) > target):
        y = np.nextafter(y, ftype(np.inf) if up else ftype(-np.inf))
        if np.isinf(y):
            break
    return float(y)


def exact(v: Number) -> Fraction | float:
    return v if isinstance(v, float) and math.isinf(v) else Fraction(v)


def fit_interval(lo: Fraction | float, hi: Fraction | float, dtype: np.dtype | None) -> tuple[Number, Number, bool]:
    """Round an exact interval outwards to `dtype`; for ints, report overflow (the op may wrap)."""
    rlo, rhi = round_out(lo, dtype, up=False), round_out(hi, dtype, up=True)
    if is_int(dtype):
        tlo, thi = type_range(dtype)
        if rlo < tlo or rhi > thi:
            return tlo, thi, True
    return rlo, rhi, False


# --------------------------------------------------------------------------------------------- arithmetic
def exact_add(a: Interval, b: Interval) -> tuple[Fraction | float, Fraction | float]:
    return _safe(lambda: exact(a.lo) + exact(b.lo), -math.inf), _safe(lambda: exact(a.hi) + exact(b.hi), math.inf)


def exact_sub(a: Interval, b: Interval) -> tuple[Fraction | float, Fraction | float]:
    return _safe(lambda: exact(a.lo) - exact(b.hi), -math.inf), _safe(lambda: exact(a.hi) - exact(b.lo), math.inf)


def exact_mul(a: Interval, b: Interval) -> tuple[Fraction | float, Fraction | float]:
    corners = []
    for x in (a.lo, a.hi):
        for y in (b.lo, b.hi):
            if (isinstance(x, float) and math.isinf(x)) or (isinstance(y, float) and math.isinf(y)):
                if x == 0 or y == 0:
                    return -math.inf, math.inf  # inf * 0 is NaN: give up on this product
                corners.append(math.inf if (x > 0) == (y > 0) else -math.inf)
            else:
                corners.append(Fraction(x) * Fraction(y))
    return min(corners), max(corners)


def _safe(fn, fallback: float):
    try:
        return fn()
    except (ValueError, TypeError, OverflowError):  # inf - inf and the like
        return fallback


def union(spans: Sequence[Interval]) -> Interval:
    worst = main_operand(spans)
    return Interval(min(s.lo for s in spans), max(s.hi for s in spans), any(s.nan for s in spans),
                worst.source, worst.clamp, worst.trail)


def main_operand(spans: Sequence[Interval]) -> Interval:
    """The operand whose provenance explains the result: the widest (unbounded first), non-constant preferred."""
    def width(s: Interval) -> float:
        try:
            return float(s.hi) - float(s.lo) + (math.inf if s.nan else 0)
        except OverflowError:
            return math.inf

    variable = [s for s in spans if not s.source.startswith("constant")] or list(spans)
    return max(variable, key=width)


def push_trail(trail: tuple[str, ...], label: str) -> tuple[str, ...]:
    trail = trail + (label,)
    return trail if len(trail) <= _MAX_TRAIL else trail[:1] + ("...",) + trail[-(_MAX_TRAIL - 2):]
