"""Bands pass: ordinary tensors over --max-buffer (BiRefNet's decoder tail) are computed in row bands (Conv) and
channel groups (Resize), each shown exact on its own (passes/local_proof.py) before anything is written."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graphs import decoder_tail
from helpers import assert_bytes_equal, patch_in_memory
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon import patch
from deform_surgeon.budget import analyze
from deform_surgeon.pipeline import Outcome, Refuse

KiB = 1024
LEVELS = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}


def run(model: onnx.ModelProto | str, feeds: dict, level: str = "all") -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def feeds_for(model: onnx.ModelProto, seed: int = 0, integers: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = (rng.integers(-3, 4, shape) if integers else rng.standard_normal(shape)).astype(np.float32)
    return out


def bands_actions(actions) -> list:
    return [a for a in actions if a.pass_name == "bands"]


def over(model: onnx.ModelProto | str, limit: int) -> list[str]:
    return [t.name for t in analyze(model, max_buffer=limit, max_binding=2**62).over_buffer]


# ------------------------------------------------------------------------------------ BiRefNet's decoder tail
@pytest.mark.parametrize("current", [False, True], ids=["legacy", "current"])
def test_decoder_tail_fits_the_limit_and_is_byte_identical(tmp_path, current):
    """The replica of BiRefNet's decoder tail at 300 KiB: the 512 KiB Resize in channel groups, the three Convs
    reading 320-640 KiB inputs in row bands; each is shown exact on its own before writing, nothing is over. In the
    current code's form the Resize is also read by a Shape (a Constant afterwards) and the image branch's first
    Conv has an input of unknown shape (derived from its output for the bands)."""
    src, out, limit = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx", 300 * KiB
    onnx.save(decoder_tail(current=current), src)
    assert sorted(over(str(src), limit)) == ["att_cat", "dec_up", "ipt_conv1", "out_cat"]
    report = patch(src, out, max_buffer=limit)
    acts = {a.node: a for a in bands_actions(report.actions)}
    assert sorted(acts) == ["Conv_att_conv1", "Conv_ipt_conv_out", "Conv_mask", "Resize_dec_up"]
    assert all(a.action == Outcome.REWRITTEN and not a.needs_verify for a in acts.values())
    assert all(a.details["shown_exact"] == "on_its_own" for a in acts.values())
    resize = acts["Resize_dec_up"].details
    assert (resize["groups"], resize["group_channels"], resize["channels"]) == (2, [16, 16], 32)
    assert resize["source"] == "Conv_dec_conv_out"  # the Conv computed for each group's channels, not a Slice
    assert resize["shape_readers"] == (1 if current else 0)  # a Shape reader becomes a Constant
    assert acts["Conv_ipt_conv_out"].details["source"] == "Conv_ipt_conv1"
    assert acts["Conv_att_conv1"].details["carried"] == ["Relu"]
    assert all(a.details["band_bytes"] <= limit for a in acts.values() if a.op == "Conv")
    assert report.written and over(str(out), limit) == []
    model = onnx.load(src)
    for seed in (0, 1):
        feeds = feeds_for(model, seed)
        for level in LEVELS:
            assert_bytes_equal(run(model, feeds, level), run(str(out), feeds, level))
    # a second patch finds nothing over the limit and changes nothing
    again = patch(out, tmp_path / "again.onnx", max_buffer=limit)
    assert not again.changed and not again.refused and not (tmp_path / "again.onnx").exists()


def test_without_max_buffer_the_tail_is_left_alone(tmp_path):
    src = tmp_path / "tail.onnx"
    onnx.save(decoder_tail(), src)
    report = patch(src, tmp_path / "out.onnx")
    assert not bands_actions(report.actions) and not report.changed


def test_a_band_not_shown_exact_on_the_whole_model_is_undone(tmp_path):
    """What `patch` does when the whole patched model differs: it keeps those nodes whole (the plan's
    keep_whole, here given up front as the fallback gives it), says why, and writes the rest."""
    from deform_surgeon.passes.split import SplitPlan
    from deform_surgeon.surgeon import _lift, _options

    src = tmp_path / "tail.onnx"
    onnx.save(decoder_tail(), src)
    why = "not shown exact on the whole model: (test)"
    plan = SplitPlan(keep_whole={"Conv_mask": Refuse(why, undone="whole_model"),
                                 "Resize_dec_up": Refuse(why, undone="whole_model")})
    lifted, _ = _lift(src, _options(False, None, 300 * KiB), plan)
    acts = {a.node: a for a in bands_actions(lifted.actions)}
    assert acts["Conv_mask"].action == Outcome.REFUSED and acts["Conv_mask"].details["undone"] == "whole_model"
    assert acts["Conv_mask"].reason.endswith(why)  # the reason says why, for a person
    resize = acts["Resize_dec_up"]
    assert resize.action == Outcome.REFUSED and resize.details["undone"] == "whole_model"
    assert (resize.details["tensor"], resize.details["size_bytes"], resize.details["limit_bytes"]) == \
        ("dec_up", 524_288, 300 * KiB)
    assert acts["Conv_att_conv1"].action == Outcome.REWRITTEN


def test_groups_from_a_slice_when_the_conv_output_is_read_elsewhere(tmp_path):
    """When the Conv before the Resize is also read elsewhere (here: a second graph output), the groups would read
    Slices of its output. Whatever ORT's level-all layout makes of that, what is written is byte-identical."""
    model = decoder_tail()
    model.graph.output.append(helper.make_tensor_value_info("dec_conv_out", TensorProto.FLOAT, [1, 32, 32, 32]))
    src, out = tmp_path / "tail2.onnx", tmp_path / "tail2.patched.onnx"
    onnx.save(model, src)
    report = patch(src, out, max_buffer=300 * KiB)
    act = next(a for a in bands_actions(report.actions) if a.node == "Resize_dec_up")
    # its proof runs the Conv before it too (the NCHWc layout reaches the whole Resize, not the Slices' groups):
    # the groups differ at level 'all', so the Resize is kept whole, with the measured difference
    assert act.action == Outcome.REFUSED and act.details["undone"] == "on_its_own"
    assert act.details["level"] == "all" and 0 < act.details["max_diff"] < 1e-7  # measured: 3e-08
    assert "1 rewrite(s) undone: not shown exact on their own" in report.note
    feeds = feeds_for(model)
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(str(out), feeds, level))


