"""A Resize in channel groups (the bands pass, bands.py): how many groups, what each group reads (a Slice, or the
Conv making the Resize's input computed for the group's channels), the elementwise ops carried per group, and a
channel Concat several nodes read taken apart by its readers.

Why apart from the pass: these decide along the channels, where each channel is interpolated on its own with
weights of the spatial sizes only; none of it concerns the row bands of a Conv or the row chunks of a MatMul chain
the same pass computes. The module docstring of bands.py says why each form is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.budget import human
from ..graph.ops import ELEMENTWISE_NARY, ELEMENTWISE_UNARY
from ..graph.pipeline import Action, Context, Refuse
from ..graph.shapes import Shapes
from .cut_and_join import cut, float16_details, join
from .oversize import OversizeRun, concat_axis, even_parts


def _resize_inputs(node: gs.Node) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor]:
    """A Resize's roi, scales and sizes (an empty tensor for one it does not have)."""
    ins = list(node.inputs) + [gs.Variable.empty()] * (4 - len(node.inputs))
    return ins[1], ins[2], ins[3]


def _resize_part(ctx: Context, resize: gs.Node, x: gs.Tensor, channels: int, name: str, out_name: str,
                 shapes: Shapes) -> gs.Tensor:
    """`resize` of `x`, some `channels` of its input (a group, or one input of the Concat it read), with its
    attributes, roi and scales, and its sizes made a constant for those channels: the output's part."""
    out = resize.outputs[0]
    ys = shapes.shape(out)
    roi, scales, sizes = _resize_inputs(resize)
    part = ctx.var(out_name, shapes.dtype(out), (ys[0], channels, *ys[2:]))
    if sizes.name:
        part_sizes = ctx.const(f"{name}/sizes", np.array([ys[0], channels, *ys[2:]], np.int64))
        ctx.node("Resize", name, [x, roi, scales, part_sizes], [part], dict(resize.attrs))
    else:
        ctx.node("Resize", name, [x, roi, scales], [part], dict(resize.attrs))
    return part


def _shape_constant(ctx: Context, shape_node: gs.Node, shape: tuple[int, ...]) -> None:
    """A Shape of a tensor of static `shape` becomes a Constant of `shape[start:end]` (in place)."""
    start, end = int(shape_node.attrs.get("start", 0)), shape_node.attrs.get("end")
    value = np.array(shape[start:None if end is None else int(end)], np.int64)
    shape_node.op, shape_node.attrs = "Constant", {"value": ctx.const(f"{shape_node.name}/value", value)}
    shape_node.inputs.clear()


@dataclass(frozen=True)
class GroupPlan:
    """The channel groups a Resize is computed in: `groups` as `[c0, c1)` each; `carriers` the elementwise ops
    carried per group; `readers` the channel Concats the groups join, `sizers` the Shape readers made constants;
    `made_by` how its input is made per group (`_channel_source`), `makers` the same for the carriers' `others`
    inputs that are not constants (by id)."""

    resize: gs.Node
    whole: gs.Tensor  # the Resize's output
    groups: list[tuple[int, int]]
    carriers: list[gs.Node]
    readers: list[gs.Node]
    sizers: list[gs.Node]
    made_by: tuple
    others: dict[int, gs.Tensor]
    makers: dict[int, tuple]
    float16: bool  # a float16 tensor is made in groups: only the whole model shows the rewrite exact


