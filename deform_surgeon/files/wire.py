"""A model's protobuf wire format, read and written record by record: the one place that knows it.

Reading (`scan_model`): what a model file names and holds, from its field headers only (memory-mapped, no tensor's
bytes are read: the real BiRefNet-lite 1024 export, 221 MB and 18,813 nodes, is scanned in a few hundredths of a
second, where `onnx.load` takes a few tenths): the external data files its initializers name (io_check.py refuses
a write onto them before any work), its graph inputs (verify.py), and where the raw data of every initializer and
of every large node's tensor attribute is in the file (`RawData`). `without_data` gives the file's bytes with
chosen raw data left out, every enclosing record re-framed: what load.py parses, so a stored tensor's bytes are
never read into memory (weights.py).

Writing (`model_pieces`): the two things that serialize a whole model, the skeleton onnx.checker and shape
inference read (weights.py) and the written file (write.py). Protobuf lets a message's repeated fields be written
one record at a time, so a model is serialized from its own messages without building a second ModelProto
(copying every node and weight). A piece is a record's bytes, or a `FileBytes` of the input file: a stored tensor's raw
data, which the writer copies from file to file (`tensor_record`, `constant_record`).
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
    """(field number, start of its record, start, length) of each length-delimited field of the message in
    `buf[pos:end]` (the others are skipped); the field's bytes are `buf[start:start + length]`, never touched here."""
    while pos < end:
        head = pos
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
            yield key >> 3, head, pos, n
            pos += n
        else:
            raise _Truncated
    if pos != end:
        raise _Truncated


Record = tuple[int, int, int, int]  # (field number, start of the record, start of its bytes, end)


@dataclass(frozen=True)
class RawData:
    """Where a tensor's raw data is in a model file: `length` bytes at `offset`; `records` are the nested records
    from the graph's down to the raw data's own (what `without_data` re-frames and drops)."""

    offset: int
    length: int
    records: tuple[Record, ...]

    @property
    def file_bytes(self) -> FileBytes:
        """The bytes alone, as the writer and `Weights` take them."""
        return FileBytes(self.offset, self.length)


@dataclass
class ModelScan:
    """What the wire-format scan of a model file found (see `scan_model`)."""

    locations: list[str] = field(default_factory=list)  # external data files named by main-graph initializers
    inputs: list[bytes] = field(default_factory=list)  # serialized ValueInfoProtos of the graph inputs
    initializers: set[str] = field(default_factory=set)  # initializer names
    initializer_data: dict[int, RawData] = field(default_factory=dict)  # initializer position -> its raw data
    large_nodes: list[int] = field(default_factory=list)  # positions of the node records over STORED_SCAN_BYTES
    constant_data: dict[int, RawData] = field(default_factory=dict)  # position of such a node with one attribute,
    # a tensor -> that tensor's raw data
    complete: bool = False  # the whole file parsed as fields and it has a graph
    key: tuple = ()  # the scanned file's `file_key`: the same file, unchanged

    def feed_inputs(self) -> list:
        """The graph inputs a caller feeds (initializers excluded), as ValueInfoProtos."""
        inputs = [onnx.ValueInfoProto.FromString(b) for b in self.inputs]
        return [vi for vi in inputs if vi.name not in self.initializers]


STORED_SCAN_BYTES = 1 << 12  # node records above this are looked into for a Constant's raw data
_SCANS: dict[tuple, ModelScan] = {}  # file_key -> scan: the CLI and patch() both check one command


