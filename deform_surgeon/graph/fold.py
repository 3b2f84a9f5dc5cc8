"""Fold what is static: float16 computations whose inputs are all known for the model's input shapes are
evaluated once, exactly, and stored as initializers.

Why: an fp16 conversion (onnxconverter-common) turns the constant-valued parts of a model into float16 too: in a
Swin backbone the window-padding sizes (`Ceil` of a float constant), the shifted-window attention masks
(ConstantOfShape -> ScatterND -> Sub -> Equal -> Where) and every shape computation downstream of them. ONNX
Runtime folds static computations itself when a session is created, but only with CPU kernels, and its CPU EP
has none for most float16 arithmetic: in fp16 those nodes are never folded, and on a WebGPU EP the int64 shape
nodes downstream of them then run on the CPU EP with Memcpy around them (real BiRefNet-lite 512 fp16: 2,456 CPU
nodes, 164 Memcpy after the deform passes; its fp32 export: none; docs/runtime-facts.md, section 4). Folding them
here makes the fp16 model as static as ORT makes the fp32 one.

What is folded: a node is *static* when every input is an initializer (of at most `FOLD_LIMIT` bytes, not also a
graph input), a Constant or a static node's output, or when it is a `Shape`/`Size` of a tensor whose shape shape
inference knows completely. Folded are the static nodes that read or write float16/bfloat16 (`REDUCED_FLOATS`),
everything static downstream of them, and the static nodes they need; the tensors the rest of the model reads
from them become initializers. Static computations without such a type are left to ORT, which folds them at
session creation anyway (so an fp32 model is not changed at all and does not grow). Never folded: random ops,
control flow, custom domains, and any tensor larger than `FOLD_LIMIT` (the nodes that make it stay).

How, exactly: the static subgraph is evaluated by ONNX Runtime CPU itself, so the stored bytes are ORT's. That
alone is not enough for float16: ORT computes a float16 node without a CPU kernel in float32 between Casts it
inserts, and removes the Cast pairs between two such nodes, so inside the model a node may read its producer's
float32 value unrounded, where a folded initializer would give it the rounded float16 one (measured: a folded
fp16 Mul changes its consumer in 1,055 of 4,096 elements). So the subgraph is evaluated twice, as it is and with
every float16/bfloat16 widened to float32, and a node is folded only when every tensor of its static cone is the
same in both: then no float16 rounding happened anywhere in it, and however ORT (or a GPU computing in float16)
arranges its Casts, the values are these. Integer and bool computations are exact either way. What is not exact
in that sense (a `Sqrt` of an attention scale, say) is left in the model and reported with its reason.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..files import TypeTable, Weights, elem_nbytes
from .budget import human
from .pipeline import Action, Outcome
from .region import subgraph_reads

PASS = "fold"
FOLD_LIMIT = 16 << 20  # bytes: no folded tensor is larger (BiRefNet-lite's largest Swin mask: 6.6 MB fp16 at 1024)
REDUCED_FLOATS = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}  # the standard ops with graph attributes
NEVER_STATIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                "Bernoulli", "Dropout", *CONTROL_FLOW}
SHAPE_OF = {"Shape", "Size"}  # read only their input's shape
_SUBGRAPH = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
# the attributes through which a node can name a float16/bfloat16 type; widening rewrites them, or gives up
_TYPED_ATTRS = {("Cast", "to"), ("ConstantOfShape", "value"), ("Constant", "value"), ("EyeLike", "dtype")}


@dataclass
class _Static:
    """The nodes of a model as plain lists (protobuf field access is the cost on 19,000 nodes), and which are
    static."""

    nodes: list[onnx.NodeProto]
    ops: list[str] = field(default_factory=list)
    ins: list[list[str]] = field(default_factory=list)
    outs: list[list[str]] = field(default_factory=list)
    reads: list[list[str]] = field(default_factory=list)  # inputs, and for control flow its subgraphs' outer reads
    static: set[int] = field(default_factory=set)
    producer: dict[str, int] = field(default_factory=dict)
    readers: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))


def fold_static(model: onnx.ModelProto, types: TypeTable, weights: Weights, limit: int = FOLD_LIMIT) -> list[Action]:
    """Fold `model`'s static float16 computations in place (see the module docstring); one Action per node folded
    or left. `types` is the model's shape inference, `weights` where its stored tensors are."""
    graph = model.graph
    if not has_reduced_floats(model):  # nothing can be float16: an fp32 model costs one scan
        return []
    found = _find_static(graph, types, weights, limit)
    tainted = _tainted(found, types)
    if not tainted:
        return []
    cone = _cone(found, tainted)
    # a static Shape of a folded tensor is folded too: else the tensor would be stored only for its shape
    cone |= {r for k in cone for o in found.outs[k] if o for r in found.readers.get(o, ())
             if r in found.static and found.ops[r] in SHAPE_OF}
    cone, refused = _sized(found, cone, types, limit)
    try:
        values, widened = _evaluate(model, found, cone, tainted, types, weights)
    except Exception as exc:  # ORT could not run it: nothing is folded, and the report says why
        reason = f"static, but ORT CPU could not evaluate the static subgraph ({_first_line(exc)})"
        return [Action(PASS, found.nodes[k].name, found.ops[k], Outcome.REFUSED, reason) for k in sorted(tainted)]
    exact: set[int] = set()  # nodes whose outputs are fixed however ORT arranges its float16 Casts
    rounded: dict[str, str] = {}  # tensors of those that differ when computed in float32: why
    for k in sorted(cone):  # the model's node order is topological
        bad_input = next((p for i in found.ins[k] if (p := found.producer.get(i)) in cone and p not in exact), None)
        if bad_input is not None:
            refused[k] = f"reads '{found.nodes[bad_input].name}', which is not folded"
            continue
        problem = next((f"{rounded[i]}, read by {found.ops[k]}" for i in found.ins[k]
                        if i in rounded and not _absorbs(found.ops[k], values[i], widened[i])), None)
        if problem:
            refused[k] = problem
            continue
        exact.add(k)
        for o in found.outs[k] if found.ops[k] != "Constant" else ():
            why = _inexact(o, values, widened) if o in widened else None
            if why:
                rounded[o] = why
    folded = {k for k in exact if found.ops[k] != "Constant"}
    outputs = {o.name for o in graph.output}
    while True:  # a tensor the model keeps reading must be small enough, and typed as shape inference says
        boundary = _boundary(found, folded, outputs)
        unstorable = {}
        for name in boundary:
            problem = rounded.get(name) or _unstorable(name, values[name], types, limit)
            if problem:
                unstorable[found.producer[name]] = problem
        if not unstorable:
            break
        for k, problem in unstorable.items():
            folded.discard(k)
            refused[k] = problem
    dead = _dead(found, folded, outputs)
    actions = []
    for k in sorted(dead - {k for k in dead if found.ops[k] == "Constant"}):
        actions.append(Action(PASS, found.nodes[k].name, found.ops[k], Outcome.REWRITTEN,
                              "removed: only folded nodes read its output"))
    for k in sorted(folded | set(refused)):
        node = found.nodes[k]
        if k in folded:
            stored = [f"'{o}' ({_describe(values[o])})" for o in found.outs[k] if o in boundary]
            absorbers = sorted({found.ops[r] for o in found.outs[k] if o in rounded for r in found.readers[o]})
            reason = "static for the model's input shapes: evaluated once on ORT CPU, " + (
                f"rounded in float16, which its readers ({', '.join(absorbers)}) absorb: the same result on its "
                "float32 value" if absorbers else "the same wherever ORT's float16 fallback rounds")
            reason += f"; stored {', '.join(stored)} as an initializer" if stored else ""
            details = {"stored": [{"tensor": o, "dtype": str(values[o].dtype), "shape": list(values[o].shape),
                                   "bytes": values[o].nbytes} for o in found.outs[k] if o in boundary]}
            if absorbers:
                details["absorbed_by"] = absorbers
            actions.append(Action(PASS, node.name, found.ops[k], Outcome.REWRITTEN, reason, details=details))
        elif k in tainted:  # ancestors that are only needed are not worth a line of their own
            actions.append(Action(PASS, node.name, found.ops[k], Outcome.REFUSED, f"static, not folded: {refused[k]}"))
    _apply(model, found, folded | dead, boundary, values)
    return actions


