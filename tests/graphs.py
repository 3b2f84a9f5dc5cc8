"""Small hand-built graphs in the exporter's shape, for unit and property tests.

`exporter_like(...)` builds what deform-conv2d-onnx-exporter 1.2.0 emits for the sampling step of one
deformable conv: `p = grid + offset -> Floor -> Cast(int64) -> Slice y/x (+1 for the far corner) ->
Clip(0, size-1) -> Concat -> 4 x GatherND(batch_dims=2) -> weighted 4-input Sum`, with the index source
selectable so tests can build proven, partly proven and unprovable variants.

Run as a script to (re)write the committed hand-built fixtures: `python tests/graphs.py --out tests/fixtures`.
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


FIXTURES = {
    "gathernd_b2g2.onnx": lambda: exporter_like(B=2, G=2, H=5, W=6, C=3, P=7),
    "gathernd_refused.onnx": lambda: exporter_like(source=CLIP_BEFORE_GRID),
    "sum_only.onnx": sum_only,
    "no_deform.onnx": no_deform,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "fixtures"))
    args = parser.parse_args()
    for name, build in FIXTURES.items():
        path = Path(args.out) / name
        path.write_bytes(build().SerializeToString())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
