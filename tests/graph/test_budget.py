"""`deform-surgeon budget`: sizes from graph shapes, biggest first, producer and deform block, peak, exit codes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from helpers import FIXTURES
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon.base.errors import SurgeonError
from deform_surgeon.commands.cli import main
from deform_surgeon.graph.budget import (
    SPEC_MAX_BINDING,
    SPEC_MAX_BUFFER,
    analyze,
    execution_order,
    parse_size,
    write_in_execution_order,
)
from deform_surgeon.graph.device import SPEC_DEFAULT_LIMITS, profile_from_file


@pytest.mark.parametrize("text, value", [("268435456", 268435456), ("256MiB", 256 * 2**20), ("256 mib", 256 * 2**20),
                                         ("1GiB", 2**30), ("0.5GiB", 2**29), ("800MB", 800 * 10**6),
                                         ("16kB", 16000), ("12KiB", 12288), ("7B", 7), (42, 42)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "12Q", "-5", "0", "1.5B", "MiB", "0.1B"])
def test_parse_size_rejects(text):
    with pytest.raises(SurgeonError):
        parse_size(text)


def _chain(shapes: list[list[int]], dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    """x -> Relu -> Reshape -> ... : one tensor per shape, the first is the graph input."""
    nodes, inits = [], []
    prev = "x"
    for k, s in enumerate(shapes[1:], start=1):
        inits.append(numpy_helper.from_array(np.array(s, np.int64), f"s{k}"))
        nodes.append(helper.make_node("Reshape", [prev, f"s{k}"], [f"t{k}"], name=f"reshape{k}"))
        prev = f"t{k}"
    nodes.append(helper.make_node("Relu", [prev], ["y"], name="relu"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, shapes[0])],
                              [helper.make_tensor_value_info("y", dtype, shapes[-1])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sizes_limits_order_and_kinds():
    model = _chain([[64, 1024, 1024], [1024, 64, 1024], [2**26]])  # 256 MiB each (fp32)
    at_default = analyze(model)
    assert at_default.ok and at_default.max_buffer == SPEC_MAX_BUFFER and at_default.max_binding == SPEC_MAX_BINDING
    assert len(at_default.over_binding) == 4 and all(t.nbytes == 2**28 for t in at_default.over_binding)
    lower = analyze(model, max_buffer=2**28 - 1, max_binding=2**20)
    assert not lower.ok and [t.name for t in lower.over_buffer] == ["t1", "t2", "x", "y"]  # same size: by name
    assert {t.kind for t in lower.over_buffer} == {"activation", "input"}
    assert lower.over_buffer[-2].producer == "graph input" and lower.over_buffer[0].producer == "Reshape 'reshape1'"


def test_unknown_shapes_are_counted_not_guessed():
    model = _chain([["n", 8], [-1]])
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array([-1], np.int64), "s1"))
    report = analyze(model)
    assert report.tensors_unknown >= 2 and "x" in report.unknown_examples


def test_the_exporter_fixture_names_producers_and_blocks():
    report = analyze(FIXTURES / "decoder_gathernd.onnx", max_buffer=150_000, max_binding=60_000)
    assert report.blocks == 8 and report.tensors_unknown == 0
    top = report.over_buffer[0]
    assert top.nbytes == 200_704 and top.block.startswith("Conv 'Conv_1004' (decoder_blocks.0.dec_att.aspp_deforms.2")
    gathers = [t for t in report.over_buffer if t.producer.startswith("GatherND")]
    assert len(gathers) == 4 and all(t.shape == [1, 1, 12544, 4] for t in gathers)
    sizes = [t.nbytes for t in report.over_buffer]
    assert sizes == sorted(sizes, reverse=True)


def test_peak_follows_ort_order_and_sees_what_is_alive():
    model = _chain([[4, 4], [16], [2, 8]])
    assert execution_order(model) == [0, 1, 2]
    report = analyze(model)
    assert report.peak_bytes == 2 * 64  # a tensor and the next one are alive together
    assert len(report.peak_live) == 2


def test_device_limits_file_round_trip(tmp_path):
    doc = {"runtime": "node", "adapter": {"limits": {"maxBufferSize": 2**30}},
           "limits": {"maxBufferSize": 2**30, "maxStorageBufferBindingSize": 2**29,
                      "maxStorageBuffersPerShaderStage": 10}}
    path = tmp_path / "limits.json"
    path.write_text(json.dumps(doc))
    profile = profile_from_file(path)
    assert (profile.max_buffer, profile.max_binding, profile.storage_buffers) == (2**30, 2**29, 10)
    path.write_text(json.dumps({"maxBufferSize": 12345}))
    profile = profile_from_file(path)  # a limit the file does not name is the spec's default
    assert profile.max_buffer == 12345 and profile.limits == {**SPEC_DEFAULT_LIMITS, "maxBufferSize": 12345}
    path.write_text(json.dumps({"nothing": 1}))
    with pytest.raises(SurgeonError, match="no WebGPU limits"):
        profile_from_file(path)
    path.write_text("{not json")
    with pytest.raises(SurgeonError, match="not JSON"):
        profile_from_file(path)


def test_cli_exit_codes_table_and_json(tmp_path, capsys):
    model = FIXTURES / "decoder_gathernd.onnx"
    assert main(["budget", str(model)]) == 0
    out = capsys.readouterr().out
    assert "nothing over maxBufferSize" in out and "OK:" in out and "device profile 'spec-default'" in out
    js = tmp_path / "b.json"
    assert main(["budget", str(model), "--max-buffer", "150kB", "--max-binding", "60000", "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert "OVER maxBufferSize" in out and "FAIL: 4" not in out and "GatherND 'GatherND_987'" in out
    doc = json.loads(js.read_text())
    assert doc["limits"]["max_buffer"] == 150_000 and not doc["ok"] and doc["over_buffer"][0]["nbytes"] == 200_704
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"limits": {"maxBufferSize": 100_000, "maxStorageBufferBindingSize": 50_000}}))
    assert main(["budget", str(model), "--device-profile", str(limits)]) == 1
    assert f"limits from {limits}" in capsys.readouterr().out
    assert main(["budget", str(model), "--device-profile", str(limits), "--max-buffer", "1GiB"]) == 0
    capsys.readouterr()


def test_cli_bad_input(tmp_path, capsys):
    assert main(["budget", str(tmp_path / "missing.onnx")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["budget", str(FIXTURES / "decoder_gathernd.onnx"), "--max-buffer", "lots"])
    assert exc.value.code == 2
    assert "bad size 'lots'" in capsys.readouterr().err


def test_patch_cli_takes_max_buffer(tmp_path, capsys):
    out = tmp_path / "p.onnx"
    assert main(["patch", str(FIXTURES / "decoder_gathernd.onnx"), str(out), "--max-buffer", "60000",
                 "--report", str(tmp_path / "r.json")]) == 3  # tensors outside the block stay over 60,000 B
    text = capsys.readouterr().out
    assert "split: 1 node(s) rewritten" in text and "split into 4 chunks" in text
    assert "refused: 7 tensor(s) over the device profile" in text and out.exists()
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["options"]["max_buffer"] == 60000
    assert any(n["pass_name"] == "split" and n["details"]["chunks"] == 4 for n in doc["nodes"])
    assert main(["inspect", str(FIXTURES / "decoder_gathernd.onnx"), "--max-buffer", "60000"]) == 0
    assert "split: 1 node(s) rewritten" in capsys.readouterr().out


def test_patch_cli_takes_max_memory(tmp_path, capsys):
    out = tmp_path / "p.onnx"
    assert main(["patch", str(FIXTURES / "decoder_gathernd.onnx"), str(out), "--max-memory", "800kB",
                 "--report", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "--max-memory 800,000 B: peak of live activations" in text and "within the limit" in text
    assert json.loads((tmp_path / "r.json").read_text())["options"]["max_memory"] == 800_000
    assert main(["budget", str(out), "--max-memory", "800kB"]) == 0
    assert "OK: peak of live activations" in capsys.readouterr().out
    assert main(["budget", str(FIXTURES / "decoder_gathernd.onnx"), "--max-memory", "800kB"]) == 1
    assert "FAIL: peak of live activations 1.3 MB (1.2 MiB) OVER --max-memory 800,000 B" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["patch", str(FIXTURES / "decoder_gathernd.onnx"), str(out), "--max-memory", "lots"])
    assert exc.value.code == 2 and "bad size 'lots'" in capsys.readouterr().err


def test_the_peak_is_attributed_to_the_deform_blocks_live_at_it():
    report = analyze(FIXTURES / "decoder_gathernd.onnx")
    label, held = max(report.peak_blocks.items(), key=lambda kv: kv[1])
    assert label.startswith("Conv 'Conv_1004'")  # the 7x7 block, as the largest live tensors say
    assert sum(report.peak_blocks.values()) <= report.peak_bytes and held > report.peak_bytes // 2
    assert all(t.block == label for t in report.peak_live)


def _interleaved_branches() -> onnx.ModelProto:
    """Two branches that each widen [1, 100] to [100, 100] and sum it back, written interleaved."""
    shape = numpy_helper.from_array(np.array([100, 100], np.int64), "shape")
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [helper.make_node("Expand", ["x", "shape"], ["a1"], name="a1"),
             helper.make_node("Expand", ["x", "shape"], ["b1"], name="b1"),
             helper.make_node("ReduceSum", ["a1", "axes"], ["a2"], name="a2"),
             helper.make_node("ReduceSum", ["b1", "axes"], ["b2"], name="b2"),
             helper.make_node("Add", ["a2", "b2"], ["y"], name="y")]
    graph = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 100])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 100])], [shape, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_peak_in_the_files_own_order_beside_orts_default_order():
    """A depth-first order runs one branch after the other (one wide tensor live at a time), the file's order
    makes both wide tensors first; budget gives both peaks."""
    report = analyze(_interleaved_branches())
    wide, small = 100 * 100 * 4, 100 * 4
    assert report.peak_bytes == wide + 2 * small  # x, a1, a2 at a2 (x still read by b1)
    assert report.peak_file_bytes == 2 * wide + small  # x, a1, b1 at b1
    assert f"in the file's own node order: {report.peak_file_bytes:,} B" in report.format()
    assert json.loads(report.to_json())["peak"]["file_order_bytes"] == report.peak_file_bytes


def test_written_in_execution_order_the_files_peak_is_orts():
    model = _interleaved_branches()
    protos = {n.name: n for n in model.graph.node}
    assert write_in_execution_order(model)
    assert [n.name for n in model.graph.node] == ["a1", "a2", "b1", "b2", "y"]
    assert all(n is protos[n.name] for n in model.graph.node)  # moved, not copied
    onnx.checker.check_model(model, full_check=True)
    report = analyze(model)
    assert report.peak_file_bytes == report.peak_bytes == 100 * 100 * 4 + 2 * 100 * 4
    assert not write_in_execution_order(model)  # already in that order: nothing to do


def test_a_graph_with_a_subgraph_keeps_its_order():
    """An If's branches may read tensors of the outer graph, which the order does not count as inputs."""
    model = _interleaved_branches()
    then = helper.make_graph([helper.make_node("Identity", ["b1"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [100, 100])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    model.graph.initializer.append(cond)
    model.graph.node.append(helper.make_node("If", ["cond"], ["u"], then_branch=then, else_branch=then, name="if"))
    model.graph.output.append(helper.make_tensor_value_info("u", TensorProto.FLOAT, [100, 100]))
    names = [n.name for n in model.graph.node]
    assert not write_in_execution_order(model)
    assert [n.name for n in model.graph.node] == names


def _ort_run_order(model: onnx.ModelProto, tmp_path) -> list[str]:
    """The nodes' names in the order ORT CPU ran them (its profiler's kernel events; level `disable`, so the nodes
    it runs are the file's)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {i.name: np.zeros([d.dim_value for d in i.type.tensor_type.shape.dim], np.float32)
             for i in model.graph.input}
    session.run(None, feeds)
    events = json.loads(open(session.end_profiling()).read())
    return [e["name"].removesuffix("_kernel_time") for e in events
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


@pytest.mark.parametrize("name", ["branches", "decoder_gathernd"])
def test_orts_default_order_is_the_walk_taking_the_highest_index_first(name, tmp_path):
    """What ORT runs, read from its profiler: the depth-first walk that takes a node's inputs, and the outputs,
    highest index first; budget's peak walk takes them lowest first (the order `patch` writes chunks in)."""
    model = _interleaved_branches() if name == "branches" else onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    ran = _ort_run_order(model, tmp_path)
    names = [n.name for n in model.graph.node]
    assert len(ran) > len(names) // 2
    for highest_first, same in ((True, True), (False, False)):
        walk = [names[k] for k in execution_order(model, highest_first=highest_first) if names[k] in set(ran)]
        assert (walk == ran) is same
    if name == "branches":
        assert ran == ["b1", "b2", "a1", "a2", "y"]
        report = analyze(model)
        assert report.peak_ort_bytes == report.peak_bytes  # the two walks are mirror images: same peak here
        assert json.loads(report.to_json())["peak"]["ort_order_bytes"] == report.peak_ort_bytes
        assert f"in ORT's default order (the same walk, inputs highest index first): {report.peak_ort_bytes:,} B" \
            in report.format()


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic-height"])
def test_budget_sees_the_sizes_patch_sees(tmp_path, symbolic):
    """`budget` reads the type table `patch` reads (one strict inference, the Swin pads to whole windows
    evaluated), so its count of tensors of unknown size is what `patch`'s type table leaves unknown: none on the
    Swin pad replica, where plain ONNX inference loses the Pad's output and the MatMul after it; with a symbolic
    height (the pads are then not static), the same tensors for both."""
    from helpers import graphs

    from deform_surgeon.commands.patch import PatchRun
    from deform_surgeon.commands.patching.options import rewrite_options
    from deform_surgeon.files import TypeTable
    from deform_surgeon.graph.budget import sized_tensors

    model = graphs.swin_pad(size=10, window=7)
    if symbolic:
        model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "height"
    path = tmp_path / "swin_pad.onnx"
    onnx.save(model, path)
    patch_types = PatchRun(path, rewrite_options()).lift_once().types  # what `patch` proves and fits with
    patch_unknown = sized_tensors(model, patch_types)[1]
    report = analyze(path)
    assert report.tensors_unknown == len(patch_unknown) and report.unknown_examples == patch_unknown[:5]
    plain = sized_tensors(model, TypeTable(onnx.shape_inference.infer_shapes(model, data_prop=True).graph))[1]
    if symbolic:
        assert {"padded", "y"} <= set(patch_unknown)
    else:
        assert patch_unknown == [] and {"padded", "y"} <= set(plain)  # what budget reported before
        assert next(t for t in report.largest if t.name == "y").shape == [1, 14, 14, 8]


def test_the_three_peaks_are_one_walk_over_three_orders():
    """The peak in budget's order, in the file's and in ORT's come from one tensor-lifetime walk (`_in_order`) over
    three node orders: on a model already in budget's order, the file's peak is budget's."""
    model = onnx.load(FIXTURES / "decoder_gathernd.onnx")
    write_in_execution_order(model)
    report = analyze(model)
    assert report.peak_file_bytes == report.peak_bytes > 0 and report.peak_ort_bytes > 0
