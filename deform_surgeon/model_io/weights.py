"""Stored tensors: the one form weights take on the way through `patch`, and the one way their values are read.

A model is loaded with its external data left on disk. Every external initializer, every embedded initializer
larger than `STORED_WEIGHT_BYTES` and the value of every Constant node larger than that is a *stored tensor*
(`Weights`): its original protobuf stays where it is in the loaded model, is never copied, and is written once,
by the writer (write.py). Everything else sees a stored tensor as a typed name only:

- onnx.checker and shape inference see the model's *skeleton* (`skeleton_bytes`): stored tensors are typed graph
  inputs there (shape inference does not need their values; past 2 GB it could not take them; and the checker's
  work no longer grows with the weights: the real BiRefNet-lite 1024 export's skeleton is 3 MB of its 221 MB);
  what the checker would have checked of them (a complete data field, an external file inside the model's folder)
  is checked when the model is loaded (load.py);
- the lifted region (region.py) sees them as typed graph inputs too, and the range prover reads the few values it
  needs (the sampling grids in the cone of gather indices, never a conv weight) through `Weights.read`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from . import wire

STORED_WEIGHT_BYTES = 1 << 12  # embedded tensors above this are stored (never copied); every external tensor is


_BITS = {getattr(onnx.TensorProto, name): bits for name, bits in (
    ("FLOAT", 32), ("UINT8", 8), ("INT8", 8), ("UINT16", 16), ("INT16", 16), ("INT32", 32), ("INT64", 64),
    ("BOOL", 8), ("FLOAT16", 16), ("DOUBLE", 64), ("UINT32", 32), ("UINT64", 64), ("COMPLEX64", 64),
    ("COMPLEX128", 128), ("BFLOAT16", 16), ("FLOAT8E4M3FN", 8), ("FLOAT8E4M3FNUZ", 8), ("FLOAT8E5M2", 8),
    ("FLOAT8E5M2FNUZ", 8), ("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("FLOAT8E8M0", 8), ("UINT2", 2),
    ("INT2", 2)) if hasattr(onnx.TensorProto, name)}


@dataclass
class Weights:
    """The stored tensors of a loaded model (see the module docstring).

    `tensors` maps each tensor's name in the graph (an initializer's, or a Constant node's output) to its original
    TensorProto: embedded data, or an external reference resolved against `base_dir`, the input model's folder.
    `constants` names those that are a Constant node's value; `loaded` those whose values were read, in order;
    `scan` is the scan of the file the model was loaded from (`wire.scan_model`; empty without one).
    """

    base_dir: Path | None
    tensors: dict[str, onnx.TensorProto] = field(default_factory=dict)
    constants: set[str] = field(default_factory=set)
    scan: wire.ModelScan = field(default_factory=wire.ModelScan, repr=False)
    loaded: list[str] = field(default_factory=list)
    _values: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def read(self, name: str) -> np.ndarray:
        """The values of stored tensor `name` (read-only; read from disk or decoded once, then remembered)."""
        array = self._values.get(name)
        if array is None:
            src = self.tensors[name]
            if _is_external(src):  # older onnx fills raw_data in while reading: never into the original reference
                copy = onnx.TensorProto()
                copy.CopyFrom(src)
                src = copy
            base = "" if self.base_dir is None else str(self.base_dir)
            array = onnx.numpy_helper.to_array(src, base_dir=base)
            if array.flags.writeable:  # (a view of protobuf's bytes is read-only already; copying it costs)
                array.setflags(write=False)
            self._values[name] = array
            self.loaded.append(name)
        return array

    def raw_size(self, name: str) -> int:
        """The length of a stored tensor's raw data (`wire.ModelScan.raw_size`)."""
        return self.scan.raw_size(name, self.tensors[name])

    def message_size(self, name: str) -> int:
        """The serialized size of a stored tensor (what the writer announces before it serializes the tensor)."""
        return message_size(self.tensors[name], self.raw_size(name))

    @property
    def external(self) -> bool:
        return any(_is_external(t) for t in self.tensors.values())

    def sources(self) -> set[Path]:
        """The external data files the model reads, resolved."""
        base = self.base_dir if self.base_dir is not None else Path()
        return {(base / _external_ref(t)[0]).resolve() for t in self.tensors.values() if _is_external(t)}


