"""float16 Split -> Slices (deform_surgeon/passes/float16_slices.py).

`_attention_split()` stands for the Swin attention of the real BiRefNet-lite fp16 export
(`/bb/layers.N/blocks.M/attn/Split`: `q, k, v = qkv[0], qkv[1], qkv[2]` exported as Transpose -> Split(axis 0,
split = Constant [1, 1, 1]) -> Squeeze, in float16 after onnxconverter-common); JSEP 1.30 puts such a Split on
the CPU EP, the fp32 one on the GPU.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import deform_surgeon as ds

HEADS, TOKENS, DIM = 2, 6, 4


def _attention_split(dtype: int = TensorProto.FLOAT16, opset: int = 17, split: str = "constant") -> onnx.ModelProto:
    """qkv float32 [TOKENS, 3, HEADS, DIM] (cast to `dtype`) -> Transpose -> Split along 0 -> Squeeze -> q @ k^T,
    and v, cast back to float32."""
    nodes = [helper.make_node("Cast", ["qkv"], ["qkv16"], to=dtype),
             helper.make_node("Transpose", ["qkv16"], ["t"], perm=[1, 2, 0, 3], name="attn/Transpose")]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    if split == "constant":
        nodes.append(helper.make_node("Constant", [], ["sizes"],
                                      value=numpy_helper.from_array(np.array([1, 1, 1], np.int64))))
        nodes.append(helper.make_node("Split", ["t", "sizes"], ["q3", "k3", "v3"], axis=0, name="attn/Split"))
    elif split == "equal":
        attrs = {"num_outputs": 3} if opset >= 18 else {}
        nodes.append(helper.make_node("Split", ["t"], ["q3", "k3", "v3"], axis=-4, name="attn/Split", **attrs))
    else:  # sizes computed at run time from the input
        nodes += [helper.make_node("Shape", ["qkv"], ["s"], start=0, end=1),
                  helper.make_node("Div", ["s", "s"], ["one"]),
                  helper.make_node("Concat", ["one", "one", "one"], ["sizes"], axis=0),
                  helper.make_node("Split", ["t", "sizes"], ["q3", "k3", "v3"], axis=0, name="attn/Split")]
    for name in "qkv":
        nodes.append(helper.make_node("Squeeze", [f"{name}3", "axis0"], [name]))
    nodes += [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
              helper.make_node("MatMul", ["q", "kt"], ["a"]),
              helper.make_node("Cast", ["a"], ["attn"], to=TensorProto.FLOAT),
              helper.make_node("Cast", ["v"], ["value"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(
        nodes, "attention_split", [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [TOKENS, 3, HEADS, DIM])],
        [helper.make_tensor_value_info("attn", TensorProto.FLOAT, [HEADS, TOKENS, TOKENS]),
         helper.make_tensor_value_info("value", TensorProto.FLOAT, [HEADS, TOKENS, DIM])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8  # what onnxruntime-web 1.30 reads (onnx 1.23 writes 14 by default)
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(path) -> list[bytes]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    feed = {"qkv": np.random.default_rng(0).normal(0, 2, (TOKENS, 3, HEADS, DIM)).astype(np.float32)}
    return [o.tobytes() for o in ort.InferenceSession(str(path), options,
                                                      providers=["CPUExecutionProvider"]).run(None, feed)]


@pytest.mark.parametrize(("opset", "split"), [(17, "constant"), (17, "equal"), (18, "equal")])
def test_float16_split_becomes_slices(tmp_path, opset, split):
    src = tmp_path / "split.onnx"
    onnx.save(_attention_split(opset=opset, split=split), str(src))
    out = tmp_path / "split.patched.onnx"
    report = ds.patch(src, out, verify=True)
    assert report.verification.identical and _run(src) == _run(out)
    [action] = report.rewritten
    assert (action.pass_name, action.node) == ("split_fp16", "attn/Split")
    assert action.details == {"slices": 3, "axis": 0, "sizes": [1, 1, 1]}
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert "Split" not in ops and ops.count("Slice") == 3
    assert not ds.patch(out, tmp_path / "again.onnx").actions  # idempotent


def test_float32_split_is_left_alone(tmp_path):
    src = tmp_path / "split32.onnx"
    onnx.save(_attention_split(TensorProto.FLOAT), str(src))
    assert not ds.patch(src, tmp_path / "out.onnx").actions


def test_computed_split_sizes_are_refused(tmp_path):
    src = tmp_path / "computed.onnx"
    onnx.save(_attention_split(split="computed"), str(src))
    report = ds.patch(src, tmp_path / "out.onnx")
    assert not report.written and not report.rewritten
    [refused] = report.refused
    assert (refused.node, refused.reason) == ("attn/Split", "its split sizes are computed, not constant")


@pytest.mark.webgpu
def test_jsep_places_the_slices_on_the_gpu(tmp_path):
    """The real JSEP (onnxruntime-web 1.30 in headless Chromium, session creation): the float16 Split is on the
    CPU EP with Memcpy; after the patch nothing is."""
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup

    missing = missing_setup()
    if missing is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing}")
    src = tmp_path / "split.onnx"
    onnx.save(_attention_split(), str(src))
    out = tmp_path / "split.patched.onnx"
    ds.patch(src, out)
    before, after = (measure_placement(p, runtime="browser", bundle="jsep") for p in (src, out))
    assert before.session_ok and before.cpu_ops == {"Split": 1} and before.memcpy > 0
    assert after.session_ok and (after.cpu_nodes, after.memcpy) == (0, 0)
