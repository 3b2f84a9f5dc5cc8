"""Stored tensors: the one form weights take on the way through `patch`, and the one way their values are read.

A model is loaded without its weights' bytes (load.py): external data stays on disk, and the raw data of every
embedded initializer larger than `STORED_WEIGHT_BYTES` and of every Constant node's value larger than that stays
in the model file (the file's scan tells where: wire.py). These are the *stored tensors* (`Weights`): their
protobuf stays where it is in the loaded model, holding no data, is never copied, and is written by the writer
(write.py), which copies their bytes from the input's files into the output's. Everything else sees a stored
tensor as a typed name only:

- onnx.checker and shape inference see the model's *skeleton* (`skeleton_bytes`): stored tensors are typed graph
  inputs there (shape inference does not need their values; past 2 GB it could not take them; and the checker's
  work does not grow with the weights: the real BiRefNet-lite 1024 export's skeleton is 3 MB of its 221 MB);
  what the checker would have checked of them (a complete data field, an external file inside the model's folder)
  is checked when the model is loaded (load.py);
- the lifted region (region.py) sees them as typed graph inputs too, and the range prover reads the few values it
  needs (the sampling grids in the cone of gather indices, never a conv weight) through `Weights.read`.

A model built in memory (`split_weights` without a source file) has the same stored tensors, their data in its
protobuf.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..base.errors import SurgeonError
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
    TensorProto: an external reference resolved against `base_dir`, the input model's folder, or an embedded
    tensor whose raw data is the `FileBytes` of `source` (the model file, as `source_key` tells it: `wire.file_key`) in
    `data` (or, for a model built in memory, in its protobuf). `constants` names those that are a Constant node's
    value; `loaded` those whose values were read, in order.
    """

    base_dir: Path | None
    tensors: dict[str, onnx.TensorProto] = field(default_factory=dict)
    constants: set[str] = field(default_factory=set)
    source: Path | None = None
    source_key: tuple = ()
    data: dict[str, wire.FileBytes] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)
    inputs: dict[Path, tuple] = field(default_factory=dict)  # every file read (model, external data) -> file_key
    _values: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def read(self, name: str) -> np.ndarray:
        """The values of stored tensor `name` (read-only; read from disk or decoded once, then remembered)."""
        array = self._values.get(name)
        if array is None:
            src = self.tensors[name]
            if is_external(src) or name in self.data:  # the data goes into a copy, never into the original
                copy = onnx.TensorProto()
                copy.CopyFrom(src)
                if name in self.data:
                    with self.open_source() as fh:
                        copy.raw_data = self.read_bytes(fh, self.data[name])
                src = copy
            base = "" if self.base_dir is None else str(self.base_dir)
            array = onnx.numpy_helper.to_array(src, base_dir=base)
            if array.flags.writeable:  # (a view of protobuf's bytes is read-only already; copying it costs)
                array.setflags(write=False)
            self._values[name] = array
            self.loaded.append(name)
        return array

    def data_length(self, name: str) -> int:
        """The length of an embedded stored tensor's raw data (without reading it)."""
        span = self.data.get(name)
        return span.length if span is not None else len(self.tensors[name].raw_data)

    @contextmanager
    def open_source(self) -> Iterator:
        """The model file the stored tensors' data is in, opened unbuffered; refused if it is not the file that was
        loaded (changed, or replaced, since): its bytes would not be those tensors'."""
        assert self.source is not None
        with open(self.source, "rb", buffering=0) as fh:
            self.check_source(fh)
            yield fh

    def check_source(self, fh) -> None:
        """Refuse an open `source` that is not the file the model was loaded from, unchanged (`wire.file_key`)."""
        _refuse_changed(self.source, self.source_key, os.fstat(fh.fileno()))

    def check_unchanged(self) -> None:
        """Refuse (nothing is written) if any file the model was read from, the model itself or one of its external
        data files, is not the file that was loaded, unchanged: the output's bytes come from them (copied, or read
        again by the verification), so an output made while one changed would be neither the old model patched
        nor the new one. The writer asks this just before the output takes its place."""
        for path, key in self.inputs.items():
            try:
                now = os.stat(path)
            except OSError:
                now = None
            _refuse_changed(path, key, now)

    def read_bytes(self, fh, where: wire.FileBytes) -> bytes:
        """The bytes of `where` from the open `source` (`open_source`)."""
        data = os.pread(fh.fileno(), where.length, where.offset)
        if len(data) != where.length:
            raise SurgeonError(self.source, "changed while it was being patched (it is shorter now)")
        return data

    @property
    def external(self) -> bool:
        return any(is_external(t) for t in self.tensors.values())

    def sources(self) -> set[Path]:
        """The external data files the model reads, resolved."""
        base = self.base_dir if self.base_dir is not None else Path()
        return {(base / external_ref(t)[0]).resolve() for t in self.tensors.values() if is_external(t)}

    def named_sources(self) -> list[Path]:
        """The external data files as the model names them (its `location`s, links not followed), each once: what
        the output's data file is named after (`write.external_data_path`). Not `sources()`: a `model.onnx_data`
        that is a link to `blob.bin` is still transformers.js's name, and the planner (io_check) reads the names
        from the file as written, so the writer must too, or it writes a name nobody checked."""
        base = self.base_dir if self.base_dir is not None else Path()
        return sorted({base / external_ref(t)[0] for t in self.tensors.values() if is_external(t)})


