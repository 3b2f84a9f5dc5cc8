"""Small hand-built graphs in the exporter's shape, for unit and property tests.

`exporter_like(...)` builds what deform-conv2d-onnx-exporter 1.2.0 emits for the sampling step of one
deformable conv: `p = grid + offset -> Floor -> Cast(int64) -> Slice y/x (+1 for the far corner) ->
Clip(0, size-1) -> Concat -> 4 x GatherND(batch_dims=2) -> weighted 4-input Sum`, with the index source
selectable so tests can build proven, partly proven and unprovable variants.

Run as a script to (re)write the committed hand-built fixtures: `python tests/helpers/graphs.py --out tests/fixtures`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CLAMPED = "clamped"  # every component clipped to [0, size-1] after the grid is added (the exporter's form)
PARTLY = "partly"  # y clipped, x not
UNCLAMPED = "unclamped"  # no clip at all
CLIP_BEFORE_GRID = "clip_before_grid"  # the offset is clipped, then the grid is added: bounds nothing
SOURCES = (CLAMPED, PARTLY, UNCLAMPED, CLIP_BEFORE_GRID)

_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int32): TensorProto.INT32, np.dtype(np.float64): TensorProto.DOUBLE}


def _builder():
    """Node and initializer lists plus `const(name, value)` and `node(op, inputs, output, **attrs)` that fill them."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=f"{op}_{output}", **attrs))
        return output

    return nodes, inits, const, node


