#!/usr/bin/env python
"""Measure whether onnxruntime's dynamic 8-bit quantization (DynamicQuantizeLinear -> ConvInteger -> Cast ->
Mul) can be rewritten into float ops the WebGPU EPs run, with the same bytes on ORT CPU (docs/variants.md).

The float form: DynamicQuantizeLinear's scale and zero point from ReduceMin/ReduceMax, Div, Round and Clip as ORT's
CPU kernel computes them, q - zp = Round(Clip(x / scale, -zp, 255 - zp)); ConvInteger as two float Convs of
q - zp with the weight's high and low 4-bit parts, summed by one Add (every product and partial sum an integer
below 2^24, so exact in any order; one correctly rounded add of two exact parts equals ORT's int32 -> float Cast).

    python scripts/measure_integer_lowering.py [--trials 200]

Prints, for finite inputs and for inputs holding a NaN or an inf, how many trials gave other bytes than ORT's
own DynamicQuantizeLinear + ConvInteger.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

C, K, OUT, S = 16, 3, 8, 12


def _session(nodes, inits, out_type=TensorProto.FLOAT) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, S, S])],
                              [helper.make_tensor_value_info("y", out_type, [1, OUT, S, S])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def original(w: np.ndarray, wzp: int, wscale: float) -> ort.InferenceSession:
    """What quantize_dynamic writes for a Conv without bias."""
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.uint8(wzp), "wzp"),
             numpy_helper.from_array(np.float32(wscale), "ws")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"]),
             helper.make_node("ConvInteger", ["xq", "w", "xzp", "wzp"], ["acc"], pads=[1] * 4),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"]),
             helper.make_node("Mul", ["accf", "s"], ["y"])]
    return _session(nodes, inits)


def lowered(w: np.ndarray, wzp: int, wscale: float) -> ort.InferenceSession:
    centred = w.astype(np.int32) - wzp  # in [-255, 255]
    hi = np.floor_divide(centred, 16)
    lo = centred - 16 * hi  # in [0, 15]
    f = np.float32
    inits = [numpy_helper.from_array(hi.astype(f), "whi"), numpy_helper.from_array(lo.astype(f), "wlo"),
             numpy_helper.from_array(f(wscale), "ws"), numpy_helper.from_array(f(0), "zero"),
             numpy_helper.from_array(f(255), "q255"), numpy_helper.from_array(f(1), "one"),
             numpy_helper.from_array(f(16), "sixteen")]
    n = helper.make_node
    nodes = [n("ReduceMin", ["x"], ["mn0"], keepdims=0), n("ReduceMax", ["x"], ["mx0"], keepdims=0),
             n("Min", ["mn0", "zero"], ["mn"]), n("Max", ["mx0", "zero"], ["mx"]),
             n("Sub", ["mx", "mn"], ["rng"]), n("Div", ["rng", "q255"], ["s0"]),
             n("Equal", ["mx", "mn"], ["flat"]), n("Where", ["flat", "one", "s0"], ["xs"]),
             n("Div", ["mn", "xs"], ["mns"]), n("Sub", ["zero", "mns"], ["zp0"]),
             n("Clip", ["zp0", "zero", "q255"], ["zp1"]), n("Round", ["zp1"], ["zp"]),
             n("Div", ["x", "xs"], ["xd"]), n("Sub", ["zero", "zp"], ["lo_b"]), n("Sub", ["q255", "zp"], ["hi_b"]),
             n("Max", ["xd", "lo_b"], ["xc0"]), n("Min", ["xc0", "hi_b"], ["xc"]), n("Round", ["xc"], ["xqz"]),
             n("Conv", ["xqz", "whi"], ["chi"], pads=[1] * 4), n("Conv", ["xqz", "wlo"], ["clo"], pads=[1] * 4),
             n("Mul", ["chi", "sixteen"], ["chi16"]), n("Add", ["chi16", "clo"], ["accf"]),
             n("Mul", ["xs", "ws"], ["s"]), n("Mul", ["accf", "s"], ["y"])]
    return _session(nodes, inits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {"finite": 0, "nan": 0, "inf": 0}
    for _ in range(args.trials):
        w = rng.integers(0, 256, size=(OUT, C, K, K), dtype=np.uint8)
        a, b = original(w, 128, 0.01), lowered(w, 128, 0.01)
        x = (rng.standard_normal((1, C, S, S)) * rng.uniform(0.01, 100)).astype(np.float32)
        x += np.float32(rng.uniform(-3, 3))
        for kind in results:
            xi = x.copy()
            if kind != "finite":
                xi.flat[rng.integers(xi.size)] = np.nan if kind == "nan" else np.inf
            ya, yb = a.run(None, {"x": xi})[0], b.run(None, {"x": xi})[0]
            results[kind] += ya.tobytes() != yb.tobytes()
    for kind, bad in results.items():
        print(f"{kind} inputs: {bad} of {args.trials} trials gave other bytes than ORT's own kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
