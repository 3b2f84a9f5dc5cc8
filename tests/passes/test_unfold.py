"""passes/unfold.py, asked for by `--device-profile wasm`: the large broadcasts ORT would store when it folds are
computed at run time, the written model gives the same bytes, and ORT stores none of them any more.

`_swin_scores` stands for a shifted-window block of the real Swin backbones (BiRefNet's, as exported): the
relative-position bias [1, heads, N, N] (a stored table, gathered, transposed, unsqueezed) plus the window mask
[windows, 1, N, N] (a stored constant, reshaped and unsqueezed), added to the attention scores. In the real full
BiRefNet at 1024 ORT stores 23 such sums, 1.36 GB (docs/runtime-facts.md, "The wasm backend")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import deform_surgeon as ds
from deform_surgeon.base.js_runtimes import missing_setup
from deform_surgeon.base.ort_cpu import run_ort_cpu
from deform_surgeon.passes.unfold import FLAG, stored_by_ort

WINDOWS, HEADS, N = 300, 4, 64  # the stored sum: 300 x 4 x 64 x 64 float32, 19.7 MB (FOLD_LIMIT is 16 MiB)
SUM = "/attn/Add_output_0"


def _swin_scores(path: Path, input_type: int = TensorProto.FLOAT, windows: int | str = WINDOWS) -> Path:
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((N * N, HEADS)).astype(np.float32), "table")
    index = numpy_helper.from_array(rng.integers(0, N * N, N * N).astype(np.int64), "index")
    mask = numpy_helper.from_array(np.where(rng.random((WINDOWS, N * N)) < 0.5, -100.0, 0.0).astype(np.float32),
                                   "mask")
    shapes = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("nnh", [N, N, HEADS]), ("wnn", [WINDOWS, N, N]), ("ax0", [0]), ("ax1", [1]))]
    nodes = [
        helper.make_node("Gather", ["table", "index"], ["g"], name="/attn/Gather"),
        helper.make_node("Reshape", ["g", "nnh"], ["r"], name="/attn/Reshape"),
        helper.make_node("Transpose", ["r"], ["t"], perm=[2, 0, 1], name="/attn/Transpose"),
        helper.make_node("Unsqueeze", ["t", "ax0"], ["bias"], name="/attn/Unsqueeze"),
        helper.make_node("Reshape", ["mask", "wnn"], ["m"], name="/Reshape_mask"),
        helper.make_node("Unsqueeze", ["m", "ax1"], ["window_mask"], name="/attn/Unsqueeze_mask"),
        helper.make_node("Add", ["bias", "window_mask"], [SUM], name="/attn/Add"),
    ]
    inputs = [helper.make_tensor_value_info("scores", input_type, [windows, HEADS, N, N])]
    if input_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", ["scores"], ["scores_f"], to=TensorProto.FLOAT, name="/Cast"))
    nodes += [helper.make_node("Add", ["scores" if input_type == TensorProto.FLOAT else "scores_f", SUM], ["a"],
                               name="/attn/Add_1"),
              helper.make_node("Softmax", ["a"], ["probs"], axis=-1, name="/attn/Softmax")]
    graph = helper.make_graph(nodes, "swin_scores", inputs,
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [windows, HEADS, N, N])],
                              [table, index, mask, *shapes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _unfold_actions(report) -> list[dict]:
    return [a for a in report.to_dict()["nodes"] if a["pass_name"] == "unfold"]


def test_wasm_profile_computes_the_stored_sum_at_run_time_and_the_bytes_stay(tmp_path: Path) -> None:
    original = _swin_scores(tmp_path / "swin.onnx")
    assert stored_by_ort(original) == {SUM: (WINDOWS, HEADS, N, N)}  # ORT folds and keeps the 19.7 MB sum
    patched = tmp_path / "swin.wasm.onnx"
    report = ds.patch(original, patched, device_profile="wasm", verify=True)
    (action,) = _unfold_actions(report)
    assert action["action"] == "rewritten" and action["node"] == "/attn/Add", action
    assert "shown exact with its readers on ORT CPU at levels 'disable' and 'all'" in action["reason"]
    assert action["details"] == {"stored_bytes": WINDOWS * HEADS * N * N * 4, "shape": [WINDOWS, HEADS, N, N]}
    assert stored_by_ort(patched) == {}  # nothing over the limit is stored any more
    model = onnx.load(str(patched))
    (where,) = [n for n in model.graph.node if n.op_type == "Where"]
    assert list(where.input) == [FLAG, "bias", "bias"] and where.output[0] in model.graph.node[-3].input
    x = np.random.default_rng(1).standard_normal((WINDOWS, HEADS, N, N)).astype(np.float32)
    x.flat[0] = np.nan  # the flag's false: the Where gives the same tensor
    for level in ("disable", "all"):  # the whole model, byte for byte, at two thread counts
        assert ds.verify(original, patched, opt_level=level, iterations=1, threads=[1, 2]).identical
        for threads in (1, 2):
            (a,), (b,) = (run_ort_cpu(onnx.load(str(p)), {"scores": x}, level, threads=threads)
                          for p in (original, patched))
            assert a.tobytes() == b.tobytes()


def test_plain_patch_leaves_what_ort_stores(tmp_path: Path) -> None:
    original = _swin_scores(tmp_path / "swin.onnx")
    report = ds.patch(original, tmp_path / "out.onnx", copy_unchanged=True)
    assert _unfold_actions(report) == []


def test_without_a_float32_input_it_is_left_and_says_why(tmp_path: Path) -> None:
    original = _swin_scores(tmp_path / "swin_int.onnx", input_type=TensorProto.INT32)
    report = ds.patch(original, tmp_path / "out.onnx", device_profile="wasm", copy_unchanged=True)
    (action,) = _unfold_actions(report)
    assert action["action"] == "refused" and action["reason"].endswith(
        "left: no float32 graph input to compute the run-time flag from"), action


def test_with_input_shapes_it_is_not_asked_and_says_why(tmp_path: Path) -> None:
    """ORT reads the file, whose dims --input-shapes fixes only in memory: what it would store there is not what
    the written model holds, so the wasm profile does not ask and the report says so."""
    original = _swin_scores(tmp_path / "swin_dynamic.onnx", windows="windows")
    report = ds.patch(original, tmp_path / "out.onnx", device_profile="wasm", copy_unchanged=True,
                      input_shapes={"scores": [WINDOWS, HEADS, N, N]})
    (action,) = _unfold_actions(report)
    assert action["action"] == "refused" and action["reason"].startswith("not asked: ORT reads the file"), action


@pytest.mark.webgpu
@pytest.mark.skipif(missing_setup("browser") is not None, reason=f"runtimes not set up: {missing_setup('browser')}")
def test_on_the_wasm_backend_the_heap_holds_less_and_the_bytes_are_the_originals(tmp_path: Path) -> None:
    """onnxruntime-web's wasm backend in Chromium: the session of the patched model leaves a smaller heap than the
    original's (no stored sum), and both runs give the same bytes."""
    from deform_surgeon.webgpu.placement import measure_placement

    original = _swin_scores(tmp_path / "swin.onnx")
    patched = tmp_path / "swin.wasm.onnx"
    ds.patch(original, patched, device_profile="wasm")
    runs = [measure_placement(m, runtime="browser", bundle="wasm", run=True, timeout=600) for m in (original, patched)]
    for p in runs:
        assert p.session_ok and p.run["ok"], (p.error, p.run)
        assert 0 < p.wasm_heap["after_session"]["bytes"] <= p.wasm_heap["after_run"]["bytes"] <= 4294901760
    assert runs[1].wasm_heap["after_session"]["bytes"] < runs[0].wasm_heap["after_session"]["bytes"]
    digests = [p.run["outputs"]["probs"]["sha256"] for p in runs]
    assert digests[0] == digests[1]
