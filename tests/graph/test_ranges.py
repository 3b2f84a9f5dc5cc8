"""The range prover: verdicts with reasons, and soundness (no value ever escapes its proven interval)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from helpers import FIXTURES, run_ort
from helpers.graphs import CLAMPED, CLIP_BEFORE_GRID, PARTLY, UNCLAMPED, exporter_like
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon.files import infer_value_types
from deform_surgeon.graph.ranges import RangeProver, Status, gather_elements_verdict, gathernd_verdict

I64 = TensorProto.INT64


def build(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "t", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def prover(model: onnx.ModelProto) -> tuple[RangeProver, gs.Graph]:
    graph = gs.import_onnx(model)
    return RangeProver(graph, infer_value_types(model)), graph


def gathernd_model(index_nodes, index_name, H=10, W=10, index_inputs=(), inits=()) -> onnx.ModelProto:
    """data [1,1,H,W,2] gathered by an index tensor [1,1,3,2] built by `index_nodes`."""
    nodes = list(index_nodes) + [helper.make_node("GatherND", ["data", index_name], ["out"], name="gnd", batch_dims=2)]
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 1, H, W, 2]), *index_inputs]
    return build(nodes, inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 3, 2])], inits)


def verdict_of(model):
    p, graph = prover(model)
    node = next(n for n in graph.nodes if n.op == "GatherND")
    return gathernd_verdict(p, node)


def i64(v) -> np.ndarray:
    return np.asarray(v, dtype=np.int64)


# --------------------------------------------------------------------------------------------- verdicts
def test_exporter_pattern_is_proven_by_the_clips_after_the_grid():
    p, graph = prover(exporter_like(source=CLAMPED, H=6, W=7))
    verdicts = [gathernd_verdict(p, n) for n in graph.nodes if n.op == "GatherND"]
    assert [v.status for v in verdicts] == [Status.PROVEN] * 4
    for v in verdicts:
        assert [c.size for c in v.components] == [6, 7]
        assert [(c.span.lo, c.span.hi) for c in v.components] == [(0, 5), (0, 6)]
        assert "by Clip 'Clip_" in v.reason


@pytest.mark.parametrize("source", [PARTLY, UNCLAMPED, CLIP_BEFORE_GRID])
def test_exporter_variants_without_a_clip_after_the_grid_are_not_proven(source):
    p, graph = prover(exporter_like(source=source))
    verdicts = [gathernd_verdict(p, n) for n in graph.nodes if n.op == "GatherND"]
    assert all(v.status is Status.UNPROVEN for v in verdicts)
    # the reason names the node where the proof stopped
    assert all("proof stops at" in v.reason for v in verdicts)
    if source == PARTLY:  # y is clamped, x is not: only x is blamed
        assert all([c.status for c in v.components] == [Status.PROVEN, Status.UNPROVEN] for v in verdicts)


def test_a_clip_before_the_grid_is_added_bounds_nothing_and_the_reason_says_where():
    # offset (int) -> Clip(-2, 2) -> + grid in [0, 9] -> index: [-2, 11] is not within [0, 9]
    nodes = [
        helper.make_node("Clip", ["off", "lo", "hi"], ["off_c"], name="clip_offset"),
        helper.make_node("Add", ["grid", "off_c"], ["idx"], name="add_grid"),
    ]
    model = gathernd_model(nodes, "idx", index_inputs=[helper.make_tensor_value_info("off", I64, [1, 1, 3, 2])],
                           inits=[("lo", i64(-2)), ("hi", i64(2)), ("grid", i64([[[[0, 9], [3, 4], [9, 0]]]]))])
    v = verdict_of(model)
    assert v.status is Status.UNPROVEN
    assert "[-2, 11]" in v.reason
    assert "bounded by Clip 'clip_offset'" in v.reason
    assert "proof stops at Add 'add_grid'" in v.reason


def test_every_index_outside_the_data_is_out_of_range():
    model = gathernd_model([helper.make_node("Identity", ["c"], ["idx"])], "idx",
                           inits=[("c", i64(np.full((1, 1, 3, 2), 12)))])
    v = verdict_of(model)
    assert v.status is Status.OUT_OF_RANGE
    assert "every index is in [12, 12]" in v.reason


def test_components_are_judged_against_their_own_dimension():
    # y in [0, 4], x in [0, 9]: fits H=5, W=10, but not H=10, W=5
    def model(H, W):
        nodes = [
            helper.make_node("Clip", ["y", "zero", "four"], ["yc"], name="clip_y"),
            helper.make_node("Clip", ["x", "zero", "nine"], ["xc"], name="clip_x"),
            helper.make_node("Concat", ["yc", "xc"], ["idx"], name="cat", axis=3),
        ]
        ins = [helper.make_tensor_value_info(n, I64, [1, 1, 3, 1]) for n in ("y", "x")]
        return gathernd_model(nodes, "idx", H=H, W=W, index_inputs=ins,
                              inits=[("zero", i64(0)), ("four", i64(4)), ("nine", i64(9))])

    assert verdict_of(model(5, 10)).status is Status.PROVEN
    v = verdict_of(model(10, 5))
    assert [c.status for c in v.components] == [Status.PROVEN, Status.UNPROVEN]
    assert "data dim 3 (size 5)" in v.reason and "[0, 9]" in v.reason


def test_negative_indices_are_not_proven():
    nodes = [helper.make_node("Clip", ["i", "lo", "hi"], ["idx"], name="clip")]
    model = gathernd_model(nodes, "idx", index_inputs=[helper.make_tensor_value_info("i", I64, [1, 1, 3, 2])],
                           inits=[("lo", i64(-1)), ("hi", i64(3))])
    v = verdict_of(model)
    assert v.status is Status.UNPROVEN and "[-1, 3]" in v.reason


def test_integer_overflow_loses_the_bound():
    # Clip to [0, 2^62] then * 4 may wrap in int64: nothing is known afterwards, then a Clip restores it.
    nodes = [
        helper.make_node("Clip", ["i", "zero", "big"], ["a"], name="clip"),
        helper.make_node("Mul", ["a", "four"], ["b"], name="times4"),
    ]
    model = build(nodes, [helper.make_tensor_value_info("i", I64, [3])], [helper.make_tensor_value_info("b", I64, [3])],
                  [("zero", i64(0)), ("big", i64(2**62)), ("four", i64(4))])
    p, graph = prover(model)
    span = p.bound(graph.tensors()["b"]).whole
    assert (span.lo, span.hi) == (-(2**63), 2**63 - 1)
    assert "may overflow" in span.source


def test_float_to_int_cast_of_a_possibly_nan_value_is_unbounded():
    nodes = [helper.make_node("Floor", ["f"], ["g"]), helper.make_node("Cast", ["g"], ["i"], name="cast", to=I64)]
    model = build(nodes, [helper.make_tensor_value_info("f", TensorProto.FLOAT, [3])],
                  [helper.make_tensor_value_info("i", I64, [3])])
    p, graph = prover(model)
    span = p.bound(graph.tensors()["i"]).whole
    assert (span.lo, span.hi) == (-(2**63), 2**63 - 1)
    assert "may be NaN" in span.source


def test_a_nan_constant_bounds_nothing():
    # Clip(x, NaN, 5) and Clip(x, 0, NaN): a NaN bound is no bound (ORT returns NaN or x there); the constant itself
    # is the whole float range plus NaN, not the empty interval of its non-NaN values
    nan = np.array(np.nan, np.float32)
    nodes = [helper.make_node("Clip", ["x", "nan", "five"], ["c1"]),
             helper.make_node("Clip", ["x", "zero", "nan"], ["c2"]),
             helper.make_node("Add", ["x", "nans"], ["s"])]
    model = build(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                  [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("c1", "c2", "s")],
                  [("nan", nan), ("five", np.array(5, np.float32)), ("zero", np.array(0, np.float32)),
                   ("nans", np.array([np.nan, 1.0], np.float32))])
    p, graph = prover(model)
    t = graph.tensors()
    const = p.bound(t["nan"]).whole
    assert (const.lo, const.hi, const.nan) == (-math.inf, math.inf, True)
    for name in ("c1", "c2", "s"):
        span = p.bound(t[name]).whole
        assert span.nan and not span.within(-1e30, 1e30), (name, span)


def test_unmodelled_ops_give_the_whole_type_range_and_say_so():
    nodes = [helper.make_node("Mod", ["a", "b"], ["m"], name="mod")]
    model = build(nodes, [helper.make_tensor_value_info("a", I64, [3])], [helper.make_tensor_value_info("m", I64, [3])],
                  [("b", i64(3))])
    p, graph = prover(model)
    span = p.bound(graph.tensors()["m"]).whole
    assert span.lo == -(2**63) and "not modelled" in span.source


def test_float_arithmetic_is_rounded_outwards_to_the_element_type():
    # 0.1 + 0.2 in float16: the bound must contain the float16 result of the add
    nodes = [helper.make_node("Clip", ["x", "a", "a"], ["c"]), helper.make_node("Add", ["c", "b"], ["y"])]
    model = build(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1])],
                  [("a", np.array(0.1, np.float16)), ("b", np.array(0.2, np.float16))])
    p, graph = prover(model)
    span = p.bound(graph.tensors()["y"]).whole
    actual = run_ort(model, {"x": np.array([0.0], np.float16)})[0][0]
    assert span.lo <= float(actual) <= span.hi
    assert span.hi - span.lo <= 2 * float(np.finfo(np.float16).eps)


def test_gather_elements_verdict():
    nodes = [helper.make_node("Clip", ["i", "zero", "hi"], ["idx"], name="clip"),
             helper.make_node("GatherElements", ["data", "idx"], ["out"], name="ge", axis=1)]
    for hi, status in ((7, Status.PROVEN), (8, Status.UNPROVEN)):
        model = build(nodes, [helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 8]),
                              helper.make_tensor_value_info("i", I64, [2, 3])],
                      [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])],
                      [("zero", i64(0)), ("hi", i64(hi))])
        p, graph = prover(model)
        assert gather_elements_verdict(p, next(n for n in graph.nodes if n.op == "GatherElements")).status is status


def test_every_gathernd_of_the_exporter_fixtures_is_proven():
    for name in ("decoder_gathernd.onnx", "decoder_gathernd_b2g2.onnx", "decoder_gathernd_fp16.onnx"):
        model = onnx.load(str(FIXTURES / name))
        p, graph = prover(model)
        nodes = [n for n in graph.nodes if n.op == "GatherND"]
        assert len(nodes) == 32
        assert all(gathernd_verdict(p, n).proven for n in nodes)


# ------------------------------------------------------------------------------------------- soundness
# A random chain of integer ops on a bounded input; the prover's interval must contain every value that
# ONNX Runtime computes for inputs at the extremes and in between.
_OPS = st.sampled_from(["Add", "Sub", "Mul", "Clip", "Min", "Max", "Neg", "CastI32", "Floor"])


@st.composite
def int_chains(draw):
    lo = draw(st.integers(-(2**40), 2**40))
    hi = draw(st.integers(lo, lo + 2**41))
    steps = draw(st.lists(st.tuples(_OPS, st.integers(-(2**33), 2**33), st.integers(-(2**33), 2**33)),
                          min_size=1, max_size=6))
    return lo, hi, steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(int_chains())
def test_integer_intervals_are_sound(chain):
    lo, hi, steps = chain
    nodes, inits = [helper.make_node("Clip", ["x", "lo", "hi"], ["t0"])], [("lo", i64(lo)), ("hi", i64(hi))]
    cur, dtype = "t0", I64
    for k, (op, a, b) in enumerate(steps):
        out = f"t{k + 1}"
        np_t = np.int64 if dtype == I64 else np.int32
        info = np.iinfo(np_t)
        a, b = int(np.clip(a, info.min, info.max)), int(np.clip(b, info.min, info.max))
        if op in ("Add", "Sub", "Mul", "Min", "Max"):
            inits.append((f"c{k}", np.asarray(a, np_t)))
            nodes.append(helper.make_node(op, [cur, f"c{k}"], [out]))
        elif op == "Clip":
            inits += [(f"l{k}", np.asarray(min(a, b), np_t)), (f"h{k}", np.asarray(max(a, b), np_t))]
            nodes.append(helper.make_node("Clip", [cur, f"l{k}", f"h{k}"], [out]))
        elif op == "Neg":
            nodes.append(helper.make_node("Neg", [cur], [out]))
        elif op == "CastI32":
            dtype = TensorProto.INT32 if dtype == I64 else I64
            nodes.append(helper.make_node("Cast", [cur], [out], to=dtype))
        else:  # Floor through float64 and back (exact for |v| < 2^53)
            nodes += [helper.make_node("Cast", [cur], [f"{out}_f"], to=TensorProto.DOUBLE),
                      helper.make_node("Floor", [f"{out}_f"], [f"{out}_g"]),
                      helper.make_node("Cast", [f"{out}_g"], [out], to=dtype)]
        cur = out
    model = build(nodes, [helper.make_tensor_value_info("x", I64, [5])],
                  [helper.make_tensor_value_info(cur, dtype, [5])], inits)
    p, graph = prover(model)
    span = p.bound(graph.tensors()[cur]).whole
    xs = np.array([lo, hi, (lo + hi) // 2, lo + 1 if lo < hi else lo, hi - 1 if lo < hi else hi], dtype=np.int64)
    with np.errstate(all="ignore"):
        got = run_ort(model, {"x": xs})[0]
    assert all(span.lo <= int(v) <= span.hi for v in got), (span, got)


@settings(max_examples=60, deadline=None)
@given(st.floats(-1e6, 1e6), st.floats(0, 1e6), st.floats(-1e3, 1e3),
       st.sampled_from([TensorProto.FLOAT, TensorProto.FLOAT16]))
def test_float_intervals_are_sound(lo, width, c, ftype):
    np_t = np.float32 if ftype == TensorProto.FLOAT else np.float16
    with np.errstate(over="ignore"):
        lo_t, hi_t = np_t(lo), np_t(lo + width)
    if not (math.isfinite(lo_t) and math.isfinite(hi_t)) or hi_t < lo_t:
        return
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["a"]), helper.make_node("Mul", ["a", "c"], ["b"]),
             helper.make_node("Add", ["b", "c"], ["d"]), helper.make_node("Floor", ["d"], ["e"]),
             helper.make_node("Cast", ["e"], ["y"], to=I64)]
    model = build(nodes, [helper.make_tensor_value_info("x", ftype, [4])],
                  [helper.make_tensor_value_info("y", I64, [4])],
                  [("lo", np.asarray(lo_t)), ("hi", np.asarray(hi_t)), ("c", np.asarray(np_t(c)))])
    p, graph = prover(model)
    span = p.bound(graph.tensors()["y"]).whole
    with np.errstate(all="ignore"):
        xs = np.array([lo_t, hi_t, lo_t + (hi_t - lo_t) / 2, -1e30], dtype=np_t)
        d = run_ort(model, {"x": xs})[0]
    assert all(span.lo <= int(v) <= span.hi for v in d)
