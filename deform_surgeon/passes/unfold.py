"""Keep ORT from storing a large broadcast of small static tensors: the model computes it when it runs.

Why: ORT folds every static computation when a session is created and keeps each result the model reads as an
initializer for the session's life. A broadcast of two small static tensors can be large: in a Swin backbone each
shifted-window block adds its relative-position bias [1, heads, N, N] to its window mask [windows, 1, N, N] before
both reach the attention scores, and folded that sum is [windows, heads, N, N] (the full BiRefNet at 1024: 23 such
tensors, 1.36 GB beside 0.92 GB of weights, the largest 241 MB). onnxruntime-web's wasm backend keeps them in its
heap, which cannot grow past 4 GiB, and the WebGPU EPs hold them there before uploading them
(docs/runtime-facts.md, "The wasm backend"); computed at run time, each lives only until its reader has run.

Which: ORT itself says. Whether a tensor is static depends on shapes ONNX's shape inference does not know (a
Swin block's window count comes from Shape -> Gather -> Div chains that ORT folds one after another), so the
model is optimized once by ORT CPU at level `basic` (constant folding; `optimized_model_filepath`), on a second
core, and the stored tensors larger than `FOLD_LIMIT` that a node of a broadcasting elementwise op makes, at
least twice the size of its inputs, are the candidates.

How: the node's smallest input goes through `Where(flag, t, t)`, `flag` being the first element of the model's
first float32 input compared with itself: true, or false for a NaN, the Where gives `t` either way, but nothing
that depends on an input is folded.

Why that is exact: Where copies `t`'s bytes (NaN, -0.0 and all), and the node runs the kernel ORT's folding ran,
on the same bytes: an elementwise op, each element computed alone, whatever the thread count. What could differ is
how ORT fuses the node's readers with a stored tensor and with a computed one, so each rewrite is shown exact
with its readers on ORT CPU at levels `disable` and `all` and every thread-count class of their kernels (seeded
inputs: fusion and splitting depend on shapes, not values) before it is made, and is left as it was where not.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..base.ort_cpu import optimized_graph, run_ort_cpu
from ..base.scratch import scratch
from ..base.threads import thread_counts
from ..files import TypeTable, elem_nbytes
from ..graph.budget import human
from ..graph.fold import FOLD_LIMIT
from ..graph.pipeline import Action, Outcome
from ..proofs.local_proof import LEVELS, kernels_of

PASS = "unfold"
BROADCASTS = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Where"}
GROWTH = 2  # the stored result is at least this many times its inputs
FLAG = "deform_surgeon/unfold/run_time_true"
SEED = 0


@dataclass(frozen=True)
class Candidate:
    """A node whose output ORT stores: the node's index, its inputs' shapes and its output's."""

    index: int
    inputs: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4

    @property
    def smallest(self) -> int:
        """The input the Where wraps: the cheapest to compute at run time."""
        return min(range(len(self.inputs)), key=lambda i: math.prod(self.inputs[i]))


def stored_by_ort(model_path: str | os.PathLike[str], limit: int = FOLD_LIMIT) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every initializer over `limit` bytes that ORT CPU keeps after folding `model_path` at level
    `basic` (prepacking off: it changes no graph, and it costs memory)."""
    with scratch("ds-unfold-", "ORT CPU's folded graph of the model") as tmp:
        graph = optimized_graph(str(model_path), "basic", Path(tmp), external_over=limit,
                                config={"session.disable_prepacking": "1"})
    return {t.name: tuple(t.dims) for t in graph.initializer if (elem_nbytes(t.data_type, t.dims) or 0) > limit}


def candidates(model: onnx.ModelProto, types: TypeTable, stored: dict[str, tuple[int, ...]],
               original: set[str]) -> list[Candidate]:
    """The broadcasting nodes of `model` whose float32 output ORT stores (`stored`, and not an initializer of the
    file: `original`), at least `GROWTH` times their inputs; an input's dims shape inference does not know are
    taken as the output's (the largest they can be)."""
    found = []
    for k, node in enumerate(model.graph.node):
        if node.op_type not in BROADCASTS or len(node.output) != 1 or node.output[0] not in stored \
                or node.output[0] in original or types.elem_type(node.output[0]) != TensorProto.FLOAT:
            continue
        shape = stored[node.output[0]]
        inputs = tuple(_resolved(types, i, shape) for i in node.input)
        if any(s is None for s in inputs):
            continue
        c = Candidate(k, inputs, shape)
        if c.nbytes >= GROWTH * sum(math.prod(s) * 4 for s in inputs):
            found.append(c)
    return found