def _refuse_changed(path: Path | None, key: tuple, now: os.stat_result | None) -> None:
    """The one test of "the same file, unchanged" (`wire.file_key`, which a restored mtime cannot fool)."""
    if now is None:
        raise SurgeonError(path, "was removed while it was being patched; nothing was written")
    if wire.file_key(now) != key:
        raise SurgeonError(path, "changed while it was being patched; nothing was written",
                           "run again once nothing writes to it")


def left_out(scan: wire.ModelScan) -> tuple[dict[int, wire.RawData], dict[int, wire.RawData]]:
    """The raw data load.py leaves in the file (by initializer position, by node position): every piece over
    `STORED_WEIGHT_BYTES`. Those of tensors that are not stored after all are read back (`split_weights`)."""
    return ({k: d for k, d in scan.initializer_data.items() if d.length > STORED_WEIGHT_BYTES},
            {k: d for k, d in scan.constant_data.items() if d.length > STORED_WEIGHT_BYTES})


def split_weights(model: onnx.ModelProto, base_dir: str | Path | None, scan: wire.ModelScan | None = None,
                  source: str | Path | None = None) -> Weights:
    """Which tensors of `model` are stored (see `Weights`); nothing is read or copied. `scan`: the scan of the file
    `model` was just loaded from (`wire.scan_model`), which tells where the large Constant nodes are (else every
    node is looked at); `source`: that file, if `model` was parsed from it without the raw data `left_out(scan)`
    names (a piece of it whose tensor is not stored, a Constant that is not plain, say, is read back in)."""
    weights = Weights(None if base_dir is None else Path(base_dir))
    initializers, nodes = model.graph.initializer, model.graph.node
    cut_initializers, cut_nodes = left_out(scan) if source is not None and scan is not None else ({}, {})
    if source is not None:
        weights.source, weights.source_key = Path(source), scan.key
    declared = {t.name for t in initializers} | {i.name for i in model.graph.input}

    def plain_constant(k: int) -> onnx.TensorProto | None:
        value = stored_constant(nodes[k], k in cut_nodes)
        return value if value is not None and nodes[k].output[0] not in declared else None  # (a clash stays
        # for the checker to see)

    back = [(initializers[k], cut_initializers.pop(k)) for k in list(cut_initializers)
            if not _is_heavy_embedded(initializers[k], True)]
    back += [(nodes[k].attribute[0].t, cut_nodes.pop(k)) for k in list(cut_nodes) if plain_constant(k) is None]
    if back:
        with weights.open_source() as fh:
            for t, raw in back:
                t.raw_data = weights.read_bytes(fh, raw.file_bytes)
    for k, t in enumerate(initializers):
        if is_external(t) or _is_heavy_embedded(t, k in cut_initializers):
            weights.tensors[t.name] = t
            if k in cut_initializers:
                weights.data[t.name] = cut_initializers[k].file_bytes
    for k in large_nodes(model, scan):
        value = plain_constant(k)
        if value is not None:
            name = nodes[k].output[0]
            weights.tensors[name] = value
            weights.constants.add(name)
            if k in cut_nodes:
                weights.data[name] = cut_nodes[k].file_bytes
    return weights


