"""Which files a command reads and writes, checked before any work: no write may land on a read.

Why one module: `patch`, `inspect`, `verify`, `budget` and `batch` all write something (OUT, OUT's external data
file `<OUT>.data`, a JSON report, a summary) and read something (the models and every external data file they
name). A write target that is one of those inputs (by any spelling: `..`, a symlink, a hard link), that is
another write target of the same command, or that is not a regular file (`/dev/null`, a FIFO, a folder) would
destroy data or hang, and is refused here, before any work, as one line naming the file (exit 2).

The external data files a model names are found by a scan of its protobuf wire format (memory-mapped; field
headers only, no tensor bytes: a 190 MB, 19,000-node BiRefNet is scanned in ~0.05-0.08 s, where `onnx.load`
takes a second), remembered per unchanged file. The scan only widens what is refused; `model_io.load_model`
checks the references themselves afterwards (inside the folder after symlinks, present, long enough).
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SurgeonError
from .model_io import external_data_path

# field numbers and wire types of onnx.proto (ModelProto.graph, GraphProto.initializer/input, TensorProto.name/
# external_data, StringStringEntryProto.key/value)
_MODEL_GRAPH, _GRAPH_INITIALIZER, _GRAPH_INPUT, _TENSOR_NAME, _TENSOR_EXTERNAL_DATA = 7, 5, 11, 8, 13
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
    complete: bool = False  # the whole file parsed as fields and it has a graph

    def feed_inputs(self) -> list:
        """The graph inputs a caller feeds (initializers excluded), as ValueInfoProtos."""
        import onnx

        inputs = [onnx.ValueInfoProto.FromString(b) for b in self.inputs]
        return [vi for vi in inputs if vi.name not in self.initializers]


_SCANS: dict[tuple, ModelScan] = {}  # (inode, size, mtime) -> scan: the CLI and patch() both check one command


def scan_model(model_path: str | Path) -> ModelScan:
    """`_scan_model`, remembered for an unchanged file (same inode, size and modification time)."""
    try:
        st = os.stat(model_path)
    except OSError:
        return _scan_model(model_path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _SCANS:
        _SCANS[key] = _scan_model(model_path)
    return _SCANS[key]


def _scan_model(model_path: str | Path) -> ModelScan:
    """External data locations, graph inputs and initializer names of a model, read from the file's wire format
    (memory-mapped: no tensor's bytes are read; a 190 MB, 19,000-node model is scanned in tens of milliseconds,
    where `onnx.load` takes a second). A malformed file gives what was found before the fault, and
    `complete=False` (`load_model` then names the problem)."""
    found = ModelScan()
    try:
        with open(model_path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                return found
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                graphs = 0
                for number, _, start, n in _fields(buf, 0, size):
                    if number != _MODEL_GRAPH:
                        continue
                    graphs += 1
                    for g_number, _, g_start, g_n in _fields(buf, start, start + n):
                        if g_number == _GRAPH_INPUT and g_n <= _SMALL:
                            found.inputs.append(bytes(buf[g_start:g_start + g_n]))
                        if g_number != _GRAPH_INITIALIZER:
                            continue
                        for t_number, _, t_start, t_n in _fields(buf, g_start, g_start + g_n):
                            if t_number == _TENSOR_NAME and t_n <= _SMALL:
                                found.initializers.add(bytes(buf[t_start:t_start + t_n]).decode("utf-8", "replace"))
                            if t_number != _TENSOR_EXTERNAL_DATA or t_n > _SMALL:
                                continue
                            entry = {e_number: bytes(buf[e_start:e_start + e_n])
                                     for e_number, _, e_start, e_n in _fields(buf, t_start, t_start + t_n)}
                            if entry.get(_ENTRY_KEY) == b"location" and _ENTRY_VALUE in entry:
                                found.locations.append(entry[_ENTRY_VALUE].decode("utf-8", "replace"))
                found.complete = graphs > 0
    except (_Truncated, OSError, ValueError):
        found.complete = False
    found.locations = sorted(set(found.locations))
    return found


def external_locations(model_path: str | Path) -> list[str]:
    """The `location` of every external tensor among the main graph's initializers (the only place `load_model`
    accepts external data)."""
    return scan_model(model_path).locations


def _keys(path: Path) -> set:
    """Every identity of a path: its absolute spelling, its real path and, if it exists, its inode."""
    keys: set = {os.path.abspath(path)}
    try:
        keys.add(str(path.resolve()))
        st = path.stat()
        keys.add((st.st_dev, st.st_ino))
    except (OSError, RuntimeError):
        pass
    return keys


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def require_regular_input(path: str | Path) -> None:
    """An input that exists must be a regular file: reading a FIFO or a device would hang or never end."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return  # missing: load_model names it
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise SurgeonError(path, f"is {_kind(mode)}, not a regular file", "give an .onnx file")


