"""GatherND -> Gather on the flattened data, with a linear int32 index.

Why: the exporter's `GatherND(batch_dims=2)` on rank-5 data `[B, G, Hp, Wp, C]` is not usable on the web (JSEP's
shader fails to compile for rank-5 data; the native EP needs int64 index arithmetic on the CPU). A plain
`Gather(axis=0)` on the data reshaped to `[B*G*Hp*Wp, C]` reads exactly the same rows, *provided* every index
component lies in `[0, dim-1]`: only then is `((b*G + g)*Hp + y)*Wp + x` a bijection onto the rows. The range
prover must prove that; an unproven GatherND is left alone and reported, unless the user asks for
`--allow-unproven`, which rewrites it and says so loudly.

    data [B, G, H, W, C] --Reshape--> [B*G*H*W, C] --Gather(axis=0)--> out [B, G, P, C]
    indices [B, G, P, 2] -> y, x (int32) -> y*W + x + base[b, g]  (base = (b*G + g)*H*W)

The pass is general in `batch_dims`, index depth and trailing dims; the exporter's form is one instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph.pipeline import Action, Context, Outcome, Pass, Refuse
from ..graph.ranges import IndexVerdict, Status, gathernd_verdict

INT32_MAX = 2**31 - 1


def gate(ctx: Context, node: gs.Node, verdict: IndexVerdict, rows: int | None) -> None:
    """The checks every gather lowering shares (raises `Refuse`): a proof (or --allow-unproven), an integer index,
    and, once the shapes are known, a flattened row count an int32 index addresses."""
    if verdict.status is Status.OUT_OF_RANGE:
        raise Refuse(f"indices out of range ({verdict.reason})", **verdict.details)
    if not verdict.proven and not ctx.options.allow_unproven:
        raise Refuse(f"indices not proven in range: {verdict.reason}", **verdict.details)
    if rows is not None and rows - 1 > INT32_MAX:
        raise Refuse(f"flattened data has {rows} rows, more than an int32 index can address", data_rows=rows,
                     max_rows=INT32_MAX + 1)
    dtype = ctx.prover.dtype(node.inputs[1])
    if dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise Refuse(f"indices dtype {dtype} is not int32/int64", dtype=str(dtype))


def rewritten(pass_name: str, node: gs.Node, verdict: IndexVerdict, **details) -> Action:
    """The Action of a lowered gather: proven, or loudly unproven under --allow-unproven."""
    details = {**verdict.details, **details}
    if verdict.proven:
        return Action(pass_name, node.name, node.op, Outcome.REWRITTEN, verdict.reason, details=details)
    return Action(pass_name, node.name, node.op, Outcome.REWRITTEN_UNPROVEN,
                  f"UNPROVEN, rewritten because --allow-unproven was given: {verdict.reason}", details=details)


@dataclass(frozen=True)
class GatherNDPlan:
    """What `check` found for one GatherND: the static shapes, `batch_dims` and index depth the rewrite builds on."""

    dshape: tuple[int, ...]
    ishape: tuple[int, ...]
    b: int  # batch_dims
    r: int  # index depth: the data dims each index addresses
    verdict: IndexVerdict  # the prover's: proven, or rewritten under --allow-unproven

    @property
    def rows(self) -> int:
        return math.prod(self.dshape[: self.b + self.r])


class LowerGatherND(Pass):
    """Rewrite every proven GatherND into Reshape + int32 index arithmetic + Gather(axis=0)."""

    name = "gathernd"

    # `memo`: shared work across the gathers of one run: the four corners of a deformable conv read the same data
    # and share their clamped coordinates, so each flattened data tensor, each int32 coordinate and each scaled
    # coordinate is built once, not once per corner.
    def matches(self, ctx: Context) -> list[gs.Node]:
        return [n for n in ctx.graph.nodes if n.op == "GatherND"]

    def check(self, ctx: Context, node: gs.Node) -> GatherNDPlan:
        """The plan for rewriting `node`, or `Refuse` with the reason it must not be."""
        verdict = gathernd_verdict(ctx.prover, node)
        dshape = ctx.prover.static_shape(node.inputs[0])
        ishape = ctx.prover.static_shape(node.inputs[1])
        if dshape is None or ishape is None:
            gate(ctx, node, verdict, rows=None)
            raise Refuse("data or indices shape not known statically")
        plan = GatherNDPlan(tuple(dshape), tuple(ishape), int(node.attrs.get("batch_dims", 0)), ishape[-1], verdict)
        if dshape[:plan.b] != ishape[:plan.b]:
            raise Refuse(f"batch dims differ: data {dshape[:plan.b]} vs indices {ishape[:plan.b]}",
                         data_shape=dshape, indices_shape=ishape)
        gate(ctx, node, verdict, rows=plan.rows)
        return plan

    def rewrite(self, ctx: Context, node: gs.Node, plan: GatherNDPlan) -> Action:
        prover = ctx.prover
        data, indices = node.inputs[0], node.inputs[1]
        out = node.outputs[0]
        dshape, b, r, rows = plan.dshape, plan.b, plan.r, plan.rows
        addressed = dshape[b: b + r]
        rest = list(dshape[b + r:])
        point_shape = list(plan.ishape[:-1])
        base = node.name or out.name

        flat = self.memo.get(("flat", data.name))
        if flat is None:
            flat = ctx.layer("Reshape", f"{base}/flatten",
                             [data, ctx.const(f"{base}/flat_shape", np.array([rows, *rest], dtype=np.int64))],
                             prover.dtype(data), [rows, *rest], output=f"{base}/flat")
            self.memo[("flat", data.name)] = flat

        linear: gs.Tensor | None = None
        for i, comp in enumerate(self.components(ctx, indices, r, point_shape, base)):
            stride = math.prod(addressed[i + 1:])
            term = comp
            if stride != 1:
                term = self.memo.get(("scaled", comp.name, stride))
                if term is None:
                    term = ctx.layer("Mul", f"{base}/scale{i}",
                                     [comp, ctx.const(f"{base}/stride{i}", np.array(stride, dtype=np.int32))],
                                     np.int32, point_shape, output=f"{base}/term{i}")
                    self.memo[("scaled", comp.name, stride)] = term
            if linear is None:
                linear = term
            else:
                linear = ctx.layer("Add", f"{base}/accumulate{i}", [linear, term], np.int32, point_shape,
                                   output=f"{base}/linear{i}")

        batch = dshape[:b]
        if math.prod(batch) > 1:
            offsets = (np.arange(math.prod(batch), dtype=np.int64) * math.prod(addressed)).astype(np.int32)
            offsets = offsets.reshape(list(batch) + [1] * (len(point_shape) - b))
            linear = ctx.layer("Add", f"{base}/add_batch_offset", [linear, ctx.const(f"{base}/batch_offset", offsets)],
                               np.int32, point_shape, output=f"{base}/linear")

        node.outputs.clear()
        ctx.node("Gather", f"{base}/gather", [flat, linear], [out], {"axis": 0})
        return rewritten(self.name, node, plan.verdict, data_rows=rows)

    def components(self, ctx: Context, indices: gs.Tensor, r: int, point_shape: list[int],
                   base: str) -> list[gs.Tensor]:
        """The r index components as int32 tensors of shape `point_shape`.

        The exporter builds its indices as `Concat([y, x], axis=-1)` of `[..., 1]` tensors; reading `y` and `x`
        before the Concat avoids materialising and re-splitting it (the Concat then dies in cleanup).
        Casting to int32 is exact because the prover showed each component lies in `[0, dim-1]` and the
        flattened row count fits int32 (checked in `check`).
        """
        sources = self._concat_sources(ctx, indices, r)
        comps = []
        for i in range(r):
            key = ("component", sources[i].name if sources else f"{indices.name}[{i}]", tuple(point_shape))
            if key in self.memo:
                comps.append(self.memo[key])
                continue
            if sources is not None:
                shape_const = self.memo.get(("shape", tuple(point_shape)))
                if shape_const is None:
                    shape_const = ctx.const(f"{base}/point_shape", np.array(point_shape, dtype=np.int64))
                    self.memo[("shape", tuple(point_shape))] = shape_const
                shaped = ctx.layer("Reshape", f"{base}/index{i}_reshape", [sources[i], shape_const],
                                   ctx.prover.dtype(indices), point_shape, output=f"{base}/index{i}_i64")
            else:
                shaped = ctx.layer("Gather", f"{base}/index{i}_select",
                                   [indices, ctx.const(f"{base}/component{i}", np.array(i, dtype=np.int64))],
                                   ctx.prover.dtype(indices), point_shape, {"axis": -1},
                                   output=f"{base}/index{i}_i64")
            comp = ctx.layer("Cast", f"{base}/index{i}_to_int32", [shaped], np.int32, point_shape,
                             {"to": onnx.TensorProto.INT32}, output=f"{base}/index{i}")
            self.memo[key] = comp
            comps.append(comp)
        return comps

    @staticmethod
    def _concat_sources(ctx: Context, indices: gs.Tensor, r: int) -> list[gs.Tensor] | None:
        if len(indices.inputs) != 1 or indices.inputs[0].op != "Concat":
            return None
        concat = indices.inputs[0]
        rank = len(ctx.prover.static_shape(indices) or ())
        if rank == 0 or concat.attrs.get("axis") not in (-1, rank - 1) or len(concat.inputs) != r:
            return None
        sources = []
        for t in concat.inputs:
            shape = ctx.prover.static_shape(t)
            if shape is None or len(shape) != rank or shape[-1] != 1:
                return None
            # Reshape(Reshape(a, s1), s2) == Reshape(a, s2): start from `a`, so corners that reshape the same
            # clamped coordinate separately (the exporter does, once per corner) share one int32 coordinate.
            while len(t.inputs) == 1 and t.inputs[0].op == "Reshape":
                t = t.inputs[0].inputs[0]
            sources.append(t)
        return sources
