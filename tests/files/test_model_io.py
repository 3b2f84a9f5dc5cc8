"""model_io's one weights form, the wire scan and writer, and background.py: stored tensors (large initializers and
large Constant values) are loaded without their data, read only through `Weights.read`, written byte for byte as
protobuf would write them, their data copied from the input file (refused if that file changed), dropped when
nothing reads them; the whole-model checks give the same verdict from a forked child as inline."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from helpers import assert_bytes_equal, copy_fixture, graphs, one_error_line, run, run_ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon import patch
from deform_surgeon.base import background
from deform_surgeon.base.background import Background
from deform_surgeon.base.errors import SurgeonError
from deform_surgeon.commands.patch import PatchRun
from deform_surgeon.files import (
    STORED_WEIGHT_BYTES,
    Weights,
    load_model,
    save_model_atomic,
    scan_model,
    split_weights,
    wire,
)
from deform_surgeon.graph.pipeline import Options
from deform_surgeon.graph.region import find_region, splice


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
    lifted = PatchRun(path, Options()).lift_once()
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


def _materialized(pieces: list, path) -> bytes:
    """The bytes the writer would write for `pieces`, each FileBytes read from `path`."""
    data = path.read_bytes()
    return b"".join(p if isinstance(p, bytes) else data[p.offset:p.offset + p.length] for p in pieces)


@settings(max_examples=40, deadline=None)
@given(raw=st.integers(STORED_WEIGHT_BYTES + 1, 70_000), doc=st.text(max_size=300),
       name=st.text(max_size=40).filter(lambda n: n not in {"c", "y", "small"}),  # (the graph's other names)
       node_doc=st.text(max_size=300), metadata=st.booleans())
def test_a_model_loads_without_its_stored_data_and_is_written_as_protobuf_writes_it(tmp_path_factory, raw, name, doc,
                                                                                     node_doc, metadata):
    """The scan's cut (every enclosing record re-framed) parses to the model without those raw data fields, and the
    writer's records, the data copied from the file, are protobuf's own serialization of the original messages:
    fields after raw_data (doc_string, metadata) included, in protobuf's order; a model written untouched is the
    file it was loaded from, byte for byte (its initializers in their order, the model's fields after its graph)."""
    path = tmp_path_factory.mktemp("m") / "m.onnx"
    table = TensorProto(name=name or "t", dims=[raw], data_type=TensorProto.UINT8, doc_string=doc,
                        raw_data=np.random.default_rng(raw).integers(0, 256, raw, np.uint8).tobytes())
    if metadata:
        table.metadata_props.add(key="k", value="v")
    floats = raw // 4 + 2  # over STORED_WEIGHT_BYTES too
    value = TensorProto(dims=[floats], data_type=TensorProto.FLOAT, raw_data=bytes(floats * 4), doc_string=doc)
    nodes = [helper.make_node("Constant", [], ["c"], name="const", value=value, doc_string=node_doc),
             helper.make_node("Identity", [table.name], ["y"])]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.UINT8, [raw]),
                                               helper.make_tensor_value_info("c", TensorProto.FLOAT, [floats])],
                              [table, numpy_helper.from_array(np.arange(3, dtype=np.int64), "small")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], doc_string=doc)
    if metadata:  # ModelProto fields numbered after its graph's
        onnx.helper.set_model_props(model, {"k": "v"})
    path.write_bytes(model.SerializeToString())
    loaded, weights = load_model(path)
    assert set(weights.data) == {table.name, "c"} and weights.constants == {"c"}
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    bare.graph.initializer[0].ClearField("raw_data")
    bare.graph.node[0].attribute[0].t.ClearField("raw_data")
    assert loaded.SerializeToString() == bare.SerializeToString()
    assert _materialized(wire.tensor_record(wire.GRAPH_INITIALIZER, loaded.graph.initializer[0],
                                            weights.data[table.name]), path) == wire.record(wire.GRAPH_INITIALIZER,
                                                                                            table)
    assert _materialized(wire.constant_record(loaded.graph.node[0], weights.data["c"]), path) == wire.record(
        wire.GRAPH_NODE, model.graph.node[0])
    assert weights.read(table.name).tobytes() == table.raw_data
    out = path.with_name("out.onnx")
    save_model_atomic(loaded, out, weights=weights)
    assert out.read_bytes() == path.read_bytes()  # an untouched model is written as protobuf writes it


