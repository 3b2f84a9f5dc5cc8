"""ORT CPU on a model in memory, at one graph optimisation level: the one oracle of the project's small checks
(constant folding, a rewrite's proof, a split Conv's chunks), beside `checks.verify`, which asks the same runtime
about whole models through polygraphy.

Why in the base layer: every layer asks it (the graph's folding, the passes' proofs, the checks), so it may import
nothing above it.
"""

from __future__ import annotations

import os

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
