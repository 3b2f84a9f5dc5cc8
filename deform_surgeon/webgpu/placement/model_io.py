"""What a harness is given and what it gives back, in numpy: the model folder a transformers.js pipeline loads, the
seeded inputs written for the harness, the tensors it uploads read back, and ORT CPU's reference outputs they are
held against, byte for byte."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

# transformers.js's file name suffix per dtype (`onnx/model{suffix}.onnx`), as its pipeline picks the file
TRANSFORMERS_DTYPES = {"": "fp32", "_fp16": "fp16", "_quantized": "q8", "_int8": "int8", "_uint8": "uint8",
                       "_q4": "q4", "_q4f16": "q4f16", "_bnb4": "bnb4"}
DEFAULT_INT_RANGE = (0, 4)

# onnxruntime-js tensor type names -> numpy dtypes
JS_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
_NP_TO_JS = {v: k for k, v in JS_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """A transformers.js model folder (config.json beside onnx/) and the one file of it a pipeline loads."""

    root: Path
    model: Path  # root/onnx/<name><suffix>.onnx

    @property
    def file_name(self) -> str:  # transformers.js's `model_file_name` (the file's stem)
        return self.model.stem

    @property
    def dtype(self) -> str:  # the `dtype:` a user writes to get this file ("fp32" for one it does not name)
        stem = self.model.stem
        return next((d for suffix, d in TRANSFORMERS_DTYPES.items() if suffix and stem.endswith(suffix)), "fp32")

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> ModelFolder:
        """The folder of `path`: a model folder (its onnx/model.onnx), or a file in a model folder's onnx/."""
        p = Path(path)
        model = p / "onnx" / "model.onnx" if p.is_dir() else p
        root = model.parent.parent
        if model.parent.name != "onnx" or not (root / "config.json").is_file():
            raise ValueError(f"{path}: not in a transformers.js model folder (config.json beside onnx/, the model in "
                             "onnx/, as `batch DIR OUTDIR` writes it); --bundle transformers loads such a folder")
        if not model.is_file():
            raise FileNotFoundError(f"model file not found: {model}")
        return cls(root, model)


def external_data_files(model: Any) -> list[str]:
    """Relative paths of the external-data files a model references (the browser must be given them)."""
    from onnx import TensorProto

    locations: list[str] = []
    for init in model.graph.initializer:
        if init.data_location == TensorProto.EXTERNAL:
            for entry in init.external_data:
                if entry.key == "location" and entry.value not in locations:
                    locations.append(entry.value)
    return locations


