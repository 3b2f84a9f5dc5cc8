"""Writing: the rule "no input is modified and no partial output file is ever left behind" lives here, in the
streaming writer, and in the two modules it writes through: `temporary` (a temporary file beside its target, locked
while its writer lives, and the lock of a folder) and `pair` (an OUT and its data file put in place together, and
what a killed writer of them left, settled).

Every write goes to a temporary file in the target folder, is checked (its size; the caller's checks and
verification), and only then renamed over the target (a rename within one folder is atomic). The model is written
record by record (wire.py), no second copy of it in memory; the stored tensors' bytes are copied from the input's
files in the kernel where it can (`os.copy_file_range`): embedded ones into the model file, external ones into the
output's own data file (`<OUT>.data`, or `<OUT>_data` as the input's: `external_data_path`), written through a
temporary name like the model itself.

Which form the output's weights take (`weights_external`, `--external-data`): a page loads a single-file model through
onnxruntime-web's 32-bit wasm heap, which fails past `BROWSER_SINGLE_FILE_LIMIT` (docs/browser-loading.md), while
external data is fetched and uploaded by the WebGPU EP itself. So by default ("auto") an output that would be one
file larger than that (its own size, as serialized: not the input's) is written with its weights in external data,
named as transformers.js fetches them (`<OUT>_data`); a smaller one stays one file, and an input with external data
keeps it. "always" and "never" force either form. `DataForm` carries that choice, and the data file's name, to
every step that plans, checks, writes or reports the output's files, so the name checked is the name written.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..base.errors import SurgeonError
from . import wire
from .pair import check_data_target, external_data_path, install_pair
from .temporary import temp_path
from .weights import Weights, external_ref, is_external

_PROTOBUF_LIMIT = 2**31 - 1

EXTERNAL_DATA_CHOICES = ("auto", "always", "never")
# The largest single-file model written by default. A page's onnxruntime-web holds a single file twice in its 4 GiB
# wasm heap, beside the constants ORT folds at session creation: the full BiRefNet 1024 (925 MiB) fails there, a
# file of weights alone at 1920 MiB (measured in headless Chromium: docs/browser-loading.md). 1.8x below the first.
BROWSER_SINGLE_FILE_LIMIT = 512 * 2**20


_ALIGN_THRESHOLD, _ALIGN = 1 << 20, 1 << 16  # onnx's own layout: tensors >= 1 MiB start at 64 KiB boundaries


_CHUNK = 1 << 24


@dataclass(frozen=True)
class DataForm:
    """Where an output's weights go, decided once and handed to every step that plans (io_check, batch), checks,
    writes and reports the output's files, so that the data file checked is the one written: `choice`
    (`--external-data`: one of `EXTERNAL_DATA_CHOICES`) and `suffix`, the data file's name after OUT's (one of
    `DATA_SUFFIXES`; None: in the form of the input's own data files, `external_data_path`)."""

    choice: str = "auto"
    suffix: str | None = None

    def data_path(self, out: str | Path, input_data: Iterable[str | Path] = ()) -> Path:
        """OUT's data file, for an input whose data files are `input_data` as its model names them."""
        return external_data_path(out, input_data, self.suffix)

    def expected(self, input_data: Iterable[str | Path]) -> bool | None:
        """Whether OUT will have a data file: known for "always", "never" and an input with external data; None
        for "auto" of a single file, which the output's own size decides when it is written (`weights_external`)."""
        if self.choice != "auto":
            return self.choice == "always"
        return True if list(input_data) else None


@dataclass(frozen=True)
class Written:
    """What `save_model_atomic` wrote: `data`, the external data file beside the model (None: the model is one
    file), and `one_file_size`, the model's size as one file where the writer measured it (a model written as one
    file, or one "auto" moved to a data file because of that size; None otherwise). The report's weights form is
    told from this, not from the input's size."""

    data: Path | None
    one_file_size: int | None


def save_model_atomic(
    model: onnx.ModelProto,
    target: str | Path,
    verify: Callable[[Path], None] | None = None,
    weights: Weights | None = None,
    check: Callable[[], None] | None = None,
    form: DataForm = DataForm(),
) -> Written:
    """Write `model` to a temporary file, check its size, run `check()` and `verify(tmp_path)` if given (either may
    raise: the temporary files are then removed), then put it in place (with its data file: `install_pair`). Returns
    what was written (`Written`): the data file beside it, or None when there was nothing to put there (a model
    with no stored tensor is one file).

    The model is written record by record (wire.py): no second copy of it is built in memory, and the bytes of
    the stored tensors (`weights`) go from file to file. `form.choice` (`weights_external`): "auto" keeps the
    input's external tensors external and its embedded ones embedded, and moves every stored initializer of a
    single-file input to the data file when the output as one file would be over `BROWSER_SINGLE_FILE_LIMIT`;
    "always" writes every stored initializer to the data file, "never" every one into the model file (Constant
    nodes' values stay in the model, as onnx's own converter leaves them). The data file,
    `form.data_path(target, ...)` beside the output, is named after the input's data files as the model names
    them, so the output's references are relative to its own folder and the input's data file is never touched.
    """
    target = Path(target)
    weights = weights if weights is not None else Weights(None)
    data_target = form.data_path(target, weights.named_sources())
    to_data, one_file = _to_data(model, weights, form.choice)
    try:
        if to_data:
            check_data_target(target, data_target, weights)
        with ExitStack() as stack:
            tmp = stack.enter_context(temp_path(target))
            tmp_data = stack.enter_context(temp_path(data_target, suffix=".data")) if to_data else None
            layout = _copy_to_data(to_data, weights, tmp_data) if tmp_data is not None else {}
            location = tmp_data.name if tmp_data is not None and verify is not None else data_target.name
            pieces = one_file if one_file is not None and not to_data else _pieces(model, weights, layout, location)
            size = _write_model(pieces, weights, tmp, target)
            if check is not None:
                check()
            if verify is not None:
                verify(tmp)
                if tmp_data is not None:
                    _write_model(_pieces(model, weights, layout, data_target.name), weights, tmp, target)
            weights.check_unchanged()  # last: every input read (copied, verified) is the one loaded
            install_pair(tmp, target, tmp_data, data_target, weights.inputs.values())
    except OSError as exc:
        weights.check_unchanged()  # an input removed or replaced under the writer: that is the file to name
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None
    if to_data:
        return Written(data_target, sum(map(len, one_file)) if one_file is not None else None)
    return Written(None, size)


def _to_data(model: onnx.ModelProto, weights: Weights, choice: str
             ) -> tuple[list[onnx.TensorProto], list[wire.Piece] | None]:
    """The stored initializers that go to the data file for `choice` (`weights_external`), and, where the output's
    size as one file decided it ("auto" of a single-file input), the pieces of that one file (written as they are
    when it stays one file)."""
    stored = [t for t in model.graph.initializer if t.name in weights.tensors]
    if choice != "auto" or weights.external:
        keep = [t for t in stored if is_external(t)]
        return (keep if choice == "auto" else stored if choice == "always" else []), None
    pieces = _pieces(model, weights, {}, "")
    return (stored if weights_external(choice, False, sum(map(len, pieces))) else []), pieces


def weights_external(choice: str, input_external: bool, one_file_size: int) -> bool:
    """Whether an output has its weights in external data, for `choice` (`--external-data`,
    `EXTERNAL_DATA_CHOICES`): "auto" keeps an input's external data, and moves the weights of an output larger
    than `BROWSER_SINGLE_FILE_LIMIT` as one file out of it (a page could not load it). `one_file_size` is the
    output's own size as one file (the writer's measure; a dry run, which writes nothing, has only the input's)."""
    if choice != "auto":
        return choice == "always"
    return input_external or one_file_size > BROWSER_SINGLE_FILE_LIMIT


def single_file_problem(name: str, size: int) -> str | None:
    """Why a page could not load a model written as one file of `size` bytes (over `BROWSER_SINGLE_FILE_LIMIT`),
    or None."""
    if size <= BROWSER_SINGLE_FILE_LIMIT:
        return None
    return (f"{name} is one file of {size / 2**20:,.0f} MiB: onnxruntime-web holds a single file twice in its 4 GiB "
            f"wasm heap, with the constants it folds, and the full BiRefNet's 925 MiB file already fails there (over "
            f"{BROWSER_SINGLE_FILE_LIMIT / 2**20:,.0f} MiB is not written as one file by default); with its weights "
            f"in external data (--external-data always) a page loads it")


def copy_atomic(src: str | Path, target: str | Path, check: Callable[[], None] | None = None,
                inputs: Iterable[tuple] = ()) -> None:
    """Copy a file byte for byte through a temporary name (used when there is nothing to rewrite); `check()` (e.g.
    `Weights.check_unchanged`) runs before the copy takes the target's place, and may raise. It takes OUT's place
    as a written model does (`install_pair`): an old OUT's own data files leave with it, no input (`inputs`) is
    moved."""
    target = Path(target)
    try:
        with temp_path(target) as tmp:
            shutil.copyfile(src, tmp)
            if check is not None:
                check()
            install_pair(tmp, target, None, target, inputs)
    except OSError as exc:
        if check is not None:
            check()  # the input removed or replaced: that is the file to name
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None


def check_external_output(out: str | Path, weights: Weights, form: DataForm) -> None:
    """Before any work: refuse an output whose data file (`form.data_path`), which it has when the input has
    external data or `form` puts its weights there, could not be written (`check_data_target`). Where the
    output's own size decides ("auto" of a single file), the writer checks it when it writes one."""
    if form.expected(weights.named_sources()):
        check_data_target(Path(out), form.data_path(out, weights.named_sources()), weights)


def _pieces(model: onnx.ModelProto, weights: Weights, layout: dict[str, tuple[int, int]], location: str
            ) -> list[wire.Piece]:
    """The records of the file `model` is written as: its stored embedded tensors' data copied from the input
    file, its external ones pointing at (offset, length) of `layout` in `location`."""
    return wire.model_pieces(model, _file_graph(model.graph, weights, layout, location))


def _write_model(pieces: list[wire.Piece], weights: Weights, path: Path, target: Path) -> int:
    """Write the records `pieces` (`_pieces`) to `path`, and check that the file has the size protobuf says it
    must (a failed write raises on its own). Returns that size."""
    total = sum(map(len, pieces))
    if total > _PROTOBUF_LIMIT:
        raise SurgeonError(target, "patched model exceeds protobuf's 2 GB limit",
                           "write its weights to external data: --external-data always")
    size = 0
    with ExitStack() as files, ThreadPoolExecutor(1) as disk:  # a write gives up the GIL: the next records are
        fh = files.enter_context(open(path, "wb", buffering=0))  # serialized while the last ones go to disk
        sources: dict[Path | None, object] = {}
        if weights.data:
            sources[None] = files.enter_context(weights.open_source())
        writing = None
        try:
            for data in wire.serialized(pieces):
                if writing is not None:
                    writing.result()
                    writing = None
                if isinstance(data, wire.FileBytes):
                    if data.path not in sources:  # an external data file whose tensors go into the model
                        sources[data.path] = files.enter_context(open(data.path, "rb", buffering=0))
                    _copy_range(sources[data.path], data.offset, data.length, fh)
                else:
                    writing = disk.submit(_write_all, fh, data)
                size += len(data)
        finally:
            if writing is not None:
                writing.result()
    if size != total or os.path.getsize(path) != size:  # a failed write raises; this catches a short one
        raise SurgeonError(target, "written model is not complete (disk full?)")
    return size


def _write_all(fh, data: bytes) -> None:
    """All of `data` to the unbuffered file `fh` (a raw write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[fh.write(view):]


def _file_graph(graph: onnx.GraphProto, weights: Weights, layout: dict[str, tuple[int, int]], location: str
                ) -> Iterator[wire.Piece]:
    """The graph records of the written file, in protobuf's own field order (an untouched model is written as
    `SerializeToString` would write it): external tensors re-pointed at the output's data file, the stored embedded
    ones with their raw data copied from the input file."""
    data = weights.data
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] in data:
            yield from wire.constant_record(node, data[node.output[0]])
        else:
            yield wire.record(wire.GRAPH_NODE, node)
    yield from wire.graph_name(graph)
    for t in graph.initializer:
        if t.name in layout:
            yield wire.record(wire.GRAPH_INITIALIZER, _pointed(t, location, *layout[t.name]))
        elif t.name in data:
            yield from wire.tensor_record(wire.GRAPH_INITIALIZER, t, data[t.name])
        elif t.name in weights.tensors and is_external(t):  # into the model file: the bytes of its data file
            path, offset, length = _external_span(t, weights.base_dir)
            yield from wire.tensor_record(wire.GRAPH_INITIALIZER, _embedded(t), wire.FileBytes(offset, length, path))
        else:
            yield wire.record(wire.GRAPH_INITIALIZER, t)
    yield from wire.graph_rest(graph)


def _copy_to_data(tensors: list[onnx.TensorProto], weights: Weights, out: Path) -> dict[str, tuple[int, int]]:
    """Copy the bytes of the stored initializers `tensors` into the data file `out` (in the kernel where it can):
    an external one's from its data file, an embedded one's from the input model file (or, for a model built in
    memory, its protobuf). Their new (offset, length); one span shared by several tensors is written once."""
    layout: dict[str, tuple[int, int]] = {}
    done: dict[tuple, tuple[int, int]] = {}
    pos = 0
    with ExitStack() as files, open(out, "wb", buffering=0) as dst:
        sources: dict[Path | None, object] = {}

        def opened(path: Path | None):
            if path not in sources:
                sources[path] = files.enter_context(weights.open_source() if path is None
                                                    else open(path, "rb", buffering=0))
            return sources[path]

        for t in tensors:
            if is_external(t):
                path, offset, length = _external_span(t, weights.base_dir)
                key: tuple = (path, offset, length)
            elif t.name in weights.data:
                span = weights.data[t.name]
                path, offset, length, key = None, span.offset, span.length, (None, span.offset, span.length)
            else:  # in the protobuf of a model built in memory
                raw = t.raw_data
                path, offset, length, key = None, 0, len(raw), ("memory", t.name)
            if key in done:
                layout[t.name] = done[key]
                continue
            if length >= _ALIGN_THRESHOLD and pos % _ALIGN:
                pos += dst.write(b"\0" * (_ALIGN - pos % _ALIGN))
            if key[0] == "memory":
                _write_all(dst, raw)
            else:
                _copy_range(opened(path), offset, length, dst)
            layout[t.name] = done[key] = (pos, length)
            pos += length
    if os.path.getsize(out) != pos:
        raise SurgeonError(out, "external data was not copied completely (disk full?)")
    return layout


def _external_span(t: onnx.TensorProto, base_dir: Path | None) -> tuple[Path, int, int]:
    """The file, offset and length of external tensor `t`'s bytes (a missing length: to the end of the file)."""
    location, offset, length = external_ref(t)
    path = (base_dir if base_dir is not None else Path()) / location
    return path, offset, os.path.getsize(path) - offset if length is None else length


