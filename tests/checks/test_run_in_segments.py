"""`verify --segment-memory`: a model run on ORT CPU in segments, the tensors between them on disk, gives the bytes of
its whole run at level disable (segments.py). Checked here on the replicas, every node its own segment where the
limit is one byte; on the real BiRefNet exports in docs/verify.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import graphs
from onnx import TensorProto, helper, numpy_helper

from deform_surgeon import SurgeonError, patch, verify
from deform_surgeon.checks.run_in_segments import (
    plan_segments,
    planned_bytes,
    run_in_segments,
    segment_graph,
    tensor_bytes,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"


def disable_session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feeds_of(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs of a model, integers in [0, 8], floats in [0, 1) (verify's defaults)."""
    rng = np.random.default_rng(seed)
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        dims = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = (rng.integers(0, 9, dims).astype(dtype) if np.issubdtype(dtype, np.integer)
                          else rng.random(dims).astype(dtype))
    return feeds


def whole_and_segmented(path: Path, max_bytes: int, tmp: Path) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    g = segment_graph(path)
    feeds = [feeds_of(path, 0), feeds_of(path, 1)]
    whole = [a for f in feeds for a in disable_session(path).run(None, f)]
    tmp.mkdir()
    saved, count, disk = run_in_segments(g, feeds, max_bytes, tmp, disable_session)
    assert disk > 0
    pieces = [np.load(file) for per_feed in saved for _, file in per_feed]
    left = sorted(p.name for p in tmp.iterdir())
    assert left == sorted(Path(file).name for per_feed in saved for _, file in per_feed), left  # nothing else kept
    return whole, pieces, count


@pytest.fixture(scope="module")
def exporter_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The exporter's deform block (batch 2, 2 offset groups) and its patched form."""
    folder = tmp_path_factory.mktemp("pair")
    patched = folder / "patched.onnx"
    patch(FIXTURES / "gathernd_b2g2.onnx", patched)
    return FIXTURES / "gathernd_b2g2.onnx", patched


