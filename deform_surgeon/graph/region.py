"""Lift only the deformable-conv regions of a model into onnx-graphsurgeon, and splice the result back.

Why: a BiRefNet-scale model has about 19,000 nodes, of which the deform blocks are a few hundred. Importing all of
them into onnx-graphsurgeon, cleaning up, sorting and exporting them again cost about three times the plain
`onnx.load` + `onnx.save` of the model, while every pass only ever looks at the blocks.

What: the region is every deform block's sampling, its Conv and the per-channel ops right after it (bias Add,
BatchNormalization, activation: the split pass carries its chunks through them), as `blocks.find_blocks` finds
them, every `Sum` and exported gather, plus the nodes that compute their inputs, walked backward a few steps
through anything but heavy ops. The region becomes a model of its own: tensors it reads from outside are its
graph inputs (typed from the whole model's shape inference), tensors read outside it or by the graph's outputs
are its graph outputs.

Why that is exact: the passes see the region's outside inputs as tensors they know nothing about but type and
shape, so whatever they prove on the region holds for any values those tensors take, in particular the real ones;
and every tensor the rest of the model reads keeps its name and its producer's meaning (the graph interface of
the region is preserved by graph-surgeon's cleanup, which never removes graph outputs). A region that is too small
can only make a proof fail (the rewrite is refused with its reason), never make a wrong one.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

import onnx
import onnx_graphsurgeon as gs

from ..files import Weights
from .blocks import GraphIndex, find_blocks
from .device import storage_buffers
from .ops import EXPORTED_SAMPLERS, HEAVY, SAMPLING_START

ANCHORS = {SAMPLING_START, *EXPORTED_SAMPLERS}  # a deform block's start (blocks.py), or a sampler outside one
LOCAL = {"Sum"}  # rewritten where they stand
BACKWARD_STEPS = 6
_SUBGRAPH = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


@dataclass
class Region:
    """The nodes (indices into `model.graph.node`) the passes see, and the boundary they are cut along."""

    nodes: list[int]
    inputs: list[str] = field(default_factory=list)  # read from outside the region (not initializers)
    outputs: list[str] = field(default_factory=list)  # read outside the region, or graph outputs
    initializers: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)  # every node and tensor name of the whole model
    readers: dict[str, int] = field(default_factory=dict)  # output -> index of the first outside node reading it
    read_outside: set[str] = field(default_factory=set)  # every tensor read outside the region, or a graph output
    constants: list[int] = field(default_factory=list)  # stored Constant nodes (kept out) only the region reads
    outs: list[list[str]] = field(default_factory=list)  # every node's outputs, by index (what splice places by)


def _subgraph_names(node: onnx.NodeProto, names: set[str]) -> None:
    """Add every node and tensor name of `node`'s subgraphs (recursively) to `names`."""
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            names.update(t.name for t in (*g.input, *g.output, *g.value_info, *g.initializer))
            for n in g.node:
                names.add(n.name)
                names.update(n.input)
                names.update(n.output)
                _subgraph_names(n, names)
    names.discard("")


