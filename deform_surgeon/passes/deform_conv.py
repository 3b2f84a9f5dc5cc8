"""ONNX `DeformConv` -> the gather form the WebGPU EPs run: float sampling arithmetic, int32 row indices, four
`Gather`s, an `Add` chain and one `MatMul`, in the order ORT CPU's own DeformConv kernel computes.

Why: torch's dynamo exporter writes torchvision's `deform_conv2d` as one `DeformConv` (opset 19+), for which
neither WebGPU EP of onnxruntime-web has a kernel: it runs on the CPU EP with two Memcpy around it.

What ORT CPU computes (onnxruntime/core/providers/cpu/nn/deform_conv.cc), per image, offset group `og`, kernel
tap `k = (i, j)` and output position `p = (oy, ox)`, and what this pass builds for each step:

    h = (oy*stride_h - pad_h + i*dil_h) + offset_h        Add(constant grid, offset): one rounding, as there
    inside = -1 < h < H and -1 < w < W                    else all four weights 0, all four indices 0
    y0 = floor(h), lh = h - y0, hh = 1 - lh               Floor, Sub, Sub (likewise x0, lw, hw)
    w00 = hh*hw, w01 = hh*lw, w10 = lh*hw, w11 = lh*lw     Mul
    corner (a, b) valid: y_a, x_b inside the image         else its weight and its index are 0
    sample = w00*X[i00] + w01*X[i01] + w10*X[i10] + w11*X[i11]   (left to right), then `*= mask`
    Y[g] = W[g] @ col[g]  (MLAS SGEMM, M/g x P x K)        MatMul of the same shapes: the same MLAS SGEMM
    Y += bias[m]                                          Add

A float16 DeformConv is computed in float32 between Casts (every input to float32, the output back), because
that is how ORT CPU runs it: it has a float32 kernel only and inserts those Casts itself.

A NaN coordinate fails the inside test, so its sample is an outside one (weights 0, index 0), as on ORT 1.32 CPU
(measured: NaN offsets give the bytes +inf offsets give). The gather indices never depend on that reasoning: every
row index is built from coordinates clamped by `Where(0 <= c <= size-1, c, 0)` (NaN fails both comparisons), and
the range prover (ranges.py) checks every Gather's index against its data before the rewrite is kept.

Exactness: every elementwise step is the same IEEE float32 operation on the same operands as ORT's C++ (compiled
without FMA contraction on x86-64), and the GEMM is the MLAS SGEMM MatMul uses for the same M, N, K. The latter is
a property of ORT's kernels, not of the graph, so the rewrite is marked `needs_verify`: `patch` writes it only
after the whole patched model verified byte-identical on ORT CPU, and undoes it otherwise (docs/deformconv.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..graph.budget import human
from ..graph.pipeline import Action, Context, Outcome, Pass, Refuse
from ..graph.ranges import gather_elements_verdict
from .gathernd import INT32_MAX

OP = "DeformConv"
# The constants one lowering may add (its sampling grid, `grid_bytes`). Why a bound: the grid grows with the output
# positions, not with the file, so a model of a few hundred bytes declaring a 16384 x 16384 input would otherwise
# build (and prove, export and write) gigabytes before anything else looks at a size. 256 MiB is the largest buffer
# a WebGPU device must offer (the spec's maxBufferSize); a grid of 256 MiB is 5,792 x 5,792 output positions.
MAX_CONSTANT_BYTES = 256 * 2**20
STAYS = "it stays a DeformConv, which runs on the CPU EP in onnxruntime-web (no WebGPU EP has a kernel for it)"


@dataclass(frozen=True)
class DeformConvPlan:
    """The static shapes and attributes of one DeformConv (ONNX DeformConv-19 defaults filled in)."""

    n: int
    c: int
    h: int
    w: int
    m: int
    kh: int
    kw: int
    oh: int
    ow: int
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int, int, int]
    group: int
    offset_group: int
    has_bias: bool
    has_mask: bool
    chunk_rows: int  # output rows lowered at once (all of them unless --max-buffer asks for less)
    half: bool = False  # float16: computed in float32 between Casts, as ORT CPU runs it

    @property
    def taps(self) -> int:
        return self.kh * self.kw

    @property
    def points(self) -> int:
        return self.oh * self.ow


class LowerDeformConv(Pass):
    """Rewrite every float32 or float16 2-D DeformConv with static shapes into the sampling form (module
    docstring)."""

    name = "deform_conv"

    def __init__(self, keep_whole: dict[str, Refuse] | None = None) -> None:
        self.keep_whole = keep_whole if keep_whole is not None else {}  # node -> why it stays (a failed check)

    def matches(self, ctx: Context) -> list[gs.Node]:
        return [n for n in ctx.graph.nodes if n.op == OP and n.domain in (None, "", "ai.onnx")]

    def refused(self, node: gs.Node, why: Refuse) -> Action:
        """A refusal says where the node runs instead (on the CPU EP in the browser)."""
        return Action(self.name, node.name, node.op, Outcome.REFUSED, f"{why}; {STAYS}", details=why.details)

    def check(self, ctx: Context, node: gs.Node) -> DeformConvPlan:
        """The plan for `node`, or `Refuse` with the reason it stays a DeformConv."""
        if node.name in self.keep_whole:
            raise self.keep_whole[node.name]
        prover = ctx.prover
        ins = list(node.inputs) + [gs.Variable("")] * (5 - len(node.inputs))
        x, weight, offset, bias, mask = ins[:5]
        dtype = prover.dtype(x)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise Refuse(f"element type {dtype} (float32 and float16 are lowered: the WebGPU EPs have no {dtype})",
                         dtype=str(dtype))
        shapes = [prover.static_shape(t) for t in (x, weight, offset)]
        if any(s is None for s in shapes):
            raise Refuse("input, weight or offset shape not known statically")
        (n, c, h, w), wshape, oshape = shapes[0], shapes[1], shapes[2]
        if len(shapes[0]) != 4 or len(wshape) != 4:
            raise Refuse("only the 2-D DeformConv (rank-4 input and weight) is lowered")
        attrs = node.attrs
        m, kh, kw = wshape[0], wshape[2], wshape[3]
        if list(attrs.get("kernel_shape", [kh, kw])) != [kh, kw]:
            raise Refuse(f"kernel_shape {attrs['kernel_shape']} differs from the weight's {[kh, kw]}")
        strides = tuple(attrs.get("strides", [1, 1]))
        dilations = tuple(attrs.get("dilations", [1, 1]))
        pads = tuple(attrs.get("pads", [0, 0, 0, 0]))
        group, og = int(attrs.get("group", 1)), int(attrs.get("offset_group", 1))
        if len(strides) != 2 or len(dilations) != 2 or len(pads) != 4:
            raise Refuse("strides, dilations or pads do not have the 2-D lengths")
        if c % group or m % group or c % og or wshape[1] * group != c:
            raise Refuse(f"channels {c}, output channels {m}, group {group}, offset_group {og} do not divide",
                         channels=c, output_channels=m, group=group, offset_group=og)
        oh = (h + pads[0] + pads[2] - (dilations[0] * (kh - 1) + 1)) // strides[0] + 1
        ow = (w + pads[1] + pads[3] - (dilations[1] * (kw - 1) + 1)) // strides[1] + 1
        if oh < 1 or ow < 1:
            raise Refuse(f"empty output ({oh} x {ow})", output_shape=[oh, ow])
        if min(n, c, m) < 1:  # (ORT's kernel returns an empty output; a lowering would divide by zero)
            raise Refuse(f"empty input or output ({n} images, {c} input channels, {m} output channels)",
                         shape=[n, c, h, w], output_shape=[n, m, oh, ow])
        constants = grid_bytes(oh, ow)
        if constants > MAX_CONSTANT_BYTES:
            raise Refuse(f"its lowering would add {human(constants)} of constants (the sampling grid of {oh} x {ow} "
                         f"output positions), over the {human(MAX_CONSTANT_BYTES)} one rewrite may add",
                         size_bytes=constants, limit_bytes=MAX_CONSTANT_BYTES)
        if tuple(oshape) != (n, og * 2 * kh * kw, oh, ow):
            raise Refuse(f"offset shape {list(oshape)} is not {[n, og * 2 * kh * kw, oh, ow]}", shape=oshape,
                         expected=[n, og * 2 * kh * kw, oh, ow])
        has_mask = mask.name != ""
        if has_mask and prover.static_shape(mask) != (n, og * kh * kw, oh, ow):
            raise Refuse(f"mask shape {prover.static_shape(mask)} is not {[n, og * kh * kw, oh, ow]}",
                         shape=prover.static_shape(mask), expected=[n, og * kh * kw, oh, ow])
        has_bias = bias.name != ""
        if has_bias and prover.static_shape(bias) != (m,):
            raise Refuse(f"bias shape {prover.static_shape(bias)} is not {[m]}", shape=prover.static_shape(bias),
                         expected=[m])
        if n * og * h * w - 1 > INT32_MAX:
            raise Refuse(f"{n * og * h * w} sampled rows, more than an int32 index can address",
                         data_rows=n * og * h * w, max_rows=INT32_MAX + 1)
        return DeformConvPlan(n, c, h, w, m, kh, kw, oh, ow, strides, dilations, pads, group, og, has_bias, has_mask,
                              _chunk_rows(ctx.options.max_buffer, n, c, kh * kw, oh, ow, c // group * kh * kw),
                              half=dtype == np.dtype(np.float16))

    def rewrite(self, ctx: Context, node: gs.Node, plan: DeformConvPlan) -> Action:
        out = node.outputs[0]
        name = node.name or out.name
        node.name = ctx.names.fresh(f"{name}/lowered")  # the MatMul takes its name: the block keeps its label
        ctx.names.used.add(name)
        node.outputs.clear()
        b = _Builder(ctx, name)
        gathers = self._build(b, node, plan, out)
        verdicts = [gather_elements_verdict(ctx.prover, g) for g in gathers]
        if not all(v.proven for v in verdicts):  # cannot happen by construction; never written unproven (the
            # refusal takes the nodes built back, and gives the node its name and output again)
            raise Refuse(f"sampling index not proven in range: {'; '.join(v.reason for v in verdicts if not v.proven)}",
                         **next(v.details for v in verdicts if not v.proven))
        p = plan
        what = (f"{p.kh}x{p.kw}, stride {list(p.strides)}, dilation {list(p.dilations)}, pads {list(p.pads)}, "
                f"group {p.group}, offset_group {p.offset_group}, {'with' if p.has_mask else 'no'} mask, "
                f"{'with' if p.has_bias else 'no'} bias")
        if p.chunk_rows < p.oh:
            what += f"; in {-(-p.oh // p.chunk_rows)} chunks of {p.chunk_rows} output rows (--max-buffer)"
        reason = (f"DeformConv ({what}) -> 4 Gathers + Add chain + MatMul in ORT CPU's own order; indices "
                  f"proven in range ({verdicts[0].reason})")
        chunks = -(-p.oh // p.chunk_rows)
        details = {"kernel": [p.kh, p.kw], "strides": p.strides, "dilations": p.dilations, "pads": p.pads,
                   "group": p.group, "offset_group": p.offset_group, "mask": p.has_mask, "bias": p.has_bias,
                   "rows": p.oh, "chunks": chunks, "chunk_rows": [min(p.chunk_rows, p.oh - r)
                                                                  for r in range(0, p.oh, p.chunk_rows)],
                   **verdicts[0].details}
        if p.chunk_rows < p.oh:
            details["limit_bytes"] = ctx.options.max_buffer
        return Action(self.name, name, OP, Outcome.REWRITTEN, reason, needs_verify=True, details=details)

    @staticmethod
    def _build(b: _Builder, node: gs.Node, p: DeformConvPlan, out: gs.Tensor) -> list[gs.Node]:
        """Build the replacement, in chunks of `p.chunk_rows` output rows; return its Gathers (whose indices the
        caller proves)."""
        ins = list(node.inputs) + [gs.Variable("")] * (5 - len(node.inputs))
        if p.half:  # ORT CPU has a float32 kernel only: its graph casts every input to float32 and the output back
            ins = [t if t.name == "" else b.op("Cast", [t], f"input{i}_float32", to=onnx.TensorProto.FLOAT)
                   for i, t in enumerate(ins)]
        x, weight, offset, bias, mask = ins[:5]
        og, cg = p.offset_group, p.c // p.offset_group
        final = out
        if p.half:
            out = b.ctx.var(f"{b.name}/output_float32", np.float32, None)

        # the image as rows of channels: row (n*og + g)*H*W + y*W + x holds X[n, g*cg:(g+1)*cg, y, x]
        grouped = b.op("Reshape", [x, b.i64([p.n, og, cg, p.h * p.w])], "image_grouped")
        rows_first = b.op("Transpose", [grouped], "image_rows_first", perm=[0, 1, 3, 2])
        table = b.op("Reshape", [rows_first, b.i64([-1, cg])], "image_rows", shape=[p.n * og * p.h * p.w, cg])
        base = None
        if p.n * og > 1:
            starts = (np.arange(p.n * og, dtype=np.int64) * p.h * p.w).astype(np.int32).reshape(p.n, og, 1, 1)
            base = b.const(starts)
        kdim = (p.c // p.group) * p.taps
        wmat = b.op("Reshape", [weight, b.i64([p.group, p.m // p.group, kdim])], "weight_rows")
        w_groups = [wmat] if p.group == 1 else [
            b.op("Gather", [wmat, b.const(np.array(g, np.int32))], f"weight_group{g}", axis=0) for g in range(p.group)]

        gathers: list[gs.Node] = []
        products: list[list[gs.Tensor]] = [[] for _ in range(p.group)]  # per group, per chunk
        chunks = [(r, min(r + p.chunk_rows, p.oh)) for r in range(0, p.oh, p.chunk_rows)]
        for c, rows in enumerate(chunks):
            tag = "" if len(chunks) == 1 else f"chunk{c}"
            sb = b if not tag else b.scoped(tag)
            offset_c, mask_c = offset, (mask if p.has_mask else None)
            if tag:  # this chunk's output rows of the offsets and the mask
                offset_c, mask_c = (None if t is None else sb.op(
                    "Slice", [t, sb.i64([rows[0]]), sb.i64([rows[1]]), sb.i64([2])], f"{name}_rows")
                    for t, name in ((offset, "offset"), (mask_c, "mask")))
            col, picked = LowerDeformConv._sample(sb, p, table, base, offset_c, mask_c, rows)
            gathers += picked
            # W[g] @ col[g], one MatMul per group as ORT calls one SGEMM per group (a batched MatMul would share
            # the threads among the groups: other column ranges per thread)
            for g in range(p.group):
                col_g = col if p.group == 1 else sb.op("Gather", [col, sb.const(np.array(g, np.int32))],
                                                       f"col_group{g}", axis=1)
                step = "/".join(x for x in (tag, f"group{g}" if g else "") if x)
                products[g].append(b.op("MatMul", [w_groups[g], col_g], step, exact_name=not step))
        per_group = [ps[0] if len(ps) == 1 else b.op("Concat", ps, f"chunks_group{g}", axis=-1)
                     for g, ps in enumerate(products)]
        prod = per_group[0] if p.group == 1 else b.op("Concat", per_group, "groups", axis=1)
        if p.has_bias:
            y = b.op("Reshape", [prod, b.i64([p.n, p.m, p.oh, p.ow])], "unbiased")
            bias_col = b.op("Reshape", [bias, b.i64([p.m, 1, 1])], "bias_col")
            b.op("Add", [y, bias_col], "bias", into=out)
        else:
            b.op("Reshape", [prod, b.i64([p.n, p.m, p.oh, p.ow])], "output", into=out)
        if p.half:
            b.op("Cast", [out], "output_float16", into=final, to=onnx.TensorProto.FLOAT16)
        return gathers

    @staticmethod
    def _sample(b: _Builder, p: DeformConvPlan, table: gs.Tensor, base: gs.Tensor | None, offset: gs.Tensor,
                mask: gs.Tensor | None, rows: tuple[int, int]) -> tuple[gs.Tensor, list[gs.Node]]:
        """The im2col matrix `[N, group, C/group*kH*kW, points]` of output rows `rows` (row c*K + k of a group),
        and its four Gathers."""
        og, k = p.offset_group, p.taps
        pts = (rows[1] - rows[0]) * p.ow
        lead = [p.n, og, k, pts]  # one sampling point per image, offset group, kernel tap, output position

        # sampling coordinates: the integer grid plus the offset, one rounding
        pairs = b.op("Reshape", [offset, b.i64([p.n, og, k, 2, pts])], "offset_pairs")
        coords = []
        for axis, (stride, dil, pad, size) in enumerate(((p.strides[0], p.dilations[0], p.pads[0], p.h),
                                                         (p.strides[1], p.dilations[1], p.pads[1], p.w))):
            tap = np.arange(k) // p.kw if axis == 0 else np.arange(k) % p.kw
            pos = np.arange(rows[0] * p.ow, rows[1] * p.ow)
            out_pos = pos // p.ow if axis == 0 else pos % p.ow
            # the grid out_pos*stride - pad + tap*dil, made from its two small factors (exact: small integers)
            grid = b.op("Add", [b.const((tap[:, None] * dil).astype(np.float32)),
                                b.const((out_pos[None, :] * stride - pad).astype(np.float32))], f"grid_{'hw'[axis]}")
            shift = b.op("Gather", [pairs, b.const(np.array(axis, np.int32))], f"offset_{'hw'[axis]}", axis=3)
            coords.append((b.op("Add", [grid, shift], f"{'hw'[axis]}_im"), size))
        (hi, hsize), (wi, wsize) = coords

        # -1 < h < H and -1 < w < W: NaN (and +-inf) fail it, the sample is outside. Conditions are combined as
        # 0/1 floats (exact products): JSEP has no And kernel, neither WebGPU EP an Or
        bounds = [b.flag(cmp, t, v) for t, size in ((hi, hsize), (wi, wsize))
                  for cmp, v in (("Greater", -1.0), ("Less", float(size)))]
        inside = b.op("Mul", [b.op("Mul", bounds[:2]), b.op("Mul", bounds[2:])], "inside")

        # bilinear weights, ORT's expressions; then zeroed where ORT zeroes them
        y0, x0 = b.op("Floor", [hi], "y_low"), b.op("Floor", [wi], "x_low")
        lh, lw = b.op("Sub", [hi, y0], "lh"), b.op("Sub", [wi, x0], "lw")
        hh, hw = b.op("Sub", [b.f32(1.0), lh], "hh"), b.op("Sub", [b.f32(1.0), lw], "hw")
        raw = {(0, 0): (hh, hw), (0, 1): (hh, lw), (1, 0): (lh, hw), (1, 1): (lh, lw)}
        # ORT: h_low >= 0, h_high < H (where the sample is inside, so the coordinates are finite)
        ok_y = {0: b.flag("GreaterOrEqual", y0, 0.0), 1: b.flag("Less", y0, hsize - 1.0)}
        ok_x = {0: b.flag("GreaterOrEqual", x0, 0.0), 1: b.flag("Less", x0, wsize - 1.0)}
        rows_ok = {a: b.op("Mul", [inside, ok_y[a]], f"row{a}_valid") for a in (0, 1)}

        # row indices: coordinates clamped to the image (NaN -> 0) by a Where the prover reads, then int32
        y1, x1 = b.op("Add", [y0, b.f32(1.0)], "y_high"), b.op("Add", [x0, b.f32(1.0)], "x_high")
        ys = {a: b.op("Mul", [b.to_int32(b.clamp(c, hsize), f"y{a}"), b.const(np.array(wsize, np.int32))],
                      f"y{a}_row") for a, c in ((0, y0), (1, y1))}
        xs = {a: b.to_int32(b.clamp(c, wsize), f"x{a}") for a, c in ((0, x0), (1, x1))}

        gathers, total = [], None
        for (a, c), (wa, wb) in raw.items():
            tag = f"{a}{c}"
            valid = b.op("Cast", [b.op("Mul", [rows_ok[a], ok_x[c]], f"corner{tag}_valid")], f"corner{tag}_kept",
                         to=onnx.TensorProto.BOOL)
            weight_k = b.op("Where", [valid, b.op("Mul", [wa, wb], f"w{tag}"), b.f32(0.0)], f"w{tag}_kept")
            index = b.op("Where", [valid, b.op("Add", [ys[a], xs[c]], f"i{tag}"), b.const(np.array(0, np.int32))],
                         f"i{tag}_kept")
            if base is not None:
                index = b.op("Add", [index, base], f"i{tag}_row")
            picked = b.op("Gather", [table, index], f"corner{tag}", axis=0)
            gathers.append(picked.inputs[0])  # the Gather node
            term = b.op("Mul", [b.op("Reshape", [weight_k, b.i64([*lead, 1])], f"w{tag}_col"), picked], f"t{tag}")
            total = term if total is None else b.op("Add", [total, term], f"sum{tag}")
        if mask is not None:
            total = b.op("Mul", [total, b.op("Reshape", [mask, b.i64([*lead, 1])], "mask_col")], "masked")

        # im2col layout [N, C*kH*kW, P] (row c*K + k), by group
        col = b.op("Transpose", [total], "col_channels_first", perm=[0, 1, 4, 2, 3])
        return b.op("Reshape", [col, b.i64([p.n, p.group, (p.c // p.group) * k, pts])], "col"), gathers


def grid_bytes(oh: int, ow: int) -> int:
    """The bytes of the constants a lowering materialises that grow with its output: the float32 grid of the
    output positions per axis (`_sample`'s `grid_h` / `grid_w` operands, [1, points] each, over all chunks). The
    rest (per-tap grids, shapes, offset starts) is a few numbers per tap or image."""
    return 2 * 4 * oh * ow


def _chunk_rows(max_buffer: int | None, n: int, c: int, taps: int, oh: int, ow: int, kdim: int) -> int:
    """Output rows per chunk so that the im2col tensors (`n*c*taps` float32 per output position) fit `max_buffer`
    bytes; all rows without a limit. A chunk keeps at least `kdim` columns where the whole has as many: MLAS picks
    its K blocking from a GEMM's column count, and one block over all of K is what the unchunked GEMM does."""
    if max_buffer is None:
        return oh
    rows = max(1, max_buffer // (n * c * taps * ow * 4))
    if oh * ow >= kdim:
        rows = max(rows, -(-kdim // ow))
    return min(rows, oh)


_BOOL_OPS = {"GreaterOrEqual", "LessOrEqual", "Greater", "Less"}


class _Builder:
    """Nodes named `<deformconv>/<step>`, their outputs typed (the prover reads the types): `op` returns the
    output tensor."""

    def __init__(self, ctx: Context, name: str, scope: str = "") -> None:
        self.ctx, self.name, self.scope = ctx, name, scope

    def scoped(self, scope: str) -> _Builder:
        """The same builder, its steps named `<deformconv>/<scope>/<step>`."""
        return _Builder(self.ctx, self.name, scope)

    def op(self, op: str, inputs: list[gs.Tensor], step: str = "", *, into: gs.Tensor | None = None,
           exact_name: bool = False, shape: list[int] | None = None, **attrs) -> gs.Tensor:
        path = "/".join(x for x in (self.name, self.scope, step or op) if x)
        out = into if into is not None else self.ctx.var(path, self._dtype(op, inputs, attrs), shape)
        node = gs.Node(op=op, name=self.name if exact_name else self.ctx.names.fresh(path), attrs=attrs,
                       inputs=inputs, outputs=[out])
        self.ctx.graph.nodes.append(node)
        return out

    def _dtype(self, op: str, inputs: list[gs.Tensor], attrs: dict) -> np.dtype | None:
        if op in _BOOL_OPS:
            return np.dtype(np.bool_)
        if op == "Cast":
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(attrs["to"]))
        return self.ctx.prover.dtype(inputs[1] if op == "Where" else inputs[0])

    def const(self, values: np.ndarray) -> gs.Constant:
        return self.ctx.const(f"{self.name}/const", values)

    def i64(self, values: list[int]) -> gs.Constant:
        return self.const(np.array(values, np.int64))

    def f32(self, v: float) -> gs.Constant:
        return self.const(np.array(v, np.float32))

    def cmp(self, op: str, t: gs.Tensor, v: float) -> gs.Tensor:
        return self.op(op, [t, self.f32(v)], f"{t.name.rsplit('/', 1)[-1]}_{op}")

    def flag(self, op: str, t: gs.Tensor, v: float) -> gs.Tensor:
        """The comparison `t op v` as a float 0/1."""
        step = f"{t.name.rsplit('/', 1)[-1]}_{op}_flag"
        return self.op("Cast", [self.cmp(op, t, v)], step, to=onnx.TensorProto.FLOAT)

    def clamp(self, t: gs.Tensor, size: int) -> gs.Tensor:
        """`t` where `0 <= t <= size-1`, else 0: in range for every input, NaN and infinities included. Each Where
        compares the tensor it passes on, which is how the range prover bounds it (ranges.RangeProver._taken)."""
        step = t.name.rsplit("/", 1)[-1]
        below = self.op("Where", [self.cmp("LessOrEqual", t, size - 1.0), t, self.f32(0.0)], f"{step}_below_size")
        return self.op("Where", [self.cmp("GreaterOrEqual", below, 0.0), below, self.f32(0.0)], f"{step}_clamped")

    def to_int32(self, t: gs.Tensor, step: str) -> gs.Tensor:
        return self.op("Cast", [t], f"{step}_int32", to=onnx.TensorProto.INT32)
