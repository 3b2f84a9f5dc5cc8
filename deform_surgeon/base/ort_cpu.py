"""ORT CPU on a model in memory, at one graph optimisation level: the one oracle of the project's small checks
(constant folding, a rewrite's proof, a split Conv's chunks), beside `checks.verify`, which asks the same runtime
about whole models through polygraphy.

Why in the base layer: every layer asks it (the graph's folding, the passes' proofs, the checks), so it may import
nothing above it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx


def ort_level(name: str):
    import onnxruntime as ort

    return {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[name]


def run_ort_cpu(model: onnx.ModelProto, feeds: dict[str, np.ndarray], level: str = "all", *,
                threads: int | None = None, quiet: bool = False) -> list[np.ndarray]:
    """ORT CPU on an in-memory model at one optimisation level ("disable" ... "all"): the one oracle of the
    project's small checks (fold's evaluation of static computations, the split pass's chunk check), beside
    `verify`, which asks the same runtime about whole models through polygraphy."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort_level(level)
    options.enable_cpu_mem_arena = False  # one run: its memory goes back when the session ends, not to an arena
    if quiet:
        options.log_severity_level = 3
    if threads is not None:
        options.intra_op_num_threads = threads
        if threads > (os.cpu_count() or 1):  # more threads than cores: spinning ones only take the others' time
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds)


def optimized_graph(source: str | bytes, level: str, folder: Path, *, external_over: int = 1024,
                    config: dict[str, str] | None = None) -> onnx.GraphProto:
    """ORT CPU's graph of `source` (a file's path, or a serialized model) after its optimizations at `level`, as ORT
    saves it (`optimized_model_filepath`) in `folder`, which the caller removes: initializers over `external_over`
    bytes go to a data file beside it that is never read back. `config`: more session config entries. Why ask ORT:
    which nodes it folds, fuses or computes in float32 is its optimizers' and kernels' choice (proofs/precision.py,
    passes/unfold.py)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort_level(level)
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = False
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                     str(external_over))
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath, load_external_data=False).graph