def _embedded(t: onnx.TensorProto) -> onnx.TensorProto:
    """A copy of external tensor `t` without its external reference (its raw data is written beside it)."""
    out = onnx.TensorProto()
    out.CopyFrom(t)
    del out.external_data[:]
    out.ClearField("data_location")
    return out


def _copy_range(src, offset: int, length: int, dst) -> None:
    """Append `length` bytes of `src` from `offset` to `dst` (unbuffered files)."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < length:
                n = os.copy_file_range(src.fileno(), dst.fileno(), min(length - done, 1 << 30), offset + done)
                if n == 0:
                    break
                done += n
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
    while done < length:
        chunk = os.pread(src.fileno(), min(length - done, _CHUNK), offset + done)
        if not chunk:
            raise SurgeonError(src.name, f"ended early: {length - done} bytes of a stored tensor missing",
                               "was it changed while it was read?")
        _write_all(dst, chunk)
        done += len(chunk)


def _pointed(original: onnx.TensorProto, location: str, offset: int, length: int) -> onnx.TensorProto:
    """A copy of external tensor `original` (which holds no data) pointing at `location`, `offset`, `length`."""
    dst = onnx.TensorProto()
    dst.CopyFrom(original)
    keep = [(e.key, e.value) for e in original.external_data if e.key not in ("location", "offset", "length",
                                                                               "basepath")]
    del dst.external_data[:]
    for key, value in [("location", location), ("offset", str(offset)), ("length", str(length)), *keep]:
        entry = dst.external_data.add()
        entry.key, entry.value = key, value
    dst.data_location = onnx.TensorProto.EXTERNAL
    return dst