def has_reduced_floats(model: onnx.ModelProto) -> bool:
    """Whether any tensor of the model can be float16/bfloat16: a float type enters a graph only through its
    inputs, initializers, Constant / ConstantOfShape values and Cast targets (or a dtype attribute)."""
    graph = model.graph
    if any(t.data_type in REDUCED_FLOATS for t in graph.initializer) or \
            any(i.type.tensor_type.elem_type in REDUCED_FLOATS for i in graph.input):
        return True
    for node in graph.node:
        if node.op_type in ("Constant", "ConstantOfShape", "Cast", "EyeLike") or node.domain not in ("", "ai.onnx"):
            for a in node.attribute:
                if (a.type == onnx.AttributeProto.INT and a.i in REDUCED_FLOATS) or \
                        (a.type == onnx.AttributeProto.TENSOR and a.t.data_type in REDUCED_FLOATS):
                    return True
    return False


def _find_static(graph: onnx.GraphProto, types: TypeTable, weights: Weights, limit: int) -> _Static:
    """Stored weights are not static sources: they are never read, and what is computed from them (a Cast or an
    Identity of a weight, say) would only be a copy of weights in the file, which ORT folds at load anyway."""
    found = _Static(list(graph.node))
    overridable = {i.name for i in graph.input}
    initializers = {t.name for t in graph.initializer}
    known = {t.name for t in graph.initializer if t.name not in overridable and t.name not in weights.tensors
             and (elem_nbytes(t.data_type, t.dims) or limit + 1) <= limit}
    for k, node in enumerate(found.nodes):
        op, ins, outs, domain = node.op_type, list(node.input), list(node.output), node.domain
        custom = domain not in ("", "ai.onnx")
        nested = (op in CONTROL_FLOW or custom) and any(a.type in _SUBGRAPH for a in node.attribute)
        reads = ins if not nested else [*ins, *subgraph_reads(node)]
        found.ops.append(op)
        found.ins.append(ins)
        found.outs.append(outs)
        found.reads.append(reads)
        for i in reads:
            if i:
                found.readers[i].append(k)
        for o in outs:
            if o:
                found.producer[o] = k
        if nested or custom or op in NEVER_STATIC or \
                (op == "Identity" and ins and ins[0] in initializers):  # folding it would only copy a weight
            continue
        if op in SHAPE_OF:
            static = bool(ins) and (ins[0] in known or _static_shape(ins[0], types) is not None)
        else:
            static = all(i in known for i in ins if i)
        if static:
            found.static.add(k)
            known.update(o for o in outs if o)
    return found