def file_key(st: os.stat_result) -> tuple:
    """What tells one unchanged file: device, inode, size, modification time and the inode's change time (which
    any write, rename or `touch -r` moves, and no user can set back: an edit whose mtime was restored is seen)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def scan_model(model_path: str | Path) -> ModelScan:
    """`_scan_model`, remembered for an unchanged file (`file_key`)."""
    try:
        key = file_key(os.stat(model_path))
    except OSError:
        return _scan_model(model_path)
    if key not in _SCANS:
        _SCANS[key] = _scan_model(model_path)
    return _SCANS[key]


def _scan_model(model_path: str | Path) -> ModelScan:
    """What the module docstring says a scan finds, read from the file's wire format. A malformed file gives what
    was found before the fault, and `complete=False` (`load_model` then names the problem)."""
    found = ModelScan()
    try:
        with open(model_path, "rb") as fh:
            st = os.fstat(fh.fileno())
            found.key = file_key(st)
            if st.st_size == 0:
                return found
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                graphs = 0
                for number, head, start, n in _fields(buf, 0, st.st_size):
                    if number != MODEL_GRAPH:
                        continue
                    graphs += 1
                    graph = (number, head, start, start + n)
                    nodes = initializers = 0
                    for g_number, g_head, g_start, g_n in _fields(buf, start, start + n):
                        record = (g_number, g_head, g_start, g_start + g_n)
                        if g_number == GRAPH_NODE:
                            nodes += 1
                            if g_n > STORED_SCAN_BYTES:
                                found.large_nodes.append(nodes - 1)
                                _scan_node(buf, (graph, record), found, nodes - 1)
                        elif g_number == _GRAPH_INPUT and g_n <= _SMALL:
                            found.inputs.append(bytes(buf[g_start:g_start + g_n]))
                        elif g_number == GRAPH_INITIALIZER:
                            _scan_initializer(buf, (graph, record), found, initializers)
                            initializers += 1
                found.complete = graphs == 1  # (two graph records would merge: positions would not hold)
    except (_Truncated, OSError, ValueError):
        found.complete = False
    found.locations = sorted(set(found.locations))
    return found


def _raw_data(buf, records: tuple[Record, ...]) -> RawData | None:
    """The raw data of the tensor whose record is `records[-1]`, if it has exactly one raw data field (protobuf
    keeps the last of several: such a tensor is left to protobuf to parse)."""
    _, _, start, end = records[-1]
    found = [(number, head, t_start, t_start + t_n) for number, head, t_start, t_n in _fields(buf, start, end)
             if number == _TENSOR_RAW_DATA]
    if len(found) != 1:
        return None
    _, _, t_start, t_end = found[0]
    return RawData(t_start, t_end - t_start, (*records, found[0]))


def _scan_initializer(buf, records: tuple[Record, ...], found: ModelScan, position: int) -> None:
    _, _, start, end = records[-1]
    for number, _, t_start, t_n in _fields(buf, start, end):
        if number == _TENSOR_NAME and t_n <= _SMALL:
            found.initializers.add(bytes(buf[t_start:t_start + t_n]).decode("utf-8", "replace"))
        elif number == _TENSOR_EXTERNAL_DATA and t_n <= _SMALL:
            entry = {e_number: bytes(buf[e_start:e_start + e_n])
                     for e_number, _, e_start, e_n in _fields(buf, t_start, t_start + t_n)}
            if entry.get(_ENTRY_KEY) == b"location" and _ENTRY_VALUE in entry:
                found.locations.append(entry[_ENTRY_VALUE].decode("utf-8", "replace"))
    data = _raw_data(buf, records)
    if data is not None:
        found.initializer_data[position] = data


def _scan_node(buf, records: tuple[Record, ...], found: ModelScan, position: int) -> None:
    """The raw data of a large node's tensor attribute, if the node has one attribute and it holds a tensor (what a
    stored Constant is: weights.py)."""
    _, _, start, end = records[-1]
    attributes = [(number, head, a_start, a_start + a_n) for number, head, a_start, a_n in _fields(buf, start, end)
                  if number == _NODE_ATTRIBUTE]
    if len(attributes) != 1:
        return
    _, _, a_start, a_end = attributes[0]
    tensors = [(number, head, t_start, t_start + t_n) for number, head, t_start, t_n in _fields(buf, a_start, a_end)
               if number == _ATTRIBUTE_T]
    if len(tensors) == 1:
        data = _raw_data(buf, (*records, attributes[0], tensors[0]))
        if data is not None:
            found.constant_data[position] = data


def without_data(buf, size: int, left_out: Iterable[RawData]) -> bytes:
    """The bytes of the model file in `buf` (`size` bytes long) with the raw data records of `left_out` dropped and
    every record that held one re-framed: the same model, but for those tensors' data."""
    chains = [d.records for d in sorted(left_out, key=lambda d: d.offset)]
    return b"".join(_without(buf, 0, size, chains))