class FilePlan:
    """The files one command (or one batch) reads and writes; `read_model` and `write` refuse any overlap."""

    def __init__(self) -> None:
        self.reads: dict[object, str] = {}
        self.writes: dict[object, tuple[str, Path]] = {}

    def read_model(self, model_path: str | Path, label: str | None = None) -> list[Path]:
        """Register a model and its external data files as read; returns those data files."""
        path = Path(model_path)
        require_regular_input(path)
        if not path.is_file():
            return []  # missing or a folder: load_model names the problem
        label = label or f"the input model {path}"
        for key in _keys(path):
            self.reads.setdefault(key, label)
        data = [path.parent / loc for loc in external_locations(path)]
        for file in data:
            for key in _keys(file):
                self.reads.setdefault(key, f"an external data file of {path}")
        return data

    def read(self, path: str | Path, label: str) -> None:
        """Register another file the command reads (e.g. a limits JSON)."""
        for key in _keys(Path(path)):
            self.reads.setdefault(key, label)

    def write(self, role: str, target: str | Path) -> Path:
        """Register `target` as written (as `role`, e.g. "OUT" or "--report"), or raise `SurgeonError`."""
        target = Path(target)
        try:
            mode = target.stat().st_mode
        except OSError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise SurgeonError(target, f"{role} is {_kind(mode)}, not a regular file: it would be replaced by one",
                               "give a new file name or a regular file")
        keys = _keys(target)
        for key in keys:
            if key in self.reads:
                what = self.reads[key]
                if what.startswith("the input"):  # a model (or a batch entry's input) itself
                    raise SurgeonError(target, f"{role} is {what}", "choose another name; inputs are never modified")
                raise SurgeonError(target, f"{role} would overwrite the input's data: it is {what}",
                                   "choose another name; inputs are never modified")
            if key in self.writes:
                other, _ = self.writes[key]
                raise SurgeonError(target, f"{role} is also {other}: one would overwrite the other",
                                   "give each output its own name")
        folder = target.parent
        if not folder.exists():
            raise SurgeonError(target, f"folder {folder} does not exist")
        if not folder.is_dir():
            raise SurgeonError(target, f"{folder} is not a folder, so {role} cannot be written there")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise SurgeonError(target, f"folder {folder} is not writable")
        for key in keys:
            self.writes[key] = (role, target)
        return target

    def write_model(self, target: str | Path, external: bool, role: str = "OUT") -> None:
        """An output model and, if the model keeps external data, its data file `<OUT>.data`."""
        target = Path(target)
        if target.is_dir():
            raise SurgeonError(target, "output path is a folder; give a file name such as model.patched.onnx")
        self.write(role, target)
        if external:
            self.write(f"{role}'s external data file", external_data_path(target))


def check_io(models: Sequence[str | Path], out: str | Path | None = None,
             others: Sequence[tuple[str, str | Path | None]] = (),
             other_reads: Sequence[tuple[str, str | Path | None]] = ()) -> FilePlan:
    """One command's files: refuse (one line, exit 2) any write target that is an input, another write target,
    not a regular file, or in a folder that is missing or not writable. `out` is an output model (its data file
    `<OUT>.data` is included when the first model keeps external data); `others` are (option, path) pairs such
    as ("--report", "r.json"), None meaning not given."""
    plan = FilePlan()
    data = [plan.read_model(m) for m in models]
    for label, path in other_reads:
        if path is not None:
            plan.read(path, label)
    if out is not None:
        plan.write_model(out, external=bool(data and data[0]))
    for role, path in others:
        if path is not None:
            plan.write(role, path)
    return plan
