"""Split pass: deformable blocks over --max-buffer are cut into the fewest row chunks that fit, bit-identically.

Also checks the torch-free exporter replica the 1024 fixtures are built from against the real exporter output.
"""

from __future__ import annotations

import collections
import math
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import FIXTURES, assert_bytes_equal, op_count, patch_in_memory, patch_whole_graph
from helpers.exporter_replica import SPECS, CopiedWeights, build, deform_conv_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deform_surgeon import patch
from deform_surgeon.graph.budget import analyze, human
from deform_surgeon.graph.pipeline import Outcome

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
    return action.details["chunks"]


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
    patched, actions = patch_in_memory(birefnet64, max_buffer=256 * MiB)
    (split,) = split_actions(actions)
    assert split.action == Outcome.REWRITTEN and chunks_of(split) == 4  # 64 of 256 rows: 205.5 MB per chunk tensor
    assert split.details["conv_split"] and split.details["carried"] == ["Add", "BatchNormalization", "Relu"]
    assert split.details["conv_input_bytes"] == 822_083_584 and split.details["chunk_rows"] == [64] * 4
    report = analyze(patched)
    assert report.ok and report.over_buffer == []
    assert [n.name for n in patched.graph.node if n.op_type == "Conv" and n.name.startswith(split.node)] == [
        f"{split.node}/chunk{c}" for c in range(4)]
    before = analyze(birefnet64)
    assert report.blocks == before.blocks == 16  # the chunk Convs keep their block's label
    assert report.peak_bytes < before.peak_bytes / 3


# --------------------------------------------------------------------------------------- exactness on ORT CPU
@pytest.mark.parametrize("name, limit", [("decoder_gathernd", 60_000), ("decoder_gatherelements", 60_000),
                                         ("decoder_gathernd_b2g2", 30_000), ("decoder_gathernd_1024", 20_000)])
def test_split_exporter_fixtures_are_bit_identical(name, limit):
    model = onnx.load(str(FIXTURES / f"{name}.onnx"))
    unsplit, _ = patch_in_memory(model)
    patched, actions = patch_in_memory(model, max_buffer=limit)
    splits = split_actions(actions)
    assert splits and all(a.action == Outcome.REWRITTEN for a in splits)
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
    refused = [a for a in split_actions(actions) if a.action == Outcome.REFUSED]
    assert "Conv_1004" in [a.node for a in refused] and all("row_bytes" in a.details for a in refused)
    big = next(a for a in refused if a.node == "Conv_1004")
    assert (big.details["row_bytes"], big.details["rows"], big.details["limit_bytes"]) == (12_544, 16, 10_000)
    assert f"alone needs {human(big.details['row_bytes'])}" in big.reason  # a person reads the same, in bytes
    joined = {n.name for n in patched.graph.node if n.name.endswith("/split/join")}
    assert "Conv_1004/split/join" not in joined and joined  # the smaller blocks still split


FP16 = FIXTURES / "decoder_gathernd_fp16.onnx"  # 8 float16 deform blocks, each Conv -> Add -> BatchNorm -> Relu


