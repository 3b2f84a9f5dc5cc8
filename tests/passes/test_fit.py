"""The fit pass: wide Split / Concat / Max / Min become trees whose every node binds at most the device profile's
storage buffers; the outputs are byte-identical on ORT CPU (NaN and signed zeros included), a second patch finds
nothing, and what cannot be fitted exactly is refused with its reason. Runs the production path (`ds.patch`:
region lifting, splice, checker), on models of any width and axis (hypothesis), and on the legacy BiRefNet form."""

from __future__ import annotations

import json

import numpy as np
import onnx
from helpers import assert_bytes_equal, run_ort
from helpers.graphs import legacy_patches, wide_split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import deform_surgeon as ds
from deform_surgeon.commands.cli import main
from deform_surgeon.graph.budget import analyze
from deform_surgeon.graph.device import resolve_profile, storage_buffers
from deform_surgeon.webgpu.placement.runner import limit_violations


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "fit", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _widest(model: onnx.ModelProto) -> int:
    return max(storage_buffers(n.op_type, list(n.input), list(n.output)) for n in model.graph.node)


def _feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Random values with NaN, +-inf and both zeros mixed in: Max/Min differ on those if the order changes."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        x = rng.standard_normal(shape).astype(np.float32)
        special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=np.float32)
        mask = rng.random(shape) < 0.2
        x[mask] = rng.choice(special, size=int(mask.sum()))
        feeds[vi.name] = x
    return feeds


def _patch_and_compare(tmp_path, model: onnx.ModelProto, limit: int, name: str = "m") -> tuple[onnx.ModelProto,
                                                                                               ds.PatchReport]:
    src, out = tmp_path / f"{name}.onnx", tmp_path / f"{name}.fit.onnx"
    onnx.save(model, src)
    profile = tmp_path / f"{name}.limits.json"
    profile.write_text(json.dumps({"limits": {"maxStorageBuffersPerShaderStage": limit}}))
    report = ds.patch(src, out, device_profile=profile, copy_unchanged=True)
    assert report.written, report.format()
    patched = onnx.load(out)
    assert _widest(patched) <= limit
    feeds = _feeds(model, seed=limit)
    assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))
    again = ds.patch(out, tmp_path / f"{name}.again.onnx", device_profile=profile)
    assert not again.changed and not again.written  # idempotent: every node already fits
    return patched, report


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 40), axis=st.integers(-3, 2), limit=st.integers(3, 12), sizes_seed=st.integers(0, 99))
def test_concat_of_any_width_and_axis(tmp_path, n, axis, limit, sizes_seed):
    rng = np.random.default_rng(sizes_seed)
    base = [2, 3, 4]
    shapes = []
    for _ in range(n):
        s = list(base)
        s[axis] = int(rng.integers(1, 4))
        shapes.append(s)
    names = [f"x{i}" for i in range(n)]
    model = _model([helper.make_node("Concat", names, ["y"], name="wide", axis=axis)],
                   [helper.make_tensor_value_info(x, TensorProto.FLOAT, s) for x, s in zip(names, shapes,
                                                                                           strict=True)],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    _, report = _patch_and_compare(tmp_path, model, limit)
    assert report.changed == (n + 1 > limit)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 40), axis=st.integers(-3, 2), limit=st.integers(3, 12),
       form=st.sampled_from(["sizes", "equal", "num_outputs"]), sizes_seed=st.integers(0, 99))
def test_split_of_any_width_and_axis(tmp_path, n, axis, limit, form, sizes_seed):
    rng = np.random.default_rng(sizes_seed)
    sizes = [int(rng.integers(1, 4)) for _ in range(n)] if form == "sizes" else [2] * n
    if form == "num_outputs":  # opset 18: ceil(dim / n) each, the last one smaller
        sizes = [3] * (n - 1) + [1]
    shape = [2, 3, 4]
    shape[axis] = sum(sizes)
    outs = [f"y{i}" for i in range(n)]
    inits, inputs, attrs, opset = [], ["x"], {"axis": axis}, 17
    if form == "sizes":
        inits = [numpy_helper.from_array(np.array(sizes, dtype=np.int64), "sizes")]
        inputs = ["x", "sizes"]
    elif form == "num_outputs":
        attrs["num_outputs"], opset = n, 18
    model = _model([helper.make_node("Split", inputs, outs, name="wide", **attrs)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                   [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits, opset)
    _, report = _patch_and_compare(tmp_path, model, limit)
    assert report.changed == (n + 1 > limit)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 30), limit=st.integers(3, 12), op=st.sampled_from(["Max", "Min"]),
       broadcast=st.booleans())