def _without(buf, start: int, end: int, chains: list[tuple[Record, ...]]) -> Iterator[bytes]:
    pos, k = start, 0
    while k < len(chains):
        number, head, inner_start, inner_end = chains[k][0]
        j = k
        while j < len(chains) and chains[j][0][1] == head:
            j += 1
        yield buf[pos:head]
        if len(chains[k]) > 1:  # a record holding what is left out: re-framed (else it is what is left out)
            inner = b"".join(_without(buf, inner_start, inner_end, [c[1:] for c in chains[k:j]]))
            yield _header(number, len(inner)) + inner
        pos, k = inner_end, j
    yield buf[pos:end]


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
class FileBytes:
    """`length` bytes at `offset` of the input model file (a stored tensor's raw data), or of `path` (an external
    data file whose tensor is written into the model): the writer copies them from file to file. (Not
    intervals.Interval, which bounds a tensor's values.)"""

    offset: int
    length: int
    path: Path | None = None

    def __len__(self) -> int:
        return self.length


Piece = bytes | FileBytes


def record(number: int, message: Message) -> bytes:
    data = message.SerializeToString()
    return _header(number, len(data)) + data


def tensor_record(number: int, tensor: onnx.TensorProto, data: FileBytes) -> list[Piece]:
    """The record of `tensor` (which holds no raw data) with `data` as its raw data."""
    bare = onnx.TensorProto()
    bare.CopyFrom(tensor)
    bare.raw_data = b""
    return _with_data(number, bare.SerializeToString(), (_TENSOR_RAW_DATA,), data)


def constant_record(node: onnx.NodeProto, data: FileBytes) -> list[Piece]:
    """The graph's record of a Constant node whose one attribute's tensor (which holds no raw data) has `data` as
    its raw data."""
    bare = onnx.NodeProto()
    bare.CopyFrom(node)
    bare.attribute[0].t.raw_data = b""
    return _with_data(GRAPH_NODE, bare.SerializeToString(), (_NODE_ATTRIBUTE, _ATTRIBUTE_T, _TENSOR_RAW_DATA), data)


def _with_data(number: int, message: bytes, path: tuple[int, ...], data: FileBytes) -> list[Piece]:
    """The record of `message` (serialized, with an empty record at the field path `path`) with `data` as the bytes
    of that record: where protobuf itself puts the field, so the file is what serializing the whole tensor gives."""

    def grown(start: int, end: int, level: int) -> list[Piece]:
        number, head, inner, n = next(f for f in _fields(message, start, end) if f[0] == path[level])
        body = [data] if level == len(path) - 1 else grown(inner, inner + n, level + 1)
        return [message[start:head], _header(number, sum(map(len, body))), *body, message[inner + n:end]]

    body = grown(0, len(message), 0)
    return [_header(number, sum(map(len, body))), *body]


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
    """The pieces of `model` with `graph` (pieces of its GraphProto) as its graph, in protobuf's field order: the
    model's fields numbered below the graph's, the graph record, the fields numbered above it (opset_import,
    metadata_props, functions, ...)."""
    numbers = {fd.name: fd.number for fd in onnx.ModelProto.DESCRIPTOR.fields}
    head, tail = onnx.ModelProto(), onnx.ModelProto()
    copy_fields(model, head, skip={name for name, number in numbers.items() if number >= MODEL_GRAPH})
    copy_fields(model, tail, skip={name for name, number in numbers.items() if number <= MODEL_GRAPH})
    pieces = list(graph)
    return [head.SerializeToString(), _header(MODEL_GRAPH, sum(map(len, pieces))), *pieces, tail.SerializeToString()]


def serialized(pieces: Iterable[Piece], chunk: int = 1 << 20) -> Iterator[Piece]:
    """`pieces` with runs of records joined into chunks of about `chunk` bytes (records are small and many: one
    write a record would cost more than the writing); a FileBytes is passed on as it is."""
    run: list[bytes] = []
    size = 0
    for piece in pieces:
        if isinstance(piece, bytes):
            run.append(piece)
            size += len(piece)
            if size < chunk:
                continue
        if run:
            yield b"".join(run)
            run, size = [], 0
        if isinstance(piece, FileBytes):
            yield piece
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
