"""How ORT CPU's intra-op thread count changes a Conv's and a MatMul's bytes (base/threads.py), checked against
ORT itself element by element: two thread counts the model puts in one class give the same bytes (the proofs rely
on that), and the counts it says differ do (the model is not just coarse). Then the proofs and `verify` at the
counts that matter: a Conv in row bands shown exact at this machine's count only differs at others."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import FIXTURES, assert_bytes_equal, assert_exact_everywhere
from onnx import TensorProto, helper

import deform_surgeon
from deform_surgeon.base.threads import MAX_THREADS, Kernel, _signature, thread_counts
from deform_surgeon.graph.pipeline import Outcome

COUNTS = [*range(1, 21), 24, 32]  # past 16, where a Conv stops changing and a GEMM need not


def _run(model: onnx.ModelProto, feeds: dict, threads: int, level: str = "disable") -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if level == "disable" else
                                        ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]


def _conv(cin: int, cout: int, h: int, w: int, k: int) -> onnx.ModelProto:
    weight = np.random.default_rng(0).standard_normal((cout, cin, k, k)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[k // 2] * 4)], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [onnx.numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _matmul(m: int, n: int, k: int, constant: bool) -> onnx.ModelProto:
    b = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])]
    if not constant:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [k, n]))
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "matmul", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(b, "b")] if constant else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check_classes(model: onnx.ModelProto, feeds: dict, kernel: Kernel) -> tuple[int, int]:
    """(pairs of counts in one class with other bytes: must be 0, pairs in different classes with other bytes)."""
    outs = {t: _run(model, feeds, t).view(np.uint32) for t in COUNTS}
    signature = {t: _signature(kernel, t) for t in COUNTS}
    same_class_differs = sum(1 for a in COUNTS for b in COUNTS
                             if a < b and signature[a] == signature[b] and not np.array_equal(outs[a], outs[b]))
    told_apart = sum(1 for a in COUNTS for b in COUNTS
                     if a < b and signature[a] != signature[b] and not np.array_equal(outs[a], outs[b]))
    return same_class_differs, told_apart


@pytest.mark.parametrize("cin, cout, h, w, k", [(16, 8, 9, 13, 5), (20, 16, 30, 17, 3), (64, 32, 7, 50, 3),
                                                (8, 8, 40, 40, 5), (32, 16, 12, 12, 1), (8, 40, 3, 5, 3)])
def test_counts_the_model_puts_in_one_class_give_a_conv_the_same_bytes(cin, cout, h, w, k):
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, cin, h, w)).astype(np.float32)}
    kernel = Kernel("Conv", {"pads": [k // 2] * 4}, ((1, cin, h, w), (cout, cin, k, k)))
    same_class_differs, told_apart = _check_classes(_conv(cin, cout, h, w, k), feeds, kernel)
    assert same_class_differs == 0
    if cin * k * k > 128 and (cout, k) != (40, 3):  # (K within one block, or more filters than pixels: one order)
        assert told_apart > 0  # the model tells apart counts ORT does compute differently


@pytest.mark.parametrize("m, n, k", [(20, 700, 300), (40, 1000, 150), (7, 2000, 1000), (500, 64, 600),
                                     (1, 3000, 400)])
@pytest.mark.parametrize("constant", [False, True])
def test_counts_the_model_puts_in_one_class_give_a_matmul_the_same_bytes(m, n, k, constant):
    rng = np.random.default_rng(1)
    feeds = {"a": rng.standard_normal((m, k)).astype(np.float32)}
    if not constant:
        feeds["b"] = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    kernel = Kernel("MatMul", {}, ((m, k), (k, n)), constant_b=constant)
    same_class_differs, told_apart = _check_classes(_matmul(m, n, k, constant), feeds, kernel)
    assert same_class_differs == 0
    if not constant and (m, n, k) in ((20, 700, 300), (40, 1000, 150), (7, 2000, 1000)):
        assert told_apart > 0  # (a prepacked B is summed in fixed blocks: one class)


def test_a_conv_stops_changing_at_16_threads_and_a_gemm_is_read_to_the_limit():
    conv = Kernel("Conv", {"pads": [2] * 4}, ((1, 16, 200, 200), (16, 16, 5, 5)))
    assert {_signature(conv, t) for t in range(16, MAX_THREADS + 1)} == {_signature(conv, 16)}
    assert len(thread_counts([conv], 2)) == 1  # 40,000 pixels: every segment is large, one order at every count
    small = Kernel("Conv", {"pads": [1] * 4}, ((1, 32, 7, 50), (32, 32, 3, 3)))
    reps = thread_counts([small], 2)
    assert 2 in reps and len(reps) > 1 and max(reps) <= 16
    gemm = Kernel("MatMul", {}, ((7, 1000), (1000, 2000)))
    assert max(thread_counts([gemm], 2)) > 16
    assert thread_counts([Kernel("Add", {}, ((1, 4), (1, 4)))], 3) == (3,)  # no sum split between threads
    assert thread_counts([Kernel("ConvTranspose", {}, (None, None))], 3) == tuple(range(1, 17))  # not modelled


def _concat_conv(k: int, size: int = 40, inputs: int = 8, channels: int = 4) -> onnx.ModelProto:
    """An 8-input channel Concat read by a kxk Conv: the form `bands` computes in row bands under --max-buffer."""
    rng = np.random.default_rng(3)
    names = [f"x{i}" for i in range(inputs)]
    weight = (rng.standard_normal((16, inputs * channels, k, k)) / 10).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Concat", names, ["cat"], axis=1, name="Concat_cat"),
         helper.make_node("Conv", ["cat", "w"], ["y"], pads=[k // 2] * 4, name="Conv_y")], "concat_conv",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, channels, size, size]) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, size, size])],
        [onnx.numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("k", [5, 3])
def test_row_bands_are_written_only_where_every_thread_count_gives_the_whole_conv_bytes(tmp_path, k):
    """A Conv over an 8-input Concat in row bands can be exact at 2 threads and differ at level `disable` from 3
    threads (5x5) or 6 (3x3), so a proof at one machine's thread count does not hold. Its proof runs at one count
    of each class MLAS splits it by (base/threads.py): the bands are written only where they give the whole Conv's
    bytes at every count, at both levels; else they are undone with the count that differed."""
    src, out = tmp_path / "m.onnx", tmp_path / "m.patched.onnx"
    onnx.save(_concat_conv(k), src)
    report = deform_surgeon.patch(src, out, max_buffer=131072)
    (band,) = [a for a in report.actions if a.pass_name == "bands"]
    model = onnx.load(src)
    rng = np.random.default_rng(7)
    feeds = {i.name: rng.standard_normal((1, 4, 40, 40)).astype(np.float32) for i in model.graph.input}
    patched = onnx.load(out)
    if band.action == Outcome.REWRITTEN:
        assert band.details["shown_exact"] == "on_its_own"
    else:
        assert band.details["undone"] == "on_its_own" and band.details["threads"] >= 1
    for threads in (1, 2, 3, 4, 6, 8, 16):
        for level in ("disable", "all"):
            assert_bytes_equal([_run(model, feeds, threads, level)], [_run(patched, feeds, threads, level)])
    assert_exact_everywhere(src, out)


def _float16_block_out(size: int, channels: int, planes: int, seed: int) -> onnx.ModelProto:
    """One float16 deformable block in the exporter's form whose output is the graph's, through Relu -> Identity
    (onnxconverter-common's float16 conversion, float16 inputs and output: where the output's float16 rounding
    hides a 1-ulp float32 difference on some inputs and not on others)."""
    from helpers.exporter_replica import deform_conv_model
    from onnxconverter_common import float16

    model = deform_conv_model(1, channels, planes, 3, size, seed=seed)
    last = next(n for n in model.graph.node if n.op_type == "Identity" and n.output[0] == "y")
    last.output[0] = "y_pre"
    model.graph.node.extend([helper.make_node("Relu", ["y_pre"], ["y_relu"], name="Relu_out"),
                             helper.make_node("Identity", ["y_relu"], ["y"], name="Identity_out")])
    return float16.convert_float_to_float16(model, keep_io_types=False)


@pytest.mark.parametrize("size, channels, planes, limit, seed", [(16, 4, 4, 9_000, 0), (16, 4, 4, 9_000, 1),
                                                                 (16, 4, 8, 9_000, 1), (32, 8, 4, 100_000, 1)])
def test_a_float16_block_whose_output_is_the_graphs_is_written_only_where_exact_everywhere(tmp_path, size,
                                                                                          channels, planes, limit,
                                                                                          seed):
    """A split float16 block whose output is the model's cannot be shown exact on its own ("'y' is fused away in
    the model"), so the whole model decides; one seeded input per level is not enough there (rounding to float16
    can hide a 1-ulp float32 difference that `verify`'s 3 inputs find). The check runs `verify`'s default inputs
    at each thread-count class: the written file gives the original's
    bytes at both levels, at every count of 1-16 tried, on random, large, tiny, zero, NaN and inf inputs, or the
    split is undone."""
    src, out = tmp_path / "block.onnx", tmp_path / "block.patched.onnx"
    onnx.save(_float16_block_out(size, channels, planes, seed), src)
    report = deform_surgeon.patch(src, out, max_buffer=limit)
    for split in (a for a in report.actions if a.pass_name == "split" and a.action == Outcome.REWRITTEN):
        if split.details.get("shown_exact") == "whole_model":
            assert "3 input(s)" in split.reason and "intra-op threads" in split.reason
    assert_exact_everywhere(src, out)
    assert deform_surgeon.verify(src, out, threads=[1, 3, 8]).identical


def test_verify_compares_at_each_thread_count_and_says_which(tmp_path):
    fixture = FIXTURES / "decoder_gathernd.onnx"
    result = deform_surgeon.verify(fixture, fixture, threads=[1, 3], iterations=1)
    assert result.identical and result.threads == [1, 3] and "intra-op threads 1, 3" in result.summary()
    with pytest.raises(deform_surgeon.SurgeonError, match="threads must be an integer from 1 to"):
        deform_surgeon.verify(fixture, fixture, threads=[0])
