"""A model's nodes in topological order and models made of some of them: `bisect`'s prefixes and repro windows,
`verify --segment-memory`'s segments. One place for what such a piece reads, exposes and keeps, so that a piece
runs its nodes unchanged on exactly the tensors the whole model gave them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..base.errors import SurgeonError

if TYPE_CHECKING:  # numpy and onnx are imported where they are used: `import deform_surgeon` stays light
    import numpy as np
    import onnx


def subgraph_reads_outside(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If, Loop, Scan) read from outside: a node reads them as it reads its inputs."""
    from onnx import AttributeProto

    reads: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            inner = {i.name for i in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                inner.update(n.output)
            for n in g.node:
                reads.update(x for x in (*n.input, *subgraph_reads_outside(n)) if x and x not in inner)
    return reads


def reads(node: onnx.NodeProto) -> list[str]:
    return [x for x in node.input if x] + sorted(subgraph_reads_outside(node) - set(node.input))


@dataclass
class Graph:
    """A model's nodes in topological order (the file's, when it is one), and who makes and reads each tensor."""

    model: onnx.ModelProto
    nodes: list[onnx.NodeProto]
    producer: dict[str, int]
    last_read: dict[str, int]
    graph_inputs: list[str]
    constants: set[str]  # initializers, and outputs of Constant nodes
    types: dict[str, onnx.TypeProto]

    @classmethod
    def of(cls, model: onnx.ModelProto, path: object, types: Mapping[str, onnx.TypeProto] | None = None) -> Graph:
        """`types`: every tensor's type where the caller has them (patch's type table, `segments`), else ONNX's
        shape inference of `model` is asked."""
        inits = {i.name for i in model.graph.initializer}
        graph_inputs = [i.name for i in model.graph.input if i.name not in inits]
        nodes = toposort(list(model.graph.node), set(graph_inputs) | inits, path)
        producer: dict[str, int] = {}
        last_read: dict[str, int] = {}
        constants = set(inits)
        for i, n in enumerate(nodes):
            for x in reads(n):
                last_read[x] = i
            for y in n.output:
                if y:
                    producer[y] = i
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                constants.update(y for y in n.output if y)
        for o in model.graph.output:
            last_read[o.name] = len(nodes)  # read after the last node
        if types is None:
            types = {vi.name: vi.type for vi in (*_inferred(model).graph.value_info, *model.graph.output,
                                                 *model.graph.input) if vi.type.HasField("tensor_type")}
        return cls(model, nodes, producer, last_read, graph_inputs, constants, dict(types))

    def cut(self, k: int) -> list[str]:
        """The tensors a prefix ending at node k exposes: those nodes 0..k made that a later node reads or that are
        graph outputs, and node k's own outputs; Constant nodes' outputs are not exposed (they cannot differ)."""
        out: list[str] = []
        for i in range(k + 1):
            for y in self.nodes[i].output:
                if y and (i == k or (self.last_read.get(y, -1) > k and y not in self.constants)):
                    out.append(y)
        return list(dict.fromkeys(out))

    def describe(self, k: int) -> str:
        n = self.nodes[k]
        return f"{n.name or '(unnamed)'} ({n.op_type})"


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with ONNX's shape inference's types, for the prefixes' outputs (onnx.checker, which placement's
    runner applies, wants every graph output typed); the model itself where inference cannot run (`_typed` then
    types the outputs from ORT CPU's)."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference errors, or a model over protobuf's 2 GB
        return model


def toposort(nodes: list[onnx.NodeProto], given: set[str], path: object) -> list[onnx.NodeProto]:
    """The file's node order when it is topological (ONNX requires it; exporters write it so), else a stable
    topological sort of it; a graph with a cycle, or reading a tensor nothing makes, is a SurgeonError."""
    made = set(given) | {""}
    for n in nodes:
        if not set(reads(n)) <= made:
            break
        made.update(n.output)
    else:
        return nodes
    made = set(given) | {""}
    left = list(nodes)
    order: list[onnx.NodeProto] = []
    while left:
        ready = [n for n in left if set(reads(n)) <= made]
        if not ready:
            missing = sorted(set(reads(left[0])) - made)
            raise SurgeonError(path, f"node {left[0].name or left[0].op_type} reads {', '.join(missing)}, which no "
                                     "node, input or initializer makes (or the graph has a cycle)")
        first = ready[0]
        order.append(first)
        made.update(first.output)
        left.remove(first)
    return order


def sub_model(g: Graph, nodes: Sequence[int], outputs: Sequence[str],
              inputs: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """The model of `nodes` (indices into g.nodes, kept in their order, unchanged) exposing `outputs`.

    `inputs` None: a prefix, fed as the model is (every graph input kept). Otherwise a window: the tensors its
    nodes read that no node of it makes become graph inputs typed as the given arrays, and the Constant nodes and
    initializers they read are kept."""
    import onnx
    from onnx import helper

    keep = sorted(set(nodes))
    body = [g.nodes[i] for i in keep]
    made = {y for n in body for y in n.output}
    read = {x for n in body for x in reads(n)}
    if inputs is not None:  # Constant nodes the window reads, before it
        const_nodes = sorted({g.producer[x] for x in read - made if x in g.constants and x in g.producer})
        body = [g.nodes[i] for i in const_nodes] + body
        made |= {y for i in const_nodes for y in g.nodes[i].output}
    src = g.model.graph
    inits = [t for t in src.initializer if t.name in read]
    if inputs is None:
        graph_inputs = list(src.input)
        init_names = {t.name for t in inits}
        inits += [t for t in src.initializer if t.name not in init_names and t.name in {i.name for i in src.input}]
    else:
        graph_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
                        for name, a in inputs.items()]
    outs = []
    for name in outputs:
        vi = onnx.ValueInfoProto(name=name)
        if name in g.types:
            vi.type.CopyFrom(g.types[name])
        outs.append(vi)
    kept = made | read
    graph = helper.make_graph(body, f"{src.name or 'graph'}_bisect", graph_inputs, outs, inits,
                              value_info=[vi for vi in src.value_info if vi.name in kept])
    model = helper.make_model(graph, opset_imports=list(g.model.opset_import), producer_name="deform-surgeon bisect")
    model.ir_version = g.model.ir_version
    model.functions.extend(g.model.functions)
    return model


def save_model(model: onnx.ModelProto, path: Path) -> Path:
    """Written whole, or with its weights in `<name>.data` beside it when protobuf cannot hold it in one message."""
    import onnx

    big = model.ByteSize() > 1_800_000_000
    onnx.save_model(model, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=f"{path.name}.data" if big else None)
    return path


def window_inputs(g: Graph, first: int, last: int) -> list[str]:
    """The tensors nodes first..last read that none of them makes, constants excepted, in the order read."""
    made = {y for i in range(first, last + 1) for y in g.nodes[i].output}
    out = [x for i in range(first, last + 1) for x in reads(g.nodes[i]) if x not in made and x not in g.constants]
    return list(dict.fromkeys(out))
