"""Compute int64 index chains in float32 and cast once to int32, so they stay on the GPU.

Why: after the gathers are lowered, the exporter's index arithmetic is still int64
(`Floor -> Cast(int64) -> Slice -> Add(+1) -> Clip(int64) -> Reshape -> Cast(int32)`), and neither WebGPU EP
computes int64 (no int64 Add, Clip or Slice; the native EP's Slice takes only floats). Left like that, every
node of the chain runs on the CPU EP with Memcpy nodes around it, which on JSEP 1.30 is a correctness hazard,
not only a cost. In float32 every one of those ops has a GPU kernel on both EPs, and the final
`Cast(float32 -> int32)` does too.

Exactness, node by node, of the float32 chain against the int64 original (each checked before rewriting):
- the leaf `Cast(F -> int64)` reads an integral float `F` (the output of Floor, Ceil or Round): in float32
  the value *is* F (an fp16 F widens to float32 exactly);
- Slice, Reshape, Squeeze, Unsqueeze, Identity, Transpose, Expand, Concat move values without changing them;
- a value the range prover bounds within +-2^24 is an integer float32 represents exactly, so Add, Sub and Mul
  of such values (whose results the prover also bounds within +-2^24) are exact;
- `Clip(u + c, lo, hi)` of an *unbounded* integral `u`, with |c|, |lo|, |hi| <= 2^22: if |u| < 2^23 then
  `u + c` is below 2^24 and exact; otherwise `u + c` is beyond +-2^22 on the side of u's sign, float32
  rounding is monotone and 2^22 is representable, so both versions clip to the same bound. An unbounded
  value may therefore only reach a Clip like that (at most one small constant added on the way).
- NaN: a float Clip of NaN is NaN, and `Cast(NaN -> int32)` is out of range (INT32_MIN on ORT CPU), so a Clip of
  a value not proven within +-2^24 is written `Where(x >= lo, Clip(x), lo)`: the same for every non-NaN x, `lo`
  for NaN (as ORT CPU's original: INT64_MIN clipped to lo). Every index stays in range for every input.
The one place the two can differ: where `F` is infinite or beyond int64, the original `Cast` to int64 is
undefined behaviour (ONNX Runtime CPU gives INT64_MIN on x86) while float32 clips +inf to `hi`. No
meaningful offset gets there (it means a sampling point more than 9.2e18 pixels away).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph.pipeline import Action, Context, Outcome, Pass, Refuse

EXACT = 2**24  # float32 represents every integer in [-2^24, 2^24]
SMALL = 2**22  # bound on constants added before, and limits of, a saturating Clip
_INTEGRAL_FLOAT_OPS = {"Floor", "Ceil", "Round"}
_STRUCTURAL = {"Reshape", "Squeeze", "Unsqueeze", "Identity", "Slice", "Transpose", "Expand", "Flatten"}
_INT_TYPES = (np.dtype(np.int64), np.dtype(np.int32))

BOUNDED = "bounded"  # proven within +-2^24: exact in float32
LEAF = "leaf"  # an integral float of any size (moved, not changed, since the Cast)
LEAF_PLUS_C = "leaf+c"  # LEAF plus one small constant: only a small Clip may consume it


@dataclass(frozen=True)
class Translated:
    tensor: gs.Tensor
    form: str


class IndexChainResidency(Pass):
    """Rewrite `Cast(int64 -> int32)` of an exporter-style int64 index chain into the same chain in float32.

    The chain is known exact only as its float32 form is built (`translate`, node by node up the chain): the check
    finds nothing to refuse, the rewrite may; a refused chain's nodes are taken back (`Pass.run`), and so are the
    chain's entries in `memo` (float32 forms shared by the chains of one run: the corners of a deformable conv
    read the same clamped coordinates)."""

    name = "residency"

    def matches(self, ctx: Context) -> list[gs.Node]:
        return [n for n in ctx.graph.nodes if self._is_root(ctx, n)]

    def check(self, ctx: Context, node: gs.Node) -> None:
        """Nothing to plan apart: a chain is known exact only as its float32 form is built (`rewrite`)."""
        return None

    def rewrite(self, ctx: Context, node: gs.Node, plan: None) -> Action:
        got = self.translate(ctx, node.inputs[0])
        if got.form != BOUNDED:
            span = ctx.prover.bound(node.inputs[0]).whole
            raise Refuse(f"the value cast to int32 is not proven within +-{EXACT}", stop=f"Cast '{node.name}'",
                         tensor=node.inputs[0].name, interval=[span.lo, span.hi], nan=span.nan, bound=EXACT)
        out = node.outputs[0]
        node.outputs.clear()
        ctx.node("Cast", f"{node.name}/from_float", [got.tensor], [out], {"to": onnx.TensorProto.INT32})
        return Action(self.name, node.name, node.op, Outcome.REWRITTEN,
                      "int64 index chain computed in float32 (integral values exact below 2^24, saturating NaN-safe "
                      "Clip) and cast once to int32", details={"bound": EXACT})

    def refused(self, node: gs.Node, why: Refuse) -> Action:
        return Action(self.name, node.name, node.op, Outcome.REFUSED, f"int64 index chain stays as it is: {why}",
                      details=why.details)

    @classmethod
    def _is_root(cls, ctx: Context, node: gs.Node) -> bool:
        """A Cast int64 -> int32 whose result indexes a Gather (through int32 arithmetic): a lowered index."""
        return (node.op == "Cast" and node.attrs.get("to") == onnx.TensorProto.INT32
                and ctx.prover.dtype(node.inputs[0]) == np.dtype(np.int64)
                and cls._indexes_a_gather(node.outputs[0], depth=0))

    @classmethod
    def _indexes_a_gather(cls, t: gs.Tensor, depth: int) -> bool:
        for consumer in t.outputs:
            if consumer.op == "Gather" and len(consumer.inputs) > 1 and consumer.inputs[1] is t:
                return True
            if consumer.op in ("Add", "Sub", "Mul", "Reshape") and depth < 8:
                if any(cls._indexes_a_gather(o, depth + 1) for o in consumer.outputs):
                    return True
        return False

    # -- translation ---------------------------------------------------------------------------------------
    def translate(self, ctx: Context, t: gs.Tensor) -> Translated:
        if t.name in self.memo:
            return self.memo[t.name]
        got = self._translate(ctx, t)
        self.memo[t.name] = got
        return got

    def _bounded(self, ctx: Context, t: gs.Tensor) -> bool:
        span = ctx.prover.bound(t).whole
        return not span.nan and -EXACT <= span.lo and span.hi <= EXACT

    def _translate(self, ctx: Context, t: gs.Tensor) -> Translated:
        values = ctx.prover.constant(t)
        if values is not None:
            if values.size and np.abs(values.astype(np.float64)).max() > EXACT:
                raise Refuse(f"constant '{t.name}' exceeds 2^24", tensor=t.name, bound=EXACT)
            return Translated(ctx.const(f"{t.name}/f32", values.astype(np.float32)), BOUNDED)
        if len(t.inputs) != 1:
            raise Refuse(f"'{t.name}' is a graph input, not computed from a float", tensor=t.name)
        node = t.inputs[0]
        base = node.name or t.name
        if node.op == "Cast":
            return self._leaf(ctx, node, t, base)
        if node.op in _STRUCTURAL or (node.op == "Gather" and ctx.prover.constant(node.inputs[1]) is not None):
            src = self.translate(ctx, node.inputs[0])
            out = ctx.layer(node.op, f"{base}/f32", [src.tensor, *node.inputs[1:]], np.float32, None, dict(node.attrs))
            return Translated(out, src.form)
        if node.op == "Concat":
            parts = [self.translate(ctx, i) for i in node.inputs]
            if any(p.form != BOUNDED for p in parts):
                raise Refuse(f"Concat '{node.name}' joins values not proven within +-2^24",
                             stop=f"Concat '{node.name}'", bound=EXACT)
            out = ctx.layer("Concat", f"{base}/f32", [p.tensor for p in parts], np.float32, None, dict(node.attrs))
            return Translated(out, BOUNDED)
        if node.op == "Clip":
            return self._clip(ctx, node, base)
        if node.op in ("Add", "Sub", "Mul"):
            return self._arith(ctx, node, t, base)
        raise Refuse(f"{node.op} '{node.name}' has no exact float32 form here", stop=f"{node.op} '{node.name}'")

    def _leaf(self, ctx: Context, node: gs.Node, t: gs.Tensor, base: str) -> Translated:
        src = node.inputs[0]
        src_dtype = ctx.prover.dtype(src)
        if src_dtype in _INT_TYPES:
            inner = self.translate(ctx, src)
            return inner
        if src_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise Refuse(f"Cast '{node.name}' reads {src_dtype}, not float32/float16", stop=f"Cast '{node.name}'",
                         dtype=str(src_dtype))
        producer = src.inputs[0] if len(src.inputs) == 1 else None
        if producer is None or producer.op not in _INTEGRAL_FLOAT_OPS:
            raise Refuse(f"Cast '{node.name}' reads a float that is not proven integral (no Floor/Ceil/Round)",
                         stop=f"Cast '{node.name}'")
        form = BOUNDED if self._bounded(ctx, t) else LEAF
        if src_dtype == np.dtype(np.float32):
            return Translated(src, form)
        wide = ctx.layer("Cast", f"{base}/f32", [src], np.float32, None, {"to": onnx.TensorProto.FLOAT})
        return Translated(wide, form)

    def _clip(self, ctx: Context, node: gs.Node, base: str) -> Translated:
        bounds = []
        for i in (1, 2):
            if i >= len(node.inputs) or not node.inputs[i].name:
                raise Refuse(f"Clip '{node.name}' is missing a bound", stop=f"Clip '{node.name}'")
            v = ctx.prover.constant(node.inputs[i])
            if v is None or v.size != 1 or abs(int(v.reshape(-1)[0])) > SMALL:
                raise Refuse(f"Clip '{node.name}' bound is not a constant within +-2^22", stop=f"Clip '{node.name}'",
                             bound=SMALL)
            bounds.append(int(v.reshape(-1)[0]))
        if bounds[0] > bounds[1]:
            raise Refuse(f"Clip '{node.name}' has min > max", stop=f"Clip '{node.name}'", interval=bounds)
        x = self.translate(ctx, node.inputs[0])
        lo = ctx.const(f"{base}/lo_f32", np.array(bounds[0], np.float32))
        out = ctx.var(f"{base}/f32", np.float32, None)
        ctx.node("Clip", f"{base}/f32", [x.tensor, lo, ctx.const(f"{base}/hi_f32", np.array(bounds[1], np.float32))],
                 [out])
        if x.form == BOUNDED:  # proven within +-2^24, so not NaN: the Clip alone is in range
            return Translated(out, BOUNDED)
        # An unbounded integral float may be NaN (a NaN or infinite offset, an fp16 overflow). The int64 original
        # casts it to some int64 and clips that into [lo, hi]; a float Clip of NaN is NaN, and Cast(NaN -> int32)
        # is INT32_MIN on ORT CPU, an out-of-range index. `x >= lo` is false exactly for NaN among the values
        # below lo or NaN, so `Where(x >= lo, Clip(x), lo)` is Clip(x) for every non-NaN x and lo for NaN.
        keep = ctx.layer("GreaterOrEqual", f"{base}/not_nan", [x.tensor, lo], np.bool_, None)
        safe = ctx.layer("Where", f"{base}/nan_safe", [keep, out, lo], np.float32, None, output=f"{base}/f32_nan_safe")
        return Translated(safe, BOUNDED)

    def _arith(self, ctx: Context, node: gs.Node, t: gs.Tensor, base: str) -> Translated:
        a, b = (self.translate(ctx, i) for i in node.inputs[:2])
        out = ctx.var(f"{base}/f32", np.float32, None)
        if a.form == BOUNDED and b.form == BOUNDED and self._bounded(ctx, t):
            form = BOUNDED
        elif node.op in ("Add", "Sub") and self._small_const_plus_leaf(ctx, node, a, b):
            form = LEAF_PLUS_C  # only a small Clip accepts it (see `_clip`); everything else refuses it
        else:
            span = ctx.prover.bound(t).whole
            raise Refuse(f"{node.op} '{node.name}' is not proven within +-2^24", stop=f"{node.op} '{node.name}'",
                         tensor=t.name, interval=[span.lo, span.hi], nan=span.nan, bound=EXACT)
        ctx.node(node.op, f"{base}/f32", [a.tensor, b.tensor], [out])
        return Translated(out, form)

    def _small_const_plus_leaf(self, ctx: Context, node: gs.Node, a: Translated, b: Translated) -> bool:
        const = ctx.prover.constant(node.inputs[1])
        if node.op == "Add" and const is None:
            const, a = ctx.prover.constant(node.inputs[0]), b
        return (const is not None and a.form == LEAF and const.size >= 1
                and np.abs(const.astype(np.float64)).max() <= SMALL)
