"""Sum -> Add chain: bit-identical on ORT CPU, and exact by construction for fp16 on a per-op-rounding GPU."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import assert_bytes_equal, op_count, patch_in_memory, run_ort
from helpers.graphs import sum_only
from onnx import TensorProto, helper

from deform_surgeon.graph.pipeline import Outcome


def adversarial(n: int, shape, dtype, seed=0) -> list[np.ndarray]:
    """Inputs where the order of additions matters: huge values that cancel and tiny ones that get absorbed."""
    rng = np.random.default_rng(seed)
    big = np.float32(1e4 if dtype == np.float16 else 1e8)
    xs = []
    for i in range(n):
        s = list(shape) if i < n - 1 else [1, shape[-1]]
        v = rng.standard_normal(s) * (big if i % 2 == 0 else 1.0) * (-1) ** i
        xs.append(v.astype(dtype))
    return xs


def test_chain_is_bit_identical_and_tree_is_not():
    model = sum_only(4, np.float32, (64, 64))
    feeds = dict(zip([f"x{i}" for i in range(4)], adversarial(4, (64, 64), np.float32), strict=True))
    chain, actions = patch_in_memory(model)
    assert [a.action for a in actions] == [Outcome.REWRITTEN]
    assert op_count(chain, "Add") == 3 and op_count(chain, "Sum") == 0
    assert_bytes_equal(run_ort(model, feeds), run_ort(chain, feeds))
    tree, _ = patch_in_memory(model, sum_mode="tree")
    assert run_ort(model, feeds)[0].tobytes() != run_ort(tree, feeds)[0].tobytes()


def test_none_leaves_sums_alone_and_one_input_becomes_identity():
    patched, actions = patch_in_memory(sum_only(4), sum_mode="none")
    assert actions == [] and op_count(patched, "Sum") == 1
    patched, _ = patch_in_memory(sum_only(1))
    assert op_count(patched, "Sum") == 0 and op_count(patched, "Identity") == 1


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_chain_matches_ort_cpu_sum(n, dtype):
    model = sum_only(n, dtype, (8, 16))
    feeds = dict(zip([f"x{i}" for i in range(n)], adversarial(n, (8, 16), dtype, seed=n), strict=True))
    patched, _ = patch_in_memory(model)
    assert_bytes_equal(run_ort(model, feeds), run_ort(patched, feeds))


# -------------------------------------------------------------------------------- fp16: per-op semantics
_NP = {TensorProto.FLOAT16: np.float16, TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}


def eval_per_op(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Evaluate Cast/Add/Identity nodes the way a GPU does: every op rounds to its own element type."""
    values = dict(feeds)
    for node in model.graph.node:
        if node.op_type == "Cast":
            values[node.output[0]] = values[node.input[0]].astype(_NP[node.attribute[0].i])
        elif node.op_type == "Add":
            a, b = values[node.input[0]], values[node.input[1]]
            assert a.dtype == b.dtype
            values[node.output[0]] = (a + b).astype(a.dtype)  # numpy adds fp16 with one fp16 rounding
        elif node.op_type == "Identity":
            values[node.output[0]] = values[node.input[0]]
        else:
            raise AssertionError(f"unexpected op {node.op_type}")
    return values[model.graph.output[0].name]


def cpu_sum_semantics(xs: list[np.ndarray]) -> np.ndarray:
    """ORT CPU's fp16 Sum: cast to fp32, left fold in fp32, round to fp16 once."""
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = acc + x.astype(np.float32)
    return acc.astype(np.float16)


def test_fp16_chain_is_exact_under_per_op_rounding():
    model = sum_only(4, np.float16, (64, 64))
    xs = adversarial(4, (64, 64), np.float16, seed=7)
    feeds = dict(zip([f"x{i}" for i in range(4)], xs, strict=True))
    patched, _ = patch_in_memory(model)
    assert op_count(patched, "Cast") == 5  # four up, one down
    expected = cpu_sum_semantics(xs)
    assert eval_per_op(patched, feeds).tobytes() == expected.tobytes()
    assert run_ort(model, feeds)[0].tobytes() == expected.tobytes()  # the reference is what ORT CPU computes


def test_the_per_op_check_catches_a_naive_fp16_chain():
    # A plain fp16 Add chain rounds at every step on a GPU: the same check must see the difference,
    # although ORT CPU (which wraps fp16 Adds in fp32 casts) cannot.
    xs = adversarial(4, (64, 64), np.float16, seed=7)
    names = [f"x{i}" for i in range(4)]
    naive = helper.make_graph(
        [helper.make_node("Add", ["x0", "x1"], ["a1"]), helper.make_node("Add", ["a1", "x2"], ["a2"]),
         helper.make_node("Add", ["a2", "x3"], ["y"])], "naive",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, list(x.shape)) for n, x in zip(names, xs, strict=True)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [64, 64])])
    feeds = dict(zip(names, xs, strict=True))
    assert eval_per_op(helper.make_model(naive), feeds).tobytes() != cpu_sum_semantics(xs).tobytes()


def test_fp16_fixture_sums_are_exact_under_per_op_rounding():
    """On the onnxconverter-common fp16 fixture, with the real fp16 tensors of a real inference: each replaced Sum,
    evaluated op by op as a GPU rounds, equals ORT CPU's Sum of the same fp16 inputs (which is what the original
    computes in the browser: its Sum runs on the CPU EP, fed fp16 tensors from the GPU)."""
    from helpers import FIXTURES

    model = onnx.load(str(FIXTURES / "decoder_gathernd_fp16.onnx"))
    patched, actions = patch_in_memory(model)
    sums = {n.name: n for n in model.graph.node if n.op_type == "Sum"}
    replaced = [a for a in actions if a.pass_name == "sum_chain"]
    assert sorted(a.node for a in replaced) == sorted(sums) and len(sums) == 8

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    wanted = sorted({t for n in sums.values() for t in n.input})
    probe.graph.output.extend(helper.make_tensor_value_info(t, TensorProto.FLOAT16, None) for t in wanted)
    image = np.random.default_rng(11).uniform(0, 1, size=(1, 3, 64, 64)).astype(np.float16)
    values = dict(zip([o.name for o in probe.graph.output], run_ort(probe, {"image": image}), strict=True))

    new = {n.name: n for n in patched.graph.node}
    for action in replaced:
        node = sums[action.node]
        xs = [values[t] for t in node.input]
        reference = run_ort(sum_model_like(xs), {f"x{i}": x for i, x in enumerate(xs)})[0]  # ORT CPU's fp16 Sum
        assert reference.tobytes() == cpu_sum_semantics(xs).tobytes()
        sub = helper.make_model(helper.make_graph([new[name] for name in action.new_nodes], "sub", [], []))
        sub.graph.output.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT16, None))
        got = eval_per_op(sub, dict(zip(node.input, xs, strict=True)))
        assert got.tobytes() == reference.tobytes(), action.node


def sum_model_like(xs: list[np.ndarray]) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(xs))]
    graph = helper.make_graph(
        [helper.make_node("Sum", names, ["y"])], "sum",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, list(x.shape)) for n, x in zip(names, xs, strict=True)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