def _row_cuts(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The split's cuts of the tensors computed outside the blocks (weights, mask): `<tensor>/rows<r0>_<r1>`."""
    return [n for n in model.graph.node if "/rows" in n.name and n.op_type in ("Pad", "Slice")]


def test_a_float16_block_is_cut_by_pads_and_the_whole_model_stays_byte_identical_at_both_levels(tmp_path):
    """The 7x7 block in 2 chunks, shown exact on its own (proofs/float16_proof.py): the block's nodes and their
    chunks, with the producers ORT rounds their inputs by and the index chain that clamps the gathers, held to
    ORT CPU's graphs of the model without the split and of the written file; no whole-model check is run."""
    out = tmp_path / "fp16.split.onnx"
    report = patch(FP16, out, max_buffer=110_000)  # the 7x7 block (200,704 B) in 2 chunks; its Conv input fits
    (split,) = [a for a in split_actions(report.actions) if a.action == Outcome.REWRITTEN]
    assert split.node == "Conv_1017" and chunks_of(split) == 2 and not split.details["conv_split"]
    assert split.details["float16"] and split.details["shown_exact"] == "on_its_own"
    assert split.details["levels"] == ["disable", "all"] and split.details["threads"] == []  # (nothing run: below)
    assert "where ORT CPU runs them as in the model without it and in the written file" in split.reason
    # its Conv stays whole: the proof starts at the Conv's input, and what is left is the join of the chunks, which
    # both ORT graphs write and read as the whole block's (float16_proof._joined_as_made); the runs below check it
    conv = next(n for n in onnx.load(str(FP16)).graph.node if n.name == "Conv_1017")
    assert split.details["proof_starts_at"] == [conv.input[0]]
    assert report.verification is None and "verify" in [s["stage"] for s in report.stages]
    patched, original = onnx.load(str(out)), onnx.load(str(FP16))
    cuts = _row_cuts(patched)
    assert cuts and {n.op_type for n in cuts} == {"Pad"}  # never a Slice of a float16 tensor ORT holds in float32
    for n in cuts:
        pads = onnx.numpy_helper.to_array(next(t for t in patched.graph.initializer if t.name == n.input[1]))
        assert (pads <= 0).all() and pads.any()  # negative pads: rows removed, nothing added
    for level in ("disable", "all"):
        for seed in (0, 1):
            feeds = image(original, seed)
            assert_bytes_equal(run(original, feeds, level), run(patched, feeds, level))


def test_a_slice_in_place_of_the_pads_would_round_where_the_whole_block_does_not(tmp_path):
    """Why the cuts are Pads: the same split with Slices (a float16 kernel on ORT CPU) rounds the float32 values ORT
    CPU keeps between the block's ops to float16, and the output differs from the original's."""
    out = tmp_path / "fp16.split.onnx"
    patch(FP16, out, max_buffer=110_000)
    model = onnx.load(str(out))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in _row_cuts(model):
        pads = inits[n.input[1]]
        axis = int(np.flatnonzero(pads)[0]) % (len(pads) // 2)
        rank = len(pads) // 2
        start, stop = -int(pads[axis]), int(pads[rank + axis])  # stop: rows removed at the end (<= 0)
        names = [f"{n.name}/{k}" for k in ("starts", "ends", "axes")]
        model.graph.initializer.extend(onnx.numpy_helper.from_array(np.array([v], np.int64), name) for v, name in
                                       zip((start, stop if stop else np.iinfo(np.int64).max, axis), names, strict=True))
        n.op_type = "Slice"
        del n.input[1:]
        n.input.extend(names)
    original = onnx.load(str(FP16))
    feeds = image(original, 0)
    for level in ("disable", "all"):
        a, b = run(original, feeds, level)[0], run(model, feeds, level)[0]
        assert a.tobytes() != b.tobytes(), level


def test_a_float16_split_whose_proof_differs_is_undone_alone_with_what_it_measured(tmp_path):
    """At 40,000 B the 7x7 block's Conv must be cut too. The Conv's chunks do not sum as the whole Conv does
    (the whole model also differs with them: 6.1e-5 at level `all`, where ORT runs the chunks as FusedConv and the
    whole Conv with its NCHWc kernel); the proof of that group, run as ORT runs it in the model, measures the
    difference (the chunks' float32 values, read out before any float16 rounding) and that split alone is undone,
    named with the level and the difference; the other split is written and the file keeps the original's bytes."""
    out = tmp_path / "fp16.split.onnx"
    report = patch(FP16, out, max_buffer=40_000)
    splits = {a.node: a for a in split_actions(report.actions)}
    undone = [a for a in splits.values() if a.action == Outcome.REFUSED]
    assert [a.node for a in undone] == ["Conv_1017"] and undone[0].details["undone"] == "on_its_own"
    assert "not shown exact: run on its own with its neighbours" in undone[0].reason
    assert undone[0].details["level"] in ("disable", "all") and 0 < undone[0].details["max_diff"] < 1e-3
    assert 1 <= undone[0].details["threads"] <= 64  # the thread count it differed at
    # the proof ran the Conv on its own input (seeded), the nodes before it being alike in the chunks as ORT's
    # graphs of both models show (float16_proof.cut_at_conv_inputs)
    conv = next(n for n in onnx.load(str(FP16)).graph.node if n.name == "Conv_1017")
    assert undone[0].details["proof_starts_at"] == [conv.input[0]], undone[0].details
    kept = [a for a in splits.values() if a.action == Outcome.REWRITTEN]
    assert kept and all(a.details["shown_exact"] == "on_its_own" for a in kept)
    assert "1 rewrite(s) undone (1 split)" in report.note and report.written
    original = onnx.load(str(FP16))
    for level in ("disable", "all"):
        feeds = image(original, 0)
        assert_bytes_equal(run(original, feeds, level), run(onnx.load(str(out)), feeds, level))


def same_graph(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """The same nodes (names, ops, wiring, attributes) and the same stored tensors, in any order: region lifting
    with a buffer limit takes in more nodes, whose order and attribute order the splice may change."""
    def nodes(m: onnx.ModelProto) -> list:
        return sorted((n.name, n.op_type, tuple(n.input), tuple(n.output),
                       tuple(sorted(x.SerializeToString() for x in n.attribute))) for n in m.graph.node)
    def stored(m: onnx.ModelProto) -> list:
        return sorted(t.SerializeToString() for t in m.graph.initializer)
    return nodes(a) == nodes(b) and stored(a) == stored(b) and a.graph.input == b.graph.input \
        and a.graph.output == b.graph.output


def test_split_without_sum_chain_carries_the_sum():
    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    patched, actions = patch_in_memory(model, max_buffer=60_000, sum_mode="none")
    assert split_actions(actions)[0].action == Outcome.REWRITTEN and op_count(patched, "Sum") == 8 + 3  # 1 Sum -> 4
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
        assert split.action == Outcome.REFUSED and split.details["row_bytes"] == per_row
    else:
        assert split.action == Outcome.REWRITTEN and chunks_of(split) == math.ceil(size / (limit // per_row))
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
    assert chunks_of(split) == 4 and split.details["conv_split"] and split.details["carried"][-1] == "Relu"
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
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup
    from deform_surgeon.webgpu.placement import outcome as outcome_mod  # finish_run compares the outputs there

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    folder = tmp_path_factory.mktemp("small_1024")
    src, split, unsplit = folder / "m.onnx", folder / "m.split.onnx", folder / "m.patched.onnx"
    onnx.save_model(build(SPECS["birefnet4_1024_small"]), str(src))
    report = patch(src, split, max_buffer=MiB, verify=True, verify_options={"iterations": 1})
    patch(src, unsplit)
    captured: dict = {}
    original = outcome_mod.compare_outputs
    jobs = [(rt, split) for rt in _WEBGPU_RUNTIMES] + [("node", unsplit)]
    results = {}
    try:
        for rt, path in jobs:
            runtime, bundle = _WEBGPU_RUNTIMES[rt]

            def capture(got, ref, key=(rt, path.name)):
                captured[key] = {k: None if v is None else np.array(v) for k, v in got.items()}
                return original(got, ref)

            outcome_mod.compare_outputs = capture
            results[(rt, path.name)] = measure_placement(path, runtime=runtime, bundle=bundle or "webgpu", run=True,
                                                         timeout=1200)
    finally:
        outcome_mod.compare_outputs = original
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

    from deform_surgeon.files import export_graph, infer_value_types
    from deform_surgeon.graph.pipeline import Context, Options, run_passes
    from deform_surgeon.passes.split import SplitBlocks

    model = onnx.load(str(FIXTURES / "decoder_gathernd.onnx"))
    graph = gs.import_onnx(model)
    ctx = Context(graph, infer_value_types(model), Options(max_buffer=60_000))
    (split,) = run_passes(ctx, [SplitBlocks()])
    assert split.action == Outcome.REWRITTEN and chunks_of(split) == 4
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
    kept = [a for a in split_actions(actions) if a.details["over_limit"]]
    split = [a for a in split_actions(actions) if a.details["conv_split"]]
    assert len(kept) == 1 and chunks_of(kept[0]) == 16 and len(split) == 2
    assert kept[0].details["undone"] == "on_its_own" and kept[0].details["level"] == "disable"
    assert kept[0].details["max_diff"] > 0 and "REMAINS OVER" in kept[0].reason


def test_the_chunk_check_asks_the_context_oracle_at_both_levels_and_trusts_no_difference():
    """The Conv split's exactness is a kernel's choice, so the pass asks the runtime (the context's oracle, ORT CPU
    by default) at levels 'disable' and 'all'; an oracle whose chunked run differs by one ulp keeps every Conv whole,
    with the reason."""
    import onnx_graphsurgeon as gs

    from deform_surgeon.base.ort_cpu import run_ort_cpu
    from deform_surgeon.files import infer_value_types
    from deform_surgeon.graph.pipeline import Context, Options, run_passes
    from deform_surgeon.passes.split import SplitBlocks

    asked: list[str] = []

    def honest(model: onnx.ModelProto, feeds: dict, level: str, threads: int | None = None) -> list[np.ndarray]:
        asked.append(level)
        return run_ort_cpu(model, feeds, level, threads=threads)

    def one_ulp_off(model: onnx.ModelProto, feeds: dict, level: str, threads: int | None = None
                    ) -> list[np.ndarray]:
        whole, chunked = honest(model, feeds, level, threads)
        return [whole, np.nextafter(chunked, np.float32(np.inf))]

    def split_with(oracle) -> list:
        model = onnx.load(str(FIXTURES / "decoder_gathernd_b2g2.onnx"))
        ctx = Context(gs.import_onnx(model), infer_value_types(model), Options(max_buffer=30_000), ort_cpu=oracle)
        return [a for a in run_passes(ctx, [SplitBlocks()]) if a.action == Outcome.REWRITTEN]  # the three blocks

    actions = split_with(honest)
    assert sum(a.details["conv_split"] for a in actions) == 2
    assert asked.count("all") == 2 and asked.count("disable") == 3  # the Conv that differs stops at 'disable'
    asked.clear()
    actions = split_with(one_ulp_off)
    assert len(actions) == 3 and asked == ["disable"] * 3
    assert all(not a.details["conv_split"] and a.details["over_limit"] and a.details["level"] == "disable"
               and a.details["max_diff"] > 0 for a in actions)


# --------------------------------------------------------------------------------------- the whole model decides
def deform_bn_relu_model(hidden_bn: bool, size: int = 32) -> onnx.ModelProto:
    """One exporter deformable conv (8 channels, 3x3, 16 planes) followed by BatchNormalization -> Relu, the op
    sequence after every deform Conv in BiRefNet (Conv -> bias Add -> BatchNormalization -> Relu).

    With `hidden_bn`, the BatchNorm reads its parameters through Cast nodes: ORT folds them to constants and fuses
    the BatchNorm into the Conv over the whole model, while the split pass cannot read them as constants, so its
    chunk check stops before the BatchNorm. That is how a split once differed on the real BiRefNet-lite 1024
    export, where the parameters came through the Identity nodes of torch's shared initializers (which the pass
    now reads through): the chunks alone matched, the whole model did not.
    """
    model = deform_conv_model(1, 8, 16, 3, size, seed=3)
    graph = model.graph
    assert graph.node[-1].op_type == "Identity"
    conv_out = graph.node[-1].input[0]
    del graph.node[-1]
    rng = np.random.default_rng(5)
    values = [0.5 + rng.random(16), 0.1 * rng.standard_normal(16), 0.1 * rng.standard_normal(16),
              0.5 + rng.random(16)]
    names = []
    for key, v in zip(("scale", "bias", "mean", "var"), values, strict=True):
        graph.initializer.append(onnx.numpy_helper.from_array(v.astype(np.float32), f"bn.{key}"))
        names.append(f"bn.{key}")
        if hidden_bn:
            graph.node.append(onnx.helper.make_node("Cast", [names[-1]], [f"{names[-1]}.cast"],
                                                    to=onnx.TensorProto.FLOAT))
            names[-1] += ".cast"
    graph.node.append(onnx.helper.make_node("BatchNormalization", [conv_out, *names], ["bn_out"], epsilon=1e-5))
    graph.node.append(onnx.helper.make_node("Relu", ["bn_out"], ["y"]))
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(seed: int, size: int = 32) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 8, size, size)).astype(np.float32),
            "offset": rng.uniform(-3, 3, (1, 18, size, size)).astype(np.float32),
            "mask": rng.uniform(0, 2, (1, 9, size, size)).astype(np.float32)}


def test_a_split_conv_is_written_only_after_it_is_shown_exact_on_its_own(tmp_path):
    src, out = tmp_path / "m.onnx", tmp_path / "m.split.onnx"
    onnx.save(deform_bn_relu_model(hidden_bn=False), str(src))
    report = patch(src, out, max_buffer=40_000)  # no --verify: the split Conv is checked all the same
    (split,) = split_actions(report.actions)
    assert report.written and not split.needs_verify and report.verification is None
    assert split.details["conv_split"] and split.details["carried"] == ["Add", "BatchNormalization", "Relu"]
    assert split.details["shown_exact"] == "on_its_own" and split.details["levels"] == ["disable", "all"]
    patched = onnx.load(str(out))
    assert sorted(n.name for n in patched.graph.node if n.op_type == "Conv") == [f"{split.node}/chunk{c}"
                                                                                  for c in range(8)]
    for seed in range(2):
        for level in LEVELS:
            assert_bytes_equal(run(src, _feeds(seed), level), run(patched, _feeds(seed), level))


@pytest.mark.parametrize("verify", [False, True])
def test_a_split_conv_the_whole_model_disproves_is_kept_whole_and_said_so(tmp_path, verify):
    src, out = tmp_path / "m.onnx", tmp_path / "m.split.onnx"
    model = deform_bn_relu_model(hidden_bn=True)
    onnx.save(model, str(src))
    unsplit, _ = patch_in_memory(model)
    # what the pass alone does (no whole-model check): chunks through Conv -> Add, the BatchNorm after the join,
    # which ORT no longer fuses into the Conv: the whole model differs on ORT CPU
    alone, actions = patch_whole_graph(model, max_buffer=40_000)
    assert split_actions(actions)[0].details["carried"] == ["Add"]
    assert run(model, _feeds(0))[0].tobytes() != run(alone, _feeds(0))[0].tobytes()

    report = patch(src, out, max_buffer=40_000, verify=verify, verify_options={"iterations": 1})
    (split,) = split_actions(report.actions)
    assert report.written and split.action == Outcome.REWRITTEN and not split.needs_verify
    # the BatchNorm's parameters come through Cast nodes outside the lifted region: the proof folds them as ORT
    # does, so the BatchNorm it reads the Conv's output with fuses into the whole Conv and not into the chunks
    assert not split.details["conv_split"] and split.details["over_limit"]
    assert split.details["undone"] == "on_its_own" and split.details["level"] == "all" and split.details["max_diff"] > 0
    assert "1 rewrite(s) undone: not shown exact on their own" in report.note
    assert (report.verification is not None and report.verification.identical) == verify
    patched = onnx.load(str(out))
    assert [n.name for n in patched.graph.node if n.op_type == "Conv"] == [split.node]  # whole
    assert op_count(patched, "Gather") > op_count(unsplit, "Gather")  # the sampling is still chunked
    for level in LEVELS:
        assert_bytes_equal(run(model, _feeds(1), level), run(patched, _feeds(1), level))


def _block_signatures(model: onnx.ModelProto) -> set[tuple]:
    """Per deform block (from its Floor forward to the Conv): the op counts of the sampling, the ops that make what
    it reads from outside (offset conv, modulator, padded data), where the Conv and each op of its per-channel
    chain read their other inputs from (initializer, Constant, Identity of an initializer), and what reads the
    chain's end."""
    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    readers: dict[str, list] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    inits = {t.name for t in model.graph.initializer}

    def source(name: str) -> str:
        p = producer.get(name)
        return "init" if name in inits else "input" if p is None else (
            f"Identity({source(p.input[0])})" if p.op_type == "Identity" else p.op_type)

    def feeder(name: str, depth: int) -> str:
        """The ops that make a tensor the block reads from outside, `depth` steps back: the offset conv
        (`Add(grid, Reshape(Conv))`), the modulator (`Reshape(Mul(Sigmoid(Conv)))`), the padded data."""
        p = producer.get(name)
        if p is None or depth == 0:
            return ""
        ins = [feeder(i, depth - 1) for i in p.input if source(i) not in ("init", "Identity(init)", "Constant")]
        return f"{p.op_type}({','.join(ins)})"

    out = set()
    for floor in (n for n in nodes if n.op_type == "Floor"):
        stack, seen, conv = [floor], {}, None
        while stack:
            n = stack.pop()
            if id(n) not in seen:
                seen[id(n)] = n
                for c in (c for o in n.output for c in readers.get(o, [])):
                    conv, stack = (c, stack) if c.op_type == "Conv" else (conv, [*stack, c])
        chain, t, ops = [f"Conv[{','.join(source(i) for i in conv.input[1:])}]"], conv.output[0], []
        while len(readers.get(t, [])) == 1 and readers[t][0].op_type in ("Add", "BatchNormalization", "Relu"):
            n = readers[t][0]
            chain.append(f"{n.op_type}[{','.join(source(i) for i in n.input if i != t)}]")
            t = n.output[0]
        ops = tuple(sorted(collections.Counter(n.op_type for n in seen.values()).items()))
        made = {o for n in seen.values() for o in n.output}
        feeds = tuple(sorted({feeder(i, 4) for n in seen.values() for i in n.input
                              if i and i not in made and source(i) not in ("init", "Identity(init)", "Constant")}))
        out.add((ops, feeds, tuple(chain), tuple(sorted(n.op_type for n in readers.get(t, [])))))
    return out


@pytest.mark.skipif(not os.environ.get("DEFORM_SURGEON_REAL_BIREFNET"),
                    reason="set DEFORM_SURGEON_REAL_BIREFNET to a real BiRefNet export (its own code, random weights)")
def test_the_birefnet_replica_has_the_real_exports_op_sequence_around_each_deform_block(birefnet64):
    """Development check of what the 1024 replicas stand for: the real BiRefNet-lite export (torch 2.14.1 +
    deform-conv2d-onnx-exporter 1.2.0, BiRefNet's code, random weights; 20 deform blocks, here 16) has the same
    blocks: the same sampling ops, Conv -> Add(Constant) -> BatchNormalization(parameters through Identity nodes,
    one block with two direct) -> Relu -> Concat. CI cannot build the real model (torch); run with e.g.
    DEFORM_SURGEON_REAL_BIREFNET=/tmp/birefnet/out/birefnet_lite_512.onnx."""
    real = onnx.load(os.environ["DEFORM_SURGEON_REAL_BIREFNET"], load_external_data=False)
    assert _block_signatures(real) == _block_signatures(birefnet64)


# --------------------------------------------------------------------------------------- --max-memory
def test_max_memory_chunks_until_budgets_peak_fits(tmp_path):
    src, out = FIXTURES / "decoder_gathernd.onnx", tmp_path / "m.onnx"
    before = analyze(src)
    assert before.peak_bytes > 1_200_000  # the 7x7 block at 16x16: four gathered [1,1,12544,4] + their products
    report = patch(src, out, max_memory=800_000)  # nothing over the buffer limit: the memory budget alone chunks
    (split,) = split_actions(report.actions)
    assert split.node == "Conv_1004" and split.details["chunks"] >= split.details["asked_chunks"] > 1
    assert split.details["limit_bytes"] == report.options["max_buffer"] == 128 << 20  # spec-default's
    assert "peak of live activations (budget's measure) 1.3 MB (1.2 MiB) -> " in report.note
    assert "within the limit" in report.note
    after = analyze(out)
    assert after.peak_bytes <= 800_000 < before.peak_bytes
    assert report.options["max_memory"] == 800_000
    model = onnx.load(str(src))
    for level in LEVELS:
        assert_bytes_equal(run(model, image(model, 0), level), run(out, image(model, 0), level))


def test_the_fitted_file_lists_its_nodes_in_the_order_its_peak_was_measured_in(tmp_path, monkeypatch):
    """onnx-graphsurgeon's toposort lists the chunks interleaved (every chunk's first step, then every chunk's
    second): in the file's own order the chunks' temporaries are live at once. `patch` writes the nodes in the
    order budget measured the peak in (depth-first, one chunk after another), so a runtime that follows the file
    gets that peak."""
    from deform_surgeon.commands.patching import lift

    src, out, spliced = FIXTURES / "decoder_gathernd.onnx", tmp_path / "m.onnx", tmp_path / "spliced.onnx"
    with monkeypatch.context() as m:
        m.setattr(lift, "write_in_execution_order", lambda model: False)  # the splice's order, as before
        patch(src, spliced, max_memory=800_000)
    report = patch(src, out, max_memory=800_000)
    assert "within the limit" in report.note
    before, after = analyze(spliced), analyze(out)
    assert before.peak_file_bytes > before.peak_bytes  # the chunks interleaved
    assert after.peak_file_bytes == after.peak_bytes == before.peak_bytes <= 800_000
    nodes = onnx.load(str(out)).graph.node
    assert collections.Counter(n.SerializeToString() for n in nodes) == collections.Counter(
        n.SerializeToString() for n in onnx.load(str(spliced)).graph.node)  # the same nodes, another order
    onnx.checker.check_model(str(out), full_check=True)
    model = onnx.load(str(src))
    for level in LEVELS:
        assert_bytes_equal(run(model, image(model, 2), level), run(out, image(model, 2), level))


def test_a_max_memory_that_cannot_be_met_is_reported_and_the_rest_written(tmp_path):
    src, out = FIXTURES / "decoder_gathernd.onnx", tmp_path / "m.onnx"
    report = patch(src, out, max_memory=100_000)
    assert report.written and "REMAINS OVER the limit at" in report.note
    assert "largest share: Conv 'Conv_1004'" in report.note
    peak = int(report.note.split(" -> ")[1].split(" B,")[0].replace(",", ""))
    assert analyze(out).peak_bytes == peak < analyze(src).peak_bytes  # the lowest peak the rounds reached
    model = onnx.load(str(src))
    assert_bytes_equal(run(model, image(model, 1)), run(out, image(model, 1)))


def test_ort_cpu_is_asked_which_float16_tensors_it_holds_in_float32():
    """passes/cuts.py reads ORT's own optimized graph: a Relu (no float16 CPU kernel) hands its reader float32
    values, so its output is not made by the model's node; the exporter's Reshape before the deform Conv runs on
    its float16 kernel and makes its output itself (the Conv input, rounded to float16 as in the whole block)."""
    from deform_surgeon.passes.cut_and_join import made_by_ort

    made = made_by_ort(FP16)
    model = onnx.load(str(FP16))
    producer = {o: n for n in model.graph.node for o in n.output}
    relus = [o for o, n in producer.items() if n.op_type == "Relu"]
    conv_inputs = [n.input[0] for n in model.graph.node if n.op_type == "Conv" and n.input[0] in producer and
                   producer[n.input[0]].op_type == "Reshape"]
    assert relus and not any(t in made for t in relus)
    assert conv_inputs and all(t in made for t in conv_inputs)


def test_an_8bit_block_is_refused_with_why_no_split_is_exact(tmp_path):
    """The 8-bit files (onnxruntime.quantization's dynamic quantization, as transformers.js's model_quantized): the
    block's sampled values are read by a DynamicQuantizeLinear, which quantizes the whole tensor with one scale. A
    split would need that scale from the chunks' min and max, the same as ORT's only without NaN: refused, saying
    so."""
    from helpers.variant_replicas import build_variants

    import deform_surgeon as ds

    path = build_variants(tmp_path, only=("quantized",))["quantized"]
    refused = [a for a in ds.inspect(path, max_buffer=1024).actions
               if a.pass_name == "split" and a.action == Outcome.REFUSED]
    assert refused
    for act in refused:
        assert "is read by DynamicQuantizeLinear" in act.reason, act.reason
        assert "which the split cannot carry a chunk through (it quantizes the whole tensor with one scale made from " \
            "its min and max; a min and max of the chunks equal ORT's only for inputs without NaN" in act.reason