def large_nodes(model: onnx.ModelProto, scan: wire.ModelScan | None) -> Iterator[int]:
    """The positions of the nodes that may hold a stored Constant: those the file's scan found large, or every
    node without one."""
    n = len(model.graph.node)
    if scan is not None and scan.complete and (not scan.large_nodes or scan.large_nodes[-1] < n):
        return iter(scan.large_nodes)
    return iter(range(n))


def stored_constant(node: onnx.NodeProto, left_out: bool = False) -> onnx.TensorProto | None:
    """The value of a Constant node whose only attribute is an embedded tensor above `STORED_WEIGHT_BYTES`
    (`left_out`: its raw data was left in the file)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    a = node.attribute[0]
    if a.name != "value" or a.type != onnx.AttributeProto.TENSOR or len(node.output) != 1:
        return None
    return a.t if _is_heavy_embedded(a.t, left_out) else None


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
        elif is_external(original) and not _is_large(original) and weights.base_dir is not None:
            yield wire.record(wire.GRAPH_INITIALIZER, _read_in(original, weights.base_dir))
        elif t.name not in declared:
            inputs.append(_typed_input(t.name, original))
    inputs += [_typed_input(name, stored[name]) for name in sorted(weights.constants) if name in stored]
    yield from wire.graph_rest(graph, extra_inputs=inputs, drop_value_info=weights.constants)


def _typed_input(name: str, t: onnx.TensorProto) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, t.data_type, list(t.dims))


def tensor_nbytes(t: onnx.TensorProto) -> int | None:
    return elem_nbytes(t.data_type, t.dims)


def elem_nbytes(elem_type: int, shape) -> int | None:
    """Bytes of a tensor of this element type and (static) shape; None for an element type of unknown size."""
    bits = _BITS.get(elem_type)
    return None if bits is None else (math.prod(shape) * bits + 7) // 8


def is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def _is_large(t: onnx.TensorProto) -> bool:
    n = tensor_nbytes(t)
    return n is None or n > STORED_WEIGHT_BYTES


def _is_heavy_embedded(t: onnx.TensorProto, left_out: bool = False) -> bool:
    """An embedded tensor with raw data (in its protobuf, or `left_out` in the file) over `STORED_WEIGHT_BYTES`."""
    return (not is_external(t) and (left_out or t.HasField("raw_data")) and _is_large(t)
            and tensor_nbytes(t) is not None)


def external_ref(t: onnx.TensorProto) -> tuple[str, int, int | None]:
    ref = {e.key: e.value for e in t.external_data}
    length = ref.get("length")
    return ref.get("location", ""), int(ref.get("offset") or 0), None if length in (None, "") else int(length)


def _read_in(t: onnx.TensorProto, base_dir: Path) -> onnx.TensorProto:
    location, offset, length = external_ref(t)
    with open(base_dir / location, "rb") as fh:
        fh.seek(offset)
        data = fh.read() if length is None else fh.read(length)
    out = onnx.TensorProto()
    out.CopyFrom(t)
    del out.external_data[:]
    out.data_location = onnx.TensorProto.DEFAULT
    out.raw_data = data
    return out
