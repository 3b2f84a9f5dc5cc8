"""The inputs a search runs on: seeded as placement's, or given (a dict of arrays, or an `.npz` file read with its
size and types checked before its data)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...base.errors import SurgeonError
from ..placement.runner import make_inputs

if TYPE_CHECKING:  # numpy and onnx are imported where they are used: `import deform_surgeon` stays light
    import numpy as np
    import onnx

def load_inputs(inputs: str | Path | Mapping[str, Any] | None, seed: int, model: onnx.ModelProto,
                 path: object) -> tuple[dict[str, np.ndarray], list[str]]:
    """The feeds: from an .npz file or a dict, checked against the model's inputs, or seeded as placement's."""
    import numpy as np

    if inputs is None:
        return make_inputs(model, seed=seed)
    if isinstance(inputs, Mapping):
        given = {k: np.asarray(v) for k, v in inputs.items()}
        source: object = "inputs"
    else:
        source = inputs
        given = _read_npz(Path(inputs))
    inits = {i.name for i in model.graph.initializer}
    wanted = [i.name for i in model.graph.input if i.name not in inits]
    missing = [n for n in wanted if n not in given]
    extra = [n for n in given if n not in wanted]
    if missing or extra:
        problems = ([f"misses {', '.join(missing)}"] if missing else []) + (
            [f"names no input {', '.join(extra)}"] if extra else [])
        raise SurgeonError(source, "; ".join(problems), f"{path} takes {', '.join(wanted)}")
    for vi in (i for i in model.graph.input if i.name in given):
        if (why := _unlike(vi, given[vi.name])) is not None:
            raise SurgeonError(source, f"input {vi.name}: {why}", f"{path} takes {vi.name} as {_input_type(vi)}")
    return {n: np.ascontiguousarray(given[n]) for n in wanted}, []


NPZ_LIMIT = 16 << 30  # bytes an .npz of inputs may unpack to (a header claiming 37 GiB was a MemoryError)


def _read_npz(path: Path) -> dict:
    """The arrays of an .npz file: a regular file (a FIFO would block), each array's header read before its
    data, so a file that cannot be read or claims more than `NPZ_LIMIT` is one line, not a traceback."""
    import stat
    import zipfile

    import numpy as np

    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise SurgeonError(path, "is not a regular file (an .npz of input arrays is)")
        with zipfile.ZipFile(path) as z:
            total = 0
            for info in z.infolist():
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    header = {(1, 0): np.lib.format.read_array_header_1_0,
                              (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if header is None:
                        continue  # (format 3: np.load reads it; a failure there is still one line)
                    shape, _, dtype = header(f)
                total += int(np.prod(shape, dtype=object)) * dtype.itemsize
            if total > NPZ_LIMIT:
                raise SurgeonError(path, f"its arrays would take {total:,} bytes, more than {NPZ_LIMIT:,}")
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except SurgeonError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, MemoryError, KeyError) as e:
        raise SurgeonError(path, f"cannot be read as a .npz of input arrays ({type(e).__name__}: {e})") from None


def _input_type(vi) -> str:
    import onnx

    t = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
    return f"{onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)} {dims}"


def _unlike(vi, array) -> str | None:
    """Why `array` cannot be fed as graph input `vi` (its element type, its rank, a fixed dim), or None."""
    import onnx

    t = vi.type.tensor_type
    if t.elem_type and array.dtype != onnx.helper.tensor_dtype_to_np_dtype(t.elem_type):
        return f"the file gives {array.dtype}, the model takes {_input_type(vi)}"
    if t.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if len(dims) != array.ndim or any(d is not None and d != a for d, a in zip(dims, array.shape, strict=False)):
            return f"the file gives shape {list(array.shape)}, the model takes {_input_type(vi)}"
    return None
