"""`--input-shape NAME:1,3,1024,1024`: fix a model's symbolic input dims (polygraphy's `--input-shapes`,
onnxsim's `--overwrite-input-shape`).

Why: an export with dynamic axes (`dynamic_axes=...`) keeps Swin's shape computations (Shape, Gather, Concat,
Range, Expand, ...) as int64 nodes that the WebGPU EPs leave on the CPU, and the exporter still bakes the traced
size into the deform blocks (Clip bounds, Reshapes), so those are proven for that size only. Given the size the
model will get, its inputs become static: ORT then folds the shape computations when the session is created (and
fold.py folds a float16 model's own), and the proofs hold for the size the model is given, because shape
inference now knows it (a size the baked Reshapes cannot take fails as bad input, before anything is written).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import onnx
from onnx import numpy_helper

from ..base.errors import SurgeonError

_SPEC = re.compile(r"^(?P<name>.+):\[?(?P<dims>\d+(?:[,x]\d+)*)\]?$")
# The largest dim taken. Why a bound: ONNX stores a dim as an int64 (a larger one ended in "ValueError: Value out
# of range" while it was set), and the WebGPU EPs, for which a model is patched, compute shapes and indices in
# 32-bit integers. The input's whole size is bounded too (`fixed_inputs`): its bytes must be a number ONNX Runtime
# and numpy can hold (int64).
MAX_DIM = 2**31 - 1
MAX_BYTES = 2**63 - 1


def parse_input_shapes(items: Sequence[str] | None) -> dict[str, tuple[int, ...]] | None:
    """`NAME:1,3,1024,1024` (or polygraphy's `NAME:[1,3,1024,1024]`, or `NAME:1x3x1024x1024`) per item; None when
    none is given."""
    if not items:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        m = _SPEC.match(item.replace(" ", ""))
        if not m:
            raise SurgeonError(None, f"bad --input-shape '{item}'", "write NAME:DIMS, e.g. input_image:1,3,1024,1024")
        name = m.group("name")
        if name in shapes:  # two shapes for one input: neither is silently dropped
            raise SurgeonError(None, f"--input-shape names '{name}' twice ({name}:{_dims(shapes[name])} and '{item}')",
                               "give each input once")
        shapes[name] = _checked(name, tuple(int(d) for d in re.split(r"[,x]", m.group("dims"))))
    return shapes


def _checked(name: str, dims: tuple[int, ...], option: str = "--input-shape") -> tuple[int, ...]:
    """`dims` if each is from 1 to MAX_DIM; else a one-line SurgeonError naming the input and the dim."""
    for d in dims:
        if not 0 < d <= MAX_DIM:
            raise SurgeonError(None, f"{option} {name}:{_dims(dims)}: dim {d} is not from 1 to {MAX_DIM:,}",
                               "the WebGPU EPs index with 32-bit integers")
    return dims


def _dims(dims: Sequence[int]) -> str:
    return ",".join(map(str, dims))


def check_input_shapes(shapes: object) -> dict[str, tuple[int, ...]] | None:
    """The Python API's / a manifest's form ({name: [dims]}), checked; None stays None."""
    if shapes is None:
        return None
    if not isinstance(shapes, Mapping) or not all(
            isinstance(k, str) and isinstance(v, list | tuple) and v and
            all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in v) for k, v in shapes.items()):
        raise SurgeonError(None, f"bad input shapes {shapes!r}", "give {input name: [positive dims]}")
    return {k: _checked(k, tuple(v), "input_shapes") for k, v in shapes.items()}


def fixed_inputs(inputs: Sequence[onnx.ValueInfoProto], shapes: Mapping[str, Sequence[int]], path: object
                 ) -> list[tuple[onnx.ValueInfoProto, tuple[int, ...]]]:
    """Each input named in `shapes` with its new dims; a name that is no input, another rank, or a static dim
    given another value is a one-line SurgeonError naming the model."""
    by_name = {vi.name: vi for vi in inputs}
    out = []
    for name, dims in shapes.items():
        vi = by_name.get(name)
        if vi is None:
            raise SurgeonError(path, f"--input-shape names '{name}', which is not an input of the model",
                               f"inputs: {', '.join(by_name) or 'none'}")
        have = vi.type.tensor_type.shape.dim
        if len(have) != len(dims):
            raise SurgeonError(path, f"--input-shape {name}: {len(dims)} dims given, the input has {len(have)} "
                               f"({describe(vi)})")
        for d, want in zip(have, dims, strict=True):
            if d.HasField("dim_value") and d.dim_value != want:
                raise SurgeonError(path, f"--input-shape {name}:{_dims(dims)} conflicts with the "
                                   f"input's static shape {describe(vi)}")
        elem = vi.type.tensor_type.elem_type
        size = math.prod(dims) * (onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize if elem else 1)
        if size > MAX_BYTES:
            raise SurgeonError(path, f"--input-shape {name}:{_dims(dims)} makes an input of {size:,} bytes, more than "
                               f"a 64-bit size can hold ({MAX_BYTES:,})")
        out.append((vi, tuple(dims)))
    return out


def fix_input_shapes(model: onnx.ModelProto | Sequence[onnx.ValueInfoProto], shapes: Mapping[str, Sequence[int]],
                     path: object) -> list[str]:
    """Set the named inputs' dims in place (of a model, or of its input declarations alone); returns one line per
    input that changed ("name: [a,b] -> [1,2]")."""
    inputs = model.graph.input if isinstance(model, onnx.ModelProto) else model
    changed = []
    for vi, dims in fixed_inputs(inputs, shapes, path):
        before = describe(vi)
        for d, want in zip(vi.type.tensor_type.shape.dim, dims, strict=True):
            d.ClearField("dim_param")
            d.dim_value = want
        if describe(vi) != before:
            changed.append(f"{before} -> [{_dims(dims)}]")
    return changed


def impossible_reshape(model: onnx.ModelProto, types, path: object) -> None:
    """Refuse (SurgeonError) a size the model cannot run at: a Reshape to a constant shape (no 0, no -1) whose
    input, at the given size, has another number of elements. Why: an exporter that bakes the traced size into
    its Reshapes (deform-conv2d-onnx-exporter does, for every deform block) gives a model that ORT refuses to run
    at any other size; the proofs would hold for the baked shapes only, and nothing else says so before a run.
    `types` is the inference of the model at the given size (files.TypeTable)."""
    small = {t.name: t for t in model.graph.initializer if t.HasField("raw_data") or t.int64_data}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            small[node.output[0]] = node.attribute[0].t
    for node in model.graph.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in small:
            continue
        tensor = small[node.input[1]]
        if tensor.data_type != onnx.TensorProto.INT64 or not (tensor.raw_data or tensor.int64_data):
            continue  # a stored tensor (not a shape) or no value here: nothing to say
        target = numpy_helper.to_array(tensor).tolist()
        try:
            _, shape = types[node.input[0]]
        except KeyError:
            continue
        if not target or min(target) < 1 or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            continue
        if math.prod(shape) != math.prod(target):
            raise SurgeonError(path, f"the model cannot run at the given --input-shape: Reshape '{node.name}' "
                               f"turns {list(shape)} into the constant shape {target} (the export baked its "
                               "traced size in; give that size, or export at the size the model will get)")


def symbolic_inputs(model: onnx.ModelProto) -> list[str]:
    """The inputs with a dim that is not a number, described ("image: [batch,3,height,width]")."""
    init = {t.name for t in model.graph.initializer}
    return [describe(vi) for vi in model.graph.input if vi.name not in init and has_symbolic_dims(vi)]


def has_symbolic_dims(vi: onnx.ValueInfoProto) -> bool:
    return any(not d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)


def describe(vi: onnx.ValueInfoProto) -> str:
    dims = ",".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                    for d in vi.type.tensor_type.shape.dim)
    return f"{vi.name}: [{dims}]"