@pytest.mark.parametrize("which", ["original", "patched"])
@pytest.mark.parametrize("max_bytes", [1, 4096])
def test_segments_give_the_whole_models_bytes(exporter_pair, which, max_bytes, tmp_path):
    path = exporter_pair[0] if which == "original" else exporter_pair[1]
    whole, pieces, count = whole_and_segmented(path, max_bytes, tmp_path / "run")
    assert count > 2
    assert len(whole) == len(pieces)
    for a, b in zip(whole, pieces, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_the_decoder_tail_in_segments(tmp_path):
    """Convs, Resizes and Concats of BiRefNet's decoder end (graphs.decoder_tail): the same bytes in segments."""
    onnx.save(graphs.decoder_tail(), tmp_path / "tail.onnx")
    whole, pieces, count = whole_and_segmented(tmp_path / "tail.onnx", 200_000, tmp_path / "run")
    assert count > 2
    assert [a.tobytes() for a in whole] == [b.tobytes() for b in pieces]


def test_each_segment_holds_at_most_the_limit_or_one_node(exporter_pair):
    g = segment_graph(exporter_pair[0])
    for limit in (1, 2_000, 50_000):
        segments = plan_segments(g, limit)
        assert segments[0].first == 0 and segments[-1].last == len(g.nodes) - 1
        for seg in segments:
            assert seg.nbytes <= limit or seg.last == seg.first or all(
                g.nodes[k].op_type == "Constant" for k in range(seg.first, seg.last)), seg
        # every tensor a segment reads is a graph input or made by an earlier segment
        made = set(g.graph_inputs)
        for seg in segments:
            assert set(seg.inputs) <= made
            made |= set(seg.outputs)


def test_tensor_sizes_come_from_patchs_type_table(exporter_pair):
    g = segment_graph(exporter_pair[0])
    gathered = next(n.output[0] for n in g.nodes if n.op_type == "GatherND")
    shape = [d.dim_value for d in g.types[gathered].tensor_type.shape.dim]
    assert tensor_bytes(g, gathered) == int(np.prod(shape)) * 4 > 0


def branchy(tmp_path: Path) -> Path:
    """y1 is a graph output also read by a later node; y2 is a Constant node's output that is a graph output."""
    nodes = [helper.make_node("Mul", ["x", "k"], ["y1"]),
             helper.make_node("Constant", [], ["y2"], value=numpy_helper.from_array(np.float32([5, 6, 7]), "c")),
             helper.make_node("Add", ["y1", "y2"], ["t"]),
             helper.make_node("Relu", ["t"], ["y3"])]
    graph = helper.make_graph(nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                               for n, s in (("y1", [2, 3]), ("y2", [3]), ("y3", [2, 3]))],
                              [numpy_helper.from_array(np.float32([1.5, -2, 3]), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "branchy.onnx")
    return tmp_path / "branchy.onnx"


def test_outputs_also_read_later_and_constant_outputs(tmp_path):
    whole, pieces, count = whole_and_segmented(branchy(tmp_path), 1, tmp_path / "run")
    assert count == 4  # Mul, the Constant (a graph output: saved), Add (the Constant copied in), Relu
    assert [a.tobytes() for a in whole] == [b.tobytes() for b in pieces]


def test_a_graph_output_that_is_a_stored_tensor(tmp_path):
    """A graph output no node makes (an initializer given as it is) is an output of the run in segments too (it
    was refused: "fails to run on ORT CPU with the seeded inputs ((0, 'w'))"); verify in segments passes."""
    model = onnx.load(branchy(tmp_path))
    model.graph.output.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, [3]))
    onnx.save(model, tmp_path / "stored_out.onnx")
    whole, pieces, _ = whole_and_segmented(tmp_path / "stored_out.onnx", 1, tmp_path / "run")
    assert len(whole) == 8 and [a.tobytes() for a in whole] == [b.tobytes() for b in pieces]  # 2 feeds, 4 each
    result = verify(tmp_path / "stored_out.onnx", tmp_path / "stored_out.onnx", segment_memory=1)
    assert result.identical, result.summary()


def test_verify_in_segments_passes_and_says_so(exporter_pair):
    result = verify(*exporter_pair, segment_memory=2_000, iterations=2)
    assert result.identical, result.summary()
    assert result.opt_level == "disable" and result.segment_memory == 2_000
    assert result.segments["original"] > 2 and result.segments["patched"] > 2
    disk = result.segment_disk["original"]
    assert f", in segments of at most 2,000 B of tensors: the original in {result.segments['original']} (at most " \
        f"{disk:,} B on disk between them), the patched in" in result.summary()
    assert result.to_dict()["segments"] == result.segments
    assert 0 < result.segment_disk["original"] < 10**6 and result.to_dict()["segment_disk"] == result.segment_disk


def one_ulp_models(tmp_path: Path) -> tuple[Path, Path]:
    """y = (x * 0 + c) * 1 with c one ulp apart in one element: three nodes, so three segments at one byte."""
    paths = []
    for name, bump in (("a", False), ("b", True)):
        c = np.ones((2, 3), np.float32)
        if bump:
            c[1, 2] = np.nextafter(np.float32(1), np.float32(2))
        nodes = [helper.make_node("Mul", ["x", "zero"], ["t"]), helper.make_node("Add", ["t", "c"], ["u"]),
                 helper.make_node("Mul", ["u", "one"], ["y"])]
        inits = [numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(c, "c"),
                 numpy_helper.from_array(np.float32(1), "one")]
        graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        paths.append(tmp_path / f"{name}.onnx")
        onnx.save(model, paths[-1])
    return paths[0], paths[1]


def test_verify_in_segments_finds_one_ulp(tmp_path):
    a, b = one_ulp_models(tmp_path)
    result = verify(a, b, segment_memory=1)
    assert not result.identical and result.segments == {"original": 3, "patched": 3}
    assert result.mismatch.output == "y" and result.mismatch.index == (1, 2)


