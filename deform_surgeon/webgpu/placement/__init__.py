"""Measure where onnxruntime's WebGPU execution providers place a model's nodes, on the real runtimes.

The question this answers: does a (patched) model run entirely on the GPU in onnxruntime-web /
onnxruntime-node, or do some nodes fall back to ``CPUExecutionProvider`` with Memcpy nodes around them?
Placement is read from ORT's own verbose partitioning log (:func:`parse_ort_log`), produced by real sessions
(:func:`measure_placement`) in onnxruntime-node 1.30.0 (native WebGPU EP) or in headless Chromium with an
onnxruntime-web 1.30.0 bundle (``webgpu`` = native EP, ``jsep``/``all`` = JSEP), on SwiftShader when the
machine has no GPU. The runtimes are installed by ``deform-surgeon setup`` (``deform_surgeon.base.js_runtimes``);
:func:`missing_setup` tells.
"""

from __future__ import annotations

from .command import PlacementTool
from .logparse import LogSummary, parse_ort_log
from .result import Placement
from .runner import SetupMissing, compare_outputs, make_inputs, measure_placement, missing_setup

__all__ = [
    "LogSummary",
    "Placement",
    "PlacementTool",
    "SetupMissing",
    "compare_outputs",
    "make_inputs",
    "measure_placement",
    "missing_setup",
    "parse_ort_log",
]