def unfold_large_broadcasts(model: onnx.ModelProto, types: TypeTable, stored: dict[str, tuple[int, ...]],
                            original: set[str]) -> list[Action]:
    """Compute at run time each large broadcast ORT would store (see the module docstring); in place. One Action
    per candidate: rewritten, or refused with the reason."""
    found = candidates(model, types, stored, original)
    if not found:
        return []
    source = _flag_source(model.graph, types)
    nodes = list(model.graph.node)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    actions: list[Action] = []
    proven: dict[tuple, str | None] = {}  # a proof's question -> why it failed (None: shown exact)
    wrapped: list[Candidate] = []
    for c in found:
        node = nodes[c.index]
        read_by = readers.get(node.output[0], [])
        why = "no float32 graph input to compute the run-time flag from" if source is None else None
        if why is None:
            question = _question(node, c, read_by)
            if question not in proven:
                proven[question] = _prove(model.opset_import, node, c, read_by, types)
            why = proven[question]
        stored_text = f"ORT stores its float32{list(c.shape)} result ({human(c.nbytes)}) for the session's life"
        if why is not None:
            actions.append(Action(PASS, node.name, node.op_type, Outcome.REFUSED, f"{stored_text}; left: {why}"))
            continue
        wrapped.append(c)
        actions.append(Action(PASS, node.name, node.op_type, Outcome.REWRITTEN,
                              f"{stored_text}: computed at run time instead (its input '{node.input[c.smallest]}' "
                              "through a Where on a flag of the model's input, which no optimizer folds): the same "
                              "kernel on the same bytes, shown exact with its readers on ORT CPU at levels 'disable' "
                              "and 'all'", details={"stored_bytes": c.nbytes, "shape": list(c.shape)}))
    if wrapped:
        _apply(model.graph, nodes, wrapped, source)
    return actions


def _flag_source(graph: onnx.GraphProto, types: TypeTable) -> tuple[str, int] | None:
    """The first float32 graph input (not an initializer) of known rank, and its rank."""
    stored = {t.name for t in graph.initializer}
    for i in graph.input:
        if i.name not in stored and i.name in types and types[i.name][0] == TensorProto.FLOAT \
                and types[i.name][1] is not None:
            return i.name, len(types[i.name][1])
    return None


def _apply(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], wrapped: list[Candidate],
           source: tuple[str, int]) -> None:
    """`FLAG` first (the first element of `source` equal to itself, a bool scalar), each wrapped input's Where just
    before its node; the other nodes keep their order."""
    name, rank = source
    first = f"{FLAG}/first_element"
    ordered = [helper.make_node("Slice", [name, f"{FLAG}/starts", f"{FLAG}/ends"], [first], name=f"{FLAG}/Slice"),
               helper.make_node("Reshape", [first, f"{FLAG}/scalar"], [f"{first}/scalar"], name=f"{FLAG}/Reshape"),
               helper.make_node("Equal", [f"{first}/scalar"] * 2, [FLAG], name=f"{FLAG}/Equal")]
    at = {c.index: c for c in wrapped}
    for k, node in enumerate(nodes):
        c = at.get(k)
        if c is not None:
            t = node.input[c.smallest]
            kept = f"{t}/{PASS}/at_run_time"
            ordered.append(helper.make_node("Where", [FLAG, t, t], [kept], name=f"{node.name}/{PASS}/at_run_time"))
            node.input[c.smallest] = kept
        ordered.append(node)
    graph.initializer.extend([numpy_helper.from_array(np.zeros(rank, np.int64), f"{FLAG}/starts"),
                              numpy_helper.from_array(np.ones(rank, np.int64), f"{FLAG}/ends"),
                              numpy_helper.from_array(np.zeros(0, np.int64), f"{FLAG}/scalar")])
    del graph.node[:]
    graph.node.extend(ordered)


# ------------------------------------------------------------------------------------------------------- proof


def _question(node: onnx.NodeProto, c: Candidate, readers: list[onnx.NodeProto]) -> tuple:
    """What decides the proof: ops, attributes and shapes (values never decide how ORT fuses or splits)."""
    def attrs(n: onnx.NodeProto) -> tuple:
        return tuple(sorted((k, str(v)) for k, v in _attrs(n).items()))
    return (node.op_type, attrs(node), c.inputs, c.shape, c.smallest,
            tuple((r.op_type, attrs(r), tuple(j for j, i in enumerate(r.input) if i == node.output[0]))
                  for r in readers))


