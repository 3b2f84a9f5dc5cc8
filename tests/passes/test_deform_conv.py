"""ONNX `DeformConv` (torch's dynamo export) lowered by passes/deform_conv.py: the same bytes as ORT CPU's own
DeformConv kernel, indices in range for every offset (NaN, infinities, far outside the image), refusals named.

Replicas are built with onnx.helper (tests/helpers/graphs.py `deform_conv`), no torch; the real BiRefNet-lite dynamo
export is measured in docs/deformconv.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers.graphs import deform_conv

import deform_surgeon as ds
from deform_surgeon.graph.blocks import GraphIndex, find_blocks
from deform_surgeon.graph.pipeline import Outcome

LEVELS = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
CASES = {
    "default": {},
    "groups": dict(c=4, m=6, group=2),
    "offset_groups": dict(c=8, m=4, offset_group=4),
    "groups_and_offset_groups": dict(c=8, m=6, group=2, offset_group=2),
    "stride2": dict(strides=(2, 2)),
    "dilation2": dict(dilations=(2, 2), pads=(2, 2, 2, 2)),
    "uneven_pads_5x3": dict(kernel=(5, 3), pads=(2, 0, 1, 1), strides=(1, 2)),
    "no_mask": dict(mask=False),
    "no_bias": dict(bias=False),
    "neither": dict(mask=False, bias=False),
    "batch2": dict(n=2, c=4, m=4, group=2, offset_group=2),
    "wide": dict(c=64, m=48, h=24, w=20, offset_group=4),
}


def run_cpu(model: str | Path | onnx.ModelProto, feeds: dict[str, np.ndarray], level: str = "all") -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def feeds_for(model: onnx.ModelProto, seed: int, spread: float = 3.0) -> dict[str, np.ndarray]:
    """Random inputs; offsets of `spread` pixels push many samples across and outside the image border."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "offset":
            feeds[vi.name] = (rng.standard_normal(shape) * spread).astype(np.float32)
        elif vi.name == "mask":
            feeds[vi.name] = rng.random(shape, dtype=np.float32)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def patched(tmp_path: Path, model: onnx.ModelProto, name: str = "m") -> tuple[Path, Path, ds.PatchReport]:
    src, dst = tmp_path / f"{name}.onnx", tmp_path / f"{name}_patched.onnx"
    onnx.save(model, src)
    return src, dst, ds.patch(src, dst)


@pytest.mark.parametrize("case", list(CASES))
def test_lowered_deform_conv_is_byte_identical_to_ort_cpu(tmp_path: Path, case: str) -> None:
    model = deform_conv(**CASES[case])
    src, dst, report = patched(tmp_path, model)
    assert [(a.pass_name, a.action) for a in report.actions] == [("deform_conv", Outcome.REWRITTEN)]
    assert report.written and report.actions[0].details["shown_exact"] == "whole_model"
    assert report.ops_after.get("DeformConv", 0) == 0
    assert report.ops_after["MatMul"] == CASES[case].get("group", 1)  # one per group, as ORT's SGEMM calls
    for seed, spread in ((0, 0.5), (1, 3.0), (2, 12.0)):
        feeds = feeds_for(model, seed, spread)
        for level in LEVELS:
            want, got = run_cpu(src, feeds, level), run_cpu(dst, feeds, level)
            assert want.dtype == got.dtype and want.shape == got.shape
            assert want.tobytes() == got.tobytes(), f"{case} seed {seed} level {level}: max |diff| " \
                                                    f"{np.abs(want - got).max()}"


@pytest.mark.parametrize("case", ["default", "groups_and_offset_groups", "uneven_pads_5x3", "neither", "batch2"])
def test_float16_deform_conv_is_lowered_between_casts_with_ort_cpus_bytes(tmp_path: Path, case: str) -> None:
    """ORT CPU has a float32 DeformConv kernel only: a float16 node runs between Casts it inserts (every input to
    float32, the output back), at every optimisation level. The lowering does the same; NaN, infinite and far
    offsets included, the bytes are ORT's (not refused as having "no float64")."""
    model = deform_conv(**CASES[case], dtype=np.float16)
    src, dst, report = patched(tmp_path, model)
    assert [(a.pass_name, a.action) for a in report.actions] == [("deform_conv", Outcome.REWRITTEN)]
    assert report.ops_after.get("DeformConv", 0) == 0 and report.written
    for seed, spread in ((0, 0.5), (1, 3.0), (2, 12.0), (3, None)):
        feeds = {k: v.astype(np.float16) for k, v in feeds_for(model, seed, spread or 3.0).items()}
        if spread is None:
            flat = feeds["offset"].reshape(-1)  # a view: NaN, +-inf and 6e4 pixels at every 7th offset
            flat[::7] = np.resize(np.array([np.nan, np.inf, -np.inf, 6e4], np.float16), flat[::7].size)
        for level in LEVELS:
            want, got = run_cpu(src, feeds, level), run_cpu(dst, feeds, level)
            assert want.dtype == got.dtype == np.float16 and want.tobytes() == got.tobytes(), (case, seed, level)