# -------------------------------------------------------------------------------------- refusals, with reasons
def _concat_conv(inputs: list[tuple[str, int]], hw: int = 16, extra_reader: bool = False, stride: int = 1
                 ) -> onnx.ModelProto:
    """Inputs [1, c, hw, hw] -> Concat(axis 1) -> 3x3 Conv (pads 1) -> y (and the Concat also a graph output)."""
    c = sum(ch for _, ch in inputs)
    w = numpy_helper.from_array(np.ones((2, c, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Concat", [n for n, _ in inputs], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[stride, stride])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, [1, c, hw, hw]))
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, ch, hw, hw]) for n, ch in inputs]
    graph = helper.make_graph(nodes, "concat_conv", ins, outs, [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_refused_when_the_input_is_needed_whole_anyway():
    _, actions = patch_in_memory(_concat_conv([("a", 4), ("b", 4)], extra_reader=True), max_buffer=4 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REFUSED and act.details["read_elsewhere"] == "cat"


def test_refused_when_a_concat_input_is_itself_over_the_limit():
    _, actions = patch_in_memory(_concat_conv([("a", 12), ("b", 2)]), max_buffer=10 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REFUSED and (act.details["source"], act.details["source_bytes"]) == ("a", 12_288)
    assert act.details["source_bytes"] > act.details["limit_bytes"] == 10 * KiB


# --------------------------------------------------------------------------- the band geometry, for any window
def _conv_chain(cin: int, hw: int, first: tuple, second: tuple, seed: int) -> onnx.ModelProto:
    """x -> Conv(first) -> Conv(second) -> y, integer weights (any summation order gives the same bytes, so the
    comparison checks which values each band reads, not how a kernel rounds)."""
    rng = np.random.default_rng(seed)
    nodes, inits, c = [], [], cin
    for k, (kernel, stride, dilation, pad_top, pad_bottom, cout) in enumerate((first, second)):
        inits.append(numpy_helper.from_array(rng.integers(-2, 3, (cout, c, kernel, kernel)).astype(np.float32),
                                             f"w{k}"))
        nodes.append(helper.make_node("Conv", ["x" if k == 0 else "h", f"w{k}"], ["h" if k == 0 else "y"],
                                      name=f"conv{k}", kernel_shape=[kernel, kernel], strides=[stride, 1],
                                      dilations=[dilation, 1], pads=[pad_top, 1, pad_bottom, 1]))
        c = cout
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


window = st.tuples(st.sampled_from([1, 2, 3, 5]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
                   st.integers(0, 2), st.integers(0, 2), st.integers(2, 6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=window, second=window, hw=st.integers(12, 40), fraction=st.sampled_from([2, 3, 5]),
       seed=st.integers(0, 99))
@example(first=(1, 1, 1, 0, 0, 6), second=(3, 1, 2, 0, 0, 5), hw=14, fraction=3, seed=0)  # 10 bands: a join tree
def test_bands_read_exactly_the_rows_the_conv_reads(first, second, hw, fraction, seed):
    model = _conv_chain(3, hw, first, second, seed)
    h = next(vi for vi in model.graph.value_info if vi.name == "h")
    h_shape = [d.dim_value for d in h.type.tensor_type.shape.dim]
    y_rows = (h_shape[2] + second[3] + second[4] - ((second[0] - 1) * second[2] + 1)) // second[1] + 1
    if h_shape[2] < 1 or y_rows < 2:
        return  # the Convs have no room to band
    h_bytes, x_bytes = 4 * int(np.prod(h_shape)), 4 * 3 * hw * 6
    limit = max(x_bytes, h_bytes // fraction)
    if h_bytes <= limit:
        return  # the Conv's input is not over any limit its own input fits
    patched, actions = patch_in_memory(model, max_buffer=limit)
    (act,) = bands_actions(actions)
    feeds = feeds_for(model, seed, integers=True)
    if act.action == Outcome.REFUSED:  # no room to band, or its proof (float data, levels disable and all) differs
        assert act.details.get("band_bytes", 0) > limit or "output_rows" in act.details \
            or act.details.get("undone") == "on_its_own"
        return
    assert act.details["bands"] == len(act.details["band_rows"]) >= 2 and act.details["band_bytes"] <= limit
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(patched, feeds, level))
    # weights, and the joined output (over the limit as before) with the partial joins the fit pass makes of it
    # when there are more bands than a Concat may bind: each holds some of the output's rows
    whole = {t.name for t in model.graph.initializer} | _join_tree(patched, "y")
    assert [t for t in over(patched, limit) if t not in whole] == []


def _join_tree(model: onnx.ModelProto, name: str) -> set[str]:
    """`name` and the outputs of the Concats that feed it through Concats only."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    tree, todo = set(), [name]
    while todo:
        t = todo.pop()
        tree.add(t)
        node = made_by.get(t)
        if node is not None and node.op_type == "Concat":
            todo += [i for i in node.input if i in made_by and made_by[i].op_type == "Concat"]
    return tree


@pytest.mark.parametrize("stride", [1, 2])
def test_concat_bands_with_halo_and_stride(stride):
    model = _concat_conv([("a", 4), ("b", 3)], hw=20, stride=stride)
    patched, actions = patch_in_memory(model, max_buffer=7 * KiB)
    (act,) = bands_actions(actions)
    assert act.action == Outcome.REWRITTEN, act.reason
    feeds = feeds_for(model, 3, integers=True)
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(patched, feeds, level))


# ------------------------------------------------------------------------------------- on the WebGPU runtimes
@pytest.mark.webgpu
@pytest.mark.parametrize("runtime,bundle", [("node", None), ("browser", "webgpu"), ("browser", "jsep")])
def test_the_banded_tail_stays_on_the_gpu_and_matches_ort_cpu(tmp_path, runtime, bundle):
    """The bands and groups are Slice / Concat / Conv / Resize: every node has a kernel on both WebGPU EPs, so
    the patched tail runs with 0 CPU nodes and 0 Memcpy, its output within the GPU's Conv tolerance of ORT CPU."""
    from deform_surgeon.placement import measure_placement, missing_setup

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    onnx.save(decoder_tail(), src)
    assert patch(src, out, max_buffer=300 * KiB).written
    p = measure_placement(out, runtime, bundle, run=True, timeout=300)
    assert p.session_ok and p.cpu_nodes == 0 and p.memcpy == 0, (p.error, p.cpu_ops)
    assert p.run["ok"], p.run["error"]
    assert max(o["max_abs_diff"] for o in p.run["outputs"].values()) < 1e-4