def _prove(opset, node: onnx.NodeProto, c: Candidate, readers: list[onnx.NodeProto], types: TypeTable) -> str | None:
    """None when the node stored (as ORT folds it) and computed (through the Where) give its readers' outputs the
    same bytes on ORT CPU at both levels and every thread-count class of their kernels; else why not."""
    stored_side = _side(opset, node, c, readers, types, at_run_time=False)
    if isinstance(stored_side, str):
        return stored_side  # (the computed side would fail alike: the same readers)
    computed_side = _side(opset, node, c, readers, types, at_run_time=True)
    rng = np.random.default_rng(SEED)
    feeds = {v.name: _seeded(rng, v) for v in stored_side.graph.input}
    flag = {"flag_source": np.ones(1, np.float32)}
    counts = thread_counts(kernels_of(stored_side), os.cpu_count() or 1)  # shape inference: once, not per level
    for level in LEVELS:
        for threads in counts:
            stored = run_ort_cpu(stored_side, feeds, level, threads=threads, quiet=True)
            computed = run_ort_cpu(computed_side, feeds | flag, level, threads=threads, quiet=True)
            if any(a.tobytes() != b.tobytes() for a, b in zip(stored, computed, strict=True)):
                return f"its readers' outputs differ at level '{level}', {threads} thread(s)"
    return None


def _side(opset, node: onnx.NodeProto, c: Candidate, readers: list[onnx.NodeProto], types: TypeTable,
          at_run_time: bool) -> onnx.ModelProto | str:
    """The node on seeded stored inputs (ORT folds it), or through the Where, with its readers; the readers' other
    inputs are graph inputs, of their inferred shapes or, where inference does not know them, the node's."""
    rng = np.random.default_rng(SEED)
    ins = [f"in{i}" for i in range(len(c.inputs))]
    inits = [numpy_helper.from_array(_seeded_array(rng, types.elem_type(t), s), n)
             for t, s, n in zip(node.input, c.inputs, ins, strict=True)]
    nodes, graph_inputs, seen = [], [], {node.output[0]}
    if at_run_time:
        nodes += [helper.make_node("Equal", ["flag_source", "flag_source"], ["flag"]),
                  helper.make_node("Where", ["flag", ins[c.smallest], ins[c.smallest]], ["kept"])]
        graph_inputs.append(helper.make_tensor_value_info("flag_source", TensorProto.FLOAT, [1]))
        ins[c.smallest] = "kept"
    nodes.append(helper.make_node(node.op_type, ins, [node.output[0]], **_attrs(node)))
    outputs = []
    for r in readers:
        for i in r.input:
            if i and i not in seen:
                shape = _resolved(types, i, c.shape)
                if shape is None:
                    return f"the shape of '{i}', read by {r.op_type} '{r.name}', is not known"
                graph_inputs.append(helper.make_tensor_value_info(i, types.elem_type(i), shape))
                seen.add(i)
        nodes.append(helper.make_node(r.op_type, list(r.input), list(r.output), **_attrs(r)))
        outputs += [helper.make_tensor_value_info(o, types.elem_type(o) or TensorProto.FLOAT, None)
                    for o in r.output if o]
    return helper.make_model(helper.make_graph(nodes, "unfold_proof", graph_inputs, outputs, inits),
                             opset_imports=opset, ir_version=8)


def _resolved(types: TypeTable, name: str, like: tuple[int, ...]) -> tuple[int, ...] | None:
    """`name`'s shape, its unknown dims taken from `like` (same rank), or None."""
    if name not in types or types[name][1] is None:
        return None
    shape = types[name][1]
    if all(isinstance(d, int) for d in shape):
        return tuple(shape)
    if len(shape) != len(like):
        return None
    return tuple(d if isinstance(d, int) else like[j] for j, d in enumerate(shape))


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _seeded(rng: np.random.Generator, v: onnx.ValueInfoProto) -> np.ndarray:
    return _seeded_array(rng, v.type.tensor_type.elem_type, tuple(d.dim_value for d in v.type.tensor_type.shape.dim))


def _seeded_array(rng: np.random.Generator, elem: int, shape: tuple[int, ...]) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(elem or TensorProto.FLOAT)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(0, 8, shape).astype(dtype)