def test_max_min_chains_keep_the_left_fold(tmp_path, n, limit, op, broadcast):
    names = [f"x{i}" for i in range(n)]
    shapes = [[2, 5] if not (broadcast and i % 3 == 1) else [1, 5] for i in range(n)]
    model = _model([helper.make_node(op, names, ["y"], name="wide")],
                   [helper.make_tensor_value_info(x, TensorProto.FLOAT, s) for x, s in zip(names, shapes,
                                                                                           strict=True)],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    _patch_and_compare(tmp_path, model, limit)


def test_refusals_name_the_reason(tmp_path):
    names = [f"x{i}" for i in range(9)]
    model = _model([helper.make_node("Mean", names, ["y"], name="wide_mean")],
                   [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2]) for x in names],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    src = tmp_path / "mean.onnx"
    onnx.save(model, src)
    report = ds.inspect(src)
    (refusal,) = report.refused
    assert (refusal.node, refusal.op) == ("wide_mean", "Mean") and not report.changed
    assert refusal.details == {"buffers": 10, "buffers_limit": 8}
    # an equal Split of an axis of unknown size: its outputs' sizes are unknown, so it is left alone
    outs = [f"y{i}" for i in range(9)]
    model = _model([helper.make_node("Split", ["x"], outs, name="unknown_split", axis=0)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                   [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    onnx.save(model, src)
    (refusal,) = ds.inspect(src).refused
    assert refusal.node == "unknown_split" and refusal.details == {"buffers": 10, "buffers_limit": 8}
    assert refusal.reason  # (its outputs' sizes along the axis are unknown, it says)
    assert main(["patch", str(src), str(tmp_path / "o.onnx"), "--strict"]) == 3


def test_the_profile_decides(tmp_path):
    """The same 9-buffer Split fits a 12-buffer device as it is and is fitted for the spec's 8."""
    src = tmp_path / "split8.onnx"
    onnx.save(wide_split(n=8), src)
    assert ds.inspect(src).changed
    adapter_like = tmp_path / "twelve.json"
    adapter_like.write_text(json.dumps({"adapter": {"limits": {"maxStorageBuffersPerShaderStage": 12}}}))
    assert not ds.inspect(src, device_profile=adapter_like).changed
    assert main(["patch", str(src), str(tmp_path / "o.onnx"), "--device-profile", str(tmp_path / "nope.json")]) == 2


def test_legacy_birefnet_patches(tmp_path, capsys):
    """BiRefNet's 2024 form (see graphs.legacy_patches): 63 nodes over 8 buffers before, none after, verified."""
    src, out = tmp_path / "legacy.onnx", tmp_path / "legacy.patched.onnx"
    model = legacy_patches()
    onnx.save(model, src)
    before = analyze(src, storage_buffers=8)
    widths = sorted({n.buffers for n in before.over_storage})
    assert len(before.over_storage) == 63 and widths == [9, 17, 33, 65, 257, 1025]
    spec = resolve_profile(None)
    violations = limit_violations(src, spec, "node", None)
    assert {v["node"] for v in violations} == {n.node for n in before.over_storage}
    assert all(v["limit"] == "maxStorageBuffersPerShaderStage 8" for v in violations)
    assert main(["budget", str(src)]) == 1
    assert "FAIL: 63 node(s) bind more than 8 storage buffers" in capsys.readouterr().out
    assert main(["patch", str(src), str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "fit: 63 node(s) rewritten" in text and "verify: PASSED" in text
    assert analyze(out, storage_buffers=8).over_storage == []
    assert limit_violations(out, spec, "browser", "jsep") == []
    assert main(["budget", str(out)]) == 0
