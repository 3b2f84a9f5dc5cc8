"""model_io's one weights form, the wire scan and writer, and background.py: stored tensors (large initializers and
large Constant values) are read only through `Weights.read`, written as they were, dropped when nothing reads them;
the whole-model checks give the same verdict from a forked child as inline."""

from __future__ import annotations

import os

import graphs
import numpy as np
import onnx
import pytest
from helpers import assert_bytes_equal, copy_fixture, one_error_line, run, run_ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon import background, patch, surgeon
from deform_surgeon.background import Background
from deform_surgeon.errors import SurgeonError
from deform_surgeon.model_io import STORED_WEIGHT_BYTES, Weights, scan_model, split_weights
from deform_surgeon.model_io.weights import message_size
from deform_surgeon.passes.split import SplitPlan
from deform_surgeon.pipeline import Options
from deform_surgeon.region import find_region, splice


def constant_grid_model() -> onnx.ModelProto:
    """The exporter's sampling step with its grid (600 points: 4,800 bytes, a stored tensor) in a Constant node
    that carries a doc_string, as torch's exporter writes them."""
    model = graphs.exporter_like(H=30, W=40, C=4, P=600)
    grid = next(t for t in model.graph.initializer if t.name == "grid")
    model.graph.initializer.remove(grid)
    grid.name = ""
    model.graph.node.insert(0, helper.make_node("Constant", [], ["grid"], name="grid_const", value=grid,
                                                doc_string="kept as it was"))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_stored_constant_is_a_region_input_read_through_weights_and_written_as_it_was(tmp_path):
    model = constant_grid_model()
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    lifted = surgeon._run(path, Options(), SplitPlan())
    assert lifted.weights.constants == {"grid"} and "grid" in lifted.weights.loaded  # the prover read it
    assert "grid" in {t.name for t in lifted.graph.inputs}  # the region sees a typed input, not the node
    assert sum(a.op == "GatherND" and a.action == "rewritten" for a in lifted.actions) == 4
    patch(path, out)
    written = onnx.load(str(out))
    kept = [n for n in written.graph.node if n.name == "grid_const"]
    assert len(kept) == 1 and kept[0] == model.graph.node[0]  # the original node, doc_string and all
    feeds = {"data": np.random.default_rng(0).random((1, 1, 30, 40, 4), dtype=np.float32),
             "offset": np.random.default_rng(1).normal(0, 3, (1, 1, 600, 2)).astype(np.float32)}
    assert_bytes_equal(run_ort(model, feeds), run_ort(written, feeds))


def _reader_model() -> onnx.ModelProto:
    """A stored Constant read by a region node (an Add before a Sum) and by nothing else."""
    big = numpy_helper.from_array(np.arange(2000, dtype=np.float32), "")
    nodes = [helper.make_node("Constant", [], ["c"], name="big", value=big),
             helper.make_node("Add", ["c", "x"], ["a"], name="add"),
             helper.make_node("Sum", ["a", "x"], ["s"], name="sum")]
    graph = helper.make_graph(nodes, "reader", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2000])],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2000])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("still_read", [True, False])
def test_splice_keeps_a_stored_constant_the_region_reads_and_drops_one_it_does_not(still_read):
    model = _reader_model()
    weights = split_weights(model, None)
    assert weights.constants == {"c"}
    region = find_region(model, weights=weights)
    assert [model.graph.node[k].name for k in region.nodes] == ["add", "sum"] and region.inputs == ["c", "x"]
    sub = onnx.ModelProto()
    sub.graph.node.append(helper.make_node("Add", ["c" if still_read else "x", "x"], ["s"], name="add_new"))
    out = splice(model, region, sub, weights)
    assert [n.name for n in out.graph.node] == (["big", "add_new"] if still_read else ["add_new"])
    onnx.checker.check_model(out, full_check=True)


@settings(max_examples=60, deadline=None)
@given(raw=st.integers(0, 70_000), dims=st.lists(st.integers(0, 5000), max_size=4), name=st.text(max_size=40),
       doc=st.text(max_size=300), dtype=st.sampled_from([TensorProto.FLOAT, TensorProto.INT64, TensorProto.UINT8]))
