"""The public API end to end: every exporter fixture patched, verified byte-identical, reported, idempotent."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from helpers import EXPORTER_FIXTURES, FIXTURES, op_count

import deform_surgeon as ds


@pytest.mark.parametrize("name", EXPORTER_FIXTURES)
def test_every_exporter_fixture_is_patched_completely_and_verified(name, tmp_path):
    out = tmp_path / "patched.onnx"
    report = ds.patch(FIXTURES / name, out, verify=True)
    assert report.written and report.verification.identical and not report.refused
    patched = onnx.load(str(out))
    for op in ("GatherND", "GatherElements", "Sum"):
        assert op_count(patched, op) == 0
    assert report.ops_after == {k: v for k, v in sorted(
        {n.op_type: op_count(patched, n.op_type) for n in patched.graph.node}.items())}
    again = ds.patch(out, tmp_path / "again.onnx")
    assert not again.changed and not (tmp_path / "again.onnx").exists()


def test_inspect_is_a_dry_run_with_the_same_verdicts_as_patch(tmp_path):
    source = FIXTURES / "gathernd_refused.onnx"
    before = source.read_bytes()
    dry = ds.inspect(source)
    real = ds.patch(source, tmp_path / "out.onnx")
    assert source.read_bytes() == before
    assert [(a.node, a.action, a.reason, a.details) for a in dry.actions] == \
        [(a.node, a.action, a.reason, a.details) for a in real.actions]
    # what a report calls refused is what the written model still holds, node for node, exactly as it was
    written = {n.name: n for n in onnx.load(str(tmp_path / "out.onnx")).graph.node}
    original = {n.name: n for n in onnx.load(str(source)).graph.node}
    assert dry.refused and all(written[a.node] == original[a.node] for a in dry.refused)
    assert {n for n, node in written.items() if node.op_type == "GatherND"} == {a.node for a in dry.refused}


def test_report_json_round_trips_and_names_every_refusal(tmp_path):
    report = ds.inspect(FIXTURES / "gathernd_refused.onnx")
    doc = json.loads(report.to_json())
    assert doc["summary"] == {"rewritten": 1, "rewritten_unproven": 0, "refused": 4}
    assert {n["node"] for n in doc["nodes"] if n["action"] == "refused"} == {a.node for a in report.refused}
    text = report.format()
    assert all(a.node in text for a in report.refused) and "4 node(s) left unchanged" in text


def test_bad_options_are_one_line_errors():
    with pytest.raises(ds.SurgeonError, match="unknown sum mode 'fast'"):
        ds.inspect(FIXTURES / "sum_only.onnx", sum_mode="fast")


def test_a_tensor_no_pass_fits_is_said_to_stay_over_the_profile(tmp_path):
    """A plain patch fits the device profile by default; what no pass can compute in parts (here a MatMul and its
    Relu, as the Swin backbone's first MLP of the full BiRefNet at 1024) is named in the report's note, never left
    silently; a model with nothing over the limit gets no such note."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((32, 64), 0.01, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1"),
                               helper.make_node("Relu", ["h"], ["y"], name="act")], "mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 64])], [w])
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    report = ds.inspect(path, max_buffer="10KiB")
    assert "STAYS OVER the device profile: 2 tensor(s) over 10,240 B (made by MatMul 1, Relu 1; largest 'h'" \
        in report.note
    assert "STAYS OVER" not in ds.inspect(path, max_buffer="16KiB").note  # 16,384 B each: not over


def test_a_tensor_of_unknown_size_over_the_profile_even_at_its_smallest_is_named(tmp_path):
    """A dim shape inference leaves symbolic (the Swin backbone's shifted-window blocks: `[unk, 65536, 768]`) hides
    a tensor's size from the passes; over the limit even with that dim 1, it is named "at least" in the note."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((32, 64), 0.01, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1"),
                               helper.make_node("Relu", ["h"], ["y"], name="act")], "mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64, 64])], [w])
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    note = ds.inspect(path, max_buffer="10KiB").note
    assert "STAYS OVER the device profile: 2 tensor(s) over 10,240 B (made by MatMul 1, Relu 1; largest 'h' at " \
        "least 16,384 B from MatMul 'fc1'" in note
    assert "2 of them with a dim shape inference leaves symbolic, over it even where that dim is 1" in note
    assert "STAYS OVER" not in ds.inspect(path, max_buffer="16KiB").note  # 16,384 B at n = 1: not over
