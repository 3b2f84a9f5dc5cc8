"""GatherElements (the exporter's `use_gathernd=False` form) -> Gather on the transposed, flattened data.

Why: with `use_gathernd=False` the exporter samples with `GatherElements(data [B, G, C, Hp*Wp], index, axis=3)`
whose index `y*Wp + x` is `Expand`ed over the C channels: an int64 tensor C times larger than it needs to be,
which the WebGPU EPs cannot compute on the GPU. The same values come from one row gather per sampling point:

    data [B, G, C, N] --Transpose--> [B, G, N, C] --Reshape--> [B*G*N, C] --Gather(axis=0)--> [B, G, P, C]
    --Transpose--> out [B, G, C, P]          with the row index  X[b, g, 0, p] + (b*G + g)*N  (int32)

where `X` is the index before the channel `Expand`, so the channel-expanded index is never materialised.
Exact when the prover shows `0 <= X < N` (and the row count fits int32); anything else is refused.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph.pipeline import Action, Context, Pass, Refuse
from ..graph.ranges import IndexVerdict, gather_elements_verdict
from .gathernd import gate, rewritten


class LowerGatherElements(Pass):
    """Rewrite proven per-pixel GatherElements (index constant across the channel axis) into a row Gather."""

    name = "gather_elements"

    def matches(self, ctx: Context) -> list[gs.Node]:
        return [n for n in ctx.graph.nodes if n.op == "GatherElements"]

    @staticmethod
    def _key(ctx: Context, t: gs.Tensor) -> tuple:
        """Identify data tensors by value: the exporter reshapes the same input once per corner."""
        p = t.inputs[0] if len(t.inputs) == 1 else None
        if p is not None and p.op == "Reshape":
            shape = ctx.prover.constant(p.inputs[1])
            if shape is not None:
                return ("reshape", p.inputs[0].name, tuple(int(v) for v in shape.reshape(-1)))
        return ("tensor", t.name)

    def per_pixel_index(self, ctx: Context, node: gs.Node) -> gs.Tensor:
        """The index before its channel broadcast (`[..., 1, P]`), or `Refuse` with the reason there is none."""
        prover = ctx.prover
        data, indices = node.inputs
        dshape, ishape = prover.static_shape(data), prover.static_shape(indices)
        if dshape is None or ishape is None:
            raise Refuse("data or indices shape not known statically")
        k = len(dshape)
        if k < 2 or int(node.attrs.get("axis", 0)) % k != k - 1:
            raise Refuse("only a gather along the last axis (the exporter's form) is lowered")
        if dshape[:k - 1] != ishape[:k - 1]:
            raise Refuse(f"indices {list(ishape)} do not match data {list(dshape)} outside the gather axis",
                         data_shape=dshape, indices_shape=ishape)
        producer = indices.inputs[0] if len(indices.inputs) == 1 else None
        if producer is not None and producer.op == "Expand":
            src = producer.inputs[0]
            sshape = prover.static_shape(src)
            if sshape is not None and len(sshape) == k and sshape[k - 2] == 1 and \
                    list(sshape[:k - 2]) == list(ishape[:k - 2]) and sshape[k - 1] == ishape[k - 1]:
                return src
        if ishape[k - 2] == 1:
            return indices
        raise Refuse("the index is not the same for every channel (not an Expand over the channel axis)")

    def check(self, ctx: Context, node: gs.Node) -> tuple[IndexVerdict, gs.Tensor]:
        """The plan for rewriting `node` (the prover's verdict, the per-pixel index); or `Refuse` with the reason."""
        verdict = gather_elements_verdict(ctx.prover, node)
        gate(ctx, node, verdict, rows=None)
        index = self.per_pixel_index(ctx, node)
        dshape = ctx.prover.static_shape(node.inputs[0])
        gate(ctx, node, verdict, rows=math.prod(dshape[:-2]) * dshape[-1])
        return verdict, index

    def rewrite(self, ctx: Context, node: gs.Node, plan: tuple[IndexVerdict, gs.Tensor]) -> Action:
        verdict, index = plan
        prover = ctx.prover
        data, out = node.inputs[0], node.outputs[0]
        dshape = prover.static_shape(data)
        k = len(dshape)
        lead, channels, n = list(dshape[:k - 2]), dshape[k - 2], dshape[k - 1]
        points = prover.static_shape(index)[k - 1]
        swap = list(range(k - 2)) + [k - 1, k - 2]
        base = node.name or out.name

        flat = self.memo.get(("flat", self._key(ctx, data)))
        if flat is None:
            rows_first = ctx.layer("Transpose", f"{base}/rows_first", [data], prover.dtype(data),
                                   lead + [n, channels], {"perm": swap})
            flat = ctx.layer("Reshape", f"{base}/flatten",
                             [rows_first, ctx.const(f"{base}/flat_shape", np.array([-1, channels], np.int64))],
                             prover.dtype(data), [math.prod(lead) * n, channels], output=f"{base}/flat")
            self.memo[("flat", self._key(ctx, data))] = flat

        point_shape = lead + [points]
        linear = self.memo.get(("index", index.name))
        if linear is None:
            shaped = ctx.layer("Reshape", f"{base}/index_reshape",
                               [index, ctx.const(f"{base}/point_shape", np.array(point_shape, np.int64))],
                               prover.dtype(index), point_shape, output=f"{base}/index_i64")
            linear = ctx.layer("Cast", f"{base}/index_to_int32", [shaped], np.int32, point_shape,
                               {"to": onnx.TensorProto.INT32}, output=f"{base}/index")
            if math.prod(lead) > 1:
                offsets = (np.arange(math.prod(lead), dtype=np.int64) * n).astype(np.int32).reshape(lead + [1])
                linear = ctx.layer("Add", f"{base}/add_batch_offset",
                                   [linear, ctx.const(f"{base}/batch_offset", offsets)], np.int32, point_shape,
                                   output=f"{base}/linear")
            self.memo[("index", index.name)] = linear

        rows = ctx.layer("Gather", f"{base}/gather", [flat, linear], prover.dtype(data), point_shape + [channels],
                         {"axis": 0}, output=f"{base}/rows")
        node.outputs.clear()
        ctx.node("Transpose", f"{base}/channels_first", [rows], [out], {"perm": swap})
        return rewritten(self.name, node, verdict, data_rows=math.prod(lead) * n)