@pytest.mark.parametrize("kind, argv, why", [
    ("empty_batch", ["patch", "--verify"], r"empty input or output \(0 images, 4 input channels"),
    ("no_channels", ["patch", "--verify"], r"empty input or output \(1 images, 0 input channels"),
    ("huge", ["inspect"], r"its lowering would add 2\.15 GB \(2\.00 GiB\) of constants \(the sampling grid of "
                          r"16384 x 16384 output positions\), over the 268\.4 MB \(256\.0 MiB\) one rewrite may add"),
])
def test_a_deform_conv_that_cannot_be_lowered_is_refused_before_anything_is_built(tmp_path: Path, kind: str,
                                                                                   argv: list, why: str) -> None:
    """An empty batch or no channels (valid to onnx.checker) would divide by zero in the chunking; a 16384 x 16384
    input in a 372-byte file would build gigabytes of constants and end in MemoryError: each is refused with its
    reason, and the whole command stays small (run under a 3 GiB address-space limit; the refusal needs ~60 MB)."""
    model = {"empty_batch": lambda: deform_conv(n=0), "no_channels": lambda: deform_conv(c=0),
             "huge": lambda: deform_conv(c=1, m=1, h=16384, w=16384, mask=False, bias=False)}[kind]()
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / "m.onnx")
    cmd = [sys.executable, "-m", "deform_surgeon", argv[0], "m.onnx", *(["out.onnx"] if argv[0] == "patch" else []),
           *argv[1:]]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, preexec_fn=_limit_memory)
    code = 3 if argv[0] == "patch" else 0  # patch: a refused node is a finding; inspect: only with --strict
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"refused +DeformConv +node_deform_conv2d: " + why, proc.stdout), proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def _limit_memory() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


