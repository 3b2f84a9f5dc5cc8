"""What the tests share: fixture paths, ORT CPU runs, patching in memory, and running the command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort

TESTS = Path(__file__).resolve().parents[1]
FIXTURES = TESTS / "fixtures"
EXPORTER_FIXTURES = sorted(p.name for p in FIXTURES.glob("decoder_*.onnx"))
CONSOLE_SCRIPT = Path(sys.executable).parent / "deform-surgeon"
ENTRY_POINTS = {"module": [sys.executable, "-m", "deform_surgeon"], "script": [str(CONSOLE_SCRIPT)]}
ERROR_PREFIX = "deform-surgeon: error: "

def run_ort(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a model on ONNX Runtime CPU and return its outputs."""
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def patch_in_memory(model: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, list]:
    """Patch a model proto the way `deform-surgeon patch` does (load, region lifting, passes, splice, checks, the
    whole-model verification a rewrite that is not exact by construction needs, the atomic writer), through
    temporary files; return the written model and the actions. `options` are `deform_surgeon.patch`'s."""
    from deform_surgeon import patch

    with tempfile.TemporaryDirectory(prefix="patch_in_memory_") as d:
        source, target = Path(d) / "model.onnx", Path(d) / "patched.onnx"
        onnx.save(model, str(source))
        report = patch(source, target, copy_unchanged=True, **options)
        patched = onnx.load(str(target))
    onnx.checker.check_model(patched, full_check=True)
    return patched, report.actions


def patch_whole_graph(model: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, list]:
    """The passes on the whole model imported into onnx-graphsurgeon, without region lifting: what region lifting
    must be equivalent to (tests/graph/test_region.py)."""
    from deform_surgeon.commands.patch import default_passes
    from deform_surgeon.files import export_graph, infer_value_types
    from deform_surgeon.graph.pipeline import Context, Options, run_passes

    graph = gs.import_onnx(model)
    ctx = Context(graph, infer_value_types(model), Options(**options))
    actions = run_passes(ctx, default_passes())
    graph.cleanup().toposort()
    patched = export_graph(graph, model)
    onnx.checker.check_model(patched, full_check=True)
    return patched, actions


def op_count(model: onnx.ModelProto, op: str) -> int:
    return sum(1 for n in model.graph.node if n.op_type == op)


def assert_bytes_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()



def run(*args, cwd: Path, entry: str = "module", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ENTRY_POINTS[entry], *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def snapshot(folder: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every file and folder below `folder` (hidden ones included) with its bytes and mtime."""
    state = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            state[str(p.relative_to(folder))] = (None if p.is_dir() else p.read_bytes(), p.lstat().st_mtime_ns)
    return state


def copy_fixture(name: str, folder: Path, as_name: str | None = None) -> Path:
    target = folder / (as_name or name)
    shutil.copyfile(FIXTURES / name, target)
    return target


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{proc.stderr}"
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    return lines[0][len(ERROR_PREFIX):]


EVERY_THREAD_COUNT = (1, 2, 3, 4, 6, 8, 16)  # the counts the exactness promise is checked at (docs/runtime-facts.md)
INPUT_KINDS = ("random", "large", "tiny", "zero", "nan", "inf")


def kind_of_input(kind: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """A float32 input of one kind the promise covers: random normal, 1e4 x that, 1e-30 x that (subnormal
    products), zeros, random with NaNs, random with infinities of both signs."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if kind == "large":
        return x * np.float32(1e4)
    if kind == "tiny":
        return x * np.float32(1e-30)
    if kind == "zero":
        return np.zeros(shape, np.float32)
    if kind in ("nan", "inf"):
        flat = x.reshape(-1)
        flat[:: 7] = np.nan if kind == "nan" else np.inf
        flat[3:: 11] = np.nan if kind == "nan" else -np.inf
    return x


def assert_exact_everywhere(original: str | Path, patched: str | Path,
                            inputs: dict[str, tuple[int, ...]] | None = None) -> None:
    """The patched model gives the original's bytes on ORT CPU at levels `disable` and `all`, at every count of
    `EVERY_THREAD_COUNT`, on every kind of input of `INPUT_KINDS` (float inputs of the model's types; shapes from
    the model unless given)."""
    import onnxruntime as ort

    model = onnx.load(str(original), load_external_data=False)
    shapes = inputs or {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
    dtypes = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}
    for kind in INPUT_KINDS:
        feeds = {name: kind_of_input(kind, shape, k).astype(dtypes.get(name, np.float32))
                 for k, (name, shape) in enumerate(shapes.items())}
        for threads in EVERY_THREAD_COUNT:
            for level in ("disable", "all"):
                options = ort.SessionOptions()
                options.intra_op_num_threads = threads
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if level == "disable"
                                                    else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
                got = [ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)
                       for path in (original, patched)]
                for a, b in zip(*got, strict=True):
                    assert a.shape == b.shape and a.tobytes() == b.tobytes(), (kind, threads, level)
