"""The types of onnxruntime's contrib ops' outputs, which onnx's shape inference cannot give.

Why: onnx has no schema for the `com.microsoft` ops onnxruntime's quantizers write (`MatMulNBits` in the q4 and
q4f16 files, `MatMulBnb4` in bnb4), so its inference leaves their outputs, and everything computed from them,
without a type. Then the report cannot tell what a node downstream lacks (a float16 `Split` after a MatMulNBits
has no JSEP kernel) and the passes cannot rewrite it (float16_slices.py needs the Split's type and shape). So
the outputs
of such nodes are declared from the type rules of onnxruntime's docs/ContribOperators.md, and onnx's inference is
run again from them.

The rules are onnxruntime's own: `onnxruntime.tools.symbolic_shape_infer` computes MatMulNBits' output the same
way (the type of input A, A's shape with its last dim replaced by the attribute N;
tests/commands/test_variants.py checks the two agree on the replicas). That tool is not used itself: it imports
sympy, which onnxruntime does not depend on, and costs 1.6 s to import on every patch of such a model.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

Shape = tuple[int | str | None, ...] | None
Typed = tuple[int, Shape]  # element type, shape (None: rank unknown)


def _matmul_n(node: onnx.NodeProto, a: Typed) -> Typed:
    """Y: the type of A (T1), shape [..., N] (A's leading dims; `N` is an attribute)."""
    n = next((a_.i for a_ in node.attribute if a_.name == "N"), None)
    shape = a[1]
    if shape is None or not shape or n is None:
        return a[0], None
    return a[0], (*shape[:-1], n)


# com.microsoft op -> the type of its first output from the type of its first input (ContribOperators.md)
RULES: dict[str, Callable[[onnx.NodeProto, Typed], Typed]] = {
    "MatMulNBits": _matmul_n,  # Y: T1, [..., N]
    "MatMulBnb4": _matmul_n,  # Y: T1, [..., N]
}


def declared_outputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """Value infos for the first outputs of the contrib nodes of `graph` (an inferred graph) that have no type yet
    and whose first input has one."""
    known: dict[str, onnx.ValueInfoProto] = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        if vi.type.tensor_type.elem_type:
            known.setdefault(vi.name, vi)
    stored = {t.name: t for t in graph.initializer}
    out = []
    for node in graph.node:
        rule = RULES.get(node.op_type) if node.domain == "com.microsoft" else None
        if rule is None or not node.output or not node.output[0] or node.output[0] in known or not node.input:
            continue
        a = _typed(node.input[0], known, stored)
        if a is None:
            continue
        elem, shape = rule(node, a)
        out.append(onnx.helper.make_tensor_value_info(node.output[0], elem, None if shape is None else list(shape)))
    return out


def _typed(name: str, known: dict[str, onnx.ValueInfoProto], stored: dict[str, onnx.TensorProto]) -> Typed | None:
    if name in stored:
        return stored[name].data_type, tuple(stored[name].dims)
    vi = known.get(name)
    if vi is None:
        return None
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return tt.elem_type, None
    return tt.elem_type, tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)


def with_contrib_types(skeleton: bytes, inferred: onnx.GraphProto,
                       infer: Callable[[bytes], onnx.GraphProto]) -> onnx.GraphProto:
    """`inferred` (onnx's inference of the serialized model `skeleton`), with the contrib nodes' outputs declared
    and inference run again from them, as many times as that types more of them (a contrib op fed by another's
    output). An inference that fails from the declared types leaves the answer as it was: the declarations only
    ever add types, never change the checker's verdict."""
    declared: list[onnx.ValueInfoProto] = []
    while new := declared_outputs(inferred):
        declared += new
        model = onnx.ModelProto.FromString(skeleton)
        model.graph.value_info.extend(declared)
        try:
            inferred = infer(model.SerializeToString())
        except Exception:
            return inferred
        typed = {vi.name for vi in (*inferred.value_info, *inferred.output) if vi.type.tensor_type.elem_type}
        if any(vi.name not in typed for vi in new):
            return inferred  # not taken up: stop rather than loop
    return inferred