def find_region(model: onnx.ModelProto, max_storage_buffers: int | None = None,
                oversize: set[str] | None = None, weights: Weights | None = None) -> Region:
    """The region of `model` the passes need (see the module docstring); with `max_storage_buffers`, also every
    node whose kernel would bind more storage buffers than that (the fit pass rewrites them where they stand);
    with `oversize` (tensor names over `--max-buffer`), also the nodes that make or read them, and the tails of
    the Convs and MatMuls among those (the bands pass computes them in bands, groups or row chunks, and carries a
    tail per band or chunk). The stored tensors of `weights`
    (their Constant nodes stay outside) are inputs of the region, read through `Weights.read`."""
    graph = model.graph
    index = GraphIndex(model)
    nodes, ops, ins, outs, producer = index.nodes, index.ops, index.ins, index.outs, index.producer
    has_subgraph = index.nested
    names = {n.name for n in nodes} | index.consumers.keys() | producer.keys()
    names.update(t.name for t in graph.initializer)
    names.update(t.name for t in graph.input)
    for k in has_subgraph:  # a generated name must not shadow a name of an If/Loop body either (SSA)
        _subgraph_names(nodes[k], names)

    region: set[int] = set()
    for block in find_blocks(index):
        region |= block.sampling | {block.start} | set(block.tail)
        region.update(() if block.conv is None else (block.conv,))
    for k, op in enumerate(ops):
        if op in ANCHORS | LOCAL:
            region.add(k)  # an anchor outside any block still has its own rewrite (a Sum; a GatherND proof)
        elif max_storage_buffers is not None and storage_buffers(op, ins[k], outs[k]) > max_storage_buffers:
            region.add(k)
        elif oversize and k not in has_subgraph and not oversize.isdisjoint(ins[k] + outs[k]):
            region.add(k)
            region.update(index.tail(k) if op in ("Conv", "MatMul") else ())  # carried per band / row chunk
            if op == "Resize" and ins[k] and producer.get(ins[k][0]) is not None:  # its groups may be made by a
                p = producer[ins[k][0]]  # Conv of fewer output channels (bands.py), also through the Cast a
                region.add(p)  # float16 converter puts before a Resize it keeps in float32
                if ops[p] == "Cast" and ins[p] and producer.get(ins[p][0]) is not None:
                    region.add(producer[ins[p][0]])
    frontier = set(region)
    for _ in range(BACKWARD_STEPS):
        step = set()
        for k in frontier:
            for i in ins[k]:
                p = producer.get(i)
                if p is not None and p not in region and p not in has_subgraph and ops[p] not in HEAVY:
                    step.add(p)
        region |= step
        frontier = step
        if not frontier:
            break

    stored = weights.tensors if weights is not None else {}
    constants = {k for k in region if ops[k] == "Constant" and outs[k] and outs[k][0] in stored}
    region -= constants
    order = sorted(region)
    produced = {o for k in order for o in outs[k] if o}
    inits = {t.name for t in graph.initializer}
    first_reader: dict[str, int] = {}  # the first node outside the region that reads a tensor
    for k, names_in in enumerate(ins):
        if k not in region:
            for i in names_in:
                first_reader.setdefault(i, k)
    for k in sorted(has_subgraph - region):  # tensors of the outer scope read inside an If/Loop/Scan body
        for i in subgraph_reads(nodes[k]):
            first_reader[i] = min(first_reader.get(i, k), k)
    read_outside = set(first_reader) | {o.name for o in graph.output}
    inputs, initializers, seen = [], [], set()
    for k in order:
        for i in ins[k]:
            if not i or i in produced or i in seen:
                continue
            seen.add(i)
            (initializers if i in inits and i not in stored else inputs).append(i)
    outputs = [o for k in order for o in outs[k] if o and o in read_outside]
    readers = {o: first_reader[o] for o in outputs if o in first_reader}
    constants = sorted(k for k in constants if outs[k][0] not in read_outside)
    return Region(order, inputs, outputs, initializers, names, readers, read_outside, constants, outs)


def subgraph_reads(node: onnx.NodeProto) -> set[str]:
    reads: set[str] = set()
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                reads.update(n.input)
                reads.update(subgraph_reads(n))
            reads.update(o.name for o in g.output)
    return reads


def region_model(model: onnx.ModelProto, region: Region) -> onnx.ModelProto:
    """The region as a model of its own: what it reads from outside (stored tensors included) are its graph inputs,
    what the rest of the model reads are its graph outputs, declared by name (`type_boundary` types them once the
    whole model's shape inference is known: the region is lifted while that runs); only its small initializers are
    copied."""
    graph = model.graph
    sub = onnx.ModelProto()
    sub.ir_version = model.ir_version
    sub.opset_import.extend(model.opset_import)
    sub.functions.extend(model.functions)
    g = sub.graph
    g.name = graph.name or "region"
    g.node.extend(graph.node[k] for k in region.nodes)
    wanted = set(region.initializers)
    g.initializer.extend(t for t in graph.initializer if t.name in wanted)
    g.input.extend(onnx.ValueInfoProto(name=name) for name in region.inputs)
    g.output.extend(onnx.ValueInfoProto(name=name) for name in region.outputs)
    inner = {o for n in g.node for o in n.output} - set(region.inputs) - set(region.outputs)
    g.value_info.extend(vi for vi in graph.value_info if vi.name in inner)
    return sub


def type_boundary(graph: gs.Graph, types: dict) -> None:
    """Give the lifted region's graph inputs and outputs the types and shapes the whole model's shape inference
    found, as onnx-graphsurgeon reads them from declared value_info (a model of the declarations alone, imported)."""
    declared = onnx.helper.make_model(onnx.GraphProto(), opset_imports=[onnx.helper.make_opsetid("", graph.opset)])
    declared.graph.input.extend(_value_info(t.name, types) for t in graph.inputs)
    declared.graph.output.extend(_value_info(t.name, types) for t in graph.outputs)
    typed = gs.import_onnx(declared)
    for t, known in zip([*graph.inputs, *graph.outputs], [*typed.inputs, *typed.outputs], strict=True):
        t.dtype, t.shape = known.dtype, known.shape


