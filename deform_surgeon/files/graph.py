"""The bridge to onnx-graphsurgeon: export a rewritten region as a model, and `tidy`, gs's `cleanup().toposort()`
in linear time for the flat graphs the passes rewrite."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs


def export_graph(graph: gs.Graph, original: onnx.ModelProto) -> onnx.ModelProto:
    """Export `graph` as a model that keeps every model-level field of `original` (opsets, IR version, metadata)."""
    model = gs.export_onnx(graph, do_type_check=False)
    model.ir_version = original.ir_version
    del model.opset_import[:]
    model.opset_import.extend(original.opset_import)
    model.producer_name = original.producer_name
    model.producer_version = original.producer_version
    model.domain = original.domain
    model.model_version = original.model_version
    model.doc_string = original.doc_string
    del model.metadata_props[:]
    model.metadata_props.extend(original.metadata_props)
    del model.functions[:]
    model.functions.extend(original.functions)
    return model


def tidy(graph: gs.Graph) -> gs.Graph:
    """`graph.cleanup().toposort()`, with exactly gs's result (the same nodes kept; the same order: stable by
    hierarchy level, ties in gs's depth-first discovery order), in linear time on graphs without subgraphs or local
    functions. gs's own methods recompute subgraph facts per node, and the passes tidy at every round of the fixed
    point: on the real BiRefNet-lite 512 export (a region of 2,407 nodes) patch's lift takes 2.38 s of CPU with
    these walks and 2.86 s with gs's (`scripts/bench_fastgraph.py`, medians of 3, spread 0.37 s).
    Anything else (subgraphs, functions, a producer that is not in the graph, a cycle) goes to gs's methods, which
    also report the errors."""
    flat = _flat(graph)  # (a cleanup keeps it so)
    if not (flat and _cleanup(graph)):
        graph.cleanup()
    if not (flat and _toposort(graph)):
        graph.toposort()
    return graph


def _flat(graph: gs.Graph) -> bool:
    if graph.functions:
        return False
    for node in graph.nodes:
        for v in node.attrs.values():
            if isinstance(v, gs.Graph) or (isinstance(v, list) and v and isinstance(v[0], gs.Graph)):
                return False
    return True


def _cleanup(graph: gs.Graph) -> bool:
    """gs's default `cleanup()` of a flat graph; False (nothing changed) where gs must decide."""
    in_graph = {id(n) for n in graph.nodes}
    for inp in graph.inputs:  # as gs does first: graph inputs have no producers
        inp.inputs.clear()
    used: set[int] = set()
    seen: set[str] = set()
    stack = list(graph.outputs)
    while stack:
        t = stack.pop()
        if not t.is_empty():
            if t.name in seen:
                continue
            seen.add(t.name)
        for node in t.inputs:
            if id(node) not in in_graph:
                return False
            if id(node) not in used:
                used.add(id(node))
                stack.extend(node.inputs)
    kept = []
    for node in graph.nodes:
        if id(node) in used:
            kept.append(node)
        else:
            node.inputs.clear()
            node.outputs.clear()
    graph.nodes = kept
    return True


def _toposort(graph: gs.Graph) -> bool:
    """gs's default `toposort()` of a flat graph; False (nothing changed) where gs must decide."""
    producers: dict[int, list[gs.Node]] = {}
    for node in graph.nodes:
        found: list[gs.Node] = []
        for t in node.inputs:
            if t.name:  # gs skips empty (omitted optional) inputs
                for p in t.inputs:
                    if not any(q is p for q in found):
                        found.append(p)
        producers[id(node)] = found
    level: dict[int, int] = {}
    order: list[gs.Node] = []
    active: set[int] = set()
    for root in graph.nodes:  # depth first, inputs in order, post-order: gs's discovery order
        stack = [root]
        while stack:
            node = stack[-1]
            nid = id(node)
            if nid in level:
                stack.pop()
                continue
            found = producers.get(nid)
            if found is None:  # a producer that is not in the graph: gs reports it
                return False
            pending = [p for p in found if id(p) not in level]
            if pending:
                if nid in active or any(id(p) in active for p in pending):  # a cycle: gs reports it
                    return False
                active.add(nid)
                stack.extend(reversed(pending))
                continue
            stack.pop()
            active.discard(nid)
            level[nid] = 1 + max([level[id(p)] for p in found], default=-1)
            order.append(node)
    graph.nodes = sorted(order, key=lambda n: level[id(n)])
    return True
