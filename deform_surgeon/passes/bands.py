"""Compute an ordinary Conv in row bands, a Resize in channel groups and a token-major MatMul chain in row chunks,
so that no tensor exceeds `--max-buffer`.

Why: outside its deform blocks (the split pass's work) BiRefNet ends at full resolution. At 1024x1024 its decoder
makes a 480 MiB channel Concat (the upsampled features and the image-patch branch) read by the last 1x1 Conv, the
384 MiB Resize feeding it, a 320 MiB Concat of the ASPP branches at 256x256 read by a 1x1 Conv, and a 256 MiB Conv
output read by a 3x3 Conv. A WebGPU buffer over the device's `maxBufferSize` (or bound over
`maxStorageBufferBindingSize`) is an error when the kernel runs (docs/runtime-facts.md section 7).

What, and why each is exact:

* **Resize in channel groups.** A Resize over the limit whose output only Concats on the channel axis read, with
  scale 1 on the batch and channel axes, is computed per group of channels from a Slice of its input, and the
  groups replace its output among the Concats' inputs (the groups' `sizes` are constants of the inferred shape).
  Where a Conv of one group makes the Resize's input, each group's input is that Conv for the group's output
  channels instead of a Slice (see `_channel_source`: it keeps ORT's NCHWc path).
  Each output element is interpolated from its own channel with weights that depend on the spatial sizes only,
  and a Concat of the groups is the whole output element for element; but at level `all` ORT may run the whole
  Resize in its NCHWc layout with a kernel of its own (measured: 3-channel groups of a 6-channel Resize differ
  by 3e-8 there and nowhere else), so this too is `needs_verify` (below).
* **Conv in row bands.** A Conv whose input X is over the limit, read by that Conv alone, is computed for output
  rows `[o0, o1)` at a time from the rows of X those outputs read (the kernel's halo included; zero padding only
  where the original pads, beyond X's edges), and one Concat on the rows joins the bands. X is never made whole:
  per band its rows come from its producer, a channel Concat (slices of each input, concatenated), a Concat on
  the rows (a split deform block's join: slices of the inputs holding the band's rows) or a Conv
  (computed in turn for those rows from a slice of its own input, through the per-channel ops between the two).
  An input of that Concat or Conv that is itself over the limit is made for the band's rows the same way, by its
  own producer (the full BiRefNet's last Conv reads a channel Concat of the Resize's groups and a 192 MiB Conv
  output, itself made from a 256 MiB one), so each band computes its rows through the whole chain, halos
  included, and nothing over the limit is made whole; a Conv inside such a chain gets no bands of its own unless
  the outer one is refused.
  The per-channel ops after the banded Conv (bias Add, BatchNormalization, Relu) are carried per band, so ORT's
  Conv fusions see the same pattern in every band. Each output pixel reads the same values as before, but whether
  a Conv kernel sums them in the same order for fewer output rows is the implementation's choice: the action is
  marked `needs_verify`, `patch` writes it only after the whole patched model verified byte-identical, and
  undoes it otherwise (`SplitPlan.keep_whole`, shared with the split pass).

* **MatMul chain in row chunks.** The full BiRefNet's Swin backbone (swin_v1_l) runs its stage-1 MLP on 65,536
  tokens at 1024x1024: LayerNorm -> MatMul [1, 65536, 192] x [192, 768] -> bias Add -> GELU (Div, Erf, Add, Mul,
  Mul) -> MatMul x [768, 192] -> bias Add, seven [1, 65536, 768] tensors of 192 MiB. From a MatMul by a constant
  2-D matrix that makes or reads a tensor over the limit, the chain is every node making or reading a tensor of it
  over the limit, each computing a row (a token: the second-to-last axis) of its output from the same row of its
  inputs that are not constants: a MatMul by a constant 2-D matrix, an elementwise op whose constants do not vary
  along the rows (`_row_wise`). The ops after its ends whose other inputs are such constants (the bias Add after
  fc2) are carried per chunk, as the bands carry a Conv's tail: at level `all` ORT CPU fuses a MatMul and its bias
  Add into a Gemm, which a Concat between them would stop. Each chunk Slices its rows of the chain's inputs and
  runs the chain's copies; one Concat on the rows per end joins the chunks (an end over the limit is refused).
  Each output row reads only its own input row, but how MLAS's SGEMM sums for fewer rows (and what ORT fuses) is
  the implementation's choice: `needs_verify`, shown exact by its local proof like the others.

Bands (and chunks): the fewest equal bands (sizes differ by at most one row) for which every band tensor fits the
limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ..blocks import conv_tail
from ..budget import human
from ..ops import ELEMENTWISE_NARY, ELEMENTWISE_UNARY, TAIL_OPS
from ..pipeline import Action, Context, Outcome, Pass, Refuse
from ..shapes import Shapes, along_rows
from .cuts import FLOAT16_NOTE, cut, float16_details, join
from .local_proof import record
from .split import SplitPlan


@dataclass(frozen=True)
class Window:
    """How a Conv's output rows read its input rows (along H only; W is left as it is)."""

    kernel: int
    stride: int
    dilation: int
    pad_top: int
    pad_bottom: int

    @classmethod
    def of(cls, conv: gs.Node, in_shape: tuple[int, ...] | None, w_shape: tuple[int, ...] | None) -> Window:
        kernel = list(conv.attrs.get("kernel_shape") or (w_shape[2:] if w_shape else []))
        auto_pad = conv.attrs.get("auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        pads = list(conv.attrs.get("pads") or [0] * 2 * len(kernel))
        if in_shape is None:
            raise Refuse(f"the input shape of Conv '{conv.name}' is not known statically")
        if len(in_shape) != 4 or len(kernel) != 2 or auto_pad not in ("NOTSET", "VALID") or \
                (auto_pad == "VALID" and any(pads)):
            raise Refuse(f"Conv '{conv.name}' is not a 2-D Conv with explicit pads (auto_pad {auto_pad}, "
                         f"kernel {kernel})")
        strides = list(conv.attrs.get("strides") or [1, 1])
        dilations = list(conv.attrs.get("dilations") or [1, 1])
        return cls(int(kernel[0]), int(strides[0]), int(dilations[0]), int(pads[0]), int(pads[2]))

    def rows_read(self, o0: int, o1: int, height: int) -> tuple[int, int, int, int]:
        """(first, end) input rows that output rows [o0, o1) read within [0, height), and the zero rows to pad
        above and below them."""
        a = o0 * self.stride - self.pad_top
        b = (o1 - 1) * self.stride - self.pad_top + (self.kernel - 1) * self.dilation + 1
        first, end = max(a, 0), min(b, height)
        return first, end, first - a, b - end

    def band_attrs(self, conv: gs.Node, top: int, bottom: int) -> dict:
        attrs = dict(conv.attrs)
        pads = list(conv.attrs.get("pads") or [0, 0, 0, 0])
        attrs["pads"] = [top, pads[1], bottom, pads[3]]
        attrs.pop("auto_pad", None)
        return attrs


def _bands(rows: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, n)
    out, r0 = [], 0
    for k in range(n):
        r1 = r0 + base + (1 if k < extra else 0)
        out.append((r0, r1))
        r0 = r1
    return out


def _axis(node: gs.Node, rank: int) -> int:
    return int(node.attrs.get("axis", 0)) % rank


# per-element ops without parameters: after a Conv, the same bytes whether ORT fuses them into it or not (what a
# float16 Conv whose bias is added after its bands' join leaves whole after that Add)
_EXACT_TAIL = {"Relu", "Cast"}


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


class _Nothing(Exception):
    """A band whose rows would read nothing but a Conv's zero padding."""


@dataclass(frozen=True)
class RowSource:
    """How a band's rows of `tensor` are made: sliced from the whole tensor (`node` None: it fits the limit), or
    by its producer computed for those rows: a channel Concat of its inputs' rows, a Concat on the rows of the
    inputs holding those rows (`offsets`: the first row of each; a split deform block's join), or a Conv (with the
    per-channel ops `chain` after it) from the rows of its input its `window` reads."""

    tensor: gs.Tensor
    node: gs.Node | None = None
    chain: tuple[gs.Node, ...] = ()
    window: Window | None = None
    inputs: tuple[RowSource, ...] = ()
    offsets: tuple[int, ...] = ()

    def nodes(self) -> list[gs.Node]:
        """The nodes the bands replace, producers first."""
        if self.node is None:
            return []
        return [*(n for i in self.inputs for n in i.nodes()), self.node, *self.chain]

    def made_in_rows(self) -> list[str]:
        """The tensors over the limit, besides this one, that the bands make in rows by their producers."""
        return [t for i in self.inputs if i.node is not None for t in (i.tensor.name, *i.made_in_rows())]

    def describe(self, shapes: Shapes) -> str:
        if self.offsets:
            return f"Slices of the {len(self.inputs)} inputs of Concat '{self.node.name}' (on the rows) holding them"
        if self.window is None:
            nested = [f"'{i.tensor.name}' ({human(shapes.nbytes(i.tensor))}, over the limit too) made by "
                      f"{i.describe(shapes)}" for i in self.inputs if i.node is not None]
            return f"the rows of each input of Concat '{self.node.name}'" + (f" ({'; '.join(nested)})" if nested
                                                                             else "")
        made = self.inputs[0]
        reads = (f"the rows of '{made.tensor.name}' it reads" if made.node is None else
                 f"the rows it reads of '{made.tensor.name}' ({human(shapes.nbytes(made.tensor))}, over the limit "
                 f"too), made by {made.describe(shapes)}")
        chain = "".join(f" -> {c.op}" for c in self.chain)
        return f"Conv '{self.node.name}'{chain} computed for those rows from {reads}"


class BandOversize(Pass):
    """Resize in channel groups, Conv in row bands and MatMul chains in row chunks wherever a tensor outside the
    deform blocks is over `--max-buffer` (see the module docstring).

    Matches, in order: every Resize whose output is over the limit, then every Conv whose input is, then every
    MatMul by a constant 2-D matrix that makes or reads a tensor over the limit (once per chain). A Conv whose
    output, over the limit too, an outer Conv's bands compute in rows (the nested form: a channel Concat read by a
    Conv reads that Conv's output) waits for the outer one: banded alone first, its joined output would be made
    whole. It is matched right after the outer one only if that one was refused (`matches` is a generator that
    reads the refusals `refused` records), and never otherwise."""

    name = "bands"

    def __init__(self, plan: SplitPlan | None = None) -> None:
        self.plan = plan if plan is not None else SplitPlan()

    def matches(self, ctx: Context) -> Iterator[tuple[str, gs.Node, Any]]:
        limit = ctx.options.max_buffer
        if limit is None:
            return
        self.shapes, self.limit, self.outside = Shapes(ctx), limit, {id(t) for t in ctx.graph.outputs}
        shapes = self.shapes
        self.refused_ids: set[int] = set()
        self.origin: dict[int, gs.Tensor] = {}  # a channel group -> the tensor it is a part of (`_held`)
        resizes = [n for n in ctx.graph.nodes if n.op == "Resize" and (shapes.nbytes(n.outputs[0]) or 0) > limit]
        for node in resizes:  # first: the Convs below are found in the graph their groups made
            yield "resize", node, None
        shared = [n for n in ctx.graph.nodes if n.op == "Concat" and len(n.outputs) == 1
                  and (shapes.nbytes(n.outputs[0]) or 0) > limit and len(n.outputs[0].outputs) > 1
                  and shapes.shape(n.outputs[0]) is not None and len(shapes.shape(n.outputs[0])) == 4
                  and _axis(n, 4) == 1 and id(n.outputs[0]) not in self.outside
                  and any(r.op in ("Shape", "Resize") and self._live(r) for r in n.outputs[0].outputs)]
        for node in shared:  # then: its readers read their parts (the Resizes' groups' Convs among them), and
            yield "shared", node, None  # each Conv, its own Concat's one reader, is found below
        convs = [(n, self._feeding(ctx, n.inputs[0], shapes)) for n in ctx.graph.nodes
                 if n.op == "Conv" and n.inputs and (shapes.nbytes(n.inputs[0]) or 0) > limit]
        waiting: dict[int, list] = {}
        for node, feeders in convs:
            if feeders is not None:
                try:
                    inner = self._source(ctx, node.inputs[0], feeders, shapes, limit, self.outside, "",
                                         node).nodes()
                except Refuse:
                    continue
                waiting[id(node)] = [(n, f) for n, f in convs if any(n is m for m in inner)]
        deferred = {id(n) for pending in waiting.values() for n, _ in pending}
        done: set[int] = set()

        def in_turn(node: gs.Node, feeders) -> Iterator[tuple[str, gs.Node, Any]]:
            done.add(id(node))
            yield "conv", node, feeders
            if id(node) in self.refused_ids:
                for inner, f in waiting.get(id(node), []):
                    if id(inner) not in done:
                        yield from in_turn(inner, f)

        for node, feeders in convs:
            if feeders is not None and id(node) not in deferred:  # else not this pass's pattern (a deform
                yield from in_turn(node, feeders)  # block's join, for one: not reported) or waiting for an outer Conv
        self.chained: set[int] = set()  # the nodes of the row chains met so far (each chain is matched once)
        for node in [n for n in ctx.graph.nodes if self._seeds_rows(ctx, n, shapes, limit)]:
            if id(node) not in self.chained:
                yield "rows", node, None

    def check(self, ctx: Context, match: tuple[str, gs.Node, Any]) -> None:
        """Nothing to plan apart: whether a Resize's groups or a Conv's bands are exact is known only while they
        are built (`rewrite` raises `Refuse`, and the pass form takes back what it built)."""

    def rewrite(self, ctx: Context, match: tuple[str, gs.Node, Any], plan: None) -> Action:
        kind, node, feeders = match
        if kind == "resize":
            return self._groups(ctx, node, self.shapes, self.limit, self.outside)
        if kind == "shared":
            return self._unshared(ctx, node, self.shapes, self.limit)
        if kind == "rows":
            return self._row_chunks(ctx, node, self.shapes, self.limit, self.outside)
        return self._bands(ctx, node, feeders, self.shapes, self.limit, self.outside)

    def refused(self, match: tuple[str, gs.Node, Any], why: Refuse) -> Action:
        """The refusal with the tensor over the limit, its size and the limit; a refused Conv lets the Convs
        waiting for it be matched next."""
        kind, node, _ = match
        self.refused_ids.add(id(node))
        t = node.outputs[0] if kind in ("resize", "shared") else node.inputs[0]
        if kind == "rows":  # the MatMul's tensor over the limit (`why.details` names the chain's largest)
            t = max([*(i for i in node.inputs if i.name), *node.outputs], key=lambda x: self.shapes.nbytes(x) or 0)
        details = {"tensor": t.name, "size_bytes": self.shapes.nbytes(t), "limit_bytes": self.limit, **why.details}
        return Action(self.name, node.name, node.op, Outcome.REFUSED, str(why), details=details)

    # -- Resize in channel groups -------------------------------------------------------------------------------
    def _groups(self, ctx: Context, node: gs.Node, shapes: Shapes, limit: int, outside: set[int]) -> Action:
        out, x = node.outputs[0], node.inputs[0]
        size, os_, xs = shapes.nbytes(out), shapes.shape(out), shapes.shape(x)
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
        why = self.plan.keep_whole.get(node.name)
        if why is not None:
            raise why.prefixed(f"{head}: ")
        channels = xs[1]
        n = math.ceil(size / limit)
        if n > channels:
            raise Refuse(f"{head}: one channel alone is {human(size // channels)}", channels=channels,
                         channel_bytes=size // channels)
        groups = _bands(channels, n)
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
        proof = self._proof(ctx, shapes, node.name, [*([maker, *via] if source is not None else []),
                                                     *(n for m, src, v in makers.values() if src is not None
                                                       for n in (m, *v)),
                                                     node, *carriers, *readers],
                            [t for r in readers for t in r.outputs], float16)
        first = len(ctx.graph.nodes)
        parts: list[gs.Tensor] = []
        groups_of: dict[int, list[gs.Tensor]] = {}  # tensor -> its channel groups, in order
        for k, (c0, c1) in enumerate(groups):
            base = f"{node.name}/group{k}"
            part_in = self._group_of(ctx, x, (maker, source, via), c0, c1, k, shapes)  # (the Conv making the input,
            # for these output channels only, or a cut of them)
            part = _resize_part(ctx, node, part_in, c1 - c0, base, f"{out.name}/group{k}", shapes)
            parts.append(part)
            made = {id(out): part}
            for c in carriers:  # the elementwise ops between the Resize and the Concats, for these channels
                ins = [made[id(i)] if id(i) in made else
                       self._group_of(ctx, i, makers[id(i)], c0, c1, k, shapes) if id(i) in others else i
                       for i in c.inputs]
                y = c.outputs[0]
                made[id(y)] = ctx.var(f"{y.name}/group{k}", shapes.dtype(y), (os_[0], c1 - c0, *os_[2:]))
                ctx.node(c.op, f"{c.name}/group{k}", ins, [made[id(y)]], dict(c.attrs))
                groups_of.setdefault(id(y), []).append(made[id(y)])
                self.origin[id(made[id(y)])] = y
        groups_of[id(out)] = parts
        self.origin.update({id(p): out for p in parts})
        for r in readers:
            joined = [p for t in r.inputs for p in groups_of.get(id(t), [t])]
            r.inputs.clear()
            r.inputs.extend(joined)
        for c in carriers:
            c.outputs.clear()
        for r in sizers:
            _shape_constant(ctx, r, os_)
        node.outputs.clear()
        if proof is not None:
            proof.taken(ctx, shapes)
        widths = "/".join(str(w) for w in sorted({c1 - c0 for c0, c1 in groups}, reverse=True))
        largest = max(shapes.nbytes(p) or 0 for p in parts)
        details = {"groups": n, "group_channels": [c1 - c0 for c0, c1 in groups], "channels": channels,
                   "tensor": out.name, "size_bytes": size, "group_bytes": largest, "limit_bytes": limit,
                   "source": maker.name if source is not None else x.name, "readers": [r.name for r in readers],
                   "shape_readers": len(sizers), "carried": [c.op for c in carriers],
                   **float16_details(float16)}
        return Action(self.name, node.name, node.op, Outcome.REWRITTEN,
                      f"computed in {n} channel groups of {widths} channels (of {channels}): output '{out.name}' "
                      f"{human(size)} -> {human(largest)} per group, limit {human(limit)}; each group "
                      + (f"reads the output of Conv '{maker.name}' computed for its channels only"
                         if source is not None else f"reads a Slice of its channels of '{x.name}'")
                      + (f", then its {', '.join(c.op + ' ' + repr(c.name) for c in carriers)} per group" if carriers
                         else "")
                      + f"; the groups take its place in {', '.join(repr(r.name) for r in readers)} (Concat on the "
                      "channel axis)"
                      + (f", and its {len(sizers)} Shape reader(s) become Constants of its static shape" if sizers
                         else "") + "; "
                      "each element is interpolated from its own channel with the same weights (they depend on "
                      "the spatial sizes only), but ORT's NCHWc layout (level all) runs a Resize of whole channel "
                      "blocks with a kernel of its own, so it is written only once shown exact"
                      + (FLOAT16_NOTE if float16 else ""),
                      tuple(x.name for x in ctx.graph.nodes[first:]), needs_verify=True, details=details)

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
            return all(r.op == "Shape" or (r.op == "Concat" and _axis(r, len(shape)) == 1) for r in t.outputs)

        carriers = []
        for r in out.outputs:
            if r.op == "Shape" or (r.op == "Concat" and _axis(r, len(shape)) == 1):
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
                if known is None and (shapes.nbytes(i) or 0) > self.limit and \
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
            return cut(ctx, f"{t.name}/group{k}/slice", t, c0, c1, 1, part, s[1], self._held(ctx, t))
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

    def _live(self, node: gs.Node, seen: set[int] | None = None) -> bool:
        """Whether something the graph computes reads what `node` makes (a graph output, or a live reader): a node
        an earlier rewrite of this pass replaced stays in the graph, without readers, until cleanup."""
        seen = set() if seen is None else seen
        if id(node) in seen:
            return False
        seen.add(id(node))
        return any(id(t) in self.outside or any(self._live(r, seen) for r in t.outputs) for t in node.outputs)

    # -- a channel Concat that several nodes read ---------------------------------------------------------------
    def _unshared(self, ctx: Context, concat: gs.Node, shapes: Shapes, limit: int) -> Action:
        """Each reader of a channel Concat over the limit takes its part from the Concat's inputs (BiRefNet_HR's
        image pyramid, '/Concat_3': 192 MiB at 2048, read by the lateral Conv, a Resize and three Shapes).

        Why: the Concat is made whole as long as one reader reads it whole, and a Conv's bands make their rows of
        it from its inputs only when the Conv is its one reader. A Shape becomes a Constant of the static shape. A
        Resize becomes one Resize per Concat input, joined by a Concat on the channels: each channel is
        interpolated on its own with weights of the spatial sizes only (the channel groups' reasoning; ORT's NCHWc
        Resize kernel aside, so shown exact like them). The Convs are left its only readers: each one's bands then
        make their rows from the inputs' rows (`_source`), and once every Conv is in bands the Concat is gone (a
        Conv whose bands are refused keeps reading it whole, as before)."""
        out = concat.outputs[0]
        xs, size = shapes.shape(out), shapes.nbytes(out)
        head = f"output '{out.name}' ({human(size)}) stays over the {human(limit)} limit"
        readers = [r for r in out.outputs if self._live(r)]  # (a node an earlier rewrite replaced is still there)
        for r in readers:
            if r.op == "Resize" and r.inputs[0] is out:
                self._channelwise(ctx, r, shapes, head)
            elif not (r.op == "Shape" or (r.op == "Conv" and r.inputs[0] is out)):
                raise Refuse(f"{head}: it is read by {r.op} '{r.name}' (each reader must take its part from the "
                             "Concat's inputs: a Conv, a Resize or a Shape can)", reader=r.name)
        resizes = [r for r in readers if r.op == "Resize"]
        convs = [r for r in readers if r.op == "Conv"]
        sizers = [r for r in readers if r.op == "Shape"]
        float16 = shapes.dtype(out) == np.float16
        parts_in = list(concat.inputs)
        proof = self._proof(ctx, shapes, concat.name, [concat, *resizes], [r.outputs[0] for r in resizes],
                            float16) if resizes else None
        first = len(ctx.graph.nodes)
        for r in resizes:
            y = r.outputs[0]
            parts = [_resize_part(ctx, r, x, shapes.shape(x)[1], f"{r.name}/part{k}", f"{y.name}/part{k}", shapes)
                     for k, x in enumerate(parts_in)]
            held = self._held(ctx, y)
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
        return Action(self.name, concat.name, concat.op, Outcome.REWRITTEN,
                      f"read by {len(readers)} nodes, each now taking its part from its {len(parts_in)} inputs: "
                      + "; ".join(said) + " (each channel is interpolated on its own, but ORT's NCHWc layout runs "
                      "a Resize of whole channel blocks with a kernel of its own, so it is written only once shown "
                      "exact)" * bool(resizes) + (FLOAT16_NOTE if float16 and resizes else ""),
                      tuple(t.name for t in ctx.graph.nodes[first:]), needs_verify=bool(resizes), details=details)

    # -- Conv in row bands --------------------------------------------------------------------------------------
    def _source(self, ctx: Context, x: gs.Tensor, feeders: tuple[list[gs.Node], gs.Node], shapes: Shapes,
                limit: int, outside: set[int], head: str, conv: gs.Node | None = None) -> RowSource:
        """How the bands' rows of `x` are made from what `feeders` found making it: its producer computed for
        those rows from the rows of its inputs, each of them sliced from the whole tensor where that fits the
        limit, else made for those rows by its own producer in turn (the nested form: a channel Concat reads a
        Conv output itself over the limit); `Refuse` when some tensor over the limit cannot be made so.
        `conv` (reading `x`): a channel Concat `x` that other Convs read too (the channel groups of one Conv,
        `_unshared`) is made by each one's bands from its inputs' rows, and is gone once every one of them is."""
        chain, producer = feeders
        shared_by_convs = conv is not None and not chain and producer.op == "Concat" and _axis(producer, 4) == 1 \
            and all(r is conv or (r.op == "Conv" and r.inputs[0] is x) for r in x.outputs if self._live(r))
        for t in [x, *(n.outputs[0] for n in chain), *(producer.outputs if chain else ())]:
            if id(t) in outside or (len(t.outputs) != 1 and not (t is x and shared_by_convs)):
                raise Refuse(f"{head}: '{t.name}' is also read elsewhere (or outside the rewritten part), so it "
                             "would be needed whole anyway", read_elsewhere=t.name)
        if producer.op == "Concat" and _axis(producer, 4) == 2:  # rows joined: each band slices the inputs it spans
            for s in producer.inputs:
                if (shapes.nbytes(s) or 0) > limit:
                    raise Refuse(f"{head}: Concat '{producer.name}' joins rows of '{s.name}' "
                                 f"({human(shapes.nbytes(s))}), itself over the limit", source=s.name,
                                 source_bytes=shapes.nbytes(s))
            heights = [shapes.shape(s)[2] for s in producer.inputs]
            return RowSource(x, producer, (), None, tuple(RowSource(s) for s in producer.inputs),
                             tuple(int(v) for v in np.cumsum([0, *heights[:-1]])))
        window = None
        if producer.op == "Conv":
            if shapes.shape(producer.inputs[0]) is None:
                self._derive_input(producer, shapes)
            window = Window.of(producer, shapes.shape(producer.inputs[0]), shapes.shape(producer.inputs[1]))
        inputs = []
        for s in [producer.inputs[0]] if window else list(producer.inputs):
            if (shapes.nbytes(s) or 0) <= limit:
                inputs.append(RowSource(s))
                continue
            made = self._feeding(ctx, s, shapes, nested=True)
            if made is None:
                raise Refuse(f"{head}: {producer.op} '{producer.name}' reads '{s.name}' ({human(shapes.nbytes(s))}), "
                             "itself over the limit" + (f", made by {s.inputs[0].op} '{s.inputs[0].name}', which is "
                                                        "not computed in rows (a Concat on the channels or the "
                                                        "rows, or a Conv, is)"
                                                        if s.inputs else ""), source=s.name,
                             source_bytes=shapes.nbytes(s))
            inputs.append(self._source(ctx, s, made, shapes, limit, outside, head))
        return RowSource(x, producer, tuple(chain), window, tuple(inputs))

    def _bands(self, ctx: Context, conv: gs.Node, feeders: tuple[list[gs.Node], gs.Node], shapes: Shapes,
               limit: int, outside: set[int]) -> Action:
        x = conv.inputs[0]
        size, xs = shapes.nbytes(x), shapes.shape(x)
        head = f"input '{x.name}' ({human(size)}) stays over the {human(limit)} limit"
        why = self.plan.keep_whole.get(conv.name)
        if why is not None:
            raise why.prefixed(f"{head}: ")
        window = Window.of(conv, xs, shapes.shape(conv.inputs[1]))
        y_shape = shapes.shape(conv.outputs[0])
        if y_shape is None or len(y_shape) != 4 or y_shape[2] < 2:
            raise Refuse(f"{head}: the Conv's output shape is not known as [N, M, H, W] with H >= 2")
        source = self._source(ctx, x, feeders, shapes, limit, outside, head, conv)
        tail = conv_tail(ctx, conv, shapes)
        bias = ctx.prover.constant(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2].name else None
        late_bias = shapes.dtype(x) == np.float16 and bias is not None and bias.size <= 8 and \
            all(t.op in _EXACT_TAIL for t in tail)
        if late_bias:  # the tail stays whole, after the bias
            tail = []
        if shapes.dtype(x) == np.float16:
            self._shared_constants(ctx, [*([] if late_bias else [conv]),
                                         *(n for n in source.nodes() if n.op == "Conv")], head)
        rows_out, rows_x = y_shape[2], xs[2]

        def row_bytes(t: gs.Tensor) -> int:
            s = shapes.shape(t)
            return (shapes.nbytes(t) or 0) // s[2]

        def reach(src: RowSource, r0: int, r1: int) -> int:
            """The largest tensor the rows [r0, r1) of `src` need (its own band and what makes it); `Nothing` when
            a Conv on the way would read only its zero padding."""
            worst = row_bytes(src.tensor) * (r1 - r0)
            if src.window is not None:
                a, b, _, _ = src.window.rows_read(r0, r1, shapes.shape(src.inputs[0].tensor)[2])
                if b <= a:
                    raise _Nothing
                r0, r1 = a, b
            return max([worst, *(reach(i, r0, r1) for i in src.inputs)])

        def plan(n: int) -> tuple[list, int]:
            bands, worst = [], 0
            for o0, o1 in _bands(rows_out, n):
                x0, x1, top, bottom = window.rows_read(o0, o1, rows_x)
                try:
                    if x1 <= x0:
                        raise _Nothing
                    worst = max(worst, reach(source, x0, x1),
                                *[row_bytes(t) * (o1 - o0) for t in [conv.outputs[0]] + [t.outputs[0] for t in tail]])
                except _Nothing:
                    raise Refuse(f"{head}: output rows {o0}..{o1 - 1} of {n} bands would read nothing but the "
                                 "zero padding", bands=n, output_rows=[o0, o1]) from None
                bands.append((o0, o1, x0, x1, top, bottom))
            return bands, worst

        n = 2
        bands, worst = plan(n)
        while worst > limit and n < rows_out:
            n += 1
            bands, worst = plan(n)
        if worst > limit:
            raise Refuse(f"{head}: even one output row per band needs {human(worst)}", bands=n, band_bytes=worst)

        first = len(ctx.graph.nodes)
        end = (tail[-1] if tail else conv).outputs[0]
        float16 = shapes.dtype(x) == np.float16
        proof = self._proof(ctx, shapes, conv.name, [*source.nodes(), conv, *tail], [end], float16)
        joined = []
        for k, (o0, o1, x0, x1, top, bottom) in enumerate(bands):
            tag = f"band{k}"
            x_band = self._made(ctx, source, x0, x1, tag, shapes)
            joined.append(self._through(ctx, [conv, *tail], x_band, window.band_attrs(conv, top, bottom), tag,
                                        o1 - o0, shapes, drop_bias=late_bias))
        for node in [conv, *tail]:
            node.outputs.clear()
        if late_bias:  # the bias added once, after the join (see `_shared_constants`)
            summed = ctx.var(f"{end.name}/before_bias", shapes.dtype(end), shapes.shape(end))
            join(ctx, f"{conv.name}/bands/join", joined, summed, 2, shapes, self._held(ctx, end))
            ctx.node("Add", f"{conv.name}/bands/bias", [summed, ctx.const(f"{conv.inputs[2].name}/after_bands",
                                                                          bias.reshape(1, -1, 1, 1))], [end])
        else:
            join(ctx, f"{conv.name}/bands/join", joined, end, 2, shapes, self._held(ctx, end))
        if proof is not None:
            proof.taken(ctx, shapes)

        counts = "/".join(str(c) for c in sorted({b[1] - b[0] for b in bands}, reverse=True))
        carried = "".join(f" -> {t.op}" for t in tail)
        details = {"bands": n, "band_rows": [b[1] - b[0] for b in bands], "rows": rows_out, "tensor": x.name,
                   "size_bytes": size, "band_bytes": worst, "limit_bytes": limit, "source": source.node.name,
                   "carried": [t.op for t in tail], "made_in_rows": source.made_in_rows(),
                   "bias_after_join": conv.inputs[2].name if late_bias else None, **float16_details(float16)}
        late = (f", then its bias of {bias.size} element(s) is added once (ORT CPU would share a copy of it between "
                "the bands, which then run on another Conv kernel than the whole Conv; its NCHWc kernel adds the "
                "bias after the sums, as this Add does)") if late_bias else ""
        return Action(self.name, conv.name, conv.op, Outcome.REWRITTEN,
                      f"computed in {n} row bands of {counts} output rows (of {rows_out}): input '{x.name}' "
                      f"({human(size)}) was over the {human(limit)} limit; each band reads its rows of it "
                      f"(with the kernel's halo) from {source.describe(shapes)}; largest band tensor "
                      f"{human(worst)}; the Conv{carried} runs per band and one Concat joins the bands{late}; each "
                      "output pixel reads the same values, but the summation order of a Conv kernel on fewer rows "
                      "is the implementation's choice, so it is written only once shown exact"
                      + (FLOAT16_NOTE if float16 else ""),
                      tuple(t.name for t in ctx.graph.nodes[first:]), needs_verify=True, details=details)

    def _made(self, ctx: Context, src: RowSource, r0: int, r1: int, tag: str, shapes: Shapes) -> gs.Tensor:
        """Rows [r0, r1) of `src.tensor` for band `tag`: a Slice of it, or its producer computed for them."""
        if src.node is None:
            return self._rows(ctx, src.tensor, r0, r1, shapes)
        if src.offsets:  # a Concat on the rows: the rows of each input that holds some of [r0, r1)
            spans = [(i.tensor, first, first + shapes.shape(i.tensor)[2])
                     for i, first in zip(src.inputs, src.offsets, strict=True)]
            pieces = [self._rows(ctx, t, max(r0, first) - first, min(r1, end) - first, shapes)
                      for t, first, end in spans if first < r1 and end > r0]
            if len(pieces) == 1:
                return pieces[0]
            xs = shapes.shape(src.tensor)
            band = ctx.var(f"{src.tensor.name}/{tag}", shapes.dtype(src.tensor), (*xs[:2], r1 - r0, xs[3]))
            ctx.node("Concat", f"{src.node.name}/{tag}", pieces, [band], {"axis": 2})
            return band
        if src.window is None:  # a channel Concat: the rows of each of its inputs
            pieces = [self._made(ctx, i, r0, r1, tag, shapes) for i in src.inputs]
            xs = shapes.shape(src.tensor)
            band = ctx.var(f"{src.tensor.name}/{tag}", shapes.dtype(src.tensor), (*xs[:2], r1 - r0, xs[3]))
            ctx.node("Concat", f"{src.node.name}/{tag}", pieces, [band], {"axis": 1})
            return band
        # a Conv (and the per-channel ops after it) computed for these rows from the rows of its input it reads
        a, b, top, bottom = src.window.rows_read(r0, r1, shapes.shape(src.inputs[0].tensor)[2])
        return self._through(ctx, [src.node, *src.chain], self._made(ctx, src.inputs[0], a, b, tag, shapes),
                             src.window.band_attrs(src.node, top, bottom), tag, r1 - r0, shapes)

    # -- token-major chains in row chunks ------------------------------------------------------------------------
    @staticmethod
    def _seeds_rows(ctx: Context, node: gs.Node, shapes: Shapes, limit: int) -> bool:
        """Whether `node` is a MatMul by a constant 2-D matrix that makes or reads a tensor over the limit: where a
        row chain is looked for (the chain itself is found from it by `_row_chain`)."""
        if node.op != "MatMul" or len(node.inputs) != 2 or len(node.outputs) != 1:
            return False
        if not any((shapes.nbytes(t) or 0) > limit for t in (node.inputs[0], node.outputs[0])):
            return False
        b = shapes.shape(node.inputs[1])
        return b is not None and len(b) == 2 and ctx.prover.constant(node.inputs[1]) is not None

    def _row_wise(self, ctx: Context, node: gs.Node, shapes: Shapes, axis: int, rows: int,
                  varying: gs.Tensor | None = None) -> str | None:
        """None when each row of `node`'s output (along `axis`, of `rows`) is computed from the same row of its
        inputs that are not constants (a MatMul by a constant 2-D matrix, an elementwise op whose constants do not
        vary along the rows), else why not. `varying`: the input it is reached by, which must not be a MatMul's
        right-hand side."""
        what = f"{node.op} '{node.name}'"
        if node.op not in ELEMENTWISE_UNARY | ELEMENTWISE_NARY | {"MatMul"}:
            return f"{what} is not a MatMul by a constant matrix or an elementwise op"
        out = node.outputs[0] if len(node.outputs) == 1 else None
        shape = shapes.shape(out) if out is not None else None
        if out is None or shape is None or len(shape) != axis + 2 or shape[axis] != rows:
            return f"{what} does not make one tensor of known shape with the chain's {rows} rows on axis {axis}"
        if node.op == "MatMul":
            b = shapes.shape(node.inputs[1])
            if varying is node.inputs[1] or b is None or len(b) != 2 or ctx.prover.constant(node.inputs[1]) is None:
                return f"{what} does not multiply the rows by a constant 2-D matrix"
            return None
        for i in (i for i in node.inputs if i.name):
            known = ctx.prover.constant(i)
            if known is None and shapes.shape(i) != shape:
                return f"{what} broadcasts '{i.name}', which is not a constant, to its output's shape"
            if known is not None and not along_rows(shape, known.shape, axis):
                return f"{what} reads a constant '{i.name}' that varies along the rows"
        return None

    def _row_chain(self, ctx: Context, seed: gs.Node, shapes: Shapes, limit: int, outside: set[int], head: str
                   ) -> tuple[list[gs.Node], list[gs.Tensor], list[gs.Tensor], list[gs.Node], int, int]:
        """The chain computed in row chunks from `seed`: every node making or reading a tensor of it over the
        limit, each computing its rows from the same rows of its inputs (`_row_wise`), then the ops after its ends
        whose other inputs are constants (a bias Add: carried per chunk so that ORT's MatMul+Add fusion sees the
        same pattern in every chunk). Returns (nodes in graph order, the inputs sliced per chunk, the ends joined,
        the carried ops, the row axis, the rows); `Refuse` when a tensor over the limit cannot be made so."""
        shape = shapes.shape(seed.outputs[0])
        if shape is None or len(shape) < 2:
            raise Refuse(f"{head}: the shape of '{seed.outputs[0].name}' is not known statically")
        axis, rows = len(shape) - 2, shape[len(shape) - 2]
        chain: dict[int, gs.Node] = {}
        stack: list[tuple[gs.Node, gs.Tensor | None]] = [(seed, None)]
        problems: list[Refuse] = []  # the whole chain is walked first, so that each is matched (and refused) once
        while stack:
            node, reached = stack.pop()
            if id(node) in chain or id(node) in self.chained:
                continue
            self.chained.add(id(node))
            why = self._row_wise(ctx, node, shapes, axis, rows, reached)
            if why is not None:
                problems.append(Refuse(f"{head}: {why}, so the chain of '{seed.name}' cannot be computed in row "
                                       "chunks", node=node.name))
                continue
            chain[id(node)] = node
            for i in node.inputs:
                if (shapes.nbytes(i) or 0) > limit and ctx.prover.constant(i) is None:
                    if len(i.inputs) != 1:
                        problems.append(Refuse(f"{head}: '{i.name}' ({human(shapes.nbytes(i))}) is an input of the "
                                               "rewritten part, needed whole", read_elsewhere=i.name))
                    stack.extend((p, None) for p in i.inputs)
            for o in node.outputs:
                if (shapes.nbytes(o) or 0) > limit:
                    if id(o) in outside:
                        problems.append(Refuse(f"{head}: '{o.name}' is read outside the rewritten part or is a "
                                               "graph output, so it would be needed whole anyway",
                                               read_elsewhere=o.name))
                    stack.extend((r, o) for r in o.outputs)
        if problems:
            raise problems[0]
        order = {id(n): k for k, n in enumerate(ctx.graph.nodes)}
        nodes = sorted(chain.values(), key=lambda n: order[id(n)])
        carried: list[gs.Node] = []
        for node in list(nodes):  # the per-row ops after an end with constants only, as the bands carry a tail
            t = node.outputs[0]
            while id(t) not in outside and len(t.outputs) == 1 and id(t.outputs[0]) not in chain and \
                    t.outputs[0].op in ELEMENTWISE_UNARY | ELEMENTWISE_NARY and \
                    all(i is t or ctx.prover.constant(i) is not None for i in t.outputs[0].inputs if i.name) and \
                    self._row_wise(ctx, t.outputs[0], shapes, axis, rows, t) is None:
                chain[id(t.outputs[0])] = t.outputs[0]
                carried.append(t.outputs[0])
                t = t.outputs[0].outputs[0]
        nodes = sorted(chain.values(), key=lambda n: order[id(n)])
        made = {id(o) for n in nodes for o in n.outputs}
        sliced = list({id(i): i for n in nodes for i in n.inputs
                       if i.name and id(i) not in made and ctx.prover.constant(i) is None}.values())
        ends = [o for n in nodes for o in n.outputs
                if id(o) in outside or any(id(r) not in chain for r in o.outputs)]
        for t in ends:
            if (shapes.nbytes(t) or 0) > limit:
                raise Refuse(f"{head}: the chain's end '{t.name}' ({human(shapes.nbytes(t))}) is over the limit "
                             "too", end=t.name, end_bytes=shapes.nbytes(t))
        return nodes, sliced, ends, carried, axis, rows

    def _row_chunks(self, ctx: Context, seed: gs.Node, shapes: Shapes, limit: int, outside: set[int]) -> Action:
        big = max([*(i for i in seed.inputs if i.name), *seed.outputs], key=lambda t: shapes.nbytes(t) or 0)
        head = f"'{big.name}' ({human(shapes.nbytes(big))}) stays over the {human(limit)} limit"
        nodes, sliced, ends, carried, axis, rows = self._row_chain(ctx, seed, shapes, limit, outside, head)
        why = self.plan.keep_whole.get(seed.name)
        if why is not None:
            raise why.prefixed(f"{head}: ")
        tensors = [*sliced, *(o for n in nodes for o in n.outputs)]
        biggest = max(tensors, key=lambda t: shapes.nbytes(t) or 0)
        row_bytes = max(-(-(shapes.nbytes(t) or 0) // rows) for t in tensors)
        most = limit // row_bytes
        if most < 1:
            raise Refuse(f"{head}: one row of the chain is {human(row_bytes)}", rows=rows, row_bytes=row_bytes)
        n = math.ceil(rows / most)
        chunks = _bands(rows, n)
        worst = max((r1 - r0) * (shapes.nbytes(t) or 0) // rows for t in tensors for r0, r1 in chunks)

        over = [o.name for n in nodes for o in n.outputs if (shapes.nbytes(o) or 0) > limit]
        first = len(ctx.graph.nodes)
        float16 = any(shapes.dtype(t) == np.float16 for t in tensors)
        proof = self._proof(ctx, shapes, seed.name, nodes, ends, float16)
        pieces: dict[int, list[gs.Tensor]] = {id(t): [] for t in ends}
        for k, (r0, r1) in enumerate(chunks):
            tag = f"rows{k}"
            made: dict[int, gs.Tensor] = {}
            for t in sliced:
                s = shapes.shape(t)
                made[id(t)] = cut(ctx, f"{t.name}/{tag}/slice", t, r0, r1, axis,
                                  ctx.var(f"{t.name}/{tag}", shapes.dtype(t), (*s[:axis], r1 - r0, *s[axis + 1:])),
                                  rows, self._held(ctx, t))
            for node in nodes:
                outs = []
                for o in node.outputs:
                    s = shapes.shape(o)
                    made[id(o)] = ctx.var(f"{o.name}/{tag}", shapes.dtype(o), (*s[:axis], r1 - r0, *s[axis + 1:]))
                    outs.append(made[id(o)])
                ctx.node(node.op, f"{node.name}/{tag}", [made.get(id(i), i) for i in node.inputs], outs,
                         dict(node.attrs))
            for t in ends:
                pieces[id(t)].append(made[id(t)])
        for node in nodes:
            node.outputs.clear()
        for t in ends:
            join(ctx, f"{t.name}/rows/join", pieces[id(t)], t, axis, shapes, self._held(ctx, t))
        if proof is not None:
            proof.taken(ctx, shapes)

        counts = "/".join(str(c) for c in sorted({r1 - r0 for r0, r1 in chunks}, reverse=True))
        details = {"chunks": n, "chunk_rows": [r1 - r0 for r0, r1 in chunks], "rows": rows, "axis": axis,
                   "tensor": biggest.name, "size_bytes": shapes.nbytes(biggest), "chunk_bytes": worst,
                   "limit_bytes": limit, "chain": [x.op for x in nodes], "made_in_rows": over,
                   "sliced": [t.name for t in sliced], "ends": [t.name for t in ends],
                   "carried": [x.op for x in carried], **float16_details(float16)}
        return Action(self.name, seed.name, seed.op, Outcome.REWRITTEN,
                      f"computed in {n} row chunks of {counts} rows (of {rows}, axis {axis}) with the "
                      f"{len(nodes)} nodes of its chain ({' -> '.join(x.op for x in nodes)}): {len(over)} tensor(s) "
                      f"were over the {human(limit)} limit, the largest '{biggest.name}' "
                      f"({human(shapes.nbytes(biggest))}); each chunk reads a Slice of the rows of "
                      f"{', '.join(repr(t.name) for t in sliced)}, one Concat per end joins the chunks "
                      f"({', '.join(repr(t.name) for t in ends)}); largest chunk tensor {human(worst)}; each output "
                      "row reads only its own input row, but the summation order of a MatMul kernel on fewer rows is "
                      "the implementation's choice, so it is written only once shown exact"
                      + (FLOAT16_NOTE if float16 else ""),
                      tuple(t.name for t in ctx.graph.nodes[first:]), needs_verify=True, details=details)

    def _proof(self, ctx: Context, shapes: Shapes, key: str, nodes: list[gs.Node], ends: list[gs.Tensor],
               float16: bool):
        """The local proof of a rewrite (local_proof.py), or None for a float16 one: a region's inputs would be
        float16 graph inputs, rounded already, so only the whole model shows where ORT CPU rounds (cuts.py)."""
        if float16:
            return None
        proof = self.plan.proofs[key] = record(ctx, shapes, nodes, ends)
        return proof

    @staticmethod
    def _shared_constants(ctx: Context, convs: list[gs.Node], head: str) -> None:
        """Refuse float16 bands of a Conv with a stored input of at most 8 elements (a bias of few channels).

        Why: at level `all` ORT CPU runs a float16 Conv with its NCHWc kernel only when it can make float32 copies of
        the Conv's float16 initializers, which it does for an initializer one node reads; the bands read copies of
        the weights each, but ORT's ConstantSharing merges initializers of up to 8 elements with equal values into
        one, which all the bands then read, and the bands run on another Conv kernel than the whole Conv (measured
        on the real BiRefNet-lite 1024 fp16: its last Conv, 1 output channel, differs by 5.5e-6 in 2 bands).
        The banded Conv itself avoids it where it can (`_bands`): its bands run without the bias and one Add after
        the join adds it (MLAS's NCHWc kernel adds the bias after the sums too), when the ops after it are Relu or
        Cast only (left whole after that Add); a Conv inside the bands' source, or one with a BatchNormalization or
        another op after it, is refused here."""
        for conv in convs:
            for i in conv.inputs[1:]:
                value = ctx.prover.constant(i) if i.name else None
                if value is not None and value.size <= 8:
                    raise Refuse(f"{head}: float16 Conv '{conv.name}' reads '{i.name}' of {value.size} element(s), "
                                 "which ORT CPU would share between the bands (initializers of up to 8 elements), "
                                 "and then it runs them on another Conv kernel than the whole Conv at level all",
                                 conv=conv.name, shared=i.name)

    def _held(self, ctx: Context, t: gs.Tensor) -> bool:
        """Whether ORT CPU holds float16 `t` in float32 (cuts.py), a channel group as the tensor it is part of:
        the cut of a group made by a Cast to float16 must round as that Cast's readers saw it round."""
        return ctx.held_in_float32(self.origin.get(id(t), t))

    @staticmethod
    def _derive_input(conv: gs.Node, shapes: Shapes) -> None:
        """The input shape of a Conv of stride 1 from its output and weight shapes, where inference lost it (the
        current BiRefNet's image-patch Resize takes its sizes from Shape -> Gather, which ONNX's data propagation
        does not follow). With stride 1 each output size determines the input size exactly."""
        out, w = shapes.shape(conv.outputs[0]), shapes.shape(conv.inputs[1])
        strides = list(conv.attrs.get("strides") or [1, 1])
        if out is None or w is None or len(out) != 4 or strides != [1, 1] or \
                conv.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
            return
        pads = list(conv.attrs.get("pads") or [0, 0, 0, 0])
        dil = list(conv.attrs.get("dilations") or [1, 1])
        h = out[2] - pads[0] - pads[2] + (w[2] - 1) * dil[0]
        width = out[3] - pads[1] - pads[3] + (w[3] - 1) * dil[1]
        shapes.learn(conv.inputs[0], (out[0], w[1] * int(conv.attrs.get("group", 1)), h, width),
                     shapes.dtype(conv.outputs[0]))

    def _feeding(self, ctx: Context, x: gs.Tensor, shapes: Shapes, nested: bool = False
                 ) -> tuple[list[gs.Node], gs.Node] | None:
        """The node X's bands can be computed from (a channel Concat, or a Conv through per-channel ops; for an
        input of such a producer (`nested`), a Concat on the rows too) and those ops in order, or None when X is
        made otherwise (not this pass's pattern). Why a Concat on the rows only nested: a Conv reading a split
        deform block's join is that block's Conv, which the split pass chunks or keeps whole for its own reasons
        (reported there); banding it again would ask the same question twice."""
        chain: list[gs.Node] = []
        axes = (1, 2) if nested else (1,)
        t = x
        while len(t.inputs) == 1:
            node = t.inputs[0]
            if node.op == "Concat" and not chain and _axis(node, len(shapes.shape(t))) in axes and \
                    all(shapes.shape(i) is not None and len(shapes.shape(i)) == 4 for i in node.inputs):
                return chain, node
            if node.op == "Conv" and len(node.outputs) == 1:
                return list(reversed(chain)), node
            data = self._per_channel(ctx, node, shapes)
            if data is None:
                return None
            chain.append(node)
            t = data
        return None

    @staticmethod
    def _per_channel(ctx: Context, node: gs.Node, shapes: Shapes) -> gs.Tensor | None:
        """The data input of an op that computes each element of its output from the element at the same place of
        that input and constants broadcast along the rows (bias Add, BatchNormalization, Relu, ...), else None."""
        if node.op not in TAIL_OPS or len(node.outputs) != 1 or not node.inputs:
            return None
        if node.op in ELEMENTWISE_UNARY or node.op == "BatchNormalization":
            data = node.inputs[0]
            return data if all(ctx.prover.constant(i) is not None for i in node.inputs[1:] if i.name) else None
        shape = shapes.shape(node.outputs[0])
        varying = [i for i in node.inputs if ctx.prover.constant(i) is None]
        if shape is None or len(varying) != 1 or shapes.shape(varying[0]) != shape:
            return None
        for side in node.inputs:
            if side is varying[0]:
                continue
            if not along_rows(shape, ctx.prover.constant(side).shape):
                return None
        return varying[0]

    def _rows(self, ctx: Context, t: gs.Tensor, r0: int, r1: int, shapes: Shapes) -> gs.Tensor:
        s = shapes.shape(t)
        if (r0, r1) == (0, s[2]):
            return t
        base = f"{t.name}/rows{r0}_{r1}"
        return cut(ctx, base, t, r0, r1, 2, ctx.var(base, shapes.dtype(t), (*s[:2], r1 - r0, *s[3:])), s[2],
                   self._held(ctx, t))

    @staticmethod
    def _through(ctx: Context, nodes: list[gs.Node], x: gs.Tensor, first_attrs: dict, tag: str, rows: int,
                 shapes: Shapes, drop_bias: bool = False) -> gs.Tensor:
        """`x` (the rows of the first node's data input) through copies of `nodes`, a Conv with `first_attrs` and
        then per-channel ops, each reading its predecessor's output: `[N, M, rows, W]`."""
        current, replaced = x, nodes[0].inputs[0]
        for k, n in enumerate(nodes):
            out = n.outputs[0]
            s = shapes.shape(out)
            y = ctx.var(f"{out.name}/{tag}", shapes.dtype(out), (*s[:2], rows, *s[3:]))
            inputs = [current if i is replaced else i for i in n.inputs][:2 if drop_bias and k == 0 else None]
            if n.op == "Conv" and shapes.dtype(out) == np.float16:  # its own copy of the weights per band: ORT
                # CPU makes float32 weights for its NCHWc Conv kernel (level all) only for a float16 initializer
                # one node reads; bands sharing them would run another Conv kernel than the whole Conv did
                inputs = [ctx.const(f"{i.name}/{tag}", np.array(v)) if slot and i.name and
                          (v := ctx.prover.constant(i)) is not None else i for slot, i in enumerate(inputs)]
            ctx.node(n.op, f"{n.name}/{tag}", inputs, [y], first_attrs if k == 0 else dict(n.attrs))
            current, replaced = y, out
        return current
