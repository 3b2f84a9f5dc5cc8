"""Loading, exporting, checking and atomically saving models.

Why a module of its own: the brief's rule "the input is never modified and no partial output file is ever
left behind" lives here and only here. Every write goes to a temporary file in the target folder, is
re-read and checked, and only then renamed over the target (a rename within one folder is atomic).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from .errors import SurgeonError

_PROTOBUF_LIMIT = 2**31 - 1


def load_model(path: str | Path) -> onnx.ModelProto:
    """Load an ONNX model (embedded or external-data weights) or raise a one-line `SurgeonError`."""
    path = Path(path)
    if not path.exists():
        raise SurgeonError(path, "no such file")
    if path.is_dir():
        raise SurgeonError(path, "is a folder, not an ONNX model file")
    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf raises DecodeError, onnx raises others; all mean "not readable ONNX"
        raise SurgeonError(path, f"not a readable ONNX model ({_first_line(exc)})") from None
    if len(model.graph.node) == 0 and len(model.graph.output) == 0:
        # protobuf happily parses many non-ONNX byte strings into an empty ModelProto
        raise SurgeonError(path, "not an ONNX model (no graph: the file is empty, truncated or of another format)")
    return model


def check_model(model: onnx.ModelProto, path: str | Path) -> None:
    """Run onnx.checker (with shape inference when the model fits in one protobuf) or raise `SurgeonError`."""
    try:
        if model.ByteSize() < _PROTOBUF_LIMIT:
            onnx.checker.check_model(model, full_check=True)
        else:
            onnx.checker.check_model(model)
    except Exception as exc:
        raise SurgeonError(path, f"fails onnx.checker: {_first_line(exc)}") from None


def infer_value_types(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int | str | None, ...] | None]]:
    """Element type and shape of every tensor that ONNX shape inference can tell, without touching `model`.

    The result feeds the range prover and the passes; it is deliberately not written into the exported model,
    so a patch does not add value_info to tensors it did not touch.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:
        inferred = model
    info: dict[str, tuple[int, tuple[int | str | None, ...] | None]] = {}
    graph = inferred.graph
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        tt = vi.type.tensor_type
        if not tt.elem_type:
            continue
        shape = None
        if tt.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
            )
        info[vi.name] = (tt.elem_type, shape)
    for init in graph.initializer:
        info[init.name] = (init.data_type, tuple(init.dims))
    return info


def export_graph(graph: gs.Graph, original: onnx.ModelProto) -> onnx.ModelProto:
    """Export `graph` as a model that keeps every model-level field of `original` (opsets, IR version, metadata)."""
    model = gs.export_onnx(graph, do_type_check=False)
    model.ir_version = original.ir_version
    del model.opset_import[:]
    model.opset_import.extend(original.opset_import)
    model.producer_name = original.producer_name
    model.producer_version = original.producer_version
    model.domain = original.domain
    model.model_version = original.model_version
    model.doc_string = original.doc_string
    del model.metadata_props[:]
    model.metadata_props.extend(original.metadata_props)
    del model.functions[:]
    model.functions.extend(original.functions)
    return model


def check_output_path(out: str | Path, inputs: list[str | Path]) -> Path:
    """Refuse an output path that would clobber an input or cannot be written, before any work is done."""
    out = Path(out)
    for inp in inputs:
        if out.resolve() == Path(inp).resolve():
            raise SurgeonError(out, "output path is the input model; choose another OUT (the input is never modified)")
    if out.is_dir():
        raise SurgeonError(out, "output path is a folder; give a file name such as model.patched.onnx")
    if not out.parent.exists():
        raise SurgeonError(out, f"output folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise SurgeonError(out, f"output folder {out.parent} is not writable")
    return out


@contextmanager
def atomic_path(target: str | Path, suffix: str = ".onnx") -> Iterator[Path]:
    """Yield a temporary path in the target's folder; rename it over `target` only if the block succeeds."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{suffix}", dir=target.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the output gets the mode any new file would
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def save_model_atomic(
    model: onnx.ModelProto,
    target: str | Path,
    verify: Callable[[Path], None] | None = None,
) -> None:
    """Serialise `model` to a temporary file, re-read it, run `verify(tmp_path)` if given, then rename into place."""
    target = Path(target)
    if model.ByteSize() >= _PROTOBUF_LIMIT:
        raise SurgeonError(target, "patched model exceeds protobuf's 2 GB limit",
                           "external-data output is not supported yet")
    with atomic_path(target) as tmp:
        data = model.SerializeToString()
        with open(tmp, "wb") as fh:
            fh.write(data)
        if tmp.read_bytes() != data:
            raise SurgeonError(target, "written model does not read back identically (disk full?)")
        if verify is not None:
            verify(tmp)


def copy_atomic(src: str | Path, target: str | Path) -> None:
    """Copy a file byte for byte through a temporary name (used when there is nothing to rewrite)."""
    with atomic_path(target) as tmp:
        shutil.copyfile(src, tmp)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