def _with_index_outputs(path: Path) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The patched model with every sampling Gather's index as an extra output, and each one's row count."""
    model = onnx.load(path)
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in inferred.graph.value_info}
    rows = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[0].endswith("/image_rows"):
            rows[node.input[1]] = shapes[node.input[0]][0]
            model.graph.output.append(onnx.helper.make_tensor_value_info(node.input[1], onnx.TensorProto.INT32, None))
    assert len(rows) == 4
    return model, rows


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 3e38, -3e38, 1e9, -1.5, 16.5])
def test_indices_stay_in_range_for_any_offset(tmp_path: Path, value: float) -> None:
    model = deform_conv(c=4, m=4, h=8, w=10, offset_group=2)
    _, dst, report = patched(tmp_path, model)
    assert report.actions[0].details["proof"] == "proven"
    with_indices, rows = _with_index_outputs(dst)
    feeds = feeds_for(model, 3)
    feeds["offset"][0, ::3] = value  # h of some taps, w of others, both of a few
    feeds["offset"][:, :, 2, ::2] = value
    sess = ort.InferenceSession(with_indices.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = sess.run(None, feeds)
    for name, out in zip([o.name for o in with_indices.graph.output][1:], outs[1:], strict=True):
        assert out.dtype == np.int32 and 0 <= out.min() and out.max() < rows[name], (name, out.min(), out.max())


def test_infinite_and_far_offsets_give_ort_cpus_bytes(tmp_path: Path) -> None:
    """Samples outside the image read row 0 with weight +0 as ORT does: an infinite X[0, 0] makes them NaN there
    too (0 * inf), and infinite or huge offsets are outside the image."""
    model = deform_conv(c=4, m=4, h=8, w=10, offset_group=2)
    src, dst, _ = patched(tmp_path, model)
    feeds = feeds_for(model, 4)
    for k, value in enumerate((np.inf, -np.inf, 3e38, -3e38, 1e9, -1e9, 10.0, -8.0)):
        feeds["offset"][0, k, k % 8, :] = value
    for x00 in (0.5, np.inf):
        feeds["X"][0, 1, 0, 0] = x00
        for level in LEVELS:
            want, got = run_cpu(src, feeds, level), run_cpu(dst, feeds, level)
            assert want.tobytes() == got.tobytes(), (x00, level)
        assert np.isnan(got).any() == (x00 == np.inf)


def test_nan_offsets_give_ort_cpus_bytes(tmp_path: Path) -> None:
    """A NaN coordinate fails ORT's inside test (`-1 < h < H`): its sample is an outside one, the bytes of a +inf
    offset; here as there."""
    model = deform_conv(c=4, m=4, h=8, w=11, offset_group=2)
    src, dst, _ = patched(tmp_path, model)
    feeds = feeds_for(model, 5)
    feeds["offset"][0, 0, 3, 4] = np.nan  # h of tap 0 at output (3, 4)
    feeds["offset"][0, 2 * 4 + 1, 6, 1] = np.nan  # w of tap 4 at (6, 1)
    feeds["offset"][0, 2 * 9 + 16:, 1, 7] = np.nan  # h and w of tap 8 of offset group 1 at (1, 7)
    feeds["offset"][0, 20, :, 5] = np.nan
    outside = {**feeds, "offset": np.nan_to_num(feeds["offset"], nan=np.inf)}
    for level in LEVELS:
        want, got = run_cpu(src, feeds, level), run_cpu(dst, feeds, level)
        assert want.tobytes() == got.tobytes() == run_cpu(src, outside, level).tobytes(), level
    assert np.isfinite(got).all()


def test_block_label_is_the_same_before_and_after(tmp_path: Path) -> None:
    model = deform_conv(c=4, m=4, h=8, w=8, offset_conv=True, offset_group=2)
    _, dst, _ = patched(tmp_path, model)
    before = find_blocks(GraphIndex(model))
    after = find_blocks(GraphIndex(onnx.load(dst)))
    assert [b.label for b in before] == [b.label for b in after] == [
        "DeformConv 'node_deform_conv2d' (deform.weight)"]
    index = GraphIndex(model)
    assert {index.ops[k] for k in before[0].nodes} == {"DeformConv", "Sigmoid", "Relu"}  # feeders, conv, tail
    patched_ops = GraphIndex(onnx.load(dst)).ops
    assert patched_ops[after[0].conv] == "MatMul" and sum(patched_ops[k] == "Gather" for k in after[0].nodes) >= 4


@pytest.mark.parametrize("kind", ["float64", "dynamic"])
def test_what_cannot_be_lowered_is_named_with_the_reason(tmp_path: Path, kind: str) -> None:
    if kind == "float64":
        model = deform_conv(dtype=np.float64)
        why = "element type float64"
    else:
        model = deform_conv()
        for vi in list(model.graph.input) + list(model.graph.output):
            vi.type.tensor_type.shape.dim[2].dim_param = "height"
        why = "not known statically"
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "patch", str(src), str(tmp_path / "out.onnx"),
                           "--report", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr  # the node refused: a finding (exit 3, as batch's "refused")
    assert "refused: 1 node(s) refused" in proc.stdout and "written all the same" not in proc.stdout
    assert "refused            DeformConv     node_deform_conv2d: " in proc.stdout
    assert why in proc.stdout and "runs on the CPU EP in onnxruntime-web" in proc.stdout
    assert "nothing to rewrite" in proc.stdout and "(1 node(s) refused: see their reasons)" in proc.stdout
    assert not (tmp_path / "out.onnx").exists()
    nodes = json.loads((tmp_path / "r.json").read_text())["nodes"]
    assert [(n["op"], n["node"], n["action"]) for n in nodes] == [("DeformConv", "node_deform_conv2d", "refused")]


def test_external_data_stays_beside_the_patched_model(tmp_path: Path) -> None:
    """torch's exporter writes `<name>.onnx.data`; the patched model gets its own, the input's is untouched."""
    model = deform_conv(c=8, m=8, h=12, w=12, offset_conv=True)
    src = tmp_path / "dynamo.onnx"
    onnx.save(model, src, save_as_external_data=True, location="dynamo.onnx.data", size_threshold=0)
    data_before = (tmp_path / "dynamo.onnx.data").read_bytes()
    report = ds.patch(src, tmp_path / "out.onnx", verify=True)
    assert report.written and report.verification.identical
    assert (tmp_path / "out.onnx.data").is_file() and (tmp_path / "dynamo.onnx.data").read_bytes() == data_before
    out = onnx.load(tmp_path / "out.onnx", load_external_data=False)
    assert {e.value for t in out.graph.initializer for e in t.external_data if e.key == "location"} == {
        "out.onnx.data"}
    feeds = feeds_for(model, 6)
    assert run_cpu(src, feeds).tobytes() == run_cpu(tmp_path / "out.onnx", feeds).tobytes()


@pytest.mark.parametrize("kwargs", [dict(c=8, m=6, h=20, w=12), dict(n=2, c=8, m=6, h=20, w=12, group=2,
                                                                      offset_group=2, mask=False)])
def test_max_buffer_lowers_in_chunks_of_output_rows(tmp_path: Path, kwargs: dict) -> None:
    """With --max-buffer the im2col tensors are built a chunk of output rows at a time, each under the limit,
    and the outputs keep ORT CPU's bytes (each chunk's GEMM keeps at least K columns: MLAS's K blocking)."""
    model = deform_conv(**kwargs)
    limit = kwargs.get("n", 1) * 8 * 9 * 12 * 4 * 10  # ten of the twenty output rows
    src, dst = tmp_path / "m.onnx", tmp_path / "p.onnx"
    onnx.save(model, src)
    report = ds.patch(src, dst, max_buffer=limit)
    assert [a.action for a in report.actions] == [Outcome.REWRITTEN]
    assert report.ops_after["MatMul"] == 2 * kwargs.get("group", 1)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(dst), strict_mode=True)
    sizes = {vi.name: 4 * int(np.prod([d.dim_value for d in vi.type.tensor_type.shape.dim]))
             for vi in inferred.graph.value_info if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    assert max(sizes.values()) <= limit and sum(v == limit for v in sizes.values()) >= 8
    for seed in range(3):
        feeds = feeds_for(model, seed, 3.0)
        for level in LEVELS:
            assert run_cpu(src, feeds, level).tobytes() == run_cpu(dst, feeds, level).tobytes(), (seed, level)