def _static_shape(name: str, types: TypeTable) -> tuple[int, ...] | None:
    if name not in types:
        return None
    shape = types[name][1]
    if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    return tuple(shape)


def _tainted(found: _Static, types: TypeTable) -> set[int]:
    """Static nodes that compute in a reduced float type, and the static nodes downstream of them."""
    tainted: set[int] = set()
    for k in sorted(found.static):
        op = found.ops[k]
        if op in SHAPE_OF or op == "Constant":
            continue
        if any(found.producer.get(i) in tainted for i in found.ins[k]) or \
                any(types.elem_type(n) in REDUCED_FLOATS for n in (*found.ins[k], *found.outs[k]) if n):
            tainted.add(k)
    return tainted


def _cone(found: _Static, tainted: set[int]) -> set[int]:
    """`tainted` and every static node it needs."""
    cone, stack = set(tainted), list(tainted)
    while stack:
        for i in found.ins[stack.pop()]:
            p = found.producer.get(i)
            if p is not None and p in found.static and p not in cone:
                cone.add(p)
                stack.append(p)
    return cone


def _sized(found: _Static, cone: set[int], types: TypeTable, limit: int) -> tuple[set[int], dict[int, str]]:
    """The cone without the nodes whose output shape inference says is larger than `limit` (nor what reads them),
    so that evaluating it never materialises a huge tensor; and why each was left out. (Sizes inference does not
    know are checked after evaluation, before anything is stored.)"""
    kept: set[int] = set()
    left: dict[int, str] = {}
    for k in sorted(cone):
        above = next((p for i in found.ins[k] if (p := found.producer.get(i)) in cone and p not in kept), None)
        if above is not None:
            left[k] = f"reads '{found.nodes[above].name}', which is not folded"
            continue
        for o in found.outs[k]:
            shape = _static_shape(o, types) if o else None
            size = None if shape is None else elem_nbytes(types[o][0], shape)
            if size is not None and size > limit:
                left[k] = f"'{o}' would be {human(size)}, above the fold limit of {human(limit)}"
                break
        else:
            kept.add(k)
    return kept, left


