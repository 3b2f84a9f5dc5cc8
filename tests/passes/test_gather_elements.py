"""GatherElements lowering: the channel-expanded index becomes one row gather, exactly, when proven."""

from __future__ import annotations

import numpy as np
import onnx
from helpers import FIXTURES, assert_bytes_equal, op_count, patch_in_memory, run_ort
from helpers.graphs import gather_elements_like
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from deform_surgeon.graph.pipeline import Outcome


def feeds(B, G, C, H, W, P, rng, wide=(-4.0, 12.0)):
    return {"data": rng.standard_normal((B, G, C, H, W)).astype(np.float32),
            "offset": rng.uniform(*wide, size=(B, G, P, 2)).astype(np.float32)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), G=st.integers(1, 3), C=st.integers(1, 4), H=st.integers(1, 8), W=st.integers(1, 8),
       P=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_lowered_gather_elements_is_exact(B, G, C, H, W, P, seed):
    model = gather_elements_like(B, G, H, W, C, P, seed=seed)
    patched, actions = patch_in_memory(model)
    assert [a.action for a in actions if a.pass_name == "gather_elements"] == [Outcome.REWRITTEN] * 4
    assert op_count(patched, "GatherElements") == 0 and op_count(patched, "Expand") == 0
    rng = np.random.default_rng(seed)
    for wide in ((-4.0, 12.0), (-1e9, 1e9)):
        f = feeds(B, G, C, H, W, P, rng, wide)
        assert_bytes_equal(run_ort(model, f), run_ort(patched, f))


def test_the_data_is_flattened_once_for_the_four_corners():
    patched, _ = patch_in_memory(gather_elements_like())
    assert op_count(patched, "Gather") == 4
    assert len({n.input[0] for n in patched.graph.node if n.op_type == "Gather"}) == 1


def test_unclamped_index_is_refused():
    model = gather_elements_like(clamp=False)
    patched, actions = patch_in_memory(model)
    refused = [a for a in actions if a.pass_name == "gather_elements"]
    assert [a.action for a in refused] == [Outcome.REFUSED] * 4
    assert all(a.details["proof"] == "unproven" and a.details["indices"][0]["status"] == "unproven" for a in refused)
    assert op_count(patched, "GatherElements") == 4


def test_an_index_that_differs_across_channels_is_refused():
    nodes = [helper.make_node("Clip", ["i", "zero", "hi"], ["idx"]),
             helper.make_node("GatherElements", ["data", "idx"], ["out"], name="ge", axis=1)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [3, 8]),
                     helper.make_tensor_value_info("i", TensorProto.INT64, [3, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 4])],
        [onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
         onnx.numpy_helper.from_array(np.array(7, np.int64), "hi")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _, actions = patch_in_memory(model)
    assert [(a.action, "same for every channel" in a.reason) for a in actions] == [(Outcome.REFUSED, True)]


def test_exporter_gather_elements_fixture_is_exact():
    model = onnx.load(str(FIXTURES / "decoder_gatherelements.onnx"))
    patched, _ = patch_in_memory(model)
    assert op_count(patched, "GatherElements") == 0 and op_count(patched, "Expand") == 0
    rng = np.random.default_rng(0)
    f = {"image": rng.uniform(0, 1, size=(1, 3, 64, 64)).astype(np.float32)}
    assert_bytes_equal(run_ort(model, f), run_ort(patched, f))