def test_message_size_is_the_serialized_size(raw, dims, name, doc, dtype):
    t = onnx.TensorProto(name=name, dims=dims, data_type=dtype, doc_string=doc, raw_data=bytes(raw))
    assert message_size(t, raw) == len(t.SerializeToString())


def test_the_scan_tells_raw_data_lengths_and_where_the_large_nodes_are(tmp_path):
    model = constant_grid_model()
    table = numpy_helper.from_array(np.zeros((100, 50), np.float32), "table")
    model.graph.initializer.append(table)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    scan = scan_model(path)
    assert scan.complete and scan.large_nodes == [0]
    assert scan.raw_sizes["grid"] == 4800 and scan.raw_sizes["table"] == 20_000
    weights = split_weights(onnx.load(str(path)), tmp_path, scan)
    assert {"grid", "table"} <= set(weights.tensors) and weights.raw_size("table") == 20_000
    assert all(len(weights.tensors[n].SerializeToString()) == weights.message_size(n) for n in weights.tensors)


def test_a_stored_constant_with_missing_data_is_one_line_and_exit_2(tmp_path):
    model = constant_grid_model()
    value = model.graph.node[0].attribute[0].t
    value.raw_data = value.raw_data[:4400]  # its shape and type need 4,800
    assert len(value.raw_data) > STORED_WEIGHT_BYTES
    onnx.save(model, tmp_path / "m.onnx")
    proc = run("patch", "m.onnx", "out.onnx", cwd=tmp_path)
    assert proc.returncode == 2
    assert one_error_line(proc) == ("m.onnx: Constant 'grid_const' has 4400 bytes of data; its shape and type need "
                                    "4800")
    assert not (tmp_path / "out.onnx").exists()


def _raise(path: str) -> None:
    raise SurgeonError(path, "fails on purpose", "a hint")


def _fail() -> None:
    raise ValueError("not a SurgeonError")


def _die_in_child(parent: int) -> str:
    if os.getpid() != parent:
        os._exit(3)
    return "asked here"


def test_background_work_runs_in_another_process_and_gives_the_callers_answer():
    if not background._can_fork():
        pytest.skip("no second core or no fork here: Background runs inline (tested below)")
    assert Background(os.getpid).result() != os.getpid()
    with pytest.raises(SurgeonError) as err:
        Background(_raise, "m.onnx").result()
    assert (err.value.path, err.value.problem, err.value.hint) == ("m.onnx", "fails on purpose", "a hint")
    with pytest.raises(ValueError, match="not a SurgeonError"):  # anything else: met again in the caller
        Background(_fail).result()
    assert Background(_die_in_child, os.getpid()).result() == "asked here"  # a child that died: asked here


def test_background_runs_inline_where_no_child_can_be_had(monkeypatch):
    monkeypatch.setattr(background, "_can_fork", lambda: False)
    assert Background(os.getpid).result() == os.getpid()


def test_a_model_failing_the_checker_gives_the_same_line_from_the_background_check(tmp_path, monkeypatch):
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    model = onnx.load(str(tmp_path / "m.onnx"))
    model.graph.node[5].output[0] = model.graph.node[3].output[0]  # two producers of one tensor: not SSA
    onnx.save(model, tmp_path / "m.onnx")
    lines = []
    for can_fork in (background._can_fork, lambda: False):
        monkeypatch.setattr(background, "_can_fork", can_fork)
        with pytest.raises(SurgeonError) as err:
            patch(tmp_path / "m.onnx", tmp_path / "out.onnx")
        lines.append(err.value.one_line())
    assert lines[0] == lines[1] and "fails onnx.checker" in lines[0], lines
    assert not (tmp_path / "out.onnx").exists()


def test_weights_read_is_read_only_and_remembered():
    model = _reader_model()
    weights = split_weights(model, None)
    a = weights.read("c")
    assert not a.flags.writeable and weights.read("c") is a and weights.loaded == ["c"]
    assert isinstance(weights, Weights) and a.tobytes() == np.arange(2000, dtype=np.float32).tobytes()