def make_inputs(
    model: Any, seed: int = 0, int_range: tuple[int, int] = DEFAULT_INT_RANGE
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Seeded inputs for every graph input that is not an initializer: floats uniform in [0, 1), integers
    uniform in ``int_range`` (half-open), bools 0/1. Unknown or symbolic dimensions become 1 (noted),
    because the runtimes need concrete shapes and 1 is the size every exported BiRefNet input accepts."""
    from onnx import helper

    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        shape: list[int] = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                shape.append(int(d.dim_value))
            else:
                shape.append(1)
                notes.append(f"input {vi.name}: dimension {i} ({d.dim_param or '?'}) set to 1")
        if dtype.kind == "f":
            arr = rng.random(shape, dtype=np.float32).astype(dtype)
        elif dtype.kind in "iu":
            arr = rng.integers(int_range[0], int_range[1], size=shape, dtype=np.int64).astype(dtype)
        elif dtype.kind == "b":
            arr = rng.integers(0, 2, size=shape).astype(np.bool_)
        else:
            raise ValueError(f"input {vi.name}: dtype {dtype} is not supported by the harness")
        feeds[vi.name] = np.ascontiguousarray(arr)
    return feeds, notes


def write_inputs(io_dir: Path, feeds: dict[str, np.ndarray]) -> None:
    meta = []
    for i, (name, arr) in enumerate(feeds.items()):
        if arr.dtype not in _NP_TO_JS:
            raise ValueError(f"input {name}: dtype {arr.dtype} has no onnxruntime-js equivalent")
        file = f"in_{i}.bin"
        (io_dir / file).write_bytes(np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes())
        meta.append({"name": name, "dtype": _NP_TO_JS[arr.dtype], "dims": list(arr.shape), "file": file})
    (io_dir / "inputs.json").write_text(json.dumps(meta))


def compare_outputs(
    got: dict[str, np.ndarray | None], ref: dict[str, np.ndarray]
) -> dict[str, dict[str, Any]]:
    """Byte-for-byte comparison of every reference output, plus the largest absolute difference.

    Bytes, not values: ``-0.0`` vs ``+0.0`` and NaN payloads are differences here (docs/runtime-facts.md section 5:
    zero tolerance is not bit identity). ``max_abs_diff`` is over positions where both values are finite;
    positions where exactly one side is non-finite (or both, but different) are counted in
    ``nonfinite_mismatch``.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            out[name] = {
                "identical": False,
                "max_abs_diff": None,
                "dtype": None,
                "shape": None,
                "missing": True,
                "reference_dtype": str(r.dtype),
                "reference_shape": list(r.shape),
            }
            continue
        entry: dict[str, Any] = {"dtype": str(g.dtype), "shape": list(g.shape)}
        if g.dtype != r.dtype or g.shape != r.shape:
            entry.update(
                identical=False,
                max_abs_diff=None,
                reference_dtype=str(r.dtype),
                reference_shape=list(r.shape),
            )
            out[name] = entry
            continue
        identical = np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(r).tobytes()
        a = g.astype(np.float64)
        b = r.astype(np.float64)
        fin = np.isfinite(a) & np.isfinite(b)
        diff = np.abs(a[fin] - b[fin])
        same_nonfinite = (~np.isfinite(a)) & (~np.isfinite(b)) & ((a == b) | (np.isnan(a) & np.isnan(b)))
        nonfinite_mismatch = int(np.count_nonzero(~fin & ~same_nonfinite))
        mismatched = int(np.count_nonzero(diff != 0)) + nonfinite_mismatch
        entry.update(
            identical=bool(identical),
            max_abs_diff=float(diff.max()) if diff.size else 0.0,
            mismatched_elements=mismatched,
            nonfinite_mismatch=nonfinite_mismatch,
            max_diff_at=_where_worst(a, b, fin, same_nonfinite, diff),
        )
        out[name] = entry
    return out


def _where_worst(a: np.ndarray, b: np.ndarray, fin: np.ndarray, same_nonfinite: np.ndarray,
                 diff: np.ndarray) -> list[int] | None:
    """Where in the tensor it differs most (`bisect` says where a node's output goes wrong): the first position
    where exactly one side is non-finite, else the largest finite difference; None when nothing differs."""
    odd = ~fin & ~same_nonfinite
    if odd.any():
        return [int(i) for i in np.unravel_index(int(np.argmax(odd)), a.shape)]
    if not diff.size or not diff.max():
        return None
    return [int(i) for i in np.unravel_index(int(np.flatnonzero(fin)[int(np.argmax(diff))]), a.shape)]


def reference_outputs(model_path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ORT CPU in this Python process on the same inputs: the ground truth every GPU run is held against."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    values = sess.run(names, feeds)
    return {n: np.asarray(v) for n, v in zip(names, values, strict=True)}


def read_tensor(io_dir: Path, o: dict[str, Any]) -> np.ndarray | None:
    """A tensor a harness uploaded ({file, dtype, dims}), or None if it is missing or of an unknown type."""
    f = io_dir / o["file"]
    dtype = JS_DTYPES.get(o["dtype"])
    if dtype is None or not f.exists():
        return None
    return np.frombuffer(f.read_bytes(), dtype=dtype.newbyteorder("<")).astype(dtype).reshape(o["dims"])