class ResizeGroups:
    """Plans and builds the channel groups of a Resize whose output is over the limit (the pass's `resize`
    matches), and the parts of a channel Concat several nodes read (its `shared` matches)."""

    def __init__(self, run: OversizeRun) -> None:
        self.run = run

    def plan(self, ctx: Context, node: gs.Node) -> GroupPlan:
        """The fewest channel groups of Resize `node` whose outputs fit the limit, the groups taking its place
        among the channel Concats reading it; `Refuse` where that cannot be shown to give the same bytes."""
        shapes, limit, outside = self.run.shapes, self.run.limit, self.run.outside
        out, x = node.outputs[0], node.inputs[0]
        size = shapes.nbytes(out)
        head = f"output '{out.name}' ({human(size)}) stays over the {human(limit)} limit"
        if id(out) in outside:
            raise Refuse(f"{head}: it is read outside the rewritten part or is a graph output",
                         read_elsewhere=out.name)
        carriers = self._carriers(ctx, out, shapes, outside, head)
        grouped = [out, *(c.outputs[0] for c in carriers)]  # the tensors made in channel groups
        sizers = [r for t in grouped for r in t.outputs if r.op == "Shape"]  # need its shape only: a constant
        readers = list({id(r): r for t in grouped for r in t.outputs if r.op == "Concat"}.values())  # on the
        # channels (`_carriers` checked)
        self._channelwise(ctx, node, shapes, head)
        why = self.run.run_state.keep_whole.get(node.name)
        if why is not None:
            raise why.prefixed(f"{head}: ")
        groups = self._fewest_groups(node, head)
        maker, source, via = self._channel_source(ctx, x, node, outside)
        float16 = any(shapes.dtype(t) == np.float16 for t in [x, *grouped])
        if source is None and float16:  # only the whole model shows a float16 rewrite exact
            raise Refuse(f"{head}: in a float16 model its groups would read Slices of '{x.name}' (no Conv in the "
                         "rewritten part makes it for them), and then the whole model is not byte-identical at level "
                         "all (measured: 5.5e-6 on the real BiRefNet-lite 1024 fp16, where ORT CPU runs the whole "
                         "Resize on its NCHWc kernel)", source=x.name)
        others = {id(i): i for c in carriers for i in c.inputs if i.name and i is not out
                  and ctx.prover.constant(i) is None}
        makers = {k: self._channel_source(ctx, i, next(c for c in carriers if i in c.inputs), outside)
                  for k, i in others.items()}
        return GroupPlan(node, out, groups, carriers, readers, sizers, (maker, source, via), others, makers, float16)

    def rewrite(self, ctx: Context, plan: GroupPlan) -> Action:
        """The Resize computed in `plan`'s groups (its local proof recorded first), and what the report says."""
        maker, source, via = plan.made_by
        proof = self.run.proof(ctx, plan.resize.name, [*([maker, *via] if source is not None else []),
                                                       *(n for m, src, v in plan.makers.values() if src is not None
                                                         for n in (m, *v)),
                                                       plan.resize, *plan.carriers, *plan.readers],
                               [t for r in plan.readers for t in r.outputs], plan.float16)
        parts = self._build(ctx, plan)
        if proof is not None:
            proof.taken(ctx, self.run.shapes)
        return self._action(plan, parts, plan.float16)

    def _fewest_groups(self, node: gs.Node, head: str) -> list[tuple[int, int]]:
        """`[c0, c1)` of the fewest equal channel groups of Resize `node` whose outputs fit the limit; `Refuse`
        when one channel alone does not."""
        shapes, limit = self.run.shapes, self.run.limit
        size, channels = shapes.nbytes(node.outputs[0]), shapes.shape(node.inputs[0])[1]
        n = math.ceil(size / limit)
        if n > channels:
            raise Refuse(f"{head}: one channel alone is {human(size // channels)}", channels=channels,
                         channel_bytes=size // channels)
        return even_parts(channels, n)

    def _build(self, ctx: Context, plan: GroupPlan) -> list[gs.Tensor]:
        """The groups into the graph: each Resizes its channels of the input (a cut, or the Conv making it
        computed for them: `_group_of`), then the carried ops for them; the groups replace the whole among the
        readers' inputs and the Shape readers become constants. Returns the Resize's groups."""
        shapes, node, carriers = self.run.shapes, plan.resize, plan.carriers
        out, x = node.outputs[0], node.inputs[0]
        os_ = shapes.shape(out)
        parts: list[gs.Tensor] = []
        groups_of: dict[int, list[gs.Tensor]] = {}  # tensor -> its channel groups, in order
        for k, (c0, c1) in enumerate(plan.groups):
            base = f"{node.name}/group{k}"
            part_in = self._group_of(ctx, x, plan.made_by, c0, c1, k, shapes)  # (the Conv making the input, for
            # these output channels only, or a cut of them)
            part = _resize_part(ctx, node, part_in, c1 - c0, base, f"{out.name}/group{k}", shapes)
            parts.append(part)
            made = {id(out): part}
            for c in carriers:  # the elementwise ops between the Resize and the Concats, for these channels
                ins = [made[id(i)] if id(i) in made else
                       self._group_of(ctx, i, plan.makers[id(i)], c0, c1, k, shapes) if id(i) in plan.others else i
                       for i in c.inputs]
                y = c.outputs[0]
                made[id(y)] = ctx.var(f"{y.name}/group{k}", shapes.dtype(y), (os_[0], c1 - c0, *os_[2:]))
                ctx.node(c.op, f"{c.name}/group{k}", ins, [made[id(y)]], dict(c.attrs))
                groups_of.setdefault(id(y), []).append(made[id(y)])
                self.run.origin[id(made[id(y)])] = y
        groups_of[id(out)] = parts
        self.run.origin.update({id(p): out for p in parts})
        for r in plan.readers:
            joined = [p for t in r.inputs for p in groups_of.get(id(t), [t])]
            r.inputs.clear()
            r.inputs.extend(joined)
        for c in carriers:
            c.outputs.clear()
        for r in plan.sizers:
            _shape_constant(ctx, r, os_)
        node.outputs.clear()
        return parts

    def _action(self, plan: GroupPlan, parts: list[gs.Tensor], float16: bool) -> Action:
        """What the report says of the groups built: why, how many, and what each reads."""
        shapes, limit, node, groups = self.run.shapes, self.run.limit, plan.resize, plan.groups
        carriers, readers, sizers = plan.carriers, plan.readers, plan.sizers
        maker, source, _ = plan.made_by
        x, out, n = node.inputs[0], plan.whole, len(groups)
        size, channels = shapes.nbytes(out), shapes.shape(x)[1]
        widths = "/".join(str(w) for w in sorted({c1 - c0 for c0, c1 in groups}, reverse=True))
        largest = max(shapes.nbytes(p) or 0 for p in parts)
        details = {"groups": n, "group_channels": [c1 - c0 for c0, c1 in groups], "channels": channels,
                   "tensor": out.name, "size_bytes": size, "group_bytes": largest, "limit_bytes": limit,
                   "source": maker.name if source is not None else x.name, "readers": [r.name for r in readers],
                   "shape_readers": len(sizers), "carried": [c.op for c in carriers],
                   **float16_details(float16)}
        return self.run.rewritten(
            node, f"computed in {n} channel groups of {widths} channels (of {channels}): output '{out.name}' "
            f"{human(size)} -> {human(largest)} per group, limit {human(limit)}; each group "
            + (f"reads the output of Conv '{maker.name}' computed for its channels only"
               if source is not None else f"reads a Slice of its channels of '{x.name}'")
            + (f", then its {', '.join(c.op + ' ' + repr(c.name) for c in carriers)} per group" if carriers else "")
            + f"; the groups take its place in {', '.join(repr(r.name) for r in readers)} (Concat on the channel "
            "axis)"
            + (f", and its {len(sizers)} Shape reader(s) become Constants of its static shape" if sizers else "")
            + "; each element is interpolated from its own channel with the same weights (they depend on the spatial "
            "sizes only), but ORT's NCHWc layout (level all) runs a Resize of whole channel blocks with a kernel of "
            "its own, so it is written only once shown exact", details, float16)

    def _carriers(self, ctx: Context, out: gs.Tensor, shapes: Shapes, outside: set[int], head: str
                  ) -> list[gs.Node]:
        """The elementwise ops between a Resize's output and the channel Concats reading it, computed per channel
        group with the Resize: a Cast (the float16 converter keeps a Resize in float32 between two Casts), an Add of
        a lateral Conv's output (BiRefNet_HR's decoder). Each makes a tensor of the Resize's shape that only channel
        Concats (or Shapes) read; its other inputs are constants of one element, or tensors of that shape, each
        group reading their channels (a Slice, or the Conv making them computed for those channels: see
        `_channel_source`); one over the limit that no Conv makes would stay whole: refused.
        Each output element is computed from the elements at its own place, so the groups give the same bytes
        (ORT's fusions aside: the rewrite is shown exact like the Resize's groups)."""
        shape = shapes.shape(out)

        def channel_concats_only(t: gs.Tensor) -> bool:
            return all(r.op == "Shape" or (r.op == "Concat" and concat_axis(r, len(shape)) == 1) for r in t.outputs)

        carriers = []
        for r in out.outputs:
            if r.op == "Shape" or (r.op == "Concat" and concat_axis(r, len(shape)) == 1):
                continue
            y = r.outputs[0] if len(r.outputs) == 1 else None
            if r.op not in ELEMENTWISE_UNARY | ELEMENTWISE_NARY or y is None or shapes.shape(y) != shape or \
                    id(y) in outside or not channel_concats_only(y):
                raise Refuse(f"{head}: it is read by {r.op} '{r.name}', not only by Concats on the channel axis (or "
                             "elementwise ops of its shape that only such Concats read)", reader=r.name)
            for i in r.inputs:
                if not i.name or i is out:
                    continue
                known = ctx.prover.constant(i)
                if known is not None and known.size != 1:
                    raise Refuse(f"{head}: {r.op} '{r.name}' reads the constant '{i.name}' of {known.size} elements",
                                 reader=r.name)
                if known is None and shapes.shape(i) != shape:
                    raise Refuse(f"{head}: {r.op} '{r.name}' broadcasts '{i.name}' to the Resize's shape",
                                 reader=r.name)
                if known is None and (shapes.nbytes(i) or 0) > self.run.limit and \
                        self._channel_source(ctx, i, r, outside)[1] is None:
                    raise Refuse(f"{head}: {r.op} '{r.name}' reads '{i.name}' ({human(shapes.nbytes(i))}), itself "
                                 "over the limit and not made by a Conv read by it alone", reader=r.name,
                                 source=i.name)
            carriers.append(r)
        return carriers

    def _group_of(self, ctx: Context, t: gs.Tensor, made_by: tuple, c0: int, c1: int, k: int, shapes: Shapes
                  ) -> gs.Tensor:
        """Channels [c0, c1) of `t`: its Conv computed for them (`made_by` from `_channel_source`), or a cut."""
        maker, source, via = made_by
        s = shapes.shape(t)
        part = ctx.var(f"{t.name}/channels{c0}_{c1}", shapes.dtype(t), (s[0], c1 - c0, *s[2:]))
        if source is None:
            return cut(ctx, f"{t.name}/group{k}/slice", t, c0, c1, 1, part, s[1], self.run.held(ctx, t))
        w, b = source
        y = maker.outputs[0]
        made = ctx.var(f"{y.name}/channels{c0}_{c1}", shapes.dtype(y), (s[0], c1 - c0, *s[2:])) if via else part
        ctx.node("Conv", f"{maker.name}/group{k}",
                 [maker.inputs[0], ctx.const(f"{maker.inputs[1].name}/group{k}", w[c0:c1]),
                  *([ctx.const(f"{maker.inputs[2].name}/group{k}", b[c0:c1])] if b is not None else [])],
                 [made], dict(maker.attrs))
        for cast in via:  # (one at most)
            ctx.node(cast.op, f"{cast.name}/group{k}", [made], [part], dict(cast.attrs))
        return part

    @staticmethod
    def _channel_source(ctx: Context, x: gs.Tensor, resize: gs.Node, outside: set[int]
                        ) -> tuple[gs.Node | None, tuple | None, tuple[gs.Node, ...]]:
        """The Conv making `x`, its (weights, bias) and the Cast between them (a float16 converter's, before a
        Resize it kept in float32) when the groups can be made by that Conv's output-channel groups instead of
        Slices of its output.

        Why: at level `all` ORT CPU keeps a Conv's output in its NCHWc layout and runs a Resize reading it with its
        own NCHWc kernel; a Slice between them brings the data back to NCHW and the plain Resize kernel rounds
        differently (measured on the decoder-tail replica: 3e-8). A Conv of fewer output channels feeds each
        group's Resize as the whole Conv fed the whole Resize. Only for a Conv of one group read by this Resize
        and by Shape nodes (the exporter's `sizes`)."""
        none = (None, None, ())
        if len(x.inputs) != 1 or id(x) in outside or any(r is not resize and r.op != "Shape" for r in x.outputs):
            return none
        maker, via = x.inputs[0], ()
        if maker.op == "Cast" and len(maker.outputs) == 1 and len(maker.inputs[0].inputs) == 1 and \
                id(maker.inputs[0]) not in outside and \
                all(r is maker or r.op == "Shape" for r in maker.inputs[0].outputs):
            maker, via = maker.inputs[0].inputs[0], (maker,)
        if maker.op != "Conv" or int(maker.attrs.get("group", 1)) != 1 or len(maker.outputs) != 1:
            return none
        w = ctx.prover.constant(maker.inputs[1])
        b = ctx.prover.constant(maker.inputs[2]) if len(maker.inputs) > 2 and maker.inputs[2].name else None
        if w is None or (len(maker.inputs) > 2 and maker.inputs[2].name and b is None):
            return none
        return maker, (w, b), via

    @staticmethod
    def _channelwise(ctx: Context, node: gs.Node, shapes: Shapes, head: str) -> None:
        """Refuse a Resize that does not interpolate each channel on its own with weights of the spatial sizes
        only: a 4-D Resize with scale 1 on the batch and channel axes (constant scales, or sizes that are its
        inferred shape), no roi, axes or aspect-ratio policy."""
        xs, os_ = shapes.shape(node.inputs[0]), shapes.shape(node.outputs[0])
        mode = node.attrs.get("coordinate_transformation_mode", "half_pixel")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if xs is None or os_ is None or len(xs) != 4 or tuple(os_[:2]) != tuple(xs[:2]) or \
                mode == "tf_crop_and_resize" or "axes" in node.attrs or \
                node.attrs.get("keep_aspect_ratio_policy", "stretch") not in ("stretch", b"stretch"):
            raise Refuse(f"{head}: Resize '{node.name}' is not a 4-D Resize with scale 1 on the batch and channel "
                         "axes and no roi, axes or aspect-ratio policy", resize=node.name)
        _, scales, sizes = _resize_inputs(node)
        if sizes.name:
            known = ctx.prover.constant(sizes)
            if known is not None and [int(v) for v in known.reshape(-1)] != list(os_):
                raise Refuse(f"{head}: the sizes {known.tolist()} of Resize '{node.name}' are not its inferred shape "
                             f"{list(os_)}", sizes=known.reshape(-1).tolist(), shape=os_)
        elif scales.name:
            values = ctx.prover.constant(scales)
            if values is None or values.size != 4 or values[0] != 1 or values[1] != 1:
                raise Refuse(f"{head}: the scales of Resize '{node.name}' are not constant with 1 on the batch and "
                             "channel axes")
        else:
            raise Refuse(f"{head}: Resize '{node.name}' has neither scales nor sizes")

    def readers(self, ctx: Context, concat: gs.Node) -> list[gs.Node]:
        """The readers of channel Concat `concat` (over the limit) that take their parts from its inputs in
        `unshared`; `Refuse` where one cannot."""
        shapes, limit, out = self.run.shapes, self.run.limit, concat.outputs[0]
        head = f"output '{out.name}' ({human(shapes.nbytes(out))}) stays over the {human(limit)} limit"
        readers = [r for r in out.outputs if self.run.live(r)]  # (a node an earlier rewrite replaced is still there)
        for r in readers:
            if r.op == "Resize" and r.inputs[0] is out:
                self._channelwise(ctx, r, shapes, head)
            elif not (r.op == "Shape" or (r.op == "Conv" and r.inputs[0] is out)):
                raise Refuse(f"{head}: it is read by {r.op} '{r.name}' (each reader must take its part from the "
                             "Concat's inputs: a Conv, a Resize or a Shape can)", reader=r.name)
        return readers

    def unshared(self, ctx: Context, concat: gs.Node, readers: list[gs.Node]) -> Action:
        """Each reader of a channel Concat over the limit takes its part from the Concat's inputs (BiRefNet_HR's
        image pyramid, '/Concat_3': 192 MiB at 2048, read by the lateral Conv, a Resize and three Shapes).

        Why: the Concat is made whole as long as one reader reads it whole, and a Conv's bands make their rows of
        it from its inputs only when the Conv is its one reader. A Shape becomes a Constant of the static shape. A
        Resize becomes one Resize per Concat input, joined by a Concat on the channels: each channel is
        interpolated on its own with weights of the spatial sizes only (the channel groups' reasoning; ORT's NCHWc
        Resize kernel aside, so shown exact like them). The Convs are left its only readers: each one's bands then
        make their rows from the inputs' rows (`ConvRowBands.source`), and once every Conv is in bands the Concat
        is gone (a Conv whose bands are refused keeps reading it whole, as before)."""
        shapes, limit, out = self.run.shapes, self.run.limit, concat.outputs[0]
        xs, size = shapes.shape(out), shapes.nbytes(out)
        resizes = [r for r in readers if r.op == "Resize"]
        convs = [r for r in readers if r.op == "Conv"]
        sizers = [r for r in readers if r.op == "Shape"]
        float16 = shapes.dtype(out) == np.float16
        parts_in = list(concat.inputs)
        proof = self.run.proof(ctx, concat.name, [concat, *resizes], [r.outputs[0] for r in resizes],
                               float16) if resizes else None
        for r in resizes:
            y = r.outputs[0]
            parts = [_resize_part(ctx, r, x, shapes.shape(x)[1], f"{r.name}/part{k}", f"{y.name}/part{k}", shapes)
                     for k, x in enumerate(parts_in)]
            held = self.run.held(ctx, y)
            r.outputs.clear()
            r.inputs.clear()  # (the Conv's bands below ask whether the Concat has other readers)
            join(ctx, f"{r.name}/join", parts, y, 1, shapes, held)
        for r in sizers:
            _shape_constant(ctx, r, xs)
        for r in [r for r in out.outputs if not any(r is x for x in readers)]:
            r.inputs.clear()  # (what an earlier rewrite replaced: left for cleanup, reading nothing)
        if proof is not None:
            proof.taken(ctx, shapes)
        details = {"tensor": out.name, "size_bytes": size, "limit_bytes": limit,
                   "inputs": [x.name for x in parts_in], "resizes": [r.name for r in resizes],
                   "convs": [c.name for c in convs], "shape_readers": len(sizers), **float16_details(float16)}
        said = [*(f"Resize '{r.name}' becomes one Resize per input joined on the channels" for r in resizes),
                *([f"its {len(sizers)} Shape reader(s) become Constants of its static shape"] if sizers else []),
                *([f"{' and '.join(repr(c.name) for c in convs)} are left its only reader(s), for their bands to "
                   "make their rows from the inputs' rows"] if convs else [])]
        return self.run.rewritten(
            concat, f"read by {len(readers)} nodes, each now taking its part from its {len(parts_in)} inputs: "
            + "; ".join(said) + " (each channel is interpolated on its own, but ORT's NCHWc layout runs a Resize of "
            "whole channel blocks with a kernel of its own, so it is written only once shown exact)" * bool(resizes),
            details, float16 and bool(resizes), needs_verify=bool(resizes))