def test_segments_run_at_level_disable_only(exporter_pair):
    with pytest.raises(SurgeonError, match="only at opt level 'disable' \\(got 'all'"):
        verify(*exporter_pair, segment_memory="1MB", opt_level="all")
    with pytest.raises(SurgeonError, match="bad size"):
        verify(*exporter_pair, segment_memory="lots")
    with pytest.raises(SurgeonError, match="segment_memory must be bytes"):
        verify(*exporter_pair, segment_memory=1.5)


def test_a_float16_model_is_refused(tmp_path):
    fp16 = FIXTURES / "decoder_gathernd_fp16.onnx"
    with pytest.raises(SurgeonError, match="has float16 tensors, which a run in segments would round") as err:
        verify(fp16, fp16, segment_memory="1MB")
    assert err.value.path == str(fp16)


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deform_surgeon", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_cli_verify_segment_memory(tmp_path):
    a, b = one_ulp_models(tmp_path)
    proc = cli("verify", a.name, a.name, "--segment-memory", "1kB", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "opt level 'disable', in segments of at most 1,000 B of tensors: the original in 1 (at most " in proc.stdout
    assert " B on disk between them), the patched in 1 (at most " in proc.stdout
    proc = cli("verify", a.name, b.name, "--segment-memory", "1", cwd=tmp_path)
    assert proc.returncode == 1 and "verify: FAILED: output 'y'" in proc.stdout, proc.stdout + proc.stderr
    proc = cli("verify", a.name, b.name, "--segment-memory", "1", "--opt-level", "basic", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["deform-surgeon: error: a run in segments equals the whole model's run only "
                                        "at opt level 'disable' (got 'basic': ORT fuses nodes across a segment's edge "
                                        "at the other levels) (give --opt-level disable or no --opt-level)"]


def test_patch_verify_runs_in_segments_when_asked(tmp_path):
    """`patch --verify --segment-memory`: the comparison the user asked for runs in segments at level disable, and
    no whole run at ORT's default level is added to it."""
    report = patch(FIXTURES / "gathernd_b2g2.onnx", tmp_path / "p.onnx", verify=True,
                   verify_options={"segment_memory": 2_000, "iterations": 1})
    assert report.written and report.verification.identical
    assert report.verification.opt_level == "disable" and report.verification.segments["original"] > 2
    with pytest.raises(SurgeonError, match="only at opt level 'disable'"):
        patch(FIXTURES / "gathernd_b2g2.onnx", tmp_path / "q.onnx", verify=True,
              verify_options={"segment_memory": 2_000, "opt_level": "all"})
    assert not (tmp_path / "q.onnx").exists()


def test_a_tensor_inference_does_not_size_is_planned_as_its_producers_largest_input(tmp_path):
    """A Reshape to a shape given at run time (inference leaves its output unsized, as the HR original's Swin
    reshapes): the plan counts it as the Reshape's data input, not as nothing; the segments give the whole bytes."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    graph = helper.make_graph(nodes, "unsized", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64]),
                                                 helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "unsized.onnx"
    onnx.save(model, path)
    g = segment_graph(path)
    assert tensor_bytes(g, "r") == 0  # (inference does not know it)
    assert planned_bytes(g)("r") == 64 * 64 * 4 and planned_bytes(g)("y") == 64 * 64 * 4
    assert len(plan_segments(g, 64 * 64 * 4 * 2)) == 2  # x and r; then r and y: not one segment of x alone
    feed = {"x": np.random.default_rng(0).random((64, 64), dtype=np.float32), "shape": np.array([128, 32])}
    (tmp_path / "run").mkdir()
    saved, count, _ = run_in_segments(g, [feed], 64 * 64 * 4 * 2, tmp_path / "run", disable_session)
    assert count == 2
    assert np.load(saved[0][0][1]).tobytes() == disable_session(path).run(None, feed)[0].tobytes()
