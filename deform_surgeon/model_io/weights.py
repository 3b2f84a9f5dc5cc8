"""Stored weights: which tensors are never copied, and the forms they take on the way through `patch`.

A model is loaded with its external data left on disk; every external tensor and every embedded one larger than
`STORED_WEIGHT_BYTES` is a *stored weight* (`Weights`). onnx.checker and shape inference see a weight-less copy
in which the large ones are typed graph inputs (`weightless`: shape inference does not need their values, and
past 2 GB it could not take them); the graph holds them as lazy constants read only if the range prover asks
(`_StoredValues`: it asks for tensors in the backward cone of gather indices, never for conv weights); an export
carries them as data-less stubs (`stub`), and the writer streams the original tensors back in (write.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

STORED_WEIGHT_BYTES = 1 << 12  # embedded tensors above this are stored weights (never copied); every external tensor is


_BITS = {getattr(onnx.TensorProto, name): bits for name, bits in (
    ("FLOAT", 32), ("UINT8", 8), ("INT8", 8), ("UINT16", 16), ("INT16", 16), ("INT32", 32), ("INT64", 64),
    ("BOOL", 8), ("FLOAT16", 16), ("DOUBLE", 64), ("UINT32", 32), ("UINT64", 64), ("COMPLEX64", 64),
    ("COMPLEX128", 128), ("BFLOAT16", 16), ("FLOAT8E4M3FN", 8), ("FLOAT8E4M3FNUZ", 8), ("FLOAT8E5M2", 8),
    ("FLOAT8E5M2FNUZ", 8), ("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("FLOAT8E8M0", 8), ("UINT2", 2),
    ("INT2", 2)) if hasattr(onnx.TensorProto, name)}


@dataclass
class Weights:
    """The stored weights of a loaded model: every external tensor and every embedded one above `STORED_WEIGHT_BYTES`.

    `tensors` maps names to the original TensorProtos (embedded data, or an external reference resolved against
    `base_dir`, the input model's folder); `stubbed` names those an export carries as stubs; `loaded` names those
    whose values were read (the range prover reads only what lies in the cone of gather indices).
    """

    base_dir: Path | None
    tensors: dict[str, onnx.TensorProto] = field(default_factory=dict)
    stubbed: set[str] = field(default_factory=set)
    loaded: list[str] = field(default_factory=list)
    lazy: dict[str, LazyValues] = field(default_factory=dict, repr=False)

    @property
    def external(self) -> bool:
        return any(_is_external(t) for t in self.tensors.values())

    def sources(self) -> set[Path]:
        """The external data files the model reads, resolved."""
        base = self.base_dir if self.base_dir is not None else Path()
        return {(base / _external_ref(t)[0]).resolve() for t in self.tensors.values() if _is_external(t)}


def split_weights(model: onnx.ModelProto, base_dir: str | Path | None) -> Weights:
    """Which initializers of `model` are stored weights (see `Weights`); nothing is read or copied."""
    tensors = {t.name: t for t in model.graph.initializer if _is_external(t) or _is_heavy_embedded(t)}
    return Weights(None if base_dir is None else Path(base_dir), tensors)


def weightless(model: onnx.ModelProto, weights: Weights) -> onnx.ModelProto:
    """A copy of `model` for onnx.checker and shape inference: large stored weights become typed graph inputs,
    small external ones are read in (shape inference needs the values of shape-like constants). Returns `model`
    itself when it holds no stored weight."""
    graph = model.graph
    if not any(t.name in weights.tensors for t in graph.initializer):
        return model
    out = onnx.ModelProto()
    copy_fields(model, out, skip={"graph"})
    copy_fields(graph, out.graph, skip={"initializer"})
    declared = {i.name for i in graph.input}
    for t in graph.initializer:
        original = weights.tensors.get(t.name)
        if original is None:
            out.graph.initializer.add().CopyFrom(t)
        elif _is_external(original) and not _is_large(original) and weights.base_dir is not None:
            out.graph.initializer.add().CopyFrom(_read_in(original, weights.base_dir))
        elif t.name not in declared:
            out.graph.input.append(onnx.helper.make_tensor_value_info(t.name, original.data_type, list(original.dims)))
    return out


class _StoredValues(LazyValues):
    """LazyValues of a stored weight: external data is read relative to the model's folder; reads are recorded."""

    def __init__(self, tensor: onnx.TensorProto, weights: Weights) -> None:
        super().__init__(tensor)
        self.weights = weights
        self.array: np.ndarray | None = None

    def load(self) -> np.ndarray:
        src = self.tensor
        if _is_external(src):  # older onnx fills raw_data in while reading: never into the original reference
            src = onnx.TensorProto()
            src.CopyFrom(self.tensor)
        base = "" if self.weights.base_dir is None else str(self.weights.base_dir)
        array = np.array(onnx.numpy_helper.to_array(src, base_dir=base))
        array.setflags(write=False)
        self.weights.loaded.append(self.tensor.name)
        self.array = array
        return array


@contextmanager
def _stubbed(graph: gs.Graph, weights: Weights | None) -> Iterator[None]:
    """Swap every stored weight the graph still holds, unchanged, for a data-less stub while exporting."""
    if weights is None or not weights.tensors:
        yield
        return
    swapped = []
    for name, t in graph.tensors().items():
        if not isinstance(t, gs.Constant) or name not in weights.tensors:
            continue
        swapped.append((t, t._values, t.data_location))
        lazy = weights.lazy.get(name)
        if lazy is not None and (t._values is lazy or t._values is lazy.array):
            original = weights.tensors[name]
            t._values = LazyValues(stub(original))
            weights.stubbed.add(name)
        t.data_location = None  # a constant whose values a pass replaced is written embedded
    try:
        yield
    finally:
        for t, values, location in swapped:
            t._values, t.data_location = values, location


def _nbytes(t: onnx.TensorProto) -> int | None:
    return elem_nbytes(t.data_type, t.dims)


def elem_nbytes(elem_type: int, shape) -> int | None:
    """Bytes of a tensor of this element type and (static) shape; None for an element type of unknown size."""
    bits = _BITS.get(elem_type)
    return None if bits is None else (math.prod(shape) * bits + 7) // 8


def _is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def _is_large(t: onnx.TensorProto) -> bool:
    n = _nbytes(t)
    return n is None or n > STORED_WEIGHT_BYTES


def _is_heavy_embedded(t: onnx.TensorProto) -> bool:
    return not _is_external(t) and t.HasField("raw_data") and _is_large(t) and _nbytes(t) is not None


def _external_ref(t: onnx.TensorProto) -> tuple[str, int, int | None]:
    ref = {e.key: e.value for e in t.external_data}
    length = ref.get("length")
    return ref.get("location", ""), int(ref.get("offset") or 0), None if length in (None, "") else int(length)


def _read_in(t: onnx.TensorProto, base_dir: Path) -> onnx.TensorProto:
    location, offset, length = _external_ref(t)
    with open(base_dir / location, "rb") as fh:
        fh.seek(offset)
        data = fh.read() if length is None else fh.read(length)
    out = onnx.TensorProto()
    out.CopyFrom(t)
    del out.external_data[:]
    out.data_location = onnx.TensorProto.DEFAULT
    out.raw_data = data
    return out


def copy_fields(src, dst, skip: set[str]) -> None:
    """Copy every set field of one protobuf message into another of the same type, except those in `skip`."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def stub(t: onnx.TensorProto) -> onnx.TensorProto:
    """A data-less stand-in for a stored weight: name, type and shape only (the writer puts the data back)."""
    return onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)


def stubbed_copy(model: onnx.ModelProto, weights: Weights) -> onnx.ModelProto:
    """A copy of `model` with its stored weights as stubs (for `save_model_atomic(..., weights=weights)`)."""
    out = onnx.ModelProto()
    copy_fields(model, out, skip={"graph"})
    copy_fields(model.graph, out.graph, skip={"initializer"})
    for t in model.graph.initializer:
        if t.name in weights.tensors:
            out.graph.initializer.add().CopyFrom(stub(t))
            weights.stubbed.add(t.name)
        else:
            out.graph.initializer.add().CopyFrom(t)
    return out