def exporter_like(B: int = 1, G: int = 1, H: int = 6, W: int = 7, C: int = 3, P: int = 5,
                  dtype: type = np.float32, source: str = CLAMPED, with_sum: bool = True,
                  seed: int = 0, opset: int = 17, margin: int = 0) -> onnx.ModelProto:
    """A model with inputs `data` [B,G,H,W,C] and `offset` float32 [B,G,P,2], four GatherNDs and (floats) a Sum.

    The base grid lies in `[margin, size-1-margin]` (a margin keeps unclamped corners in range for small offsets).
    """
    rng = np.random.default_rng(seed)
    nodes, inits, const, node = _builder()

    grid = np.stack([rng.integers(margin, H - margin, size=P), rng.integers(margin, W - margin, size=P)],
                    axis=-1).astype(np.float32)
    offset = "offset"
    if source == CLIP_BEFORE_GRID:
        offset = node("Clip", [offset, const("off_lo", np.float32(-2)), const("off_hi", np.float32(2))],
                      "offset_clipped")
    p = node("Add", [const("grid", grid.reshape(1, 1, P, 2)), offset], "p")
    p_int = node("Cast", [node("Floor", [p], "p_floor")], "p_int", to=TensorProto.INT64)
    axes = const("axis3", np.array([3], np.int64))
    y = node("Slice", [p_int, const("s0", np.array([0], np.int64)), const("e1", np.array([1], np.int64)), axes], "y")
    x = node("Slice", [p_int, const("s1", np.array([1], np.int64)), const("e2", np.array([2], np.int64)), axes], "x")
    one = const("one", np.array(1, np.int64))
    y1 = node("Add", [y, one], "y1")
    x1 = node("Add", [x, one], "x1")
    zero = const("zero", np.array(0, np.int64))
    hmax, wmax = const("hmax", np.array(H - 1, np.int64)), const("wmax", np.array(W - 1, np.int64))
    coords = {}
    for key, t, top in (("t", y, hmax), ("b", y1, hmax), ("l", x, wmax), ("r", x1, wmax)):
        clip = source == CLAMPED or (source == PARTLY and key in "tb")
        coords[key] = node("Clip", [t, zero, top], f"{key}_clipped") if clip else t
    outputs = []
    gathered = []
    for corner in ("tl", "br", "bl", "tr"):
        idx = node("Concat", [coords[corner[0]], coords[corner[1]]], f"idx_{corner}", axis=3)
        v = node("GatherND", ["data", idx], f"v_{corner}", batch_dims=2)
        gathered.append(v)
    onnx_dtype = _NP_TO_ONNX[np.dtype(dtype)]
    if with_sum and np.dtype(dtype).kind == "f":
        frac = node("Sub", [p, "p_floor"], "frac")
        if np.dtype(dtype) != np.float32:
            frac = node("Cast", [frac], "frac_cast", to=onnx_dtype)
        weighted = []
        for i, v in enumerate(gathered):
            w = node("Slice", [frac, const(f"ws{i}", np.array([i % 2], np.int64)),
                               const(f"we{i}", np.array([i % 2 + 1], np.int64)), axes], f"w{i}")
            weighted.append(node("Mul", [v, w], f"wv{i}"))
        nodes.append(helper.make_node("Sum", weighted, ["out"], name="Sum_out"))
        outputs.append(helper.make_tensor_value_info("out", onnx_dtype, [B, G, P, C]))
    else:
        outputs.extend(helper.make_tensor_value_info(v, onnx_dtype, [B, G, P, C]) for v in gathered)
    graph = helper.make_graph(
        nodes, f"exporter_like_{source}",
        [helper.make_tensor_value_info("data", onnx_dtype, [B, G, H, W, C]),
         helper.make_tensor_value_info("offset", TensorProto.FLOAT, [B, G, P, 2])],
        outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests/graphs.py")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def gather_elements_like(B: int = 1, G: int = 1, H: int = 6, W: int = 7, C: int = 3, P: int = 5,
                         clamp: bool = True, seed: int = 0) -> onnx.ModelProto:
    """The exporter's `use_gathernd=False` sampling: index `y*W + x` expanded over C, GatherElements(axis=3).

    Inputs `data` float32 [B,G,C,H,W] and `offset` float32 [B,G,P,2]; outputs the four corner gathers.
    """
    rng = np.random.default_rng(seed)
    nodes, inits, const, node = _builder()

    grid = np.stack([rng.integers(0, H, size=P), rng.integers(0, W, size=P)], axis=-1).astype(np.float32)
    p = node("Add", [const("grid", grid.reshape(1, 1, P, 2)), "offset"], "p")
    p_int = node("Cast", [node("Floor", [p], "p_floor")], "p_int", to=TensorProto.INT64)
    axes = const("axis3", np.array([3], np.int64))
    y = node("Slice", [p_int, const("s0", np.array([0], np.int64)), const("e1", np.array([1], np.int64)), axes], "y")
    x = node("Slice", [p_int, const("s1", np.array([1], np.int64)), const("e2", np.array([2], np.int64)), axes], "x")
    one, zero = const("one", np.array(1, np.int64)), const("zero", np.array(0, np.int64))
    coords = {"t": y, "b": node("Add", [y, one], "y1"), "l": x, "r": node("Add", [x, one], "x1")}
    for key, top in (("t", H - 1), ("b", H - 1), ("l", W - 1), ("r", W - 1)):
        if clamp:
            coords[key] = node("Clip", [coords[key], zero, const(f"max_{key}", np.array(top, np.int64))], f"{key}_c")
        coords[key] = node("Reshape", [coords[key], const(f"shape_{key}", np.array([B, G, 1, P], np.int64))],
                           f"{key}_r")
    flat = node("Reshape", ["data", const("flat", np.array([B, G, C, H * W], np.int64))], "data_flat")
    outputs = []
    for corner in ("tl", "br", "bl", "tr"):
        row = node("Mul", [coords[corner[0]], const(f"w_{corner}", np.array(W, np.int64))], f"row_{corner}")
        idx = node("Add", [row, coords[corner[1]]], f"idx_{corner}")
        idx = node("Expand", [idx, const(f"ex_{corner}", np.array([B, G, C, P], np.int64))], f"idx_x_{corner}")
        outputs.append(node("GatherElements", [flat, idx], f"v_{corner}", axis=3))
    graph = helper.make_graph(
        nodes, "gather_elements_like",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [B, G, C, H, W]),
         helper.make_tensor_value_info("offset", TensorProto.FLOAT, [B, G, P, 2])],
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, [B, G, C, P]) for v in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests/graphs.py")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def sum_only(n_inputs: int = 4, dtype: type = np.float32, shape: tuple[int, ...] = (2, 3)) -> onnx.ModelProto:
    """A model that is one n-input Sum (with broadcasting on the last input)."""
    t = _NP_TO_ONNX[np.dtype(dtype)]
    names = [f"x{i}" for i in range(n_inputs)]
    shapes = [list(shape)] * (n_inputs - 1) + [[1, shape[-1]]] if n_inputs > 1 else [list(shape)]
    graph = helper.make_graph(
        [helper.make_node("Sum", names, ["y"], name="the_sum")], "sum_only",
        [helper.make_tensor_value_info(n, t, s) for n, s in zip(names, shapes, strict=True)],
        [helper.make_tensor_value_info("y", t, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests/graphs.py")
    model.ir_version = 8
    return model


def no_deform() -> onnx.ModelProto:
    """A model with nothing to rewrite (Relu)."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "plain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests/graphs.py")
    model.ir_version = 8
    return model


INT64_MAX = np.iinfo(np.int64).max


def swin_mask_fp16(tokens: int = 10, window: int = 7, shift: int = 3, heads: int = 2,
                   fp16: bool = True) -> onnx.ModelProto:
    """The shifted-window attention mask of one Swin stage, as BiRefNet's Swin backbone exports it (TorchScript,
    opset 17) and onnxconverter-common converts it to fp16 (`keep_io_types=True`, then the Cast fix that lets
    onnxruntime load its output: a `Cast(to=FLOAT)` whose output the converter typed float16 targets FLOAT16).

    Stands for `/bb/layers.N/...` of the real BiRefNet-lite fp16 export, whose nodes are all static for its fixed
    input size: the padded size `ceil(H / window) * window` (the features' Shape -> Gather -> Cast(int64) ->
    Cast(FLOAT16) -> Div -> Ceil -> Cast(int64) -> Mul: a float16 division that rounds, absorbed by the Ceil),
    `img_mask = zeros(1, Hp, Wp, 1)` (ConstantOfShape), the nine `img_mask[:, h, w, :] = cnt` (TorchScript's
    index_put: per dimension a Range over Shape -> Gather -> Cast, Slice, Reshape; the index broadcast through
    Add -> Shape -> ConstantOfShape -> Mul -> Equal -> Where -> Expand -> Unsqueeze -> Concat; the update
    ConstantOfShape -> Expand -> Reshape; ScatterND), `window_partition` (Shape -> Gather -> Div -> Cast ->
    Reshape -> Transpose -> Reshape), and `mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)` with its two
    `masked_fill`s (Sub -> Equal -> Not -> Cast(bool) -> Where, Equal -> Cast(bool) -> Where -> Cast). The op
    sequence was compared with the real export's `/bb/layers.0` (tests/graph/test_fold.py says how). The only
    non-static parts are the features `x` float32 [1, H, W, 4] whose shape the sizes come from, and the attention
    the mask is added to: input `scores` float32 [windows, heads, N, N] (N = window^2), both cast to fp16 as the
    converter's `keep_io_types` does, viewed by the mask's Shape as the real attention does, plus the mask,
    Softmax, cast back to float32. Not replicated: each block's int64 padding/roll arithmetic
    (`(window - W % window) % window`: Cast -> Cast -> Mod -> Sub), integer-only like the replica's Range chains.

    `fp16=False` gives the fp32 export of the same graph (which ORT folds by itself).
    """
    nodes, inits, const, node = _builder()
    f = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    fnp = np.float16 if fp16 else np.float32
    count = iter(range(10**6))

    def c(value, dtype=np.int64) -> str:  # a Constant node, as TorchScript emits them
        name = f"/bb/layers.0/Constant_{next(count)}_output_0"
        nodes.append(helper.make_node("Constant", [], [name], name=name[:-9],
                                      value=numpy_helper.from_array(np.array(value, dtype=dtype), name)))
        return name

    def n(op: str, inputs: list[str], **attrs) -> str:
        k = next(count)
        out = f"/bb/layers.0/{op}_{k}_output_0"
        nodes.append(helper.make_node(op, inputs, [out], name=f"/bb/layers.0/{op}_{k}", **attrs))
        return out

    def cos(shape: str, value, dtype) -> str:
        return n("ConstantOfShape", [shape], value=numpy_helper.from_array(np.array([value], dtype=dtype)))

    # Hp = ceil(H / window) * window from the features' shape, in float as the export has it: Shape -> Gather ->
    # Cast(int64) -> Cast(FLOAT; FLOAT16 after the fix) -> Div -> Ceil -> Cast(int64) -> Mul. In float16, H / 7
    # is rounded (10 / 7 = 1.4287 instead of 1.428571); Ceil gives 2 either way.
    features = n("Cast", ["x"], to=f)
    padded = []
    for d in (1, 2):
        size = n("Cast", [n("Gather", [n("Shape", [features]), c(d)], axis=0)], to=TensorProto.INT64)
        size = n("Cast", [n("Ceil", [n("Div", [n("Cast", [size], to=f), c(float(window), fnp)])])],
                 to=TensorProto.INT64)
        padded.append(n("Unsqueeze", [n("Mul", [size, c(window)]), c([0])]))
    img = cos(n("Concat", [c([1]), *padded, c([1])], axis=0), 0.0, fnp)

    # img_mask[:, h, w, :] = cnt for the nine regions (TorchScript's index_put -> ScatterND)
    spans = [(0, -window), (-window, -shift), (-shift, INT64_MAX)]
    cnt = 0
    for h0, h1 in spans:
        for w0, w1 in spans:
            dims = [n("Range", [c(0), n("Cast", [n("Gather", [n("Shape", [img]), c(d)], axis=0)],
                                         to=TensorProto.INT64), c(1)]) for d in range(4)]
            dims[1] = n("Slice", [dims[1], c([h0]), c([h1]), c([0]), c([1])])
            dims[2] = n("Slice", [dims[2], c([w0]), c([w1]), c([0]), c([1])])
            idx = [n("Reshape", [dims[0], c([-1, 1, 1, 1])]), n("Reshape", [dims[1], c([-1, 1, 1])]),
                   n("Reshape", [dims[2], c([-1, 1])]), dims[3]]
            total = n("Add", [n("Add", [n("Add", [idx[0], idx[1]]), idx[2]]), idx[3]])
            bshape = n("Shape", [total])
            cols = []
            for i in idx:
                ones = cos(n("Shape", [bshape]), 1, np.int64)
                where = n("Where", [n("Equal", [bshape, n("Mul", [ones, c(-1)])]), ones, bshape])
                cols.append(n("Unsqueeze", [n("Expand", [i, where]), c([-1])]))
            indices = n("Concat", cols, axis=-1)
            region = n("Slice", [n("Slice", [img, c([h0]), c([h1]), c([1]), c([1])]), c([w0]), c([w1]), c([2]),
                                 c([1])])
            value = n("Expand", [cos(n("Shape", [region]), float(cnt), fnp), n("Shape", [region])])
            tail = n("Slice", [n("Shape", [img]), c([4]), c([INT64_MAX]), c([0])])
            update = n("Reshape", [value, n("Concat", [bshape, tail], axis=0)])
            img = n("ScatterND", [img, indices, update])
            cnt += 1

    # window_partition(img_mask, window).view(-1, window * window)
    sizes = [n("Gather", [n("Shape", [img]), c(d)], axis=0) for d in range(4)]
    parts = [n("Cast", [n("Cast", [n("Div", [sizes[d], c(window)])], to=TensorProto.INT64)],
               to=TensorProto.INT64) for d in (1, 2)]
    shape6 = n("Concat", [n("Unsqueeze", [sizes[0], c([0])]), n("Unsqueeze", [parts[0], c([0])]), c([window]),
                          n("Unsqueeze", [parts[1], c([0])]), c([window]), n("Unsqueeze", [sizes[3], c([0])])],
               axis=0)
    windows = n("Transpose", [n("Reshape", [img, shape6])], perm=[0, 1, 3, 2, 4, 5])
    windows = n("Reshape", [windows, n("Concat", [c([-1]), c([window]), c([window]),
                                                  n("Unsqueeze", [sizes[3], c([0])])], axis=0)])
    windows = n("Reshape", [windows, c([-1, window * window])])
    # attn_mask = mw.unsqueeze(1) - mw.unsqueeze(2); masked_fill(!= 0, -100.0); masked_fill(== 0, 0.0)
    diff = n("Sub", [n("Unsqueeze", [windows, c([1])]), n("Unsqueeze", [windows, c([2])])])
    filled = n("Where", [n("Cast", [n("Not", [n("Equal", [diff, c(0.0, fnp)])])], to=TensorProto.BOOL),
                         c(-100.0, fnp), diff])
    filled = n("Where", [n("Cast", [n("Equal", [diff, c(0.0, fnp)])], to=TensorProto.BOOL), c(0.0, fnp), filled])
    mask = n("Cast", [filled], to=f)  # Cast(to=FLOAT) in the export; the converter typed it fp16, the fix agrees

    # the attention it masks: attn.view(B_ // nW, nW, nH, N, N) + mask.unsqueeze(1).unsqueeze(0)
    count_w = ((tokens + window - 1) // window) ** 2
    N = window * window
    scores = n("Cast", ["scores"], to=f)
    windows_count = n("Unsqueeze", [n("Gather", [n("Shape", [mask]), c(0)], axis=0), c([0])])  # nW = mask.shape[0]
    view = n("Concat", [c([1]), windows_count, c([heads, N, N])], axis=0)
    masked = n("Add", [n("Reshape", [scores, view]), n("Unsqueeze", [n("Unsqueeze", [mask, c([1])]), c([0])])])
    probs = n("Softmax", [n("Reshape", [masked, c([-1, heads, N, N])])], axis=-1)
    nodes.append(helper.make_node("Cast", [probs], ["attn"], name="/bb/layers.0/blocks.1/Cast_out",
                                  to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "swin_mask", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                 [1, tokens, tokens, 4]),
                                                   helper.make_tensor_value_info("scores", TensorProto.FLOAT,
                                                                                 [count_w, heads, N, N])],
                              [helper.make_tensor_value_info("attn", TensorProto.FLOAT, [count_w, heads, N, N])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests/graphs.py")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def wide_split(n: int = 32, size: int = 4, opset: int = 17) -> onnx.ModelProto:
    """One Split of `x` [1, 3, 8, n*size] into `n` outputs along the last axis: a kernel that binds n + 1 storage
    buffers (the smallest model that fails "Too many storage buffers in shader" on a device with fewer)."""
    outs = [f"y{i}" for i in range(n)]
    split = numpy_helper.from_array(np.full(n, size, dtype=np.int64), "sizes")
    graph = helper.make_graph(
        [helper.make_node("Split", ["x", "sizes"], outs, name="wide_split", axis=-1)], "wide_split",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, n * size])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 3, 8, size]) for o in outs], [split])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests/graphs.py")
    model.ir_version = 8
    return model


def legacy_patches(image: int = 1024, levels: tuple[int, ...] = (32, 64, 128, 256, 1024), channels: int = 4,
                   seed: int = 0) -> onnx.ModelProto:
    """BiRefNet's `get_patches_batch` as its code before November 2024 exported it (the 2024 ONNX files):

        columns = torch.split(x[0], size_w, dim=-1)
        patches = [p.unsqueeze(0) for c in columns for p in torch.split(c, size_h, dim=-2)]
        torch.cat([torch.cat(patches, dim=1)], dim=0)

    once per decoder level with BiRefNet's patch sizes for a 1024x1024 input (32, 64, 128, 256, 1024): Splits into
    32, 16, 8, 4 and 1 outputs, Concats of 1024, 256, 64, 16 and 1 inputs of [1, 3, s, s], each followed, as in the
    decoder, by a bilinear Resize (align_corners) to the level's size and a Conv (here a 1x1 one to `channels`,
    instead of BiRefNet's decoder block). The real export's nodes are Gather, Split (its sizes an input made by
    a Constant node, not an initializer), Unsqueeze, Concat, Resize. Checked against a real legacy export of
    BiRefNet-lite 1024: the same Split widths and counts (33 x 32, 17 x 16, 9 x 8, 5 x 4, 2 x 1), the same wide
    Concats (1024, 256, 64, 16 inputs, once each), the same chain Gather(axis 0) -> Split(axis -1) ->
    Split(axis -2) -> Unsqueeze -> Concat(axis 1) -> Concat(axis 0, one input).
    """
    rng = np.random.default_rng(seed)
    nodes, inits, const, node = _builder()
    node("Gather", ["image", const("batch0", np.array(0, dtype=np.int64))], "x0", axis=0)
    outputs = []
    for level, s in enumerate(levels):
        n = image // s
        cols = [f"l{level}_col{c}" for c in range(n)]
        sizes = node("Constant", [], f"l{level}_sizes",  # a Constant node, as torch exports it
                     value=numpy_helper.from_array(np.full(n, s, dtype=np.int64)))
        nodes.append(helper.make_node("Split", ["x0", sizes], cols, name=f"l{level}_split_w", axis=-1))
        patches = []
        for c, col in enumerate(cols):
            rows = [f"l{level}_c{c}_row{r}" for r in range(n)]
            nodes.append(helper.make_node("Split", [col, sizes], rows, name=f"l{level}_split_h{c}", axis=-2))
            for r, row in enumerate(rows):
                patches.append(node("Unsqueeze", [row, const(f"l{level}_axes{c}_{r}", np.array([0]))],
                                    f"l{level}_patch{c}_{r}"))
        cat = node("Concat", patches, f"l{level}_patches", axis=1)
        batch = node("Concat", [cat], f"l{level}_batch", axis=0)
        resized = node("Resize", [batch, "", "", const(f"l{level}_size", np.array([1, 3 * n * n, s, s]))],
                       f"l{level}_resized", mode="linear", coordinate_transformation_mode="align_corners")
        w = const(f"l{level}_w", (rng.standard_normal((channels, 3 * n * n, 1, 1)) / n).astype(np.float32))
        outputs.append(node("Conv", [resized, w], f"out{level}", dilations=[1, 1], group=1, kernel_shape=[1, 1],
                            pads=[0, 0, 0, 0], strides=[1, 1]))  # every attribute spelled out, as torch does
    graph = helper.make_graph(
        nodes, "legacy_patches", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, image, image])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests/graphs.py")
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def decoder_tail(image: int = 64, feat: int = 32, channels: int = 16, dec: int = 32, ipt: tuple[int, int] = (24, 8),
                 seed: int = 0, current: bool = False, lateral: bool = False, pyramid: int = 0) -> onnx.ModelProto:
    """The end of BiRefNet's decoder, where its largest ordinary tensors live (at 1024x1024: a 320 MiB Concat of
    the ASPP branches read by a 1x1 Conv, a 384 MiB Resize and a 480 MiB channel Concat read by the last 1x1 Conv,
    a 256 MiB 3x3 Conv output read by a 3x3 Conv), at a small size:

        feat -> 5 branches (1x1/3x3 Conv, Relu; global pool -> Conv -> Relu -> Resize) -> Concat(axis 1)
             -> 1x1 Conv -> Relu -> 3x3 Conv -> Resize (bilinear, align_corners, sizes from Shape) --+
        image -> 3x3 Conv -> 3x3 Conv (the image-patch branch, ipt_blk1) ------------------------- Concat(axis 1)
             -> 1x1 Conv -> mask

    Checked against a real BiRefNet-lite 1024 export (current and legacy code): the same ops in the same order
    from dec_att's Concat to the output ('/decoder/decoder_block1/dec_att/Concat_1' -> conv1 -> Relu -> conv_out
    -> '/decoder/Resize_7' with sizes Concat(Slice(Shape), Constant) -> '/decoder/Concat_29' with ipt_blk1's conv1
    -> conv_out -> conv_out1), kernels, pads and Resize attributes as there; channel counts are smaller
    (`channels` per ASPP branch, `dec` out of the decoder block, `ipt` out of the two image-branch Convs).
    `lateral=True` is BiRefNet_HR's form at 2048 (checked against the real lite 2048 export: '/decoder/Resize_5'
    read by an Add with a lateral block's 1x1 Conv output, the Add read by the channel Concat '/decoder/Concat_22'):
    the upsampled decoder output is added to a 1x1 Conv of the image before the Concat.
    `pyramid=P` (with `lateral`) is BiRefNet_HR's image pyramid (checked against the real lite 2048 export): the
    lateral 1x1 Conv reads a channel Concat ('/Concat_3') of two P-channel features at the image's size, one made
    at full size ('/bb/Transpose_1'), one at half size and resized up ('/Resize_1'); the Concat is also read by a
    Resize to the decoder's size whose sizes come from its own Shape ('/Resize_5' through '/Shape_15'; here mixed
    into `feat` by a 1x1 Conv) and by a Shape whose H, W size the upsampling ('/decoder/Shape_13', '_14').
    `current=True` is the current code's form: the image branch cuts the image into 2x2 patches stacked on the
    channels (Reshape -> Transpose -> Reshape) with the patch size read by `Shape -> Gather -> Div -> Cast` of the
    upsampled decoder output (as '/decoder/Shape_20' reads '/decoder/Resize_7_output_0'), then resizes them with
    sizes from their own `Shape`: ONNX's data propagation stops at the Casts, so the image branch's shapes are
    unknown to shape inference up to its first Conv's output, as in the real export.
    """
    rng = np.random.default_rng(seed)
    nodes, inits, const, node = _builder()
    c = channels

    def conv(x: str, out: str, cin: int, cout: int, k: int, dilation: int = 1) -> str:
        w = const(f"{out}_w", (rng.standard_normal((cout, cin, k, k)) / (cin * k)).astype(np.float32))
        b = const(f"{out}_b", rng.standard_normal(cout).astype(np.float32))
        pad = dilation * (k // 2)
        return node("Conv", [x, w, b], out, dilations=[dilation, dilation], group=1, kernel_shape=[k, k],
                    pads=[pad] * 4, strides=[1, 1])

    features = "feat"
    if pyramid:
        full = conv("image", "bb", 3, pyramid, 3)
        half = node("Resize", ["image", "", const("half_scales", np.array([1, 1, 0.5, 0.5], np.float32))],
                    "image_half", mode="linear")
        up_half = node("Resize", [conv(half, "bb_half", 3, pyramid, 3), "", "",
                                  const("half_up", np.array([1, pyramid, image, image]))], "bb_half_up", mode="linear",
                       coordinate_transformation_mode="align_corners")
        levels = node("Concat", [full, up_half], "pyramid", axis=1)
        nc = node("Slice", [node("Shape", [levels], "pyr_shape"), const("y0", np.array([0])),
                            const("y2", np.array([2])), const("y_ax", np.array([0]))], "pyr_nc")
        small = node("Resize", [levels, "", "", node("Concat", [nc, const("pyr_hw", np.array([feat, feat]))],
                                                       "pyr_sizes", axis=0)],
                     "pyr_small", mode="linear", coordinate_transformation_mode="align_corners")
        features = conv(node("Concat", ["feat", small], "feat_pyr", axis=1), "feat_mix", c + 2 * pyramid, c, 1)
    hw = node("Shape", [levels], "pyr_hw_of", start=2) if pyramid else const("hw", np.array([image, image]))
    branches = [node("Relu", [conv(features, "aspp1", c, c, 1)], "aspp1_relu")]
    for d in (1, 2, 3):
        branches.append(node("Relu", [conv(features, f"aspp_d{d}", c, c, 3, d)], f"aspp_d{d}_relu"))
    pooled = node("Relu", [conv(node("GlobalAveragePool", [features], "gap"), "gap_conv", c, c, 1)], "gap_relu")
    branches.append(node("Resize", [pooled, "", "", const("gap_size", np.array([1, c, feat, feat]))], "gap_up",
                         mode="linear", coordinate_transformation_mode="align_corners"))
    att = node("Concat", branches, "att_cat", axis=1)
    dec_out = conv(node("Relu", [conv(att, "att_conv1", 5 * c, c, 1)], "att_relu"), "dec_conv_out", c, dec, 3)
    shape = node("Shape", [dec_out], "dec_shape")
    nc = node("Slice", [shape, const("s0", np.array([0])), const("s2", np.array([2])), const("s_ax", np.array([0]))],
              "dec_nc")
    sizes = node("Concat", [nc, hw], "dec_sizes", axis=0)
    up = node("Resize", [dec_out, "", "", sizes], "dec_up", mode="linear",
              coordinate_transformation_mode="align_corners", cubic_coeff_a=-0.75, nearest_mode="floor")
    source, side = "image", image
    if current:  # image2patches: b c (g h) (g w) -> b (c g g) h w, h = H_up // 2 through Div and Casts
        def scalar(name: str, value: int) -> str:
            return node("Constant", [], name, value=numpy_helper.from_array(np.array(value, np.int64)))

        half = node("Cast", [node("Cast", [node("Div", [node("Gather", [node("Shape", [up], "up_shape"),
                                                                        scalar("up_axis", 2)], "up_h", axis=0),
                                                        scalar("two", 2)], "up_half"),
                                            ], "up_half_f", to=TensorProto.FLOAT)], "up_half_i", to=TensorProto.INT64)
        dim = node("Unsqueeze", [half, const("unsq0", np.array([0]))], "half_dim")
        split = node("Concat", [const("p_lead", np.array([1, 3, 2])), dim, const("p_two", np.array([2])), dim],
                     "p_shape", axis=0)
        grid = node("Transpose", [node("Reshape", ["image", split], "p_grid")], "p_swap", perm=[0, 1, 2, 4, 3, 5])
        count = node("Cast", [node("Div", [node("Cast", [dim], "half_f", to=TensorProto.FLOAT),  # the 2 patches
                                           node("Cast", [node("Div", [dim, const("p_one", np.array([2]))], "quarter")],
                                                "quarter_f", to=TensorProto.FLOAT)], "count_f")],
                     "count", to=TensorProto.INT64)
        channels = node("Mul", [const("p_three", np.array([3])), node("Mul", [count, count], "count2")], "p_ch")
        flat = node("Concat", [const("p_c", np.array([1])), channels, dim, dim], "p_flat_shape", axis=0)
        patches_in = node("Reshape", [grid, flat], "p_patches")
        nc = node("Slice", [node("Shape", [patches_in], "p_shape_of"), const("q0", np.array([0])),
                            const("q2", np.array([2])), const("q_ax", np.array([0]))], "p_nc")
        source = node("Resize", [patches_in, "", "", node("Concat", [nc, const("p_hw", np.array([image, image]))],
                                                           "p_sizes", axis=0)],
                      "img_up", mode="linear", coordinate_transformation_mode="align_corners", cubic_coeff_a=-0.75,
                      nearest_mode="floor")
    patches = conv(conv(source, "ipt_conv1", 12 if current else 3, ipt[0], 3), "ipt_conv_out", ipt[0], ipt[1], 3)
    if lateral:  # the HR form: Resize read by an Add with a lateral 1x1 Conv (of the image, here)
        up = node("Add", [up, conv(levels if pyramid else "image", "lateral", 2 * pyramid or 3, dec, 1)],
                  "dec_up_lateral")
    cat = node("Concat", [up, patches], "out_cat", axis=1)
    conv(cat, "mask", dec + ipt[1], 1, 1)
    graph = helper.make_graph(
        nodes, "decoder_tail",
        [helper.make_tensor_value_info("feat", TensorProto.FLOAT, [1, c, feat, feat]),
         helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, side, side])],
        [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, image, image])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests/graphs.py")
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)



def decoder_tail_full() -> onnx.ModelProto:
    """The full BiRefNet's (swin_v1_l backbone, RMBG-2.0's architecture) decoder tail at a 512th of its size: at
    1024x1024 its decoder output is 192 channels, not the lite's 96, and the image-patch branch makes 64 then 48
    channels; against a 128 MiB limit (32 channels at 1024x1024) the 960 MiB channel Concat read by the last 1x1
    Conv reads the 768 MiB Resize and a 192 MiB Conv output itself over the limit, made by a 3x3 Conv from a
    256 MiB Conv output (the nested form). Here, against 256 KiB (16 channels at 64x64), every one of those
    tensors is over the limit by the same factor; the peak of live activations, 3.9 MB, is over 2.9 MB (1.5 GB
    scaled by the same 512) as the real 2.01 GB is over 1.5 GB."""
    return decoder_tail(dec=96, ipt=(32, 24), current=True)

def swin_mlp(tokens: int = 4096, dim: int = 192, hidden: int = 768, seed: int = 0, also_output: bool = False
             ) -> onnx.ModelProto:
    """The MLP of a Swin block as BiRefNet's full (swin_v1_l) backbone exports it, at its stage-1 width (192 -> 768
    -> 192) over fewer tokens: at 1024x1024 its 65,536 tokens make seven [1, 65536, 768] tensors of 192 MiB, over
    the 128 MiB `spec-default` buffer; here 4,096 tokens make 12 MiB ones, over an 8 MiB `--max-buffer`.

        tokens -> LayerNormalization -> MatMul(W1) -> Add(b1, .) -> GELU as Div(sqrt 2) -> Erf -> Add(1) -> Mul
               -> Mul(0.5) -> MatMul(W2) -> Add(b2, .) -> Add(tokens, .)

    Checked against the real full BiRefNet 1024 export ('/bb/layers.0/blocks.0/norm2' to '/bb/layers.0/blocks.0/
    Add_1'): the same ops in the same order, the bias first in the bias Adds, the GELU's scalars as Constant nodes
    (sqrt 2, 1, 0.5) and LayerNormalization's axis -1 and epsilon 1e-5. `also_output`: the Erf's output is also a
    graph output (needed whole: the refusal case)."""
    rng = np.random.default_rng(seed)
    nodes, inits, const, node = _builder()

    def scalar(name: str, value: float) -> str:
        return node("Constant", [], name, value=numpy_helper.from_array(np.array(value, np.float32)))

    normed = node("LayerNormalization", ["tokens", const("norm2_w", rng.standard_normal(dim).astype(np.float32)),
                                         const("norm2_b", rng.standard_normal(dim).astype(np.float32))],
                  "norm2", axis=-1, epsilon=9.999999747378752e-06)
    w1 = const("fc1_w", (rng.standard_normal((dim, hidden)) / np.sqrt(dim)).astype(np.float32))
    h = node("Add", [const("fc1_b", rng.standard_normal(hidden).astype(np.float32)),
                     node("MatMul", [normed, w1], "fc1_mm")], "fc1")
    erf = node("Erf", [node("Div", [h, scalar("sqrt2", 1.4142135)], "act_div")], "act_erf")
    gelu = node("Mul", [node("Mul", [h, node("Add", [erf, scalar("one", 1.0)], "act_add")], "act_mul"),
                        scalar("half", 0.5)], "act")
    w2 = const("fc2_w", (rng.standard_normal((hidden, dim)) / np.sqrt(hidden)).astype(np.float32))
    mlp = node("Add", [const("fc2_b", rng.standard_normal(dim).astype(np.float32)),
                       node("MatMul", [gelu, w2], "fc2_mm")], "fc2")
    node("Add", ["tokens", mlp], "out")
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, tokens, dim])]
    if also_output:
        outputs.append(helper.make_tensor_value_info("act_erf", TensorProto.FLOAT, [1, tokens, hidden]))
    graph = helper.make_graph(nodes, "swin_mlp",
                              [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, tokens, dim])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests/graphs.py")
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


FIXTURES = {
    "gathernd_b2g2.onnx": lambda: exporter_like(B=2, G=2, H=5, W=6, C=3, P=7),
    "gathernd_refused.onnx": lambda: exporter_like(source=CLIP_BEFORE_GRID),
    "sum_only.onnx": sum_only,
    "no_deform.onnx": no_deform,
}


def swin_pad(size: int = 10, window: int = 7, dim: int = 4, hidden: int = 8) -> onnx.ModelProto:
    """A Swin block's pad to whole windows as torch.onnx writes `F.pad(x, (0, 0, 0, pad_r, 0, pad_b))` (checked
    against the real BiRefNet-lite export's `/bb/layers.0/blocks.1/Pad`): the pad from Shape -> Gather -> Mod ->
    Sub -> Mod, then Concat -> ConstantOfShape -> Concat -> Reshape -> Slice (reversed) -> Transpose -> Reshape ->
    Cast, which ONNX's data propagation does not follow, and a MatMul after it. x: [1, size, size, dim]."""
    def const(name: str, value) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], name=name,
                                value=numpy_helper.from_array(np.array(value, np.int64)))

    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"), const("one", 1),
        helper.make_node("Gather", ["s", "one"], ["h"], name="gather", axis=0), const("window", window),
        helper.make_node("Mod", ["h", "window"], ["hm"], name="mod"),
        helper.make_node("Sub", ["window", "hm"], ["d"], name="sub"),
        helper.make_node("Mod", ["d", "window"], ["r"], name="mod_1"), const("axis0", [0]),
        helper.make_node("Unsqueeze", ["r", "axis0"], ["r1"], name="unsqueeze"), const("z3", [0, 0, 0]),
        const("z1", [0]), helper.make_node("Concat", ["z3", "r1", "z1", "r1"], ["pad_list"], name="concat", axis=0),
        const("two", [2]),
        helper.make_node("ConstantOfShape", ["two"], ["rest"], name="constant_of_shape",
                         value=numpy_helper.from_array(np.array([0], np.int64))),
        helper.make_node("Concat", ["pad_list", "rest"], ["all_pads"], name="concat_1", axis=0),
        const("pairs", [-1, 2]), helper.make_node("Reshape", ["all_pads", "pairs"], ["pair_rows"], name="reshape"),
        const("start", [-1]), const("end", [-(2**62)]), const("step", [-1]),
        helper.make_node("Slice", ["pair_rows", "start", "end", "axis0", "step"], ["reversed"], name="slice"),
        helper.make_node("Transpose", ["reversed"], ["by_side"], name="transpose", perm=[1, 0]),
        const("flat", [-1]), helper.make_node("Reshape", ["by_side", "flat"], ["pads_i"], name="reshape_1"),
        helper.make_node("Cast", ["pads_i"], ["pads"], name="cast", to=TensorProto.INT64),
        helper.make_node("Pad", ["x", "pads"], ["padded"], name="pad"),
        helper.make_node("MatMul", ["padded", "w"], ["y"], name="fc1"),
    ]
    w = numpy_helper.from_array(np.full((dim, hidden), 0.5, np.float32), "w")
    graph = helper.make_graph(nodes, "swin_pad", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                [1, size, size, dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "h", "w", hidden])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def deform_conv(n: int = 1, c: int = 4, h: int = 9, w: int = 10, m: int = 6, kernel: tuple[int, int] = (3, 3),
                strides: tuple[int, int] = (1, 1), dilations: tuple[int, int] = (1, 1),
                pads: tuple[int, int, int, int] = (1, 1, 1, 1), group: int = 1, offset_group: int = 1,
                mask: bool = True, bias: bool = True, offset_conv: bool = False, dtype: type = np.float32,
                seed: int = 0) -> onnx.ModelProto:
    """One ONNX `DeformConv` (opset 19), as torch's dynamo exporter writes torchvision's `deform_conv2d`.

    With `offset_conv` the offsets (and the mask, through a Sigmoid) come from a 3x3 Conv of the input and a Relu
    follows, the shape of a `DeformableConv2d` layer in BiRefNet's dynamo export; without it offset and mask are
    graph inputs, so a test can feed any value (NaN, infinities, samples far outside the image).
    """
    rng = np.random.default_rng(seed)
    kh, kw = kernel
    oh = (h + pads[0] + pads[2] - (dilations[0] * (kh - 1) + 1)) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - (dilations[1] * (kw - 1) + 1)) // strides[1] + 1
    taps = offset_group * kh * kw
    elem = _NP_TO_ONNX[np.dtype(dtype)]
    nodes, inits, inputs = [], [], [helper.make_tensor_value_info("X", elem, [n, c, h, w])]

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value.astype(dtype), name))
        return name

    const("deform.weight", rng.standard_normal((m, c // group, kh, kw)))
    slots = ["X", "deform.weight", "offset", const("deform.bias", rng.standard_normal(m)) if bias else "",
             "mask" if mask else ""]
    if offset_conv:
        assert (oh, ow) == (h, w), "the offset Conv keeps the input size: use stride 1 and 'same' pads"
        same = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1], dilations=[1, 1], group=1)  # as torch
        nodes.append(helper.make_node("Conv", ["X", const("offset.weight", rng.standard_normal(
            (2 * taps, c, 3, 3)) * 0.3)], ["offset"], name="node_offset_conv", **same))
        if mask:
            nodes.append(helper.make_node("Conv", ["X", const("mask.weight", rng.standard_normal(
                (taps, c, 3, 3)) * 0.3)], ["mask_logits"], name="node_mask_conv", **same))
            nodes.append(helper.make_node("Sigmoid", ["mask_logits"], ["mask"], name="node_sigmoid"))
    else:
        inputs.append(helper.make_tensor_value_info("offset", elem, [n, 2 * taps, oh, ow]))
        if mask:
            inputs.append(helper.make_tensor_value_info("mask", elem, [n, taps, oh, ow]))
    while slots[-1] == "":
        slots.pop()
    out = "deformed" if offset_conv else "Y"
    nodes.append(helper.make_node("DeformConv", slots, [out], name="node_deform_conv2d", kernel_shape=[kh, kw],
                                  strides=list(strides), dilations=list(dilations), pads=list(pads), group=group,
                                  offset_group=offset_group))
    if offset_conv:
        nodes.append(helper.make_node("Relu", [out], ["Y"], name="node_relu"))
    graph = helper.make_graph(nodes, "deform_conv", inputs, [helper.make_tensor_value_info("Y", elem, [n, m, oh, ow])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "fixtures"))
    args = parser.parse_args()
    for name, build in FIXTURES.items():
        path = Path(args.out) / name
        path.write_bytes(build().SerializeToString())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
