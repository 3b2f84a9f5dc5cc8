"""A model's protobuf wire format, read and written record by record: the one place that knows it.

Reading (`scan_model`): what a model file names and holds, from its field headers only (memory-mapped, no tensor's
bytes are read: the real BiRefNet-lite 1024 export, 221 MB and 18,813 nodes, is scanned in a few hundredths of a
second, where `onnx.load` takes a few tenths): the external data files its initializers name (io_check.py refuses
a write onto them before any work), its graph inputs (verify.py), and the length of every stored tensor's raw
data (weights.py: protobuf hands out a copy of a bytes field on every access, even to measure it).

Writing (`model_pieces`): the two things that serialize a whole model, the skeleton onnx.checker and shape
inference read (weights.py) and the written file (write.py). Protobuf lets a message's repeated fields be written
one record at a time, so a model is serialized from its own messages without building a second ModelProto
(copying every node and weight) and, for the file, with each stored tensor serialized only while it is written. A
piece is a record's bytes, or a `Framed` record whose message is serialized when written.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import Message

# field numbers of onnx.proto: ModelProto.graph, GraphProto.node / name / initializer
MODEL_GRAPH, GRAPH_NODE, GRAPH_NAME, GRAPH_INITIALIZER = 7, 1, 2, 5


# the scan's field numbers of onnx.proto (GraphProto.input, TensorProto.name / raw_data / external_data,
# NodeProto.output / attribute, AttributeProto.t, StringStringEntryProto.key / value) and protobuf's wire types
_GRAPH_INPUT, _TENSOR_NAME, _TENSOR_RAW_DATA, _TENSOR_EXTERNAL_DATA = 11, 8, 9, 13
_NODE_OUTPUT, _NODE_ATTRIBUTE, _ATTRIBUTE_T = 2, 5, 5
_ENTRY_KEY, _ENTRY_VALUE = 1, 2
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_SMALL = 1 << 20  # longest string / message the scan reads (names, locations, input declarations)


class _Truncated(Exception):
    pass


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    shift = result = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise _Truncated


def _fields(buf, pos: int, end: int) -> Iterable[tuple[int, int, int, int]]:
    """(field number, wire type, start, length) of each length-delimited field of the message in `buf[pos:end]`
    (the others are skipped); the field's bytes are `buf[start:start + length]`, never touched here."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        wire = key & 7
        if wire == _VARINT:
            _, pos = _varint(buf, pos, end)
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        elif wire == _LEN:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise _Truncated
            yield key >> 3, wire, pos, n
            pos += n
        else:
            raise _Truncated
    if pos != end:
        raise _Truncated


@dataclass
class ModelScan:
    """What the wire-format scan of a model file found (see `scan_model`)."""

    locations: list[str] = field(default_factory=list)  # external data files named by main-graph initializers
    inputs: list[bytes] = field(default_factory=list)  # serialized ValueInfoProtos of the graph inputs
    initializers: set[str] = field(default_factory=set)  # initializer names
    raw_sizes: dict[str, int] = field(default_factory=dict)  # raw_data length of each initializer, and of each
    # Constant node's value (by its output's name) of a node record over STORED_SCAN_BYTES
    large_nodes: list[int] = field(default_factory=list)  # positions of those node records in the graph
    complete: bool = False  # the whole file parsed as fields and it has a graph

    def raw_size(self, name: str, t: onnx.TensorProto) -> int:
        """len(t.raw_data) of tensor `name` (an initializer, or a large Constant's value), from the scan where it
        measured it: reading the field would copy it."""
        size = self.raw_sizes.get(name)
        return len(t.raw_data) if size is None else size

    def feed_inputs(self) -> list:
        """The graph inputs a caller feeds (initializers excluded), as ValueInfoProtos."""
        inputs = [onnx.ValueInfoProto.FromString(b) for b in self.inputs]
        return [vi for vi in inputs if vi.name not in self.initializers]


STORED_SCAN_BYTES = 1 << 12  # node records above this are looked into for a Constant's raw data
_SCANS: dict[tuple, ModelScan] = {}  # (inode, size, mtime) -> scan: the CLI and patch() both check one command