def _value_info(name: str, types: dict) -> onnx.ValueInfoProto:
    if name not in types:
        return onnx.ValueInfoProto(name=name)
    elem, shape = types[name]
    return onnx.helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def splice(model: onnx.ModelProto, region: Region, patched: onnx.ModelProto, weights: Weights) -> onnx.ModelProto:
    """`model` itself, its region's nodes replaced by `patched`'s in a topological order that keeps every other node
    where it was. Every other node and tensor stays the original protobuf, edited in place (stored tensors are
    never copied); the initializers and stored Constant nodes no node reads any more are dropped."""
    graph = model.graph
    new = list(patched.graph.node)
    read = region.read_outside | {i for n in new for i in n.input}
    # a stored Constant the region still reads goes first, as when it was lifted with the region (its readers'
    # places, and so ONNX Runtime's execution order, stay as they were); one nothing reads any more goes
    new = [graph.node[k] for k in region.constants if region.outs[k][0] in read] + new
    produced = _place(graph, region, sorted({*region.nodes, *region.constants}), new)

    replaced = {t.name: t for t in patched.graph.initializer}
    unread = []
    for k, t in enumerate(graph.initializer):
        if t.name not in read:
            unread.append(k)
        elif t.name in replaced:  # a small initializer that went through the region (its export is the same tensor)
            t.CopyFrom(replaced.pop(t.name))
    for k in reversed(unread):
        del graph.initializer[k]
    graph.initializer.extend(t for t in replaced.values() if t.name in read)
    boundary = {o.name for o in graph.output} | {i.name for i in graph.input}
    infos = {vi.name: vi for vi in graph.value_info if vi.name in produced}
    for vi in patched.graph.value_info:
        if vi.name in produced and vi.name not in boundary:
            infos.setdefault(vi.name, vi)
    kept = list(infos.values())
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return model


def _place(graph: onnx.GraphProto, region: Region, removed: list[int], new: list[onnx.NodeProto]) -> set[str]:
    """Remove the nodes at `removed` (sorted) and put `new` in: every other node stays in its order, each new node
    right after the latest of its producers (new nodes come in `new`'s topological order). That order is valid
    when every tensor the rest of the model reads from the region is produced before its first reader, which is
    checked; otherwise Kahn's algorithm decides. Both edit `graph.node` in place (deleting and inserting a few
    thousand nodes costs a tenth of rebuilding the list). Returns the names of all tensors the nodes produce."""
    gone = set(removed)
    key_of: dict[str, float] = {}
    for k, names in enumerate(region.outs):
        if k not in gone:
            for o in names:
                key_of[o] = k
    span = len(new) + 1
    keys = []
    for j, n in enumerate(new):
        base = max((math.floor(key_of[i]) for i in n.input if i in key_of), default=-1)
        keys.append(base + (j + 1) / span)
        for o in n.output:
            key_of[o] = keys[-1]
    in_order = all(key_of.get(o, -1) < first for o, first in region.readers.items()) and \
        all(not any(a.type in _SUBGRAPH for a in n.attribute) for n in new)
    if not in_order:
        keep = [n for k, n in enumerate(graph.node) if k not in gone]
        nodes = _toposort(keep + new, [float(k) for k in range(len(graph.node)) if k not in gone] + keys)
        del graph.node[:]
        graph.node.extend(nodes)
        return set(key_of)
    for k in reversed(removed):
        del graph.node[k]
    for j in sorted(range(len(new)), key=keys.__getitem__, reverse=True):  # the last first: positions hold
        base = math.floor(keys[j])
        graph.node.insert(base - bisect.bisect_left(removed, base) + 1, new[j])
    return set(key_of)


def _toposort(nodes: list[onnx.NodeProto], keys: list[float]) -> list[onnx.NodeProto]:
    """Kahn's algorithm, always taking the ready node with the smallest key: untouched nodes keep their order."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    waiting = [0] * len(nodes)
    users: dict[int, list[int]] = defaultdict(list)
    for k, n in enumerate(nodes):
        reads = n.input if not any(a.type in _SUBGRAPH for a in n.attribute) else [*n.input, *subgraph_reads(n)]
        deps = {producer[i] for i in reads if i in producer}
        deps.discard(k)
        waiting[k] = len(deps)
        for d in deps:
            users[d].append(k)
    ready = [(keys[k], k) for k in range(len(nodes)) if waiting[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(nodes[k])
        for u in users.get(k, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (keys[u], u))
    if len(order) != len(nodes):
        raise ValueError("the patched model has a cycle")
    return order
