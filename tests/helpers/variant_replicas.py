"""The dtype variants of a transformers.js model repository, in miniature: the exporter replica's decoder with one
MatMul (the Linear layers of BiRefNet's Swin backbone, which the 4-bit quantizers rewrite), put through
`scripts/make_variants.py` (onnxslim, onnxconverter-common float16, onnxruntime.quantization), as the real files
are made from a real export (docs/variants.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from helpers import exporter_replica

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_variants.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_variants", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_with_matmul(split: bool = False) -> onnx.ModelProto:
    """The replica decoder (exporter form, 64x64, 8 deform blocks) with a MatMul of a constant [64, 64] weight
    between the head's upsampling and its Sigmoid. `split`: the MatMul's output is split in two equal halves of its
    last axis (no sizes given: shape inference must know the dim), concatenated in the other order, as Swin's
    attention splits its qkv Linear's output (a float16 Split after MatMulNBits in the q4f16 file)."""
    model = exporter_replica.build(exporter_replica.Spec())
    graph = model.graph
    sigmoid = next(n for n in graph.node if n.op_type == "Sigmoid" and n.output[0] == graph.output[0].name)
    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32) / 8
    graph.initializer.append(numpy_helper.from_array(weight, "proj.weight"))
    graph.node.insert(list(graph.node).index(sigmoid),
                      helper.make_node("MatMul", [sigmoid.input[0], "proj.weight"], ["proj_out"], name="proj"))
    sigmoid.input[0] = "proj_out"
    if split:
        at = list(graph.node).index(sigmoid)
        graph.node.insert(at, helper.make_node("Split", ["proj_out"], ["proj_a", "proj_b"], name="proj_split", axis=-1))
        graph.node.insert(at + 1, helper.make_node("Concat", ["proj_b", "proj_a"], ["proj_ba"], name="proj_concat",
                                                   axis=-1))
        sigmoid.input[0] = "proj_ba"
    onnx.checker.check_model(model, full_check=True)
    return model


def build_variants(folder: Path, only: tuple[str, ...] | None = None, split: bool = False) -> dict[str, Path]:
    """Write the variants (transformers.js's file names) into `folder`; variant name -> path. `split`: see
    `export_with_matmul`."""
    script = _script()
    return script.make_variants(export_with_matmul(split), folder, only or script.VARIANTS)
