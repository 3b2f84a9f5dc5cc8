"""A BiRefNet-scale model, built deterministically: three copies of the exporter's own decoder
(`fixtures/decoder_gathernd_1024.onnx`, deform-conv2d-onnx-exporter 1.2.0: two full copies and the first ASPP block
of a third, 20 deformable convs in all) beside a transformer-style backbone in torch's export style (decomposed
LayerNorm and GELU, Constant nodes) that brings the graph to about 19,000 nodes and about 200 MB of embedded
weights; 1024x1024 input. Used by the region tests and by `scripts/bench_patch.py`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import FIXTURES

OPSET = 17


def _prefixed(graph: onnx.GraphProto, prefix: str, keep: set[str]) -> tuple[list, list]:
    """Nodes and initializers of `graph` with every node and tensor name prefixed (names in `keep` are not)."""
    def ren(name: str) -> str:
        return name if (not name or name in keep) else prefix + name

    nodes = []
    for n in graph.node:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.name = ren(n.name)
        m.input[:] = [ren(i) for i in n.input]
        m.output[:] = [ren(o) for o in n.output]
        nodes.append(m)
    inits = []
    for t in graph.initializer:
        u = onnx.TensorProto()
        u.CopyFrom(t)
        u.name = ren(t.name)
        inits.append(u)
    return nodes, inits


def _prune(nodes: list, outputs: list[str]) -> list:
    """Only the nodes the given outputs depend on (a backward walk), in their original order."""
    producer = {o: n for n in nodes for o in n.output}
    needed, stack, keep = set(), list(outputs), set()
    while stack:
        name = stack.pop()
        if name in needed or name not in producer:
            continue
        needed.add(name)
        node = producer[name]
        keep.add(id(node))
        stack.extend(node.input)
    return [n for n in nodes if id(n) in keep]


def exporter_decoder_copies(copies: int = 2, extra_aspp: bool = True) -> tuple[list, list, list]:
    """Nodes, initializers and outputs of `copies` renamed copies of the 1024 exporter fixture, all reading `image`,
    plus (with `extra_aspp`) a copy cut after its first ASPP block (4 more deformable convs)."""
    src = onnx.load(FIXTURES / "decoder_gathernd_1024.onnx")
    vi = {v.name: v for v in onnx.shape_inference.infer_shapes(src).graph.value_info}
    nodes, inits, outputs = [], [], []
    for k in range(copies + (1 if extra_aspp else 0)):
        prefix = f"dec{k}/"
        n, i = _prefixed(src.graph, prefix, {"image"})
        if k < copies:
            out = helper.make_tensor_value_info(prefix + "mask", TensorProto.FLOAT, [1, 1, 1024, 1024])
        else:  # the output of the first Conv after the fourth deformable Sum: the end of the first ASPP block
            sums = [j for j, node in enumerate(src.graph.node) if node.op_type == "Sum"]
            cut = next(node for node in src.graph.node[sums[3]:] if node.op_type == "Conv"
                       and vi[node.output[0]].type.tensor_type.shape.dim[1].dim_value == 8)
            out = onnx.ValueInfoProto()
            out.CopyFrom(vi[cut.output[0]])
            out.name = prefix + cut.output[0]
            n = _prune(n, [out.name])
            used = {x for node in n for x in node.input}
            i = [t for t in i if t.name in used]
            assert sum(node.op_type == "Sum" for node in n) == 4
        nodes += n
        inits += i
        outputs.append(out)
    return nodes, inits, outputs


def backbone(blocks: int, dim: int = 120, heads: int = 4, patch: int = 64, seed: int = 0,
             ) -> tuple[list, list, onnx.ValueInfoProto]:
    """A transformer-style backbone in torch's export style: patch embedding, then `blocks` pre-norm blocks with
    decomposed LayerNorm, attention, decomposed (erf) GELU and an MLP; 12*dim^2 float32 weights per block."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    tokens = (1024 // patch) ** 2
    count = [0]

    def node(op: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str]:
        count[0] += 1
        outs = [f"bb/{op}_{count[0]}" + (f"_{j}" if n_out > 1 else "") for j in range(n_out)]
        nodes.append(helper.make_node(op, inputs, outs, name=f"bb/{op}_{count[0]}", **attrs))
        return outs

    def const(value) -> str:  # torch exports small constants as Constant nodes
        return node("Constant", [], value=numpy_helper.from_array(np.asarray(value)))[0]

    def weight(name: str, shape: tuple[int, ...], scale: float = 0.02) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape, dtype=np.float32) * scale), f"bb/{name}"))
        return f"bb/{name}"

    def layer_norm(x: str, name: str) -> str:
        mean = node("ReduceMean", [x], axes=[-1])[0]
        d = node("Sub", [x, mean])[0]
        var = node("ReduceMean", [node("Pow", [d, const(np.float32(2))])[0]], axes=[-1])[0]
        std = node("Sqrt", [node("Add", [var, const(np.float32(1e-5))])[0]])[0]
        y = node("Div", [d, std])[0]
        return node("Add", [node("Mul", [y, weight(f"{name}.g", (dim,), 1.0)])[0], weight(f"{name}.b", (dim,))])[0]

    def linear(x: str, name: str, n_in: int, n_out: int) -> str:
        y = node("MatMul", [x, weight(f"{name}.w", (n_in, n_out))])[0]
        return node("Add", [y, weight(f"{name}.b", (n_out,))])[0]

    x = node("Conv", ["image", weight("patch.w", (dim, 3, patch, patch)), weight("patch.b", (dim,))],
             kernel_shape=[patch, patch], strides=[patch, patch])[0]
    x = node("Transpose", [node("Reshape", [x, const(np.array([1, dim, tokens], np.int64))])[0]], perm=[0, 2, 1])[0]
    dh = dim // heads
    for b in range(blocks):
        h = layer_norm(x, f"blk{b}.ln1")
        qkv = node("Reshape", [linear(h, f"blk{b}.qkv", dim, 3 * dim),
                               const(np.array([1, tokens, 3, heads, dh], np.int64))])[0]
        qkv = node("Transpose", [qkv], perm=[2, 0, 3, 1, 4])[0]
        q, k, v = node("Split", [qkv, const(np.array([1, 1, 1], np.int64))], n_out=3, axis=0)
        q, k, v = (node("Squeeze", [t, const(np.array([0], np.int64))])[0] for t in (q, k, v))
        q = node("Mul", [q, const(np.float32(dh ** -0.5))])[0]
        att = node("Softmax", [node("MatMul", [q, node("Transpose", [k], perm=[0, 1, 3, 2])[0]])[0]], axis=-1)[0]
        o = node("Transpose", [node("MatMul", [att, v])[0]], perm=[0, 2, 1, 3])[0]
        o = node("Reshape", [o, const(np.array([1, tokens, dim], np.int64))])[0]
        x = node("Add", [x, linear(o, f"blk{b}.proj", dim, dim)])[0]
        h = linear(layer_norm(x, f"blk{b}.ln2"), f"blk{b}.fc1", dim, 4 * dim)
        g = node("Erf", [node("Div", [h, const(np.float32(np.sqrt(2.0)))])[0]])[0]
        g = node("Mul", [node("Mul", [h, node("Add", [g, const(np.float32(1.0))])[0]])[0], const(np.float32(0.5))])[0]
        x = node("Add", [x, linear(g, f"blk{b}.fc2", 4 * dim, dim)])[0]
    out = helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, tokens, dim])
    return nodes, inits, out


def build_birefnet_scale(path: Path, target_nodes: int = 19_000) -> onnx.ModelProto:
    """(a): the exporter's decoder (20 deformable convs) beside a backbone that brings it to ~`target_nodes` nodes."""
    dec_nodes, dec_inits, dec_outs = exporter_decoder_copies()
    probe, _, _ = backbone(1, seed=0)
    per_block = len(probe) - 4  # patch embedding: Conv, Constant, Reshape, Transpose
    blocks = max(1, round((target_nodes - len(dec_nodes) - 4) / per_block))
    bb_nodes, bb_inits, bb_out = backbone(blocks)
    graph = helper.make_graph(
        dec_nodes + bb_nodes, "birefnet_scale",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 1024, 1024])],
        dec_outs + [bb_out], dec_inits + bb_inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="bench_patch.py")
    model.ir_version = 8
    onnx.save(model, path)
    return model
