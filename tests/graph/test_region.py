"""region.py: patching only the lifted deform regions gives what lifting the whole model gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from helpers import FIXTURES, assert_bytes_equal, patch_whole_graph
from helpers.scale import build_birefnet_scale
from onnx import TensorProto, helper

from deform_surgeon import patch
from deform_surgeon.files import Weights
from deform_surgeon.graph.region import find_region, splice


def feeds(model: onnx.ModelProto, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        out[vi.name] = (rng.integers(0, 4, shape) if np.dtype(dtype).kind == "i" else
                        rng.random(shape, dtype=np.float32)).astype(dtype)
    return out


def run(model: onnx.ModelProto | Path, data: dict) -> list[np.ndarray]:
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, data)


# what showed a Conv split exact or not: `patch` shows it with its local proof (proofs/local_proof.py), the passes
# alone with their own check of the chunks
_HOW_SHOWN = {"shown_exact", "levels", "undone", "level", "max_diff", "neighbours"}


def _verdict(action) -> str:
    """An action's details (docs/report.md) but how its exactness was shown, as comparable text."""
    return json.dumps({k: v for k, v in action.details.items() if k not in _HOW_SHOWN}, sort_keys=True)


def same_as_whole_graph(path: Path, tmp_path: Path, **options) -> onnx.ModelProto:
    """`patch` (regions only) against the passes run on the whole model lifted at once (helpers)."""
    model = onnx.load(str(path))
    whole, whole_actions = patch_whole_graph(model, **options)
    out = tmp_path / "out.onnx"
    report = patch(path, out, copy_unchanged=True, **options)
    region = onnx.load(str(out))
    assert sorted((a.pass_name, a.node, a.action, _verdict(a)) for a in report.actions) == \
        sorted((a.pass_name, a.node, a.action, _verdict(a)) for a in whole_actions)  # (rounds: graph order)
    assert sorted(n.op_type for n in region.graph.node) == sorted(n.op_type for n in whole.graph.node)
    assert [o.name for o in region.graph.output] == [o.name for o in model.graph.output]
    for seed in range(2):
        data = feeds(model, seed)
        try:
            expected = run(model, data)
        except Exception as exc:  # gathernd_refused's unclamped index leaves the data on random input
            with pytest.raises(type(exc)):
                run(region, data)
            continue
        assert_bytes_equal(expected, run(region, data))
        assert_bytes_equal(run(whole, data), run(region, data))
    return region


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.onnx")))
def test_every_fixture_patches_as_when_the_whole_model_is_lifted(name, tmp_path):
    same_as_whole_graph(FIXTURES / f"{name}.onnx", tmp_path)


def test_the_split_pass_sees_the_conv_and_its_tail(tmp_path):
    region = same_as_whole_graph(FIXTURES / "decoder_gathernd.onnx", tmp_path, max_buffer=60_000)
    assert any(n.name.endswith("/split/join") for n in region.graph.node)


def test_a_birefnet_scale_model_lifts_only_its_deform_blocks(tmp_path):

    path = tmp_path / "scale.onnx"
    model = build_birefnet_scale(path, target_nodes=4000)
    region = find_region(model)
    lifted = [model.graph.node[k] for k in region.nodes]
    assert {"GatherND", "Sum", "Floor", "Conv", "BatchNormalization", "Relu"} <= {n.op_type for n in lifted}
    assert not [n.name for n in lifted if n.name.startswith("bb/")]  # the transformer backbone stays out
    assert sum(n.op_type == "GatherND" for n in lifted) == 80  # 20 deform convs
    same_as_whole_graph(path, tmp_path)


