"""Writing: the rule "no input is modified and no partial output file is ever left behind" lives here.

Every write goes to a temporary file in the target folder, is checked (its size; the caller's checks and
verification), and only then renamed over the target (a rename within one folder is atomic). The model is written
record by record (wire.py), no second copy of it in memory; the stored tensors' bytes are copied from the input's
files in the kernel where it can (`os.copy_file_range`): embedded ones into the model file, external ones into the
output's own data file (`<OUT>.data`, or `<OUT>_data` as the input's: `external_data_path`), written through a
temporary name like the model itself.

Which form the output's weights take (`weights_external`, `--external-data`): a page loads a single-file model through
onnxruntime-web's 32-bit wasm heap, which fails past `BROWSER_SINGLE_FILE_LIMIT` (docs/browser-loading.md), while
external data is fetched and uploaded by the WebGPU EP itself. So by default ("auto") an input stored as one file
larger than that is written with its weights in external data, named as transformers.js fetches them
(`<OUT>_data`); a smaller one stays one file, and an input with external data keeps it. "always" and "never" force
either form.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import onnx

from ..errors import SurgeonError
from . import wire
from .weights import Weights, external_ref, is_external

_PROTOBUF_LIMIT = 2**31 - 1

EXTERNAL_DATA_CHOICES = ("auto", "always", "never")
# The largest single-file model written by default. A page's onnxruntime-web holds a single file twice in its 4 GiB
# wasm heap, beside the constants ORT folds at session creation: the full BiRefNet 1024 (925 MiB) fails there, a
# file of weights alone at 1920 MiB (measured in headless Chromium: docs/browser-loading.md). 1.8x below the first.
BROWSER_SINGLE_FILE_LIMIT = 512 * 2**20


_ALIGN_THRESHOLD, _ALIGN = 1 << 20, 1 << 16  # onnx's own layout: tensors >= 1 MiB start at 64 KiB boundaries


_CHUNK = 1 << 24


def temp_prefix(target: str | Path) -> str:
    """The start of every temporary name `atomic_path` makes for `target`: short whatever the target's length (a
    name of up to 255 bytes must still work), and the same for one target only (batch removes a killed worker's
    temporaries by it)."""
    name = Path(target).name
    readable = "".join(c if c.isascii() and c.isprintable() else "_" for c in name[:24])  # ORT takes UTF-8 only
    return f".{readable}.{hashlib.sha1(name.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}."


@contextmanager
def atomic_path(target: str | Path, suffix: str = ".onnx") -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it over `target` only if the block succeeds.

    The temporary file is removed on every way out, a signal included (the CLI turns SIGTERM into an exception,
    like Ctrl-C): its name is chosen *before* the file is created (O_EXCL), so there is no moment at which the
    file exists and the `finally` does not know its name."""
    target = Path(target)
    tmp_path: Path | None = None
    try:
        for _ in range(100):
            tmp_path = target.parent / f"{temp_prefix(target)}{secrets.token_hex(4)}.tmp{suffix}"
            try:  # mode 0666 minus the umask: the mode any new file gets
                os.close(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                break
            except FileExistsError:
                tmp_path = None
        else:
            raise FileExistsError(errno.EEXIST, "no free temporary name", str(target.parent))
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


def save_model_atomic(
    model: onnx.ModelProto,
    target: str | Path,
    verify: Callable[[Path], None] | None = None,
    weights: Weights | None = None,
    check: Callable[[], None] | None = None,
    external: bool | None = None,
) -> Path | None:
    """Write `model` to a temporary file, check its size, run `check()` and `verify(tmp_path)` if given (either may
    raise: the temporary file is then removed), then rename it into place. Returns the external data file written
    beside it, or None when there was nothing to put there (a model with no stored tensor is one file).

    The model is written record by record (wire.py): no second copy of it is built in memory, and the bytes of
    the stored tensors (`weights`) go from file to file. `external`: None keeps the input's form (its external
    tensors external, its embedded ones embedded); True writes every stored initializer to the data file, False
    every one into the model file (Constant nodes' values stay in the model, as onnx's own converter leaves them).
    The data file, `external_data_path(target)` beside the output, gets a temporary name first and is renamed just
    before the model, so the output's references are relative to its own folder and the input's data file is
    never touched.
    """
    target = Path(target)
    weights = weights if weights is not None else Weights(None)
    stored = [t for t in model.graph.initializer if t.name in weights.tensors]
    to_data = [t for t in stored if is_external(t)] if external is None else stored if external else []
    try:
        with ExitStack() as stack:
            tmp = stack.enter_context(atomic_path(target))
            layout: dict[str, tuple[int, int]] = {}
            data_target = external_data_path(target, weights.sources())
            if to_data:  # exits first: the data file is in place before the model that names it
                tmp_data = stack.enter_context(atomic_path(data_target, suffix=".data"))
                layout = _copy_to_data(to_data, weights, tmp_data)
            location = tmp_data.name if to_data and verify is not None else data_target.name
            _write_model(model, weights, layout, location, tmp, target)
            if check is not None:
                check()
            if verify is not None:
                verify(tmp)
                if to_data:
                    _write_model(model, weights, layout, data_target.name, tmp, target)
            weights.check_unchanged()  # last: every input read (copied, verified) is the one loaded
    except OSError as exc:
        weights.check_unchanged()  # an input removed or replaced under the writer: that is the file to name
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None
    return data_target if to_data else None


def weights_external(model_path: str | Path, input_data: Iterable[str | Path], choice: str) -> bool:
    """Whether the output of `model_path` (its external data files `input_data`) has its weights in external data,
    for `choice` (`--external-data`, `EXTERNAL_DATA_CHOICES`): "auto" keeps an input's external data, and moves the
    weights of a single file larger than `BROWSER_SINGLE_FILE_LIMIT` out of it (a page could not load it)."""
    if choice != "auto":
        return choice == "always"
    try:
        return bool(list(input_data)) or os.path.getsize(model_path) > BROWSER_SINGLE_FILE_LIMIT
    except OSError:  # a missing or unreadable input: loading it names the problem
        return False


def single_file_problem(name: str, size: int) -> str | None:
    """Why a page could not load a model written as one file of `size` bytes (over `BROWSER_SINGLE_FILE_LIMIT`),
    or None."""
    if size <= BROWSER_SINGLE_FILE_LIMIT:
        return None
    return (f"{name} is one file of {size / 2**20:,.0f} MiB: onnxruntime-web holds a single file twice in its 4 GiB "
            f"wasm heap, with the constants it folds, and the full BiRefNet's 925 MiB file already fails there (over "
            f"{BROWSER_SINGLE_FILE_LIMIT / 2**20:,.0f} MiB is not written as one file by default); with its weights "
            f"in external data (--external-data always) a page loads it")


def copy_atomic(src: str | Path, target: str | Path, check: Callable[[], None] | None = None) -> None:
    """Copy a file byte for byte through a temporary name (used when there is nothing to rewrite); `check()` (e.g.
    `Weights.check_unchanged`) runs before the copy takes the target's place, and may raise."""
    try:
        with atomic_path(target) as tmp:
            shutil.copyfile(src, tmp)
            if check is not None:
                check()
    except OSError as exc:
        if check is not None:
            check()  # the input removed or replaced: that is the file to name
        raise SurgeonError(target, f"could not be written ({exc.strerror or exc})") from None


_CHUNKED_DATA = re.compile(r"_data(_\d+)?$")


def external_data_path(model_path: str | Path, input_data: Iterable[str | Path] = ()) -> Path:
    """Where the external data of an output model goes, beside it, in the form of the input's own (`input_data`,
    its data files): `<OUT>.data` when the input's is named so (onnx's and torch's form), else `<OUT>_data`
    (`model.onnx_data`: transformers.js's form, which fetches `<name>.onnx_data` and gives ORT the bytes under that
    name, so a patched model folder loads there unchanged; also the name of weights moved out of a single file)."""
    model_path = Path(model_path)
    names = [Path(f).name for f in input_data]
    suffix = ".data" if names and not any(_CHUNKED_DATA.search(n) for n in names) else "_data"
    return model_path.with_name(model_path.name + suffix)


def check_external_output(out: str | Path, model_path: str | Path, weights: Weights, external: bool = False) -> None:
    """Refuse an output whose data file (`<OUT>.data`, `<OUT>_data`: `external_data_path`), which it has when the
    input has external data or `external` moves its weights there, would overwrite the input or its external
    data."""
    if not (weights.external or external):
        return
    data = external_data_path(out, weights.sources())
    if data.resolve() in weights.sources() | {Path(model_path).resolve()}:
        raise SurgeonError(data, "the output's external data file would overwrite the input's",
                           "choose another OUT: the input is never modified")
    if data.is_dir():
        raise SurgeonError(data, "is a folder; the output's external data file goes there")


def _write_model(model: onnx.ModelProto, weights: Weights, layout: dict[str, tuple[int, int]], location: str,
                 path: Path, target: Path) -> None:
    """Serialize `model` to `path` record by record, its stored embedded tensors' data copied from the input file
    and its external ones pointing at (offset, length) of `layout` in `location`, and check that the file has the
    size protobuf says it must (a failed write raises on its own)."""
    pieces = wire.model_pieces(model, _file_graph(model.graph, weights, layout, location))
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
