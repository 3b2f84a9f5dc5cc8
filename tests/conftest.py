"""Shared test helpers: fixture paths, ORT CPU runs, and patching in memory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/graphs.py

FIXTURES = Path(__file__).parent / "fixtures"
EXPORTER_FIXTURES = sorted(p.name for p in FIXTURES.glob("decoder_*.onnx"))

ort.set_default_logger_severity(3)


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


def run_ort(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a model on ONNX Runtime CPU and return its outputs."""
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def patch_in_memory(model: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, list]:
    """Run the default passes on a model proto; return the patched proto and the actions."""
    from deform_surgeon.model_io import export_graph, infer_value_types
    from deform_surgeon.pipeline import Context, Options, run_passes
    from deform_surgeon.surgeon import default_passes

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