def _evaluate(model: onnx.ModelProto, found: _Static, cone: set[int], tainted: set[int], types: TypeTable,
              weights: Weights) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every output of the cone's nodes on ORT CPU as the model has them, and the outputs of its tainted nodes
    with reduced floats widened (the rest, integer shape arithmetic, is the same in both by construction: it is
    fed to the widened run as initializers)."""
    nodes = []
    for k in sorted(cone):
        if found.ops[k] in SHAPE_OF and found.producer.get(found.ins[k][0]) not in cone:
            nodes.append(_shape_constant(found.nodes[k], types))  # the shape of a tensor the subgraph does not compute
        else:
            nodes.append(_valued(found.nodes[k], weights))
    outputs = [o for k in sorted(cone) if found.ops[k] != "Constant" for o in found.outs[k] if o]
    values = dict(zip(outputs, _run(_submodel(model, nodes, {}, outputs)), strict=True))
    wide = sorted(tainted & cone)
    wide_nodes = [found.nodes[k] for k in wide]
    constants = [_valued(found.nodes[p], weights) for p in sorted({found.producer[i] for k in wide for i in found.ins[k]
                                                 if found.producer.get(i) in cone and found.ops[found.producer[i]]
                                                 == "Constant"})]
    wide_outputs = [o for k in wide for o in found.outs[k] if o]
    fed = {i: values[i] for k in wide for i in found.ins[k] if i in values and found.producer[i] not in tainted}
    widened = dict(zip(wide_outputs, _run(_widen(_submodel(model, constants + wide_nodes, fed, wide_outputs))),
                       strict=True))
    return values, widened


def _valued(node: onnx.NodeProto, weights: Weights) -> onnx.NodeProto:
    """`node`, or, for a stored Constant (its data left in the file: files/weights.py), a copy holding its value
    for ORT to read."""
    if node.op_type != "Constant" or not node.output or node.output[0] not in weights.data:
        return node
    valued = onnx.NodeProto()
    valued.CopyFrom(node)
    valued.attribute[0].t.raw_data = weights.read(node.output[0]).tobytes()
    return valued


def _submodel(model: onnx.ModelProto, nodes: list[onnx.NodeProto], fed: dict[str, np.ndarray],
              outputs: list[str]) -> onnx.ModelProto:
    """`nodes` as a model with no inputs: the initializers they read (small, embedded: see _find_static) and
    `fed` as initializers, `outputs` as its outputs."""
    sub = onnx.ModelProto()
    sub.ir_version = model.ir_version
    sub.opset_import.extend(model.opset_import)
    g = sub.graph
    g.name = "static"
    g.node.extend(nodes)
    read = {i for n in g.node for i in n.input if i}
    g.initializer.extend(t for t in model.graph.initializer if t.name in read)
    g.initializer.extend(numpy_helper.from_array(v, name) for name, v in fed.items())
    g.output.extend(onnx.ValueInfoProto(name=o) for o in outputs)
    return sub


def _shape_constant(node: onnx.NodeProto, types: TypeTable) -> onnx.NodeProto:
    shape = _static_shape(node.input[0], types)
    if node.op_type == "Size":
        value = np.array(math.prod(shape), dtype=np.int64)
    else:
        attrs = {a.name: a.i for a in node.attribute}
        rank = len(shape)
        start, end = attrs.get("start", 0), attrs.get("end", rank)
        start, end = (min(max(x + rank if x < 0 else x, 0), rank) for x in (start, end))
        value = np.array(shape[start:end], dtype=np.int64)
    return onnx.helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                 value=numpy_helper.from_array(value, node.output[0]))


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    from ..base.ort_cpu import run_ort_cpu

    # level "disable": each node by its own kernel; quiet: ORT warns about every float16 node it computes via Casts
    return run_ort_cpu(model, {}, "disable", threads=1, quiet=True)


def _widen(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with every float16/bfloat16 tensor, Cast target and typed attribute made float32."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    g = wide.graph
    for i, t in enumerate(g.initializer):
        if t.data_type in REDUCED_FLOATS:
            g.initializer[i].CopyFrom(_wide_tensor(t))
    for node in g.node:
        for a in node.attribute:
            if (node.op_type, a.name) in _TYPED_ATTRS:
                if a.type == onnx.AttributeProto.INT and a.i in REDUCED_FLOATS:
                    a.i = TensorProto.FLOAT
                elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in REDUCED_FLOATS:
                    a.t.CopyFrom(_wide_tensor(a.t))
            elif a.type in (onnx.AttributeProto.TENSOR, onnx.AttributeProto.TENSORS, onnx.AttributeProto.INT) and \
                    a.name in ("dtype", "to", "value"):
                raise ValueError(f"cannot widen attribute '{a.name}' of {node.op_type} '{node.name}'")
    return wide


def _wide_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def _inexact(name: str, values: dict, widened: dict) -> str | None:
    """Why a tensor is not the same in the run as it is and in the widened run (None: it is)."""
    a, b = values[name], widened[name]
    if a.shape != b.shape:
        return f"'{name}' has shape {list(a.shape)}, {list(b.shape)} when computed in float32"
    if a.dtype.kind == "f" and a.dtype != b.dtype:
        a = a.astype(b.dtype)  # float16 -> float32 is exact
    if a.dtype != b.dtype or a.tobytes() != b.tobytes():
        return (f"'{name}' ({values[name].dtype}) is rounded: computed in float32 it differs (ORT's float16 "
                "fallback may or may not round it inside the model)")
    return None


def _absorbs(op: str, rounded: np.ndarray, unrounded: np.ndarray) -> bool:
    """Whether `op` gives the same result on a tensor's float16-rounded and its float32 value, so that the
    rounding (which ORT may or may not do inside the model) cannot matter downstream. Only for integer-valued
    ops whose result on a float16 input is again a float16 value (Ceil, Floor, Round: as numpy computes them)."""
    function = {"Ceil": np.ceil, "Floor": np.floor, "Round": np.round}.get(op)  # ONNX Round: half to even
    return function is not None and rounded.shape == unrounded.shape and \
        np.array_equal(function(rounded.astype(np.float32)), function(unrounded.astype(np.float32)))


def _boundary(found: _Static, folded: set[int], outputs: set[str]) -> set[str]:
    """Outputs of folded nodes that a node left in the model, or the graph's outputs, read."""
    return {o for k in folded for o in found.outs[k]
            if o and (o in outputs or any(r not in folded for r in found.readers.get(o, ())))}


