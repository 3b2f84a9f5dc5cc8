"""A float16/bfloat16 `Split` becomes one `Slice` per output, on the whole model.

Why: onnxruntime-web 1.30's JSEP (the default `import 'onnxruntime-web'`) has no float16 kernel for Split, so
each one runs on the CPU EP with Memcpy around it, and on JSEP a mid-run CPU->GPU upload is a correctness hazard
(measured on the patched real BiRefNet-lite 512 fp16: the 24 Swin attention qkv Splits on the CPU EP with 96
Memcpy; the same Splits of the fp32 export, and all of them on the native WebGPU EP, run on the GPU). JSEP and
the native EP both have float16 Slice (docs/runtime-facts.md, section 2).

Exact because: a Split output is a contiguous range along one axis of its input, which is what a Slice with
constant start and end copies; no arithmetic. Only Splits whose sizes are known (a constant `split` input or
attribute, or an equal split of a dimension shape inference knows) are rewritten; the others are reported.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..files import TypeTable
from ..graph.pipeline import Action, Outcome

PASS = "split_fp16"
REDUCED_FLOATS = {TensorProto.FLOAT16, TensorProto.BFLOAT16}


def split_to_slices(model: onnx.ModelProto, types: TypeTable) -> list[Action]:
    """Rewrite `model`'s float16/bfloat16 Splits in place (see the module docstring); one Action per Split."""
    graph = model.graph
    splits = [k for k, n in enumerate(graph.node) if n.op_type == "Split" and n.domain in ("", "ai.onnx")
              and n.input and types.elem_type(n.input[0]) in REDUCED_FLOATS]
    if not splits:
        return []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    constants = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            constants[n.output[0]] = n.attribute[0].t
    taken = {n.name for n in graph.node} | {o for n in graph.node for o in n.output} | set(constants) | \
        {i.name for i in graph.input}
    actions: list[Action] = []
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for k in splits:
        node = graph.node[k]
        sizes, axis = _sizes(node, types, constants, opset)
        if isinstance(sizes, str):
            actions.append(Action(PASS, node.name, node.op_type, Outcome.REFUSED, sizes))
            continue
        slices, start = [], 0
        for j, (output, size) in enumerate(zip(node.output, sizes, strict=True)):
            end, begin = start + size, start
            start = end
            if not output:
                continue
            names = [_fresh(f"{node.name or 'Split'}/slice_{j}{suffix}", taken)
                     for suffix in ("", "/starts", "/ends", "/axes")]
            for name, value in zip(names[1:], (begin, end, axis), strict=True):
                graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), name))
            slices.append(onnx.helper.make_node("Slice", [node.input[0], *names[1:]], [output], name=names[0]))
        replaced[k] = slices
        actions.append(Action(PASS, node.name, node.op_type, Outcome.REWRITTEN,
                              f"float16 Split -> {len(slices)} Slice(s) along axis {axis} (sizes {sizes}): JSEP has "
                              "no float16 Split kernel; a Slice copies the same elements",
                              tuple(s.name for s in slices), details={"slices": len(slices), "axis": axis,
                                                                       "sizes": sizes}))
    if replaced:
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend(n for k, old in enumerate(nodes) for n in replaced.get(k, [old]))
    return actions


def _sizes(node: onnx.NodeProto, types: TypeTable, constants: dict[str, onnx.TensorProto],
           opset: int) -> tuple[list[int] | str, int]:
    """The output sizes along the axis and the axis (normalised), or why they are not known."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    shape = types[node.input[0]][1] if node.input[0] in types else None
    if shape is None:
        return "the rank of its input is not known", 0
    axis = attrs.get("axis", 0)
    axis = axis + len(shape) if axis < 0 else axis
    dim = shape[axis] if 0 <= axis < len(shape) else None
    count = len(node.output)
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in constants:
            return "its split sizes are computed, not constant", axis
        sizes = numpy_helper.to_array(constants[node.input[1]]).astype(np.int64).tolist()
    elif "split" in attrs and opset < 13:
        sizes = list(attrs["split"])
    elif not isinstance(dim, int):
        return "the size of the split axis is not known", axis
    elif "num_outputs" in attrs:  # opset 18: the last chunk may be smaller
        chunk = -(-dim // count)
        sizes = [min(chunk, dim - chunk * j) for j in range(count)]
    elif dim % count:
        return f"axis size {dim} does not split into {count} equal parts", axis
    else:
        sizes = [dim // count] * count
    if len(sizes) != count or any(s < 0 for s in sizes) or (isinstance(dim, int) and sum(sizes) != dim):
        return f"split sizes {sizes} do not match its {count} outputs and axis size {dim}", axis
    return sizes, axis


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name
