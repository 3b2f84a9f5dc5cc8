"""Why an 8-bit file's deform block is not split (docs/variants.md): a split would give each chunk the whole tensor's
DynamicQuantizeLinear scale from a ReduceMin / ReduceMax of the chunks, which agrees with ORT's DynamicQuantizeLinear
only where the tensor has no NaN. Prints, for a NaN at several places of 4,096 seeded floats, ORT CPU's scale and
zero point and the scale the chunked min/max gives (the formula of ORT's GetQuantizationParameter); exit 1 if they
ever differ (they do: a NaN first is skipped by ORT's SIMD min/max, a NaN last makes its scale NaN).

    python scripts/measure_dql_nan.py
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

N = 4096


def session(nodes: list, outputs: list[tuple[str, int]], inits: tuple = ()) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N])],
                              [helper.make_tensor_value_info(name, elem, None) for name, elem in outputs],
                              list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def main() -> int:
    dql = session([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zp"])],
                  [("y", TensorProto.UINT8), ("scale", TensorProto.FLOAT), ("zp", TensorProto.UINT8)])
    bounds = [helper.make_tensor(f"b{k}", TensorProto.INT64, [1], [v]) for k, v in enumerate((0, N // 2, N))]
    nodes = [helper.make_node("Slice", ["x", "b0", "b1"], ["h0"]), helper.make_node("Slice", ["x", "b1", "b2"], ["h1"])]
    for k in (0, 1):
        nodes += [helper.make_node("ReduceMin", [f"h{k}"], [f"lo{k}"], keepdims=0),
                  helper.make_node("ReduceMax", [f"h{k}"], [f"hi{k}"], keepdims=0)]
    nodes += [helper.make_node("Min", ["lo0", "lo1"], ["lo"]), helper.make_node("Max", ["hi0", "hi1"], ["hi"])]
    chunked = session(nodes, [("lo", TensorProto.FLOAT), ("hi", TensorProto.FLOAT)], bounds)
    rng = np.random.default_rng(0)
    differ = 0
    for where in (0, 5, 1000, 3000, N - 1):
        x = rng.standard_normal(N).astype(np.float32)
        x[where] = np.nan
        _, scale, zp = dql.run(None, {"x": x})
        lo, hi = (float(v) for v in chunked.run(None, {"x": x}))
        lo, hi = min(lo, 0.0), max(hi, 0.0)  # the range includes 0, as ORT makes it
        ours = np.float32(1.0) if hi == lo else np.float32(hi - lo) / np.float32(255)
        same = np.float32(scale).tobytes() == np.float32(ours).tobytes()
        differ += not same
        print(f"NaN at {where:4}: DynamicQuantizeLinear scale {float(scale):.9g} zero point {int(zp)}; "
              f"chunked min/max scale {float(ours):.9g}: {'same' if same else 'DIFFERS'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
