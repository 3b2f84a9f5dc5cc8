"""GatherND lowering: exact on ORT CPU for every proven gather, refusals kept, general shapes, shared work."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import FIXTURES, assert_bytes_equal, op_count, patch_in_memory, run_ort
from helpers.graphs import CLAMPED, CLIP_BEFORE_GRID, PARTLY, SOURCES, UNCLAMPED, exporter_like
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon.graph.pipeline import Outcome


def feeds_for(model: onnx.ModelProto, rng: np.random.Generator, offset_range=(-4.0, 12.0)) -> dict:
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        elem = vi.type.tensor_type.elem_type
        if vi.name == "offset":
            feeds[vi.name] = rng.uniform(*offset_range, size=shape).astype(np.float32)
        elif elem == TensorProto.INT32:
            feeds[vi.name] = rng.integers(-1000, 1000, size=shape, dtype=np.int32)
        else:
            dtype = np.float16 if elem == TensorProto.FLOAT16 else np.float32
            feeds[vi.name] = rng.standard_normal(size=shape).astype(dtype)
    return feeds


def test_exporter_like_gather_is_lowered_exactly():
    model = exporter_like(B=2, G=3, H=5, W=6, C=4, P=9)
    patched, actions = patch_in_memory(model)
    assert op_count(patched, "GatherND") == 0 and op_count(patched, "Gather") == 4
    assert [a.action for a in actions if a.pass_name == "gathernd"] == [Outcome.REWRITTEN] * 4
    rng = np.random.default_rng(0)
    for _ in range(5):
        feeds = feeds_for(model, rng)
        assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))


def test_corners_share_their_coordinates():
    # 4 corners use 2 y's and 2 x's: 4 int32 casts, 2 multiplies by W, one flattened data tensor
    patched, _ = patch_in_memory(exporter_like(), sum_mode="none")
    gathers = [n for n in patched.graph.node if n.op_type == "Gather"]
    assert len({n.input[0] for n in gathers}) == 1
    assert sum(1 for n in patched.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.INT32) == 4
    assert sum(1 for n in patched.graph.node if n.op_type == "Mul" and "/scale" in n.name) == 2


def test_the_linear_index_is_int32_and_the_gather_keeps_the_original_output():
    model = exporter_like(with_sum=False)
    patched, _ = patch_in_memory(model)
    gathers = [n for n in patched.graph.node if n.op_type == "Gather"]
    assert sorted(g.output[0] for g in gathers) == sorted(o.name for o in model.graph.output)
    inferred = onnx.shape_inference.infer_shapes(patched)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    assert all(types[g.input[1]] == TensorProto.INT32 for g in gathers)


@pytest.mark.parametrize("source", [PARTLY, UNCLAMPED, CLIP_BEFORE_GRID])
def test_unproven_gathers_are_refused_with_a_reason(source):
    model = exporter_like(source=source)
    patched, actions = patch_in_memory(model)
    refused = [a for a in actions if a.pass_name == "gathernd"]
    assert [a.action for a in refused] == [Outcome.REFUSED] * 4
    assert all(a.details["proof"] == "unproven" for a in refused)
    assert all(i["stop"] for a in refused for i in a.details["indices"] if i["status"] != "proven")
    assert op_count(patched, "GatherND") == 4


def test_allow_unproven_rewrites_and_marks_every_such_node():
    model = exporter_like(source=CLIP_BEFORE_GRID, H=9, W=9, margin=2)
    patched, actions = patch_in_memory(model, allow_unproven=True)
    unproven = [a for a in actions if a.action == Outcome.REWRITTEN_UNPROVEN]
    assert len(unproven) == 4 and all(a.details["proof"] == "unproven" for a in unproven)
    assert all(a.reason.startswith("UNPROVEN") for a in unproven)  # said loudly to a person
    assert op_count(patched, "GatherND") == 0
    # where the indices happen to be in range the result is still the same
    feeds = feeds_for(model, np.random.default_rng(1), offset_range=(0.0, 0.5))
    assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))


def _general_gathernd(batch_dims: int, data_shape, ind_shape, hi) -> onnx.ModelProto:
    """indices = Clip(input, 0, hi) (one bound for all components): exercises the non-Concat path."""
    nodes = [helper.make_node("Clip", ["i", "zero", "hi"], ["idx"], name="clip"),
             helper.make_node("GatherND", ["data", "idx"], ["out"], name="gnd", batch_dims=batch_dims)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, data_shape),
                     helper.make_tensor_value_info("i", TensorProto.INT64, ind_shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                       list(ind_shape[:-1]) + list(data_shape[batch_dims + ind_shape[-1]:]))],
        [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(hi, np.int64), "hi")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("batch_dims,data_shape,ind_shape", [
    (0, [4, 5, 3], [6, 2]),          # r=2, trailing dim 3
    (0, [4, 5], [2, 3, 1]),          # r=1, several point dims
    (1, [2, 4, 5, 3], [2, 6, 2]),    # one batch dim
    (2, [2, 3, 4, 4, 2], [2, 3, 7, 2]),  # the exporter's rank
    (0, [4, 5, 6], [3, 3]),          # r = rank: scalar rows
])
def test_lowering_is_general_in_batch_dims_depth_and_trailing_dims(batch_dims, data_shape, ind_shape):
    hi = min(data_shape[batch_dims:batch_dims + ind_shape[-1]]) - 1
    model = _general_gathernd(batch_dims, data_shape, ind_shape, hi=hi)
    patched, actions = patch_in_memory(model)
    assert [a.action for a in actions if a.pass_name == "gathernd"] == [Outcome.REWRITTEN]
    rng = np.random.default_rng(2)
    for _ in range(3):
        feeds = {"data": rng.standard_normal(data_shape).astype(np.float32),
                 "i": rng.integers(-3, 9, size=ind_shape).astype(np.int64)}
        assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))


def test_too_many_rows_for_an_int32_index_is_refused():
    model = _general_gathernd(0, [50000, 50000, 1], [3, 2], hi=10)
    _, actions = patch_in_memory(model)
    (refused,) = [a for a in actions if a.pass_name == "gathernd"]
    assert refused.action == Outcome.REFUSED
    assert (refused.details["data_rows"], refused.details["max_rows"]) == (50000 * 50000, 2**31)


def test_exporter_fixtures_lose_every_gathernd_and_stay_identical():
    for name in ("decoder_gathernd.onnx", "decoder_gathernd_b2g2.onnx"):
        model = onnx.load(str(FIXTURES / name))
        patched, actions = patch_in_memory(model)
        assert op_count(patched, "GatherND") == 0 and op_count(patched, "Sum") == 0
        feeds = feeds_for(model, np.random.default_rng(3))
        assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))


# ------------------------------------------------------------------------------------------- properties
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), G=st.integers(1, 3), H=st.integers(1, 9), W=st.integers(1, 9), C=st.integers(1, 5),
       P=st.integers(1, 12), dtype=st.sampled_from([np.float32, np.float16, np.int32]),
       source=st.sampled_from(SOURCES), seed=st.integers(0, 2**16))
def test_every_allowed_rewrite_is_exact_and_no_escaping_index_is_proven(B, G, H, W, C, P, dtype, source, seed):
    model = exporter_like(B=B, G=G, H=H, W=W, C=C, P=P, dtype=dtype, source=source, seed=seed)
    patched, actions = patch_in_memory(model)
    gathers = [a for a in actions if a.pass_name == "gathernd"]
    if source != CLAMPED:
        # offsets can push these indices outside the data: the prover must never prove them
        assert all(a.action == Outcome.REFUSED for a in gathers)
        return
    assert all(a.action == Outcome.REWRITTEN for a in gathers)
    rng = np.random.default_rng(seed)
    for wide in ((-3.0, 3.0), (-100.0, 100.0), (-3e9, 3e9)):  # inside, outside, and beyond float32's 2^24
        feeds = feeds_for(model, rng, offset_range=wide)
        assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))
