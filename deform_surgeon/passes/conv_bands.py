"""A Conv in row bands (the bands pass, bands.py): which output rows each band computes, from which rows of its
input, and how those rows are made without making the input whole.

Why apart from the pass: what a band reads is decided by the Conv's window (kernel, stride, dilation, pads along
the rows) and by the producers of its input, walked back through channel Concats, Concats on the rows and Convs
(`RowSource`); none of it concerns the Resize's channel groups or the MatMul chains the same pass computes. The
module docstring of bands.py says why each form is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ..graph.blocks import conv_tail
from ..graph.budget import human
from ..graph.ops import ELEMENTWISE_UNARY, TAIL_OPS
from ..graph.pipeline import Action, Context, Refuse
from ..graph.shapes import Shapes, along_rows
from .cut_and_join import cut, float16_details, join
from .oversize import OversizeRun, concat_axis, even_parts, kernels_choice


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


# per-element ops without parameters: after a Conv, the same bytes whether ORT fuses them into it or not (what a
# float16 Conv whose bias is added after its bands' join leaves whole after that Add)
_EXACT_TAIL = {"Relu", "Cast"}

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


@dataclass(frozen=True)
class BandPlan:
    """The row bands a Conv is computed in: `bands` as `(o0, o1, x0, x1, top, bottom)` each (its output rows, the
    input rows they read, the zero rows padded above and below), `worst` the largest band tensor; `tail` the
    per-channel ops carried per band; `bias` the bias added once after the join (None: the bands read it)."""

    conv: gs.Node
    window: Window
    source: RowSource
    tail: list[gs.Node]
    bias: np.ndarray | None
    bands: list[tuple[int, int, int, int, int, int]]
    worst: int
    rows: int  # the Conv's output rows


class ConvRowBands:
    """Plans and builds the row bands of a Conv whose input is over the limit (the pass's `conv` matches)."""

    def __init__(self, run: OversizeRun) -> None:
        self.run = run

    def source(self, ctx: Context, x: gs.Tensor, feeders: tuple[list[gs.Node], gs.Node], head: str,
               conv: gs.Node | None = None) -> RowSource:
        """How the bands' rows of `x` are made from what `feeders` found making it: its producer computed for
        those rows from the rows of its inputs, each of them sliced from the whole tensor where that fits the
        limit, else made for those rows by its own producer in turn (the nested form: a channel Concat reads a
        Conv output itself over the limit); `Refuse` when some tensor over the limit cannot be made so.
        `conv` (reading `x`): a channel Concat `x` that other Convs read too (the channel groups of one Conv,
        `ResizeGroups.unshared`) is made by each one's bands from its inputs' rows, and is gone once every one of
        them is."""
        shapes, limit, outside = self.run.shapes, self.run.limit, self.run.outside
        chain, producer = feeders
        shared_by_convs = conv is not None and not chain and producer.op == "Concat" and \
            concat_axis(producer, 4) == 1 and \
            all(r is conv or (r.op == "Conv" and r.inputs[0] is x) for r in x.outputs if self.run.live(r))
        for t in [x, *(n.outputs[0] for n in chain), *(producer.outputs if chain else ())]:
            if id(t) in outside or (len(t.outputs) != 1 and not (t is x and shared_by_convs)):
                raise Refuse(f"{head}: '{t.name}' is also read elsewhere (or outside the rewritten part), so it "
                             "would be needed whole anyway", read_elsewhere=t.name)
        if producer.op == "Concat" and concat_axis(producer, 4) == 2:  # rows joined: each band slices the inputs
            # it spans
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
            made = self.feeding(ctx, s, shapes, nested=True)
            if made is None:
                raise Refuse(f"{head}: {producer.op} '{producer.name}' reads '{s.name}' ({human(shapes.nbytes(s))}), "
                             "itself over the limit" + (f", made by {s.inputs[0].op} '{s.inputs[0].name}', which is "
                                                        "not computed in rows (a Concat on the channels or the "
                                                        "rows, or a Conv, is)"
                                                        if s.inputs else ""), source=s.name,
                             source_bytes=shapes.nbytes(s))
            inputs.append(self.source(ctx, s, made, head))
        return RowSource(x, producer, tuple(chain), window, tuple(inputs))

    def plan(self, ctx: Context, conv: gs.Node, feeders: tuple[list[gs.Node], gs.Node]) -> BandPlan:
        """The fewest row bands of `conv` whose tensors fit the limit, each from the rows of its input it reads,
        made by `feeders`' producer (`source`); `Refuse` where that cannot be done."""
        shapes, limit = self.run.shapes, self.run.limit
        x = conv.inputs[0]
        size, xs = shapes.nbytes(x), shapes.shape(x)
        head = f"input '{x.name}' ({human(size)}) stays over the {human(limit)} limit"
        why = self.run.run_state.keep_whole.get(conv.name)
        if why is not None:
            raise why.prefixed(f"{head}: ")
        window = Window.of(conv, xs, shapes.shape(conv.inputs[1]))
        y_shape = shapes.shape(conv.outputs[0])
        if y_shape is None or len(y_shape) != 4 or y_shape[2] < 2:
            raise Refuse(f"{head}: the Conv's output shape is not known as [N, M, H, W] with H >= 2")
        source = self.source(ctx, x, feeders, head, conv)
        tail, bias = self._tail_and_late_bias(ctx, conv, head, source)
        bands, worst = self._fewest_bands(conv, window, source, tail, head)
        return BandPlan(conv, window, source, tail, bias, bands, worst, y_shape[2])

    def rewrite(self, ctx: Context, plan: BandPlan) -> Action:
        """The Conv computed in `plan`'s bands, and what the report says of them."""
        float16 = self.run.shapes.dtype(plan.conv.inputs[0]) == np.float16
        self._build(ctx, plan, float16)
        return self._action(plan, float16)

    def _tail_and_late_bias(self, ctx: Context, conv: gs.Node, head: str, source: RowSource
                            ) -> tuple[list[gs.Node], np.ndarray | None]:
        """The per-channel ops carried per band after `conv` (`blocks.conv_tail`), and the bias added once after
        the join instead of per band (None: the bands read it): a float16 Conv's bias of at most 8 elements when
        the ops after it are Relu or Cast only, which then stay whole after that Add (`_shared_constants` says why,
        and refuses the float16 bands that cannot avoid a shared small constant so)."""
        shapes, x = self.run.shapes, conv.inputs[0]
        tail = conv_tail(ctx, conv, shapes)
        bias = ctx.prover.constant(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2].name else None
        late_bias = shapes.dtype(x) == np.float16 and bias is not None and bias.size <= 8 and \
            all(t.op in _EXACT_TAIL for t in tail)
        if late_bias:  # the tail stays whole, after the bias
            tail = []
        if shapes.dtype(x) == np.float16:
            self._shared_constants(ctx, [*([] if late_bias else [conv]),
                                         *(n for n in source.nodes() if n.op == "Conv")], head)
        return tail, bias if late_bias else None

    def _row_bytes(self, t: gs.Tensor) -> int:
        s = self.run.shapes.shape(t)
        return (self.run.shapes.nbytes(t) or 0) // s[2]

    def _reach(self, src: RowSource, r0: int, r1: int) -> int:
        """The largest tensor the rows [r0, r1) of `src` need (its own band and what makes it); `_Nothing` when
        a Conv on the way would read only its zero padding."""
        worst = self._row_bytes(src.tensor) * (r1 - r0)
        if src.window is not None:
            a, b, _, _ = src.window.rows_read(r0, r1, self.run.shapes.shape(src.inputs[0].tensor)[2])
            if b <= a:
                raise _Nothing
            r0, r1 = a, b
        return max([worst, *(self._reach(i, r0, r1) for i in src.inputs)])

    def _fewest_bands(self, conv: gs.Node, window: Window, source: RowSource, tail: list[gs.Node], head: str
                      ) -> tuple[list[tuple[int, int, int, int, int, int]], int]:
        """The fewest equal row bands of `conv`'s output (from 2) whose every tensor, through the whole chain that
        makes their rows, fits the limit: `(o0, o1, x0, x1, top, bottom)` each (output rows, input rows, zero rows
        padded above and below) and the largest band tensor; `Refuse` when even one row per band does not fit, or
        when a band would read nothing but zero padding."""
        shapes, limit = self.run.shapes, self.run.limit
        rows_out, rows_x = shapes.shape(conv.outputs[0])[2], shapes.shape(conv.inputs[0])[2]

        def plan(n: int) -> tuple[list, int]:
            bands, worst = [], 0
            for o0, o1 in even_parts(rows_out, n):
                x0, x1, top, bottom = window.rows_read(o0, o1, rows_x)
                try:
                    if x1 <= x0:
                        raise _Nothing
                    worst = max(worst, self._reach(source, x0, x1),
                                *[self._row_bytes(t) * (o1 - o0)
                                  for t in [conv.outputs[0]] + [t.outputs[0] for t in tail]])
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
        return bands, worst

    def _build(self, ctx: Context, plan: BandPlan, float16: bool) -> None:
        """The bands into the graph: each makes its rows of the input (`_made`) and runs the Conv and its tail on
        them, one Concat on the rows joins them (then the late bias's Add), and the local proof is recorded."""
        shapes, conv, tail, late_bias = self.run.shapes, plan.conv, plan.tail, plan.bias is not None
        end = (tail[-1] if tail else conv).outputs[0]
        proof = self.run.proof(ctx, conv.name, [*plan.source.nodes(), conv, *tail], [end], float16)
        joined = []
        for k, (o0, o1, x0, x1, top, bottom) in enumerate(plan.bands):
            tag = f"band{k}"
            x_band = self._made(ctx, plan.source, x0, x1, tag, shapes)
            joined.append(self._through(ctx, [conv, *tail], x_band, plan.window.band_attrs(conv, top, bottom), tag,
                                        o1 - o0, shapes, drop_bias=late_bias))
        for node in [conv, *tail]:
            node.outputs.clear()
        if late_bias:  # the bias added once, after the join (see `_shared_constants`)
            summed = ctx.var(f"{end.name}/before_bias", shapes.dtype(end), shapes.shape(end))
            join(ctx, f"{conv.name}/bands/join", joined, summed, 2, shapes, self.run.held(ctx, end))
            ctx.node("Add", f"{conv.name}/bands/bias", [summed, ctx.const(f"{conv.inputs[2].name}/after_bands",
                                                                          plan.bias.reshape(1, -1, 1, 1))], [end])
        else:
            join(ctx, f"{conv.name}/bands/join", joined, end, 2, shapes, self.run.held(ctx, end))
        if proof is not None:
            proof.taken(ctx, shapes)

    def _action(self, plan: BandPlan, float16: bool) -> Action:
        """What the report says of the bands built: why, how many, and what they read."""
        shapes, limit, conv, bands, bias = self.run.shapes, self.run.limit, plan.conv, plan.bands, plan.bias
        x, n, rows_out = conv.inputs[0], len(bands), plan.rows  # (the Conv's outputs are the bands' now)
        size = shapes.nbytes(x)
        counts = "/".join(str(c) for c in sorted({b[1] - b[0] for b in bands}, reverse=True))
        carried = "".join(f" -> {t.op}" for t in plan.tail)
        details = {"bands": n, "band_rows": [b[1] - b[0] for b in bands], "rows": rows_out, "tensor": x.name,
                   "size_bytes": size, "band_bytes": plan.worst, "limit_bytes": limit,
                   "source": plan.source.node.name, "carried": [t.op for t in plan.tail],
                   "made_in_rows": plan.source.made_in_rows(),
                   "bias_after_join": conv.inputs[2].name if bias is not None else None, **float16_details(float16)}
        late = (f", then its bias of {bias.size} element(s) is added once (ORT CPU would share a copy of it between "
                "the bands, which then run on another Conv kernel than the whole Conv; its NCHWc kernel adds the "
                "bias after the sums, as this Add does)") if bias is not None else ""
        return self.run.rewritten(
            conv, f"computed in {n} row bands of {counts} output rows (of {rows_out}): input '{x.name}' "
            f"({human(size)}) was over the {human(limit)} limit; each band reads its rows of it (with the kernel's "
            f"halo) from {plan.source.describe(shapes)}; largest band tensor {human(plan.worst)}; the Conv{carried} "
            f"runs per band and one Concat joins the bands{late}; each output pixel reads the same values, but "
            + kernels_choice("Conv"), details, float16)

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

    @staticmethod
    def _shared_constants(ctx: Context, convs: list[gs.Node], head: str) -> None:
        """Refuse float16 bands of a Conv with a stored input of at most 8 elements (a bias of few channels).

        Why: at level `all` ORT CPU runs a float16 Conv with its NCHWc kernel only when it can make float32 copies of
        the Conv's float16 initializers, which it does for an initializer one node reads; the bands read copies of
        the weights each, but ORT's ConstantSharing merges initializers of up to 8 elements with equal values into
        one, which all the bands then read, and the bands run on another Conv kernel than the whole Conv (measured
        on the real BiRefNet-lite 1024 fp16: its last Conv, 1 output channel, differs by 5.5e-6 in 2 bands).
        The banded Conv itself avoids it where it can (`rewrite`): its bands run without the bias and one Add after
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

    def feeding(self, ctx: Context, x: gs.Tensor, shapes: Shapes, nested: bool = False
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
            if node.op == "Concat" and not chain and concat_axis(node, len(shapes.shape(t))) in axes and \
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
                   self.run.held(ctx, t))

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