def _unstorable(name: str, value: np.ndarray, types: TypeTable, limit: int) -> str | None:
    if value.nbytes > limit:
        return f"'{name}' would be a {_describe(value)} initializer, above the fold limit of {human(limit)}"
    if name in types:
        elem, shape = types[name]
        if elem and onnx.helper.np_dtype_to_tensor_dtype(value.dtype) != elem:
            return f"'{name}' evaluates to {value.dtype}, shape inference says {TensorProto.DataType.Name(elem)}"
        if shape is not None and (len(shape) != value.ndim or any(isinstance(d, int) and d != v
                                                                  for d, v in zip(shape, value.shape, strict=True))):
            return f"'{name}' evaluates to shape {list(value.shape)}, shape inference says {list(shape)}"
    return None


def _dead(found: _Static, folded: set[int], outputs: set[str]) -> set[int]:
    """Nodes that only folded nodes read (the Constants they read, the Cast a folded Shape looked at), and so on
    backwards."""
    gone = set(folded)
    stack = [p for k in folded for i in found.reads[k] if (p := found.producer.get(i)) is not None]
    dead: set[int] = set()
    while stack:
        k = stack.pop()
        if k in gone or any(o in outputs or any(r not in gone for r in found.readers.get(o, ()))
                            for o in found.outs[k] if o):
            continue
        gone.add(k)
        dead.add(k)
        stack.extend(p for i in found.reads[k] if (p := found.producer.get(i)) is not None)
    return dead


def _apply(model: onnx.ModelProto, found: _Static, removed: set[int], boundary: set[str],
           values: dict[str, np.ndarray]) -> None:
    """Drop the folded (and dead) nodes, store the boundary tensors, and drop the initializers only they read
    (the model is changed in place; no weight is copied). The value_info of removed tensors stays: the splice
    (region.py) keeps only that of tensors still produced."""
    graph = model.graph
    kept = [k for k in range(len(found.nodes)) if k not in removed]
    read = {i for k in kept for i in found.reads[k]} | {o.name for o in graph.output}
    was_read = {i for k in removed for i in found.reads[k]}
    for k in sorted(removed, reverse=True):  # in place: the kept nodes are not copied
        del graph.node[k]
    unread = was_read - read
    for i in reversed([i for i, t in enumerate(graph.initializer) if t.name in unread]):
        del graph.initializer[i]
    graph.initializer.extend(numpy_helper.from_array(values[name], name) for name in sorted(boundary))


def _describe(value: np.ndarray) -> str:
    return f"{value.dtype}{list(value.shape)}, {human(value.nbytes)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
