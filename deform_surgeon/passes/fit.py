"""Wide Split / Concat / Max / Min -> trees of narrow ones, so that every kernel fits the device's storage buffers.

Why: a WebGPU kernel binds one storage buffer per GPU input and output, and a device with the WebGPU spec's
default limits allows 8 per shader stage (`device.storage_buffers`). BiRefNet's code before November 2024 cut the
image into patches with `torch.split` / `torch.cat`: exported at 1024x1024 that is Splits into 32, 16 and 8
outputs and Concats of 1024, 256 and 64 inputs, and the run fails with "Too many storage buffers in shader".

What, and why each is exact:
- `Concat(x0..xn)` -> a tree of Concats along the same axis, inputs in their order. Concatenation is associative:
  the output holds the same elements at the same places. Data movement only, no arithmetic.
- `Split(x) -> y0..yn` -> a Split into consecutive groups, each group split again. Splitting a slice of the axis
  into the sizes of its outputs yields the same elements. Needs every output's size along the axis (from the
  `split` input, or from the axis size and the output count); otherwise refused.
- `Max(x0..xn)` / `Min(x0..xn)` -> a left-to-right chain of narrower Max / Min, each taking the previous result
  first: ORT CPU's variadic Max/Min is that left fold of the binary op (with broadcasting), so the same binary
  operations run in the same order (which matters only for NaN and signed zeros).
- `Mean` is refused: its division by the input count cannot be split into narrower Means exactly.
A node with too many buffers of any other op is refused with its count and the limit.

Each new node binds at most the limit (a Concat of `limit - 1` inputs plus its output; a Split of one input
into `limit - 1` outputs), so a second run finds nothing to do.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.device import storage_buffers
from ..graph.pipeline import Action, Context, Outcome, Pass, Refuse

FITTED = {"Concat", "Split", "Max", "Min"}


def node_buffers(node: gs.Node) -> int:
    return storage_buffers(node.op, [t.name for t in node.inputs], [t.name for t in node.outputs])


class FitStorageBuffers(Pass):
    """Every node binding more storage buffers than the device profile allows becomes a tree of narrow nodes."""

    name = "fit"

    def matches(self, ctx: Context) -> list[gs.Node]:
        limit = ctx.options.storage_buffers
        return [] if limit is None else [n for n in ctx.graph.nodes if node_buffers(n) > limit]

    def check(self, ctx: Context, node: gs.Node) -> list[int] | None:
        """The plan: for a Split the sizes of its outputs along the axis (None for the other ops); or `Refuse`."""
        limit = ctx.options.storage_buffers
        count = f"binds {node_buffers(node)} storage buffers, the device profile allows {limit}"
        numbers = {"buffers": node_buffers(node), "buffers_limit": limit}
        if limit < 3:
            raise Refuse(f"{count}: no tree of nodes fits fewer than 3", **numbers)
        if node.op == "Mean":
            raise Refuse(f"{count}; Mean's division by the input count cannot be split into narrower Means exactly",
                         **numbers)
        if node.op not in FITTED:
            raise Refuse(f"{count}; no exact rewrite into narrower nodes is known for {node.op}", **numbers)
        if node.op != "Split":
            return None
        sizes = self._split_sizes(ctx, node)
        if not sizes:
            raise Refuse(f"{count}; the sizes of its outputs along the axis are unknown", **numbers)
        return sizes

    def rewrite(self, ctx: Context, node: gs.Node, sizes: list[int] | None) -> Action:
        limit = ctx.options.storage_buffers
        width = limit - 1  # inputs of a Concat / outputs of a Split next to the one tensor on the other side
        base = node.name or node.outputs[0].name
        count = node_buffers(node)
        if node.op == "Concat":
            inputs, out = list(node.inputs), node.outputs[0]
            node.outputs.clear()
            self._concat_tree(ctx, inputs, out, node.attrs["axis"], width, base)
            what = f"{len(inputs)}-input Concat -> tree of Concats of at most {width} inputs"
            numbers = {"inputs": len(inputs)}
        elif node.op == "Split":
            outs = list(node.outputs)
            node.outputs.clear()
            self._split_tree(ctx, node.inputs[0], sizes, outs, node.attrs.get("axis", 0), width, base)
            what = f"Split into {len(outs)} -> tree of Splits into at most {width}"
            numbers = {"outputs": len(outs), "sizes": sizes}
        else:
            inputs, out = list(node.inputs), node.outputs[0]
            node.outputs.clear()
            self._fold(ctx, node.op, inputs, out, width, base)
            what = f"{len(inputs)}-input {node.op} -> left-to-right chain of {node.op}s of at most {width} inputs"
            numbers = {"inputs": len(inputs)}
        # The root of the tree keeps the node's name (labels and reports stay joinable); the old node, now without
        # outputs, is renamed and dropped by the next cleanup.
        made = ctx.built()
        if node.op == "Split":
            root = next(n for n in made if n.inputs[0] is node.inputs[0])
        else:
            root = next(n for n in made if n.outputs[0] is out)
        node.name, root.name = ctx.names.fresh(f"{base}/replaced"), node.name
        return Action(self.name, root.name, node.op, Outcome.REWRITTEN,
                      f"{what} (bound {count} storage buffers, the device profile allows {limit}; "
                      "same elements in the same places)",
                      details={**numbers, "width": width, "buffers": count, "buffers_limit": limit})

    # -- Concat ------------------------------------------------------------------------------------------------
    def _concat_tree(self, ctx: Context, inputs: list[gs.Tensor], out: gs.Tensor, axis: int, width: int,
                     base: str) -> None:
        def build(entries: list, target: gs.Tensor, name: str) -> None:
            parts = []
            for k, e in enumerate(entries):
                if isinstance(e, list):
                    t = ctx.var(f"{name}/part{k}", out.dtype, _concat_shape(_leaves(e), axis))
                    build(e, t, f"{name}/part{k}")
                    e = t
                parts.append(e)
            ctx.node("Concat", name, parts, [target], {"axis": axis})

        build(_tree(inputs, width), out, base)

    # -- Split -------------------------------------------------------------------------------------------------
    def _split_sizes(self, ctx: Context, node: gs.Node) -> list[int] | None:
        """Each output's size along the axis: from the `split` input or attribute, else from the axis size and the
        output count (the spec's rule), else from the outputs' inferred shapes."""
        n, axis = len(node.outputs), node.attrs.get("axis", 0)
        if len(node.inputs) > 1 and node.inputs[1].name:
            values = ctx.prover.constant(node.inputs[1])
            if values is not None:
                return [int(v) for v in values.reshape(-1)]
        elif "split" in node.attrs:  # opset < 13
            return [int(v) for v in node.attrs["split"]]
        else:
            shape = _shape(ctx, node.inputs[0])
            if shape is not None and -len(shape) <= axis < len(shape) and isinstance(shape[axis], int):
                dim = shape[axis]
                if "num_outputs" in node.attrs:  # opset 18: ceil(dim / n) each, the last one what remains
                    step = math.ceil(dim / n)
                    sizes = [min(step, max(dim - step * k, 0)) for k in range(n)]
                    if sum(sizes) == dim and all(sizes):
                        return sizes
                elif dim % n == 0:
                    return [dim // n] * n
        shapes = [_shape(ctx, o) for o in node.outputs]
        if all(s is not None and -len(s) <= axis < len(s) and isinstance(s[axis], int) for s in shapes):
            return [int(s[axis]) for s in shapes]
        return None

    def _split_tree(self, ctx: Context, src: gs.Tensor, sizes: list[int], outs: list[gs.Tensor], axis: int,
                    width: int, base: str) -> None:
        size_of = {id(t): n for t, n in zip(outs, sizes, strict=True)}

        def build(source: gs.Tensor, entries: list, name: str) -> None:
            parts, part_sizes, inner = [], [], []
            for k, e in enumerate(entries):
                if isinstance(e, list):
                    n = sum(size_of[id(t)] for t in _leaves(e))
                    shape = _shape(ctx, src)
                    if shape is not None:
                        shape[axis] = n
                    t = ctx.var(f"{name}/part{k}", src.dtype, shape)
                    inner.append((t, e, f"{name}/part{k}"))
                    parts.append(t)
                    part_sizes.append(n)
                else:
                    parts.append(e)
                    part_sizes.append(size_of[id(e)])
            self._split(ctx, source, part_sizes, parts, axis, name)
            for t, e, sub in inner:
                build(t, e, sub)

        build(src, _tree(outs, width), base)

    def _split(self, ctx: Context, src: gs.Tensor, sizes: list[int], outs: list[gs.Tensor], axis: int,
               base: str) -> None:
        if ctx.graph.opset >= 13:
            split = ctx.const(f"{base}/sizes", np.array(sizes, dtype=np.int64))
            ctx.node("Split", base, [src, split], outs, {"axis": axis})
        else:
            ctx.node("Split", base, [src], outs, {"axis": axis, "split": list(sizes)})

    # -- Max / Min ---------------------------------------------------------------------------------------------
    def _fold(self, ctx: Context, op: str, inputs: list[gs.Tensor], out: gs.Tensor, width: int,
              base: str) -> None:
        acc, rest, step = inputs[:width], inputs[width:], 0
        while rest:
            t = ctx.var(f"{base}/partial{step}", out.dtype, None)
            ctx.node(op, f"{base}/fold{step}", acc, [t])
            acc, rest, step = [t, *rest[:width - 1]], rest[width - 1:], step + 1
        ctx.node(op, base, acc, [out])


def _tree(items: list, width: int) -> list:
    """`items` as a tree of at most `width` entries per level, each an item or a subtree, leaves in order.

    Built bottom-up: runs of `width` consecutive items share a node, then runs of `width` of those, and so on, so
    that all but the last node of a level are full (1024 inputs at width 7: 147 + 21 + 3 + 1 nodes)."""
    level: list = list(items)
    while len(level) > width:
        level = [level[i] if i + 1 == len(level) else level[i:i + width] for i in range(0, len(level), width)]
    return level


def _leaves(tree: list) -> list:
    return [leaf for e in tree for leaf in (_leaves(e) if isinstance(e, list) else [e])]


def _shape(ctx: Context, t: gs.Tensor) -> list | None:
    if t.shape is not None:
        return list(t.shape)
    info = ctx.types.get(t.name)
    return None if info is None or info[1] is None else list(info[1])


def _concat_shape(group: list[gs.Tensor], axis: int) -> list | None:
    shapes = [t.shape for t in group]
    if any(s is None for s in shapes):
        return None
    shape = list(shapes[0])
    ax = axis % len(shape)
    dims = [s[ax] for s in shapes]
    shape[ax] = sum(dims) if all(isinstance(d, int) for d in dims) else None
    return shape
