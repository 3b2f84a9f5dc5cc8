"""Split pass: deformable blocks over --max-buffer are cut into the fewest row chunks that fit, bit-identically.

Also checks the torch-free exporter replica the 1024 fixtures are built from against the real exporter output.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import FIXTURES, assert_bytes_equal, op_count, patch_in_memory
from exporter_replica import SPECS, CopiedWeights, build, deform_conv_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deform_surgeon import patch
from deform_surgeon.budget import analyze
from deform_surgeon.pipeline import REFUSED, REWRITTEN

MiB = 2**20
LEVELS = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}


def run(model: onnx.ModelProto | str | Path, feeds: dict, level: str = "all") -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def image(model: onnx.ModelProto, seed: int) -> dict:
    vi = model.graph.input[0]
    shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    dtype = np.float16 if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else np.float32
    return {vi.name: np.random.default_rng(seed).random(shape, dtype=np.float32).astype(dtype)}


def split_actions(actions) -> list:
    return [a for a in actions if a.pass_name == "split"]


def chunks_of(action) -> int:
    return int(action.reason.split("split into ")[1].split(" chunks")[0])


def tensor_sizes(model: onnx.ModelProto) -> dict[str, int]:
    report = analyze(model, max_buffer=2**62, max_binding=2**62, top=10**9)
    return {t.name: t.nbytes for t in report.largest}


# --------------------------------------------------------------------------------------- the exporter replica
@pytest.mark.parametrize("name", ["decoder_gathernd", "decoder_gatherelements", "decoder_gathernd_b2g2",
                                  "decoder_gathernd_1024"])
def test_replica_is_byte_identical_to_the_real_exporter_output(name):
    """Same spec and weights -> the same bytes as torch 2.14.1 + deform-conv2d-onnx-exporter 1.2.0 wrote."""
    committed = (FIXTURES / f"{name}.onnx").read_bytes()
    rebuilt = build(SPECS[name], CopiedWeights(onnx.load_from_string(committed)))
    assert rebuilt.SerializeToString() == committed


@pytest.fixture(scope="module")
def birefnet64() -> onnx.ModelProto:
    return build(SPECS["birefnet64_1024"])


def test_birefnet64_has_birefnets_tensor_sizes(birefnet64):
    assert build(SPECS["birefnet64_1024"]).SerializeToString() == birefnet64.SerializeToString()  # deterministic
    report = analyze(birefnet64)  # WebGPU spec defaults: 256 MiB buffer, 128 MiB binding
    assert report.blocks == 16
    top = report.over_buffer[0]
    assert top.shape == [1, 1, 3211264, 64] and top.nbytes == 822_083_584 and top.producer.startswith("GatherND")
    assert "aspp_deforms.2.atrous_conv.regular_conv.weight" in top.block
    assert len(report.over_buffer) == 21 and all(t.nbytes == 822_083_584 for t in report.over_buffer)
    assert not report.ok


def test_birefnet64_split_at_256mib_leaves_nothing_over_the_limit(birefnet64):
    t0 = time.monotonic()
    patched, actions = patch_in_memory(birefnet64, max_buffer=256 * MiB)
    (split,) = split_actions(actions)
    assert split.action == REWRITTEN and chunks_of(split) == 4  # 64 of 256 rows: 205.5 MB per chunk tensor
    assert "the Conv -> Add -> BatchNormalization -> Relu is split into the same chunks" in split.reason
    assert "784.0 MiB" in split.reason
    report = analyze(patched)
    assert report.ok and report.over_buffer == []
    assert [n.name for n in patched.graph.node if n.op_type == "Conv" and n.name.startswith(split.node)] == [
        f"{split.node}/chunk{c}" for c in range(4)]
    before = analyze(birefnet64)
    assert report.blocks == before.blocks == 16  # the chunk Convs keep their block's label
    assert report.peak_bytes < before.peak_bytes / 3
    assert time.monotonic() - t0 < 120


# --------------------------------------------------------------------------------------- exactness on ORT CPU
@pytest.mark.parametrize("name, limit", [("decoder_gathernd", 60_000), ("decoder_gatherelements", 60_000),
                                         ("decoder_gathernd_b2g2", 30_000), ("decoder_gathernd_1024", 20_000)])
def test_split_exporter_fixtures_are_bit_identical(name, limit):
    model = onnx.load(str(FIXTURES / f"{name}.onnx"))
    unsplit, _ = patch_in_memory(model)
    patched, actions = patch_in_memory(model, max_buffer=limit)
    splits = split_actions(actions)
    assert splits and all(a.action == REWRITTEN for a in splits)
    for seed in range(2):
        feeds = image(model, seed)
        for level in LEVELS:
            reference = run(model, feeds, level)
            assert_bytes_equal(reference, run(patched, feeds, level))
            assert_bytes_equal(reference, run(unsplit, feeds, level))
    # every tensor the split made fits; the joined Conv inputs are the only block tensors left over the limit
    sizes = tensor_sizes(patched)
    assert all(v <= limit for k, v in sizes.items() if "/chunk" in k)
    joins = {n.output[0] for n in patched.graph.node if n.name.endswith("/split/join")}
    assert len(joins) == len(splits)


def test_no_max_buffer_no_split_and_the_default_path_is_unchanged():
    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    a, actions = patch_in_memory(model)
    b, _ = patch_in_memory(model, max_buffer=10**12)
    assert not split_actions(actions)
    assert a.SerializeToString() == b.SerializeToString()


def test_a_second_patch_changes_nothing(tmp_path):
    src = FIXTURES / "decoder_gathernd.onnx"
    first = patch(src, tmp_path / "a.onnx", max_buffer=60_000)
    assert len(split_actions(first.actions)) == 1
    second = patch(tmp_path / "a.onnx", tmp_path / "b.onnx", max_buffer=60_000)
    assert not second.changed and not second.refused and not (tmp_path / "b.onnx").exists()


def test_chunk_count_is_the_smallest_that_fits():
    # decoder_gathernd's 7x7 block at 16x16 with 4 channels: [1,1,4,49,16,16] fp32 = 200,704 B = 12,544 B a row
    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    per_row, rows = 12_544, 16
    for limit in (12_544, 12_545, 25_088, 60_000, 100_352, 100_353, 150_000, 200_703):
        patched, actions = patch_in_memory(model, max_buffer=limit)
        big = [a for a in split_actions(actions) if a.node == "Conv_1004"]  # the 7x7 block
        assert len(big) == 1, (limit, actions)
        n = chunks_of(big[0])
        fit = limit // per_row
        assert n == math.ceil(rows / fit)
        assert math.ceil(rows / n) * per_row <= limit  # n chunks fit ...
        assert n == 1 or math.ceil(rows / (n - 1)) * per_row > limit  # ... and n - 1 would not
        chunk_sizes = [v for k, v in tensor_sizes(patched).items() if "/chunk" in k]
        assert max(chunk_sizes) <= limit


def test_a_limit_below_one_row_is_refused_with_the_reason():
    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    patched, actions = patch_in_memory(model, max_buffer=10_000)
    refused = [a for a in split_actions(actions) if a.action == REFUSED]
    assert "Conv_1004" in [a.node for a in refused] and all("one output row" in a.reason for a in refused)
    assert "alone needs 0.0 MiB" not in refused[0].reason
    joined = {n.name for n in patched.graph.node if n.name.endswith("/split/join")}
    assert "Conv_1004/split/join" not in joined and joined  # the smaller blocks still split


def test_float16_blocks_are_refused_because_ort_cpu_rounds_fp16_chains_once():
    model = onnx.load(str(FIXTURES / "decoder_gathernd_fp16.onnx"))
    unsplit, _ = patch_in_memory(model)
    patched, actions = patch_in_memory(model, max_buffer=30_000)
    splits = split_actions(actions)
    assert splits and all(a.action == REFUSED and "float16 block" in a.reason for a in splits)
    assert patched.SerializeToString() == unsplit.SerializeToString()


def test_split_without_sum_chain_carries_the_sum():
    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    patched, actions = patch_in_memory(model, max_buffer=60_000, sum_mode="none")
    assert split_actions(actions)[0].action == REWRITTEN and op_count(patched, "Sum") == 8 + 3  # 1 Sum -> 4
    feeds = image(model, 0)
    assert_bytes_equal(run(model, feeds), run(patched, feeds))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 2), groups=st.sampled_from([1, 2]), per_group=st.integers(1, 3),
       planes=st.integers(1, 3), k=st.sampled_from([1, 3, 5]), size=st.integers(2, 9),
       gathernd=st.booleans(), fraction=st.floats(0.05, 0.99), seed=st.integers(0, 2**16))
def test_property_any_deform_conv_splits_exactly(batch, groups, per_group, planes, k, size, gathernd, fraction,
                                                  seed):
    channels = groups * per_group
    model = deform_conv_model(batch, channels, planes, k, size, groups, gathernd, seed)
    full = batch * channels * k * k * size * size * 4  # bytes of the gathered values of the whole block
    limit = max(1, int(full * fraction))
    patched, actions = patch_in_memory(model, max_buffer=limit)
    (split,) = split_actions(actions)
    per_row = full // size
    if limit < per_row:
        assert split.action == REFUSED and "one output row" in split.reason
    else:
        assert split.action == REWRITTEN and chunks_of(split) == math.ceil(size / (limit // per_row))
    rng = np.random.default_rng(seed)
    kk = groups * k * k
    feeds = {"x": rng.standard_normal((batch, channels, size, size)).astype(np.float32),
             "offset": rng.uniform(-size, size, (batch, 2 * kk, size, size)).astype(np.float32),
             "mask": rng.uniform(0, 2, (batch, kk, size, size)).astype(np.float32)}
    assert_bytes_equal(run(model, feeds), run(patched, feeds))


# --------------------------------------------------------------------------------------- 1024, few channels
@pytest.fixture(scope="module")
def birefnet4(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("birefnet4") / "birefnet4_1024.onnx"
    onnx.save_model(build(SPECS["birefnet4_1024"]), str(path))
    return path


def test_birefnet4_at_1024_splits_and_verifies(birefnet4, tmp_path):
    """The CI path on ORT CPU: 4 channels with a 16x smaller limit cuts the 7x7 block at 256x256 into 4 chunks."""
    out = tmp_path / "birefnet4_1024.split.onnx"
    report = patch(birefnet4, out, max_buffer=16 * MiB, verify=True, verify_options={"iterations": 1})
    assert report.verification.identical
    (split,) = split_actions(report.actions)
    assert chunks_of(split) == 4 and "Relu is split into the same chunks" in split.reason
    before, after = analyze(birefnet4, max_buffer=16 * MiB), analyze(out, max_buffer=16 * MiB)
    shapes = [t.shape for t in before.over_buffer]
    assert [1, 1, 3211264, 4] in shapes and [1, 4, 1792, 1792] in shapes  # gathered values, the Conv input
    # left: the 7x7 block's offsets and coordinates [1, 98|1x49x2, 256, 256] (25.7 MB): they have no channel axis,
    # so at 4 channels they do not shrink with the 16x smaller limit (at BiRefNet's 64 they are 10x below 256 MiB)
    assert after.over_buffer and {t.nbytes for t in after.over_buffer} == {2 * 49 * 256 * 256 * 4}


# --------------------------------------------------------------------------------------- the real WebGPU runtimes
_WEBGPU_RUNTIMES = {"node": ("node", None), "browser/webgpu": ("browser", "webgpu"),
                    "browser/jsep": ("browser", "jsep")}


@pytest.fixture(scope="module")
def small_1024_runs(tmp_path_factory) -> dict:
    """birefnet4_1024_small split at 1 MiB (256x below 256 MiB, as its 7x7 block is 256x below BiRefNet's), run
    once on each runtime; on node also the unsplit patched model, to compare the GPU outputs byte for byte."""
    from deform_surgeon.placement import measure_placement, missing_setup
    from deform_surgeon.placement import runner as runner_mod

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    folder = tmp_path_factory.mktemp("small_1024")
    src, split, unsplit = folder / "m.onnx", folder / "m.split.onnx", folder / "m.patched.onnx"
    onnx.save_model(build(SPECS["birefnet4_1024_small"]), str(src))
    report = patch(src, split, max_buffer=MiB, verify=True, verify_options={"iterations": 1})
    patch(src, unsplit)
    captured: dict = {}
    original = runner_mod.compare_outputs
    jobs = [(rt, split) for rt in _WEBGPU_RUNTIMES] + [("node", unsplit)]
    results = {}
    try:
        for rt, path in jobs:
            runtime, bundle = _WEBGPU_RUNTIMES[rt]

            def capture(got, ref, key=(rt, path.name)):
                captured[key] = {k: None if v is None else np.array(v) for k, v in got.items()}
                return original(got, ref)

            runner_mod.compare_outputs = capture
            results[(rt, path.name)] = measure_placement(path, runtime=runtime, bundle=bundle or "webgpu", run=True,
                                                         timeout=1200)
    finally:
        runner_mod.compare_outputs = original
    return {"report": report, "results": results, "outputs": captured, "split": split.name, "unsplit": unsplit.name}


@pytest.mark.webgpu
@pytest.mark.parametrize("rt", list(_WEBGPU_RUNTIMES))
def test_split_1024_runs_on_the_gpu_and_matches_ort_cpu(small_1024_runs, rt):
    (split,) = split_actions(small_1024_runs["report"].actions)
    assert chunks_of(split) == 4 and small_1024_runs["report"].verification.identical
    p = small_1024_runs["results"][(rt, small_1024_runs["split"])]
    assert p.session_ok and p.run["ok"], (p.error, p.run)
    assert p.cpu_nodes == 0 and p.memcpy == 0 and not p.run["gpu_errors"]
    (out,) = p.run["outputs"].values()
    assert out["shape"] == [1, 1, 1024, 1024] and out["max_abs_diff"] <= 1e-5  # Conv on a GPU: ~1e-6, not 0


@pytest.mark.webgpu
def test_split_1024_gives_the_same_gpu_bytes_as_the_unsplit_model(small_1024_runs):
    outputs = small_1024_runs["outputs"]
    a, b = outputs[("node", small_1024_runs["split"])], outputs[("node", small_1024_runs["unsplit"])]
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_the_split_also_carries_an_unlowered_gathernd_and_sum():
    """What a refused gather leaves (GatherND on rank-5 data, 4-input Sum) is split exactly too."""
    import onnx_graphsurgeon as gs

    from deform_surgeon.model_io import export_graph, infer_value_types
    from deform_surgeon.passes.split import SplitBlocks
    from deform_surgeon.pipeline import Context, Options, run_passes

    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    graph = gs.import_onnx(model)
    ctx = Context(graph, infer_value_types(model), Options(max_buffer=60_000))
    (split,) = run_passes(ctx, [SplitBlocks()])
    assert split.action == REWRITTEN and chunks_of(split) == 4
    graph.cleanup().toposort()
    patched = export_graph(graph, model)
    onnx.checker.check_model(patched, full_check=True)
    assert op_count(patched, "GatherND") == 32 - 4 + 16 and op_count(patched, "Sum") == 8 - 1 + 4
    for seed in range(2):
        feeds = image(model, seed)
        assert_bytes_equal(run(model, feeds), run(patched, feeds))


def test_a_conv_split_that_would_round_differently_is_refused_with_the_reason():
    """16 one-row chunks of b2g2's 16x16 block give MLAS too few output pixels per GEMM: its K blocking changes,
    so the pass keeps that Conv whole (and says so) while the other blocks' Convs are split."""
    model = onnx.load(str(FIXTURES / "decoder_gathernd_b2g2.onnx"))
    _, actions = patch_in_memory(model, max_buffer=30_000)
    kept = [a for a in split_actions(actions) if "REMAINS OVER" in a.reason]
    split = [a for a in split_actions(actions) if "is split into the same chunks" in a.reason]
    assert len(kept) == 1 and chunks_of(kept[0]) == 16 and len(split) == 2
    assert "its 16 row chunks do not give the whole Conv's bytes on ORT CPU (max diff" in kept[0].reason