def scan_model(model_path: str | Path) -> ModelScan:
    """`_scan_model`, remembered for an unchanged file (same device, inode, size and modification time)."""
    try:
        st = os.stat(model_path)
    except OSError:
        return _scan_model(model_path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _SCANS:
        _SCANS[key] = _scan_model(model_path)
    return _SCANS[key]


def _scan_model(model_path: str | Path) -> ModelScan:
    """What the module docstring says a scan finds, read from the file's wire format. A malformed file gives what
    was found before the fault, and `complete=False` (`load_model` then names the problem)."""
    found = ModelScan()
    try:
        with open(model_path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                return found
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                graphs = 0
                for number, _, start, n in _fields(buf, 0, size):
                    if number != MODEL_GRAPH:
                        continue
                    graphs += 1
                    nodes = 0
                    for g_number, _, g_start, g_n in _fields(buf, start, start + n):
                        nodes += g_number == GRAPH_NODE
                        if g_number == _GRAPH_INPUT and g_n <= _SMALL:
                            found.inputs.append(bytes(buf[g_start:g_start + g_n]))
                        elif g_number == GRAPH_INITIALIZER:
                            _scan_initializer(buf, g_start, g_start + g_n, found)
                        elif g_number == GRAPH_NODE and g_n > STORED_SCAN_BYTES:
                            found.large_nodes.append(nodes - 1)
                            _scan_node(buf, g_start, g_start + g_n, found)
                found.complete = graphs == 1  # (two graph records would merge: positions would not hold)
    except (_Truncated, OSError, ValueError):
        found.complete = False
    found.locations = sorted(set(found.locations))
    return found


def _scan_initializer(buf, start: int, end: int, found: ModelScan) -> None:
    name, raw = None, 0
    for number, _, t_start, t_n in _fields(buf, start, end):
        if number == _TENSOR_NAME and t_n <= _SMALL:
            name = bytes(buf[t_start:t_start + t_n]).decode("utf-8", "replace")
            found.initializers.add(name)
        elif number == _TENSOR_RAW_DATA:
            raw = t_n
        elif number == _TENSOR_EXTERNAL_DATA and t_n <= _SMALL:
            entry = {e_number: bytes(buf[e_start:e_start + e_n])
                     for e_number, _, e_start, e_n in _fields(buf, t_start, t_start + t_n)}
            if entry.get(_ENTRY_KEY) == b"location" and _ENTRY_VALUE in entry:
                found.locations.append(entry[_ENTRY_VALUE].decode("utf-8", "replace"))
    if name is not None:
        found.raw_sizes[name] = raw


def _scan_node(buf, start: int, end: int, found: ModelScan) -> None:
    """The raw data length of a large node's tensor attribute, by the node's first output (a Constant's value)."""
    output, raw = None, None
    for number, _, n_start, n_n in _fields(buf, start, end):
        if number == _NODE_OUTPUT and output is None and n_n <= _SMALL:
            output = bytes(buf[n_start:n_start + n_n]).decode("utf-8", "replace")
        elif number == _NODE_ATTRIBUTE:
            for a_number, _, a_start, a_n in _fields(buf, n_start, n_start + n_n):
                if a_number == _ATTRIBUTE_T:
                    raw = next((t_n for t_number, _, _, t_n in _fields(buf, a_start, a_start + a_n)
                                if t_number == _TENSOR_RAW_DATA), 0)
    if output is not None and raw is not None:
        found.raw_sizes[output] = raw


def varint(n: int) -> bytes:
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


_ONE_BYTE = [bytes((n,)) for n in range(0x80)]


def _header(number: int, size: int) -> bytes:
    return varint(number << 3 | 2) + varint(size)  # wire type 2: length-delimited


@dataclass(frozen=True)
class Framed:
    """A record whose message is serialized only when it is written (a stored tensor: one at a time)."""

    header: bytes
    message: Message
    size: int

    def __len__(self) -> int:
        return len(self.header) + self.size


Piece = bytes | Framed


def record(number: int, message: Message) -> bytes:
    data = message.SerializeToString()
    return _header(number, len(data)) + data


def framed(number: int, message: Message, size: int) -> Framed:
    """A record of `message`, whose serialized size is `size` (checked when it is written)."""
    return Framed(_header(number, size), message, size)


def graph_name(graph: onnx.GraphProto) -> Iterator[bytes]:
    if graph.name:
        yield onnx.GraphProto(name=graph.name).SerializeToString()


def graph_rest(graph: onnx.GraphProto, extra_inputs: Iterable[onnx.ValueInfoProto] = (),
               drop_value_info: set[str] | frozenset[str] = frozenset()) -> Iterator[bytes]:
    """Every field of `graph` but its nodes, name and initializers (inputs, outputs, value_info, ...), as one piece;
    `extra_inputs` are declared after the graph's own inputs, value_info of `drop_value_info` is left out."""
    rest = onnx.GraphProto()
    copy_fields(graph, rest, skip={"node", "name", "initializer", "value_info"})
    rest.input.extend(extra_inputs)
    rest.value_info.extend(vi for vi in graph.value_info if vi.name not in drop_value_info)
    yield rest.SerializeToString()


def model_pieces(model: onnx.ModelProto, graph: Iterable[Piece]) -> list[Piece]:
    """The pieces of `model` with `graph` (pieces of its GraphProto) as its graph: the model's other fields, then
    the graph record, whose length is known before any Framed message is serialized."""
    top = onnx.ModelProto()
    copy_fields(model, top, skip={"graph"})
    pieces = list(graph)
    return [top.SerializeToString(), _header(MODEL_GRAPH, sum(map(len, pieces))), *pieces]


def serialized(pieces: Iterable[Piece], chunk: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of `pieces`, in chunks of about `chunk` bytes (records are small and many: one write a record
    would cost more than the writing), each Framed message serialized as it comes and checked against its
    announced size."""
    run: list[bytes] = []
    size = 0
    for piece in pieces:
        if isinstance(piece, bytes):
            run.append(piece)
            size += len(piece)
            if size < chunk:
                continue
            piece = None
        if run:
            yield b"".join(run)
            run, size = [], 0
        if piece is None:
            continue
        data = piece.message.SerializeToString()
        if len(data) != piece.size:
            raise ValueError(f"'{getattr(piece.message, 'name', '?')}' changed size while being written")
        yield piece.header
        yield data
    if run:
        yield b"".join(run)


def copy_fields(src, dst, skip: set[str]) -> None:
    """Copy every set field of one protobuf message into another of the same type, except those in `skip`."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if is_repeated(fd):
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def is_repeated(fd) -> bool:
    """Whether a protobuf field descriptor is repeated (newer protobuf has the attribute, older ones the label)."""
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
