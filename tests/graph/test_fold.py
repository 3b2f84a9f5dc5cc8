"""The fold step (deform_surgeon/graph/fold.py): static float16 computations are evaluated once, exactly, and stored.

`graphs.swin_mask_fp16()` stands for the real BiRefNet-lite fp16 export's Swin attention-mask and shape subgraphs
(`/bb/layers.N/...`; its docstring says which ops, in which order, and which Casts). CI cannot build the real
model (no torch, no BiRefNet source in the test path); in development the replica's op sequence was compared with
a real BiRefNet-lite 512 fp16 export (built from BiRefNet's code with random weights), and like the
real model its fp16 form puts hundreds of nodes on the CPU EP of the WebGPU runtimes while its fp32 form puts
none there (`test_replica_placement_*`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers.graphs import swin_mask_fp16
from onnx import TensorProto, helper, numpy_helper

import deform_surgeon as ds
from deform_surgeon.files import check_and_infer, load_model, split_weights
from deform_surgeon.graph import fold
from deform_surgeon.graph.blocks import deform_blocks
from deform_surgeon.graph.fold import fold_static

OPSET = [helper.make_opsetid("", 17)]


def _save(model: onnx.ModelProto, path, external: bool = False):
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".weights", size_threshold=0)
    else:
        onnx.save(model, str(path))
    return path


def _run(path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _scores(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.random((1, 10, 10, 4), dtype=np.float32),
            "scores": rng.normal(0, 4, (4, 2, 49, 49)).astype(np.float32)}


def _folded(report) -> list:
    return [a for a in report.rewritten if a.pass_name == "fold"]


def test_replica_folds_to_the_attention_alone_and_verifies(tmp_path):
    src = _save(swin_mask_fp16(), tmp_path / "swin_fp16.onnx")
    out = tmp_path / "swin_fp16.patched.onnx"
    report = ds.patch(src, out, verify=True)
    assert report.written and report.verification.identical
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    # what is left is the attention on the input (Cast, Reshape, Add of the stored mask, Reshape, Softmax, Cast)
    # and the int64 view shape from the mask's (folded) Shape: Gather -> Unsqueeze -> Concat, which ORT folds itself
    left = ["Add", "Cast", "Cast", "Concat", "Gather", "Reshape", "Reshape", "Softmax", "Unsqueeze"]
    assert sorted(o for o in ops if o != "Constant") == left
    non_constant = sum(v for k, v in report.ops_before.items() if k != "Constant")
    assert len(_folded(report)) == non_constant - len(left) and not report.refused
    [stored] = [a for a in _folded(report) if any(t["dtype"] == "float16" for t in a.details.get("stored", []))]
    assert stored.reason.startswith("static for the model's input shapes: evaluated once on ORT CPU, the same "
                                    "wherever ORT's float16 fallback rounds; stored '")
    # the float16 H / 7 of the padded size rounds (10 / 7), and the Ceil reading it absorbs that
    divs = [a for a in _folded(report) if a.op == "Div" and a.details.get("absorbed_by")]
    assert [a.details["absorbed_by"] for a in divs] == [["Ceil"]] * 2
    assert divs[0].reason == ("static for the model's input shapes: evaluated once on ORT CPU, rounded in float16, "
                              "which its readers (Ceil) absorb: the same result on its float32 value")
    assert [a.reason for a in _folded(report) if a.op == "Cast" and "removed" in a.reason] == [
        "removed: only folded nodes read its output"]  # Cast(x): only the folded Shape read it
    [(name, dtype, shape, size)] = [tuple(t.values()) for t in stored.details["stored"]]
    assert (dtype, shape, size) == ("float16", [1, 4, 1, 49, 49], 19_208)
    # the stored tensor is the Swin mask, unsqueezed for the attention: 0 within a region, -100 across regions
    [mask] = [numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer if t.name == name]
    assert mask.dtype == np.float16 and set(np.unique(mask).tolist()) == {-100.0, 0.0}
    assert (mask[0, :, 0] == 0).all(axis=(1, 2)).tolist() == [True, False, False, False]  # only window 0 is unshifted
    for seed in (3, 4):  # and the outputs are the original's bytes, also on other inputs than verify's
        a, b = _run(src, _scores(seed)), _run(out, _scores(seed))
        assert a[0].tobytes() == b[0].tobytes()


def test_fp32_replica_is_left_to_ort(tmp_path):
    """ORT folds fp32 static computations itself at session creation: the fp32 model is not touched."""
    report = ds.patch(_save(swin_mask_fp16(fp16=False), tmp_path / "swin.onnx"), tmp_path / "out.onnx")
    assert not report.actions and not report.written and "nothing to rewrite" in report.note


def test_fold_is_idempotent(tmp_path):
    first = tmp_path / "once.onnx"
    ds.patch(_save(swin_mask_fp16(), tmp_path / "swin.onnx"), first)
    again = ds.patch(first, tmp_path / "twice.onnx")
    assert not again.actions and not again.written


def _rounding_model() -> onnx.ModelProto:
    """y = x16 * (a * b): `a * b` is static but rounds in float16, and its consumer is a float16 Mul that ORT CPU
    computes in float32 between inserted Casts, reading `a * b` unrounded. Folding `a * b` would change y."""
    rng = np.random.default_rng(0)
    a, b = (rng.random(1024).astype(np.float16) for _ in range(2))
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["a", "b"], ["ab"], name="static_mul"),
             helper.make_node("Mul", ["x16", "ab"], ["y16"], name="dynamic_mul"),
             helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "rounding", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])],
                              [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=OPSET)


def test_a_float16_rounding_is_not_folded(tmp_path):
    model = _rounding_model()
    src = _save(model, tmp_path / "rounding.onnx")
    # the hazard is real: storing ORT's own float16 value of `a * b` changes the output on ORT CPU
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    ab = _run(_save(_with_output(model, "ab"), tmp_path / "ab.onnx"), {"x": np.ones(1024, np.float32)})[1]
    del folded.graph.node[1]
    folded.graph.initializer.append(numpy_helper.from_array(ab, "ab"))
    x = {"x": np.random.default_rng(1).random(1024).astype(np.float32)}
    assert _run(src, x)[0].tobytes() != _run(_save(folded, tmp_path / "folded.onnx"), x)[0].tobytes()
    # so the pass leaves it, says why, and writes nothing
    report = ds.patch(src, tmp_path / "out.onnx")
    assert not report.written and not report.rewritten
    [refused] = report.refused
    assert (refused.pass_name, refused.node, refused.op) == ("fold", "static_mul", "Mul")
    assert refused.reason == ("static, not folded: 'ab' (float16) is rounded: computed in float32 it differs (ORT's "
                              "float16 fallback may or may not round it inside the model)")


def _with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.append(onnx.ValueInfoProto(name=name))
    return out


def test_size_limit_keeps_large_tensors_out(tmp_path):
    """No folded tensor exceeds the limit: the nodes that make a larger one stay, and say so; the rest folds."""
    path = _save(swin_mask_fp16(), tmp_path / "swin.onnx")
    model = onnx.load(str(path))
    weights = split_weights(model, tmp_path)
    actions = fold_static(model, check_and_infer(model, path, weights), weights, limit=4096)
    refused = [a for a in actions if a.action == "refused"]
    assert refused and all("above the fold limit" in a.reason or "which is not folded" in a.reason
                           for a in refused)
    assert any(a.action == "rewritten" for a in actions)
    assert all(t.ByteSize() < 4096 + 200 for t in model.graph.initializer)
    onnx.checker.check_model(model, full_check=True)
    out = _save(model, tmp_path / "limited.onnx")
    assert _run(out, _scores())[0].tobytes() == _run(path, _scores())[0].tobytes()


def test_external_data_and_stored_weights(tmp_path):
    """Stored weights (here every initializer: external data) are never read, and nothing computed from them is
    folded (it would only copy weights into the file; ORT folds such a Cast or Identity at load). A static float16
    computation on Constants beside them is folded; the output keeps the weights external, the input's data file
    is untouched."""
    rng = np.random.default_rng(2)
    table = (rng.integers(-8, 8, (64, 49)) * 0.5).astype(np.float16)  # half-integers: exact in float16
    nodes = [helper.make_node("Constant", [], ["table"], value=numpy_helper.from_array(table, "table")),
             helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2, np.float16))),
             helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["table", "two"], ["t2"], name="static_scale"),
             helper.make_node("Add", ["x16", "t2"], ["y16"], name="dynamic_add"),
             helper.make_node("Mul", ["w", "two"], ["w2"], name="static_on_a_weight"),
             helper.make_node("Mul", ["y16", "w2"], ["z16"], name="dynamic_weight"),
             helper.make_node("Cast", ["z16"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "stored", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 49])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 49])],
                              [numpy_helper.from_array(rng.random((64, 49)).astype(np.float16), "w")])
    src = _save(helper.make_model(graph, opset_imports=OPSET), tmp_path / "ext.onnx", external=True)
    data = src.with_name("ext.onnx.weights")
    before = data.read_bytes()
    out = tmp_path / "ext.patched.onnx"
    report = ds.patch(src, out, verify=True)
    assert report.verification.identical and data.read_bytes() == before
    assert [a.node for a in _folded(report)] == ["static_scale"] and not report.refused
    patched = onnx.load(str(out), load_external_data=False)
    stored = {t.name: t.data_location == TensorProto.EXTERNAL for t in patched.graph.initializer}
    assert stored == {"w": True, "t2": False}
    assert "static_on_a_weight" in {n.name for n in patched.graph.node}


def _static_cast_pattern(path) -> set[tuple[str, int, tuple[str, ...]]]:
    """(producer op, Cast target, reader ops) of every Cast in the static float16 cone `fold` works on."""
    model, weights = load_model(path)
    types = check_and_infer(model, path, weights)
    found = fold._find_static(model.graph, types, weights, fold.FOLD_LIMIT)
    pattern = set()
    for k in fold._cone(found, fold._tainted(found, types)):
        if found.ops[k] == "Cast":
            producer = found.producer.get(found.ins[k][0])
            readers = tuple(sorted({found.ops[r] for o in found.outs[k] for r in found.readers.get(o, ())}))
            pattern.add((found.ops[producer] if producer is not None else "input", found.nodes[k].attribute[0].i,
                         readers))
    return pattern


def _deform_block_casts(path) -> set[tuple[str, int]]:
    model = onnx.load(str(path), load_external_data=False)
    owner = deform_blocks(model)
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    return {(producer.get(n.input[0], "input"), n.attribute[0].i) for n in model.graph.node
            if n.op_type == "Cast" and n.name in owner}


REAL_FP16 = os.environ.get("DEFORM_SURGEON_REAL_BIREFNET_FP16")


@pytest.mark.skipif(not REAL_FP16, reason="set DEFORM_SURGEON_REAL_BIREFNET_FP16 to a real BiRefNet fp16 export "
                                          "(BiRefNet's own code, random weights) to compare")
def test_the_fp16_replicas_have_the_real_exports_cast_pattern(tmp_path):
    """Development check of what the fp16 replicas stand for, against the real BiRefNet-lite fp16 export (run with
    DEFORM_SURGEON_REAL_BIREFNET_FP16=/tmp/birefnet/out/birefnet_lite_512_fp16.onnx: it passes).
    The Swin replica's static float16 cone has the real one's Casts: Gather -> Cast(INT64) -> Cast(FLOAT16) -> Div,
    Ceil -> Cast(INT64) -> Mul, Not / Equal -> Cast(BOOL) -> Where, Where -> Cast(FLOAT16) -> Shape, Unsqueeze
    (the Cast-fixed mask), ...; the real one has three more, all int64 -> int64 (each block's padding/roll
    arithmetic). Inside every deform block, the decoder fp16 fixtures and the real export have the same single
    Cast: Floor -> Cast(INT64). (They differ at the graph's edges: the fixtures were converted with
    keep_io_types=False, so their input and output are float16 where the real file casts float32.)"""
    real = _static_cast_pattern(REAL_FP16)
    replica = _static_cast_pattern(_save(swin_mask_fp16(), tmp_path / "swin.onnx"))
    assert replica <= real
    assert {p for p in real if p[1] != TensorProto.INT64} == {p for p in replica if p[1] != TensorProto.INT64}
    fixtures = Path(__file__).parents[1] / "fixtures"
    for name in ("decoder_gathernd_fp16", "decoder_gatherelements_fp16"):
        assert _deform_block_casts(fixtures / f"{name}.onnx") == _deform_block_casts(REAL_FP16) == {
            ("Floor", TensorProto.INT64)}


@pytest.mark.webgpu
def test_replica_placement_node_runtime(tmp_path):
    """On the real native WebGPU EP (onnxruntime-node, session creation): the fp16 replica puts its static
    shape/mask nodes on the CPU EP with Memcpy, like the real fp16 BiRefNet; its fp32 form and the patched fp16
    model put nothing there."""
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup

    missing = missing_setup()
    if missing is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing}")
    fp16 = _save(swin_mask_fp16(), tmp_path / "swin_fp16.onnx")
    fp32 = _save(swin_mask_fp16(fp16=False), tmp_path / "swin_fp32.onnx")
    patched = tmp_path / "swin_fp16.patched.onnx"
    ds.patch(fp16, patched)
    before, after, plain = (measure_placement(p, runtime="node") for p in (fp16, patched, fp32))
    assert before.session_ok and before.cpu_nodes > 100 and before.memcpy > 0
    assert {"Range", "Expand", "Gather", "Unsqueeze", "Concat"} <= set(before.cpu_ops)
    assert plain.session_ok and (plain.cpu_nodes, plain.memcpy) == (0, 0)
    assert after.session_ok and (after.cpu_nodes, after.memcpy) == (0, 0)
    assert after.nodes_by_provider == {"WebGpuExecutionProvider": after.total_nodes}


@pytest.mark.webgpu
def test_replica_placement_jsep(tmp_path):
    """The default onnxruntime-web import (JSEP, headless Chromium, session creation): the same as on the native
    EP, the fp16 replica's static nodes on the CPU EP before the patch, none after."""
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup

    missing = missing_setup()
    if missing is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing}")
    fp16 = _save(swin_mask_fp16(), tmp_path / "swin_fp16.onnx")
    patched = tmp_path / "swin_fp16.patched.onnx"
    ds.patch(fp16, patched)
    before, after = (measure_placement(p, runtime="browser", bundle="jsep") for p in (fp16, patched))
    assert before.session_ok and before.cpu_nodes > 100 and before.memcpy > 0
    assert after.session_ok and (after.cpu_nodes, after.memcpy) == (0, 0)