def _boundary_model() -> onnx.ModelProto:
    """A Sum whose inputs come from outside (a Relu), whose output is read by a node outside the region and, in the
    outer scope, by an If's branch."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    c = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])
    branch = lambda name, op: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["s"], [f"{name}_out"], name=f"{name}_node")], name, [],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2, 3])])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Relu", ["m"], ["r"], name="relu"),
             helper.make_node("Sum", ["r", "x", "r", "x"], ["s"], name="sum4"),
             helper.make_node("Neg", ["s"], ["y"], name="neg"),
             helper.make_node("If", ["cond"], ["z"], name="if", then_branch=branch("then", "Abs"),
                              else_branch=branch("else", "Exp"))]
    w = onnx.numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    model = helper.make_model(helper.make_graph(nodes, "boundary", [x, c], [y, z], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_tensors_read_outside_the_region_keep_their_producers(tmp_path):
    model = _boundary_model()
    region = find_region(model)
    assert [model.graph.node[k].name for k in region.nodes] == ["relu", "sum4"]  # MatMul is heavy: not lifted
    assert region.inputs == ["m", "x"] and region.outputs == ["s"]  # s: read by Neg and inside the If
    path = tmp_path / "boundary.onnx"
    onnx.save(model, path)
    out = same_as_whole_graph(path, tmp_path)
    assert [n.name for n in out.graph.node][:2] == ["mm", "relu"] and out.graph.node[-1].name == "if"


def test_splice_keeps_untouched_nodes_in_their_order(tmp_path):
    path = FIXTURES / "decoder_gathernd.onnx"
    model = onnx.load(str(path))
    out = tmp_path / "out.onnx"
    patch(path, out)
    patched = onnx.load(str(out))
    lifted = {model.graph.node[k].name for k in find_region(model).nodes}
    untouched = [n.name for n in model.graph.node if n.name not in lifted]
    assert [n.name for n in patched.graph.node if n.name in set(untouched)] == untouched


def test_splice_refuses_a_cycle():
    model = _boundary_model()
    region = find_region(model)
    sub = onnx.ModelProto()
    sub.graph.node.extend([helper.make_node("Identity", ["y"], ["s"], name="loop")])  # y is computed from s
    with pytest.raises(ValueError, match="cycle"):
        splice(model, region, sub, Weights(None))


def test_the_check_of_a_spliced_model_sees_a_region_output_change_type():
    """check_spliced = plain checker on the whole model + strict inference on the region with its declared
    boundary: a region whose output changes type must fail it (the plain checker alone would not notice)."""
    from deform_surgeon.base.errors import SurgeonError
    from deform_surgeon.files import check_spliced, export_graph, infer_value_types
    from deform_surgeon.graph.region import region_model, type_boundary

    model = _boundary_model()
    region = find_region(model)
    sub = region_model(model, region)
    lifted = gs.import_onnx(sub)
    type_boundary(lifted, infer_value_types(model))  # the boundary as patch declares it
    sub = export_graph(lifted, sub)
    check_spliced(splice(model, region, sub, Weights(None)), sub, "boundary.onnx", Weights(None))  # unchanged: ok
    del sub.graph.node[-1]
    sub.graph.node.append(helper.make_node("Cast", ["r"], ["s"], name="sum4_as_int", to=TensorProto.INT64))
    spliced = splice(_boundary_model(), region, sub, Weights(None))  # splice changes the model it is given
    onnx.checker.check_model(spliced)  # the plain check passes
    with pytest.raises(SurgeonError, match=r"^boundary.onnx: fails onnx.checker: .*"):
        check_spliced(spliced, sub, "boundary.onnx", Weights(None))


def test_splice_reorders_when_a_new_node_reads_a_later_tensor():
    """A rewritten region may read a tensor produced after the region's first outside reader: then the nodes
    are reordered (Kahn), and the result is still a valid, checked model."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("b", "c")]
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="A"),
             helper.make_node("Sum", ["a", "a"], ["s"], name="R"),
             helper.make_node("Neg", ["s"], ["b"], name="B"),
             helper.make_node("Abs", ["x"], ["c"], name="C")]
    model = helper.make_model(helper.make_graph(nodes, "late", [x], outs), opset_imports=[helper.make_opsetid("", 17)])
    region = find_region(model)
    assert [model.graph.node[k].name for k in region.nodes] == ["A", "R"] and region.readers == {"s": 2}
    sub = onnx.ModelProto()
    sub.graph.node.extend([helper.make_node("Relu", ["x"], ["a"], name="A"),
                           helper.make_node("Add", ["a", "c"], ["s"], name="R_late")])
    out = splice(model, region, sub, Weights(None))
    assert [n.name for n in out.graph.node] == ["A", "C", "R_late", "B"]
    onnx.checker.check_model(out, full_check=True)


def test_a_model_with_value_info_keeps_it_for_untouched_tensors(tmp_path):
    """Exports often carry value_info for every tensor; the region takes its own, the rest stays as it was."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(FIXTURES / "decoder_gathernd.onnx")))
    assert len(model.graph.value_info) > 500
    path = tmp_path / "with_value_info.onnx"
    onnx.save(model, path)
    out = same_as_whole_graph(path, tmp_path)
    lifted = {o for k in find_region(model).nodes for o in model.graph.node[k].output}
    untouched = {vi.name: vi for vi in model.graph.value_info if vi.name not in lifted}
    kept = {vi.name: vi for vi in out.graph.value_info}
    assert untouched and all(kept.get(name) == vi for name, vi in untouched.items())


def test_region_tensors_that_are_also_graph_outputs(tmp_path):
    """Inner tensors of a deform block (its Floor, a Clip, a Sum) exposed as graph outputs: the region keeps
    them as outputs, the passes see them as such, and the result matches the whole-graph lift."""
    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    types = onnx.shape_inference.infer_shapes(model).graph.value_info
    wanted = [next(n.output[0] for n in model.graph.node if n.op_type == op) for op in ("Floor", "Clip", "Sum")]
    model.graph.output.extend(vi for vi in types if vi.name in wanted)
    assert len(model.graph.output) == 4
    path = tmp_path / "exposed.onnx"
    onnx.save(model, path)
    out = same_as_whole_graph(path, tmp_path)
    assert [o.name for o in out.graph.output][1:] == [o.name for o in model.graph.output][1:]