def test_the_scan_tells_where_raw_data_is_and_where_the_large_nodes_are(tmp_path):
    model = constant_grid_model()
    table = numpy_helper.from_array(np.zeros((100, 50), np.float32), "table")
    model.graph.initializer.append(table)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    scan = scan_model(path)
    assert scan.complete and scan.large_nodes == [0] and list(scan.constant_data) == [0]
    data = path.read_bytes()
    grid = scan.constant_data[0]
    assert data[grid.offset:grid.offset + grid.length] == model.graph.node[0].attribute[0].t.raw_data
    k = len(model.graph.initializer) - 1
    assert scan.initializer_data[k].length == 20_000
    weights = split_weights(onnx.load(str(path)), tmp_path, scan)  # in memory: the data is in the protobuf
    assert {"grid", "table"} <= set(weights.tensors) and not weights.data and weights.data_length("table") == 20_000


def test_data_left_in_the_file_of_a_tensor_that_is_not_stored_is_read_back(tmp_path):
    """A large tensor attribute of a node that is not a plain Constant (a custom op's) is cut by the scan like a
    Constant's; loading reads it back, so the model is whole and only stored tensors lack their data."""
    big = numpy_helper.from_array(np.arange(3000, dtype=np.float32), "")
    node = helper.make_node("Table", ["x"], ["y"], name="custom", domain="com.example", table=big)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    onnx.save(model, tmp_path / "m.onnx")
    assert list(scan_model(tmp_path / "m.onnx").constant_data) == [0]
    loaded, weights = load_model(tmp_path / "m.onnx")
    assert not weights.tensors and loaded == model


def test_an_input_changed_after_loading_is_refused_and_nothing_is_written(tmp_path):
    model = constant_grid_model()
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    loaded, weights = load_model(path)
    assert weights.data
    grid = model.graph.node[0].attribute[0].t
    grid.raw_data = bytes(len(grid.raw_data))  # same size, other bytes
    onnx.save(model, path)
    os.utime(path, ns=(1, 1))  # (a rewrite within one clock tick would still be caught: this one is)
    with pytest.raises(SurgeonError, match="changed while it was being patched; nothing was written"):
        save_model_atomic(loaded, out, weights=weights)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_a_tensor_with_two_raw_data_fields_keeps_protobufs_meaning(tmp_path):
    """Protobuf keeps the last of two raw_data fields; the scan leaves such a tensor to protobuf, so the value
    read and the value written are the last one's, never the first's."""
    first, last = bytes(8000), np.arange(2000, dtype=np.float32).tobytes()
    tensor = TensorProto(name="table", dims=[2000], data_type=TensorProto.FLOAT, raw_data=first)
    tensor_bytes = tensor.SerializeToString() + wire._header(9, len(last)) + last  # TensorProto.raw_data is field 9
    graph = helper.make_graph([helper.make_node("Identity", ["table"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2000])])
    graph_bytes = graph.SerializeToString() + wire._header(wire.GRAPH_INITIALIZER, len(tensor_bytes)) + tensor_bytes
    top = helper.make_model(onnx.GraphProto(), opset_imports=[helper.make_opsetid("", 17)])
    top.ClearField("graph")
    path = tmp_path / "m.onnx"
    path.write_bytes(top.SerializeToString() + wire._header(wire.MODEL_GRAPH, len(graph_bytes)) + graph_bytes)
    assert onnx.load(str(path)).graph.initializer[0].raw_data == last
    loaded, weights = load_model(path)
    assert "table" in weights.tensors and weights.read("table").tobytes() == last
    save_model_atomic(loaded, tmp_path / "out.onnx", weights=weights)
    assert onnx.load(str(tmp_path / "out.onnx")).graph.initializer[0].raw_data == last


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


def test_a_swin_pad_computed_from_static_shapes_gets_its_shape():
    """ONNX inference leaves a Swin block's Pad (and all after it) without a shape; the type table evaluates its
    pads (static shapes and constants only) and knows it, so the passes and the report see those tensors' sizes.
    The model itself is not changed."""
    from deform_surgeon.files import check_and_infer, infer_value_types, split_weights

    model = graphs.swin_pad(size=10, window=7)
    plain = onnx.shape_inference.infer_shapes(model, data_prop=True)
    padded = next(v for v in plain.graph.value_info if v.name == "padded")
    assert not any(d.HasField("dim_value") for d in padded.type.tensor_type.shape.dim)
    before = model.SerializeToString()
    types = infer_value_types(model)
    assert types["padded"] == (TensorProto.FLOAT, (1, 14, 14, 4))  # 10 padded to 2 windows of 7
    assert types["y"] == (TensorProto.FLOAT, (1, 14, 14, 8))
    checked = check_and_infer(model, "swin_pad.onnx", split_weights(model, None))  # what `patch` uses: strict
    assert (checked["padded"], checked["y"]) == (types["padded"], types["y"])
    assert model.SerializeToString() == before
    (y,) = run_ort(model, {"x": np.ones((1, 10, 10, 4), np.float32)})
    assert y.shape == (1, 14, 14, 8)  # what ORT makes at run time