def split_weights(model: onnx.ModelProto, base_dir: str | Path | None, scan: wire.ModelScan | None = None
                  ) -> Weights:
    """Which tensors of `model` are stored (see `Weights`); nothing is read or copied. `scan`: the scan of the file
    `model` was just loaded from (`wire.scan_model`), which tells the lengths of raw data and where the large
    Constant nodes are (else every node is looked at)."""
    weights = Weights(None if base_dir is None else Path(base_dir), scan=scan or wire.ModelScan())
    for t in model.graph.initializer:
        if _is_external(t) or _is_heavy_embedded(t):
            weights.tensors[t.name] = t
    declared = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    for node in large_nodes(model, scan):
        value = stored_constant(node)
        if value is not None and node.output[0] not in declared:  # (a clash stays for the checker to see)
            weights.tensors[node.output[0]] = value
            weights.constants.add(node.output[0])
    return weights


def large_nodes(model: onnx.ModelProto, scan: wire.ModelScan | None) -> Iterator[onnx.NodeProto]:
    """The nodes that may hold a stored Constant: those the file's scan found large, or every node without one."""
    nodes = model.graph.node
    if scan is not None and scan.complete and (not scan.large_nodes or scan.large_nodes[-1] < len(nodes)):
        return (nodes[k] for k in scan.large_nodes)
    return iter(nodes)


def stored_constant(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The value of a Constant node whose only attribute is an embedded tensor above `STORED_WEIGHT_BYTES`."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    a = node.attribute[0]
    if a.name != "value" or a.type != onnx.AttributeProto.TENSOR or len(node.output) != 1:
        return None
    return a.t if _is_heavy_embedded(a.t) else None


def skeleton_bytes(model: onnx.ModelProto, weights: Weights) -> bytes:
    """The serialized skeleton of `model` for onnx.checker and shape inference: stored tensors are typed graph
    inputs (their Constant nodes left out), small external ones are read in (shape inference needs the values of
    shape-like constants). Built record by record from the model's own messages: nothing is copied."""
    return b"".join(wire.serialized(wire.model_pieces(model, skeleton_graph(model.graph, weights))))


def skeleton_graph(graph: onnx.GraphProto, weights: Weights) -> Iterator[wire.Piece]:
    """The graph records of the skeleton (see `skeleton_bytes`), in field order."""
    stored = weights.tensors
    for node in graph.node:
        if not (node.op_type == "Constant" and node.output and node.output[0] in weights.constants):
            yield wire.record(wire.GRAPH_NODE, node)
    yield from wire.graph_name(graph)
    declared = {i.name for i in graph.input}
    inputs = []
    for t in graph.initializer:
        original = stored.get(t.name)
        if original is None:
            yield wire.record(wire.GRAPH_INITIALIZER, t)
        elif _is_external(original) and not _is_large(original) and weights.base_dir is not None:
            yield wire.record(wire.GRAPH_INITIALIZER, _read_in(original, weights.base_dir))
        elif t.name not in declared:
            inputs.append(_typed_input(t.name, original))
    inputs += [_typed_input(name, stored[name]) for name in sorted(weights.constants) if name in stored]
    yield from wire.graph_rest(graph, extra_inputs=inputs, drop_value_info=weights.constants)


def _typed_input(name: str, t: onnx.TensorProto) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims))


def _nbytes(t: onnx.TensorProto) -> int | None:
    return elem_nbytes(t.data_type, t.dims)


def elem_nbytes(elem_type: int, shape) -> int | None:
    """Bytes of a tensor of this element type and (static) shape; None for an element type of unknown size."""
    bits = _BITS.get(elem_type)
    return None if bits is None else (math.prod(shape) * bits + 7) // 8


def message_size(t: onnx.TensorProto, raw: int) -> int:
    """The serialized size of `t`, whose raw_data is `raw` bytes long, without serializing (or copying) its data:
    the other fields' size plus the raw_data record's (its tag, one byte; its length as a varint; its bytes)."""
    others = onnx.TensorProto()
    for fd in onnx.TensorProto.DESCRIPTOR.fields:
        if fd.name == "raw_data":
            continue
        if wire.is_repeated(fd):
            if len(getattr(t, fd.name)):
                getattr(others, fd.name).extend(getattr(t, fd.name))
        elif t.HasField(fd.name):
            if fd.message_type is not None:
                getattr(others, fd.name).CopyFrom(getattr(t, fd.name))
            else:
                setattr(others, fd.name, getattr(t, fd.name))
    return others.ByteSize() + (1 + len(wire.varint(raw)) + raw if t.HasField("raw_data") else 0)


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
