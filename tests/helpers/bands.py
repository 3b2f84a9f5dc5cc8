"""What the tests of fitting by bands share: ORT CPU at a named level, seeded feeds, the bands pass's actions, the
tensors over a limit."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from deform_surgeon.graph.budget import analyze

KiB = 1024
LEVELS = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}


def run(model: onnx.ModelProto | str, feeds: dict, level: str = "all") -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def feeds_for(model: onnx.ModelProto, seed: int = 0, integers: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = (rng.integers(-3, 4, shape) if integers else rng.standard_normal(shape)).astype(np.float32)
    return out


def bands_actions(actions) -> list:
    return [a for a in actions if a.pass_name == "bands"]


def over(model: onnx.ModelProto | str, limit: int) -> list[str]:
    return [t.name for t in analyze(model, max_buffer=limit, max_binding=2**62).over_buffer]
