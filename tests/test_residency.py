"""Index chains in float32: exact against the int64 original, including beyond 2^24, and refused otherwise."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import FIXTURES, assert_bytes_equal, patch_in_memory, run_ort
from graphs import exporter_like
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon.pipeline import REFUSED, REWRITTEN

INT64_ARITH = {"Add", "Sub", "Mul", "Clip", "Slice", "Concat", "Min", "Max", "Split"}


def int64_arith_nodes(model: onnx.ModelProto) -> list[str]:
    """Nodes that compute on int64 data (what no WebGPU EP does), ignoring shape inputs of Reshape & co."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    types.update({i.name: i.data_type for i in inferred.graph.initializer})
    consts = {i.name for i in inferred.graph.initializer}
    consts |= {o for n in inferred.graph.node if n.op_type == "Constant" for o in n.output}
    shape_math: set[str] = set()  # Shape -> Slice -> Concat -> Resize sizes: folded to constants by ORT
    for n in inferred.graph.node:
        variable = [i for i in n.input if i and i not in consts]
        if n.op_type == "Shape" or (variable and all(i in shape_math for i in variable)):
            shape_math.update(n.output)
    return [n.name for n in inferred.graph.node if not set(n.output) & shape_math
            if (n.op_type in INT64_ARITH and types.get(n.output[0]) == TensorProto.INT64)
            or (n.op_type == "Cast" and types.get(n.input[0]) == TensorProto.INT64)]


@pytest.mark.parametrize("name", ["decoder_gathernd.onnx", "decoder_gatherelements.onnx", "decoder_gathernd_fp16.onnx",
                                  "decoder_gatherelements_fp16.onnx", "decoder_gathernd_b2g2.onnx"])
def test_no_int64_arithmetic_is_left_in_the_exporter_fixtures(name):
    model = onnx.load(str(FIXTURES / name))
    assert int64_arith_nodes(model)  # the original has plenty
    patched, actions = patch_in_memory(model)
    assert int64_arith_nodes(patched) == []
    assert all(a.action == REWRITTEN for a in actions if a.pass_name == "residency")


@pytest.mark.parametrize("offsets", [(-3.0, 3.0), (-1e6, 1e6), (-3e7, 3e7), (-4e18, 4e18)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_chain_equals_int64_chain_for_huge_offsets(offsets, dtype):
    # beyond 2^24 float32 no longer represents every integer: the saturating Clip must still agree
    model = exporter_like(B=1, G=2, H=7, W=5, C=3, P=40, dtype=dtype)
    patched, actions = patch_in_memory(model)
    assert [a.action for a in actions if a.pass_name == "residency"] == [REWRITTEN] * 4
    rng = np.random.default_rng(5)
    for _ in range(3):
        feeds = {"data": rng.standard_normal((1, 2, 7, 5, 3)).astype(dtype),
                 "offset": rng.uniform(*offsets, size=(1, 2, 40, 2)).astype(np.float32)}
        assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))


def _chain_model(cast_input_op: str = "Floor", add: int = 1, hi: int = 9) -> onnx.ModelProto:
    """f -> (Floor|Relu) -> Cast(int64) -> Add(add) -> Clip(0, hi) -> GatherND on data [10, 3] (r=1)."""
    nodes = [helper.make_node(cast_input_op, ["f"], ["g"], name="round"),
             helper.make_node("Cast", ["g"], ["i"], name="to_i64", to=TensorProto.INT64),
             helper.make_node("Add", ["i", "c"], ["j"], name="plus"),
             helper.make_node("Clip", ["j", "lo", "hi"], ["k"], name="clip"),
             helper.make_node("GatherND", ["data", "k"], ["out"], name="gnd")]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [max(hi + 1, 10), 3]),
                         helper.make_tensor_value_info("f", TensorProto.FLOAT, [6, 1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [6, 3])],
        [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("c", add), ("lo", 0), ("hi", hi))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("model,why", [
    (_chain_model(cast_input_op="Relu"), "not proven integral"),
    (_chain_model(add=2**23), "not proven within"),
    (_chain_model(hi=2**23), "bound is not a constant within"),
])
def test_chains_that_float32_cannot_carry_exactly_are_refused(model, why):
    patched, actions = patch_in_memory(model)
    refused = [a for a in actions if a.pass_name == "residency"]
    assert [a.action for a in refused] == [REFUSED] and why in refused[0].reason
    assert "to_i64" in {n.name for n in patched.graph.node}  # the int64 chain is still there


def test_an_accepted_chain_is_exact_at_the_float32_limits():
    model = _chain_model()
    patched, actions = patch_in_memory(model)
    assert [a.action for a in actions if a.pass_name == "residency"] == [REWRITTEN]
    f = np.array([[-2.0**24 - 2], [-2.0**23], [-1.5], [8.7], [2.0**24 + 2], [2.0**40]], np.float32)
    feeds = {"data": np.arange(30, dtype=np.float32).reshape(10, 3), "f": f}
    assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))
