"""Index chains in float32: exact against the int64 original, including beyond 2^24, and refused otherwise."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import FIXTURES, assert_bytes_equal, patch_in_memory, run_ort
from helpers.graphs import exporter_like
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon.graph.pipeline import Outcome

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
    assert all(a.action == Outcome.REWRITTEN for a in actions if a.pass_name == "residency")


@pytest.mark.parametrize("offsets", [(-3.0, 3.0), (-1e6, 1e6), (-3e7, 3e7), (-4e18, 4e18)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_chain_equals_int64_chain_for_huge_offsets(offsets, dtype):
    # beyond 2^24 float32 no longer represents every integer: the saturating Clip must still agree
    model = exporter_like(B=1, G=2, H=7, W=5, C=3, P=40, dtype=dtype)
    patched, actions = patch_in_memory(model)
    assert [a.action for a in actions if a.pass_name == "residency"] == [Outcome.REWRITTEN] * 4
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
    (_chain_model(cast_input_op="Relu"), {"stop": "Cast 'to_i64'"}),  # a float not proven integral
    (_chain_model(add=2**23), {"stop": "Add 'plus'", "bound": 2**24}),
    (_chain_model(hi=2**23), {"stop": "Clip 'clip'", "bound": 2**22}),
])
def test_chains_that_float32_cannot_carry_exactly_are_refused(model, why):
    patched, actions = patch_in_memory(model)
    refused = [a for a in actions if a.pass_name == "residency"]
    assert [a.action for a in refused] == [Outcome.REFUSED]
    assert {k: refused[0].details.get(k) for k in why} == why
    assert "to_i64" in {n.name for n in patched.graph.node}  # the int64 chain is still there


def test_an_accepted_chain_is_exact_at_the_float32_limits():
    model = _chain_model()
    patched, actions = patch_in_memory(model)
    assert [a.action for a in actions if a.pass_name == "residency"] == [Outcome.REWRITTEN]
    f = np.array([[-2.0**24 - 2], [-2.0**23], [-1.5], [8.7], [2.0**24 + 2], [2.0**40]], np.float32)
    feeds = {"data": np.arange(30, dtype=np.float32).reshape(10, 3), "f": f}
    assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))


# -- NaN, +-inf, +-1e30: every gather index stays in range --------------------------------------------------------
EXTREMES = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf, "+1e30": 1e30, "-1e30": -1e30}
_PATCHED: dict[str, onnx.ModelProto] = {}


def _patched(name: str) -> onnx.ModelProto:
    if name not in _PATCHED:
        _PATCHED[name] = patch_in_memory(onnx.load(str(FIXTURES / name)))[0]
    return _PATCHED[name]


@pytest.mark.parametrize("name", ["decoder_gathernd.onnx", "decoder_gatherelements.onnx", "decoder_gathernd_fp16.onnx",
                                  "decoder_gatherelements_fp16.onnx", "decoder_gathernd_b2g2.onnx"])
@pytest.mark.parametrize("value", list(EXTREMES))
def test_patched_fixtures_run_wherever_the_original_runs_for_nan_and_inf_inputs(name, value):
    """NaN or +-inf in the image (or 1e30, an inf in fp16) makes the offsets NaN/inf. The original casts them to int64
    and clips, so its indices stay in range; the float32 chain must keep them in range too (ORT CPU checks every
    Gather index and fails the run otherwise), whether every pixel or 0.1% of them is extreme."""
    original, patched = onnx.load(str(FIXTURES / name)), _patched(name)
    (inp,) = original.graph.input
    dtype = np.float16 if inp.type.tensor_type.elem_type == TensorProto.FLOAT16 else np.float32
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    for fraction in (1.0, 0.001):
        x = rng.random(shape).astype(dtype)
        with np.errstate(over="ignore"):
            x[rng.random(shape) < fraction] = dtype(EXTREMES[value])
        expected = run_ort(original, {inp.name: x})  # the original runs (its int64 Clip saturates anything)
        got = run_ort(patched, {inp.name: x})  # raises on an out-of-range index
        assert [g.shape for g in got] == [e.shape for e in expected]


def test_a_nan_offset_gathers_where_the_original_does():
    """A NaN offset: ORT CPU's int64 original reads index 0 (INT64_MIN clipped); the float chain maps NaN to the
    Clip's lower bound, so both read the same element and the outputs are the same bytes."""
    model = exporter_like(H=6, W=7, C=3, P=5, with_sum=False)
    patched, _ = patch_in_memory(model)
    offset = np.random.default_rng(1).uniform(-3, 3, (1, 1, 5, 2)).astype(np.float32)
    offset[0, 0, 1, 0] = np.nan
    offset[0, 0, 3, :] = np.nan
    feeds = {"data": np.random.default_rng(2).random((1, 1, 6, 7, 3)).astype(np.float32), "offset": offset}
    assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))
    assert "GreaterOrEqual" in {n.op_type for n in patched.graph.node}
