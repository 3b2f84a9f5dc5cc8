"""The dtype variants a user downloads, on replicas made the way transformers.js makes them (tests/variant_replicas):
`batch DIR OUTDIR` patches a whole model folder into the same names, copies the rest, verifies byte-identical and
names, per variant, the nodes without a WebGPU kernel; the kernel table is checked against the real node runtime.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import one_error_line, snapshot
from helpers.variant_replicas import build_variants

from deform_surgeon.graph.kernels import KernelReport

CMD = [sys.executable, "-m", "deform_surgeon", "batch"]
QUANTIZED_8BIT = ("quantized", "int8", "uint8")  # ConvInteger / MatMulInteger / DynamicQuantizeLinear
INTEGER_OPS = {"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"}
NAMES = {"fp32": "model.onnx", "fp16": "model_fp16.onnx", "quantized": "model_quantized.onnx",
         "int8": "model_int8.onnx", "uint8": "model_uint8.onnx", "q4": "model_q4.onnx", "q4f16": "model_q4f16.onnx",
         "bnb4": "model_bnb4.onnx"}


def batch(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A transformers.js-like repository: config files, a hidden folder, and onnx/ with every variant."""
    root = tmp_path_factory.mktemp("repo")
    (root / "onnx").mkdir()
    variants = build_variants(root / "onnx")
    assert {p.name for p in variants.values()} == set(NAMES.values())
    (root / "config.json").write_text('{"model_type": "birefnet"}\n')
    (root / "preprocessor_config.json").write_text('{"size": 64}\n')
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return root


@pytest.fixture(scope="module")
def patched(repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "patched"
    before = snapshot(repo)
    (out.parent / "reports").mkdir()
    proc = batch(repo, out, "--verify", "--iterations", "1", "--jobs", "2", "--no-progress",
                 "--summary", out.parent / "summary.json", "--report-dir", out.parent / "reports", cwd=repo)
    return repo, out, before, proc, json.loads((out.parent / "summary.json").read_text())


def test_folder_patches_every_variant_verified(patched):
    repo, out, before, proc, summary = patched
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert snapshot(repo) == before  # the model folder is untouched
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "config.json", "onnx", *sorted(f"onnx/{n}" for n in NAMES.values()), "preprocessor_config.json"]
    assert (out / "config.json").read_bytes() == (repo / "config.json").read_bytes()
    by_name = {Path(m["model"]).name: m for m in summary["models"]}
    for name in NAMES.values():
        m = by_name[name]
        assert m["status"] == "ok" and m["written"], m
        assert m["verification"]["identical"] is True, name
        onnx.checker.check_model(onnx.load(out / "onnx" / name), full_check=True)
        report = json.loads((out.parent / "reports" / f"onnx__{Path(name).stem}.report.json").read_text())
        assert report["status"] == "ok" and report["webgpu"] == m["webgpu"]


def test_table_names_what_stays_on_the_cpu(patched):
    _, _, _, proc, summary = patched
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^  (onnx/\S+\.onnx)\s.*$", proc.stdout, re.M)}
    assert set(rows) == {f"onnx/{n}" for n in NAMES.values()}, proc.stdout
    by_name = {Path(m["model"]).name: KernelReport.from_dict(m["webgpu"]) for m in summary["models"]}
    for variant, name in NAMES.items():
        k, row = by_name[name], rows[f"onnx/{name}"]
        assert k.blocks == 8, (name, k)
        assert re.search(r"\bPASSED\b", row), row
        if variant in QUANTIZED_8BIT:
            # the offset and modulator convs are quantized too: ConvInteger inside the deform blocks
            assert set(k.outside) == INTEGER_OPS and set(k.inside) <= INTEGER_OPS and k.inside, (name, k)
            assert k.blocks_resident < k.blocks
            assert set(k.reasons) == INTEGER_OPS and all("no WebGPU kernel" in r for r in k.reasons.values())
            for op in INTEGER_OPS:
                assert re.search(rf"\b{op} \d+", row), row
        else:
            assert k.cpu_nodes == 0 and k.blocks_resident == 8, (name, k)
            assert re.search(r"\b8/8\s+0\s", row), row
        # JSEP (onnxruntime-web's default bundle) alone has no MatMulBnb4 kernel
        assert k.jsep_only == ({"MatMulBnb4": 1} if variant == "bnb4" else {}), (name, k)
        assert any(ln.startswith("WebGPU: 8-bit file: ") for ln in k.lines()) == (variant in QUANTIZED_8BIT)
    # one line under the table says which files those are, why, and what to ship for the GPU
    footer = [ln for ln in proc.stdout.splitlines() if "8-bit file(s)" in ln]
    assert len(footer) == 1, proc.stdout
    assert re.fullmatch(r"  8-bit file\(s\) onnx/model_int8\.onnx, onnx/model_quantized\.onnx, onnx/model_uint8\.onnx: "
                        r"their ConvInteger/MatMulInteger/DynamicQuantizeLinear nodes stay on the CPU EP: no WebGPU "
                        r"kernel and no exact lowering to float ops \(.*\); ship fp16 or q4f16 for the GPU .*",
                        footer[0]), footer[0]


def test_patch_report_names_them(patched, tmp_path):
    import deform_surgeon as ds

    repo = patched[0]
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "inspect", repo / "onnx" / "model_quantized.onnx"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "outside the deform blocks" in ln)
    assert re.fullmatch(r"WebGPU: outside the deform blocks, \d+ node\(s\) have no WebGPU kernel and will run on "
                        r"the CPU EP: .*", line), line
    assert all(op in line for op in INTEGER_OPS), line
    assert re.search(r"WebGPU:   ConvInteger: 8-bit integer convolution .*no WebGPU kernel", proc.stdout)
    # one line with the counts, the reason there is no exact lowering, and which dtype to ship instead
    k = ds.inspect(repo / "onnx" / "model_quantized.onnx").webgpu
    total = {op: k.inside.get(op, 0) + k.outside.get(op, 0) for op in INTEGER_OPS}
    inside = sum(k.inside.get(op, 0) for op in INTEGER_OPS)
    assert inside > 0
    summary = next(ln for ln in proc.stdout.splitlines() if ln.startswith("WebGPU: 8-bit file: "))
    assert summary.startswith(f"WebGPU: 8-bit file: {sum(total.values())} ConvInteger/MatMulInteger/"
                              f"DynamicQuantizeLinear node(s) ({KernelReport.ops_text(total)}; {inside} inside the "
                              "deform blocks) stay on the CPU EP: no WebGPU kernel and no exact lowering to float ops "
                              "(ORT's DynamicQuantizeLinear takes min/max with a SIMD kernel"), summary
    assert summary.endswith("; ship fp16 or q4f16 for the GPU (fp32 or q4 where the GPU has no shader-f16)")


def test_rerun_replaces_its_own_outputs(patched):
    repo, out, *_ = patched
    proc = batch(repo, out, "--jobs", "1", "--no-progress", cwd=repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("location, written", [
    ("model.onnx_data", "model.onnx_data"),  # transformers.js's form: it fetches <name>.onnx_data
    ("model.onnx.data", "model.onnx.data"),  # onnx's and torch's form
    ("weights.bin", "model.onnx.data"),
])
def test_external_data_goes_beside_each_output_in_the_inputs_form(tmp_path, location, written):
    """A model folder as transformers.js ships it (`model.onnx` + `model.onnx_data`) patches into the same two
    names, so that the patched folder loads in transformers.js unchanged; the output runs on ORT CPU to the same
    bytes as the input."""
    from helpers import assert_bytes_equal, run_ort

    src = tmp_path / "in"
    src.mkdir()
    model = onnx.load(Path(__file__).parents[1] / "fixtures" / "decoder_gathernd.onnx")
    onnx.save(model, src / "model.onnx", save_as_external_data=True, location=location, size_threshold=0)
    proc = batch(src, tmp_path / "out", "--verify", "--iterations", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^  model\.onnx\s.*\bPASSED\b", proc.stdout, re.M), proc.stdout
    got = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert got == ["model.onnx", written], got  # the input's data file is not copied as it is
    out = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    locations = {e.value for t in out.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {written}
    feed = {i.name: np.random.default_rng(3).standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32) for i in model.graph.input}
    assert_bytes_equal(run_ort(str(tmp_path / "out" / "model.onnx"), feed), run_ort(str(src / "model.onnx"), feed))


@pytest.mark.parametrize("layout, problem", [
    ("inside", r"OUTDIR is inside DIR"),
    ("same", r"OUTDIR is DIR itself"),
    ("no-outdir", r"is a folder: give the output folder too"),
    ("empty", r"no \.onnx model in this folder"),
    ("outdir-is-file", r"OUTDIR exists and is not a folder"),
])
def test_a_folder_batch_that_cannot_start_writes_nothing(tmp_path, layout, problem):
    src = tmp_path / "in"
    src.mkdir()
    if layout != "empty":
        shutil.copyfile(Path(__file__).parents[1] / "fixtures" / "no_deform.onnx", src / "model.onnx")
    (tmp_path / "a_file").write_text("x\n")
    out = {"inside": src / "out", "same": src, "no-outdir": None, "empty": tmp_path / "out",
           "outdir-is-file": tmp_path / "a_file"}[layout]
    before = snapshot(tmp_path)
    proc = batch(src, *([out] if out is not None else []), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(problem, one_error_line(proc)), proc.stderr
    assert snapshot(tmp_path) == before


def test_a_copy_onto_an_input_is_refused(tmp_path):
    """OUTDIR's copy of a file would land on a file the batch reads (here: DIR is inside OUTDIR, by a symlink
    that makes a config's target the input model itself)."""
    src = tmp_path / "in"
    src.mkdir()
    shutil.copyfile(Path(__file__).parents[1] / "fixtures" / "no_deform.onnx", src / "model.onnx")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").symlink_to(src / "model.onnx")
    (src / "notes.txt").write_text("n\n")
    before = snapshot(tmp_path)
    proc = batch(src, tmp_path / "out", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "notes.txt" in one_error_line(proc)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------- the table on the real runtime
@pytest.mark.webgpu
@pytest.mark.parametrize("variant", list(NAMES))
def test_kernel_table_matches_the_node_runtime(patched, variant):
    """What the report predicts from the table is what onnxruntime-node's native WebGPU EP places on the CPU:
    the same op types with the same counts, inside and outside the deform blocks, and the deform blocks of every
    variant but the 8-bit ones without a CPU node or a Memcpy."""
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup
    from deform_surgeon.webgpu.placement.command import per_block

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    _, out, _, _, summary = patched
    name = NAMES[variant]
    predicted = KernelReport.from_dict(next(m["webgpu"] for m in summary["models"] if m["model"].endswith(name)))
    p = measure_placement(out / "onnx" / name, "node")
    assert p.total_nodes > 0, p.error  # placement is read even where SwiftShader cannot compile f16 shaders
    total = {op: predicted.inside.get(op, 0) + predicted.outside.get(op, 0)
             for op in {*predicted.inside, *predicted.outside}}
    assert p.cpu_ops == total, (p.cpu_ops, predicted)
    inside = [v for b, v in per_block(p).items() if b != "outside deform blocks"]
    assert sum(c for c, _ in inside) == sum(predicted.inside.values())
    assert sum(1 for c, _ in inside if c == 0) == predicted.blocks_resident
    if variant not in QUANTIZED_8BIT:
        assert p.cpu_nodes == 0 and p.memcpy == 0 and all(v == (0, 0) for v in inside)


def test_replica_variants_are_what_the_quantizers_make(repo):
    """Each replica holds the op its quantizer is named for (so the tests above cover what they claim to)."""
    ops = {v: {n.op_type for n in onnx.load(repo / "onnx" / n).graph.node} for v, n in NAMES.items()}
    assert INTEGER_OPS <= ops["quantized"] and INTEGER_OPS <= ops["int8"]
    assert "MatMulNBits" in ops["q4"] and "MatMulNBits" in ops["q4f16"] and "MatMulBnb4" in ops["bnb4"]
    fp16 = onnx.load(repo / "onnx" / "model_fp16.onnx")
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in fp16.graph.initializer)
    assert fp16.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # keep_io_types
    int8 = onnx.load(repo / "onnx" / "model_int8.onnx")
    weights = {t.name: t for t in int8.graph.initializer}
    conv = next(n for n in int8.graph.node if n.op_type == "ConvInteger")
    assert weights[conv.input[1]].data_type == onnx.TensorProto.INT8
    assert np.asarray(onnx.numpy_helper.to_array(weights[conv.input[1]])).dtype == np.int8


# ------------------------------------------------------------------------------------ dynamic sizes (--input-shapes)
def dynamic_export() -> onnx.ModelProto:
    """The replica as an export with dynamic batch/height/width axes: symbolic input and output dims, the traced
    size (64x64) baked into the deform blocks' Clip bounds and Reshapes, as the exporter does."""
    from helpers import exporter_replica

    model = exporter_replica.build(exporter_replica.Spec())
    for vi in (model.graph.input[0], model.graph.output[0]):
        for d, name in zip(vi.type.tensor_type.shape.dim, ("batch", None, "height", "width"), strict=True):
            if name:
                d.ClearField("dim_value")
                d.dim_param = name
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamic")
    onnx.save(dynamic_export(), d / "dyn.onnx")
    return d


def run_cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deform_surgeon", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_symbolic_dims_without_a_size_are_reported(dynamic):
    proc = run_cli("inspect", "dyn.onnx", cwd=dynamic)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"symbolic input dims \(image: \[batch,3,height,width\]\): the deform blocks were proven for "
                     r"the sizes the export baked in \(sampled data shapes \[1, 1, 10, 10, 4\].*\), not for other "
                     r"input sizes; the shape computations on the symbolic dims stay on the CPU EP; give "
                     r"--input-shape", proc.stdout), proc.stdout
    # Resize's size computation from the symbolic input (Shape -> Slice -> Concat, int64) is what stays
    assert re.search(r"outside the deform blocks, \d+ node\(s\) have no WebGPU kernel .*: Concat \d+, Slice \d+",
                     proc.stdout), proc.stdout


def test_input_shape_fixes_the_size_and_verifies(dynamic):
    proc = run_cli("patch", "dyn.onnx", "fixed.onnx", "--input-shape", "image:1,3,64,64", "--verify",
                   "--iterations", "2", "--report", "fixed.json", cwd=dynamic)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: PASSED" in proc.stdout and "symbolic input dims" not in proc.stdout
    fixed = onnx.load(dynamic / "fixed.onnx")
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 64, 64]
    report = json.loads((dynamic / "fixed.json").read_text())
    assert report["options"]["input_shapes"] == {"image": [1, 3, 64, 64]}
    assert [(n["node"], n["details"]) for n in report["nodes"] if n["pass_name"] == "input-shape"] == [
        ("image", {"shape": [1, 3, 64, 64]})]
    assert report["webgpu"]["outside_blocks"] == {} and report["webgpu"]["blocks_resident"] == 8


@pytest.mark.parametrize("shape, problem", [
    ("input:1,3,64,64", r"--input-shape names 'input', which is not an input of the model \(inputs: image\)"),
    ("image:1,3,64", r"--input-shape image: 3 dims given, the input has 4"),
    ("image:1,4,64,64", r"conflicts with the input's static shape image: \[batch,3,height,width\]"),
    # the exporter baked the traced 64x64 into its Reshapes: another size cannot run (onnx's inference passes it)
    ("image:1,3,32,32", r"cannot run at the given --input-shape: Reshape '.+' turns \[1, 2, 4, 4\] into the "
                        r"constant shape \[1, 1, 1, 2, 8, 8\]"),
    ("image:1,3,128,128", r"cannot run at the given --input-shape: Reshape '.+' turns \[1, 2, 16, 16\]"),
    ("image", r"bad --input-shape 'image'"),
], ids=["no-such-input", "rank", "static-dim", "smaller-than-traced", "larger-than-traced", "syntax"])
def test_a_bad_input_shape_is_one_line_exit_2(dynamic, tmp_path, shape, problem):
    shutil.copyfile(dynamic / "dyn.onnx", tmp_path / "dyn.onnx")
    before = snapshot(tmp_path)
    proc = run_cli("patch", "dyn.onnx", "out.onnx", "--input-shape", shape, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(problem, one_error_line(proc)), proc.stderr
    assert snapshot(tmp_path) == before


def test_verify_of_a_dynamic_model_without_its_size_asks_for_the_size(dynamic):
    """Seeded inputs give a symbolic dim the size 1, which the baked Reshapes cannot take: the fix to suggest is
    the size (--input-shapes), not the value range."""
    proc = run_cli("verify", "dyn.onnx", "dyn.onnx", "--iterations", "1", cwd=dynamic)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert re.search(r"dyn\.onnx: fails to run on ORT CPU with the seeded inputs .*give the size the model will get "
                     r"with --input-shapes NAME:DIMS \(its inputs have symbolic dims: image: float32\[batch,3,height,"
                     r"width\]\)", line), line
    assert "--val-range" not in line


def test_input_shapes_in_a_manifest(dynamic, tmp_path):
    shutil.copyfile(dynamic / "dyn.onnx", tmp_path / "dyn.onnx")
    (tmp_path / "m.toml").write_text('[[model]]\ninput = "dyn.onnx"\noutput = "fixed.onnx"\nverify = true\n'
                                     'iterations = 1\ninput_shapes = { image = [1, 3, 64, 64] }\n')
    proc = batch("m.toml", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fixed = onnx.load(tmp_path / "fixed.onnx")
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 64, 64]
    (tmp_path / "bad.toml").write_text('[[model]]\ninput = "dyn.onnx"\ninput_shapes = { image = [1, 3, 0] }\n')
    proc = batch("bad.toml", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 1 and "option input_shapes: bad input shapes" in proc.stdout, proc.stdout


@pytest.mark.webgpu
def test_a_fixed_size_is_gpu_resident_on_the_node_runtime(dynamic):
    """Patched for its size, the dynamic export has no CPU node and no Memcpy; patched as it is, the shape
    computations on its symbolic dims stay on the CPU, as the report says."""
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    if not (dynamic / "fixed.onnx").exists():
        proc = run_cli("patch", "dyn.onnx", "fixed.onnx", "--input-shape", "image:1,3,64,64", cwd=dynamic)
        assert proc.returncode == 0, proc.stderr
    proc = run_cli("patch", "dyn.onnx", "as_is.onnx", "--report", "as_is.json", cwd=dynamic)
    assert proc.returncode == 0, proc.stderr
    fixed = measure_placement(dynamic / "fixed.onnx", "node")
    assert fixed.session_ok and fixed.cpu_nodes == 0 and fixed.memcpy == 0, fixed.cpu_ops
    as_is = measure_placement(dynamic / "as_is.onnx", "node")
    predicted = json.loads((dynamic / "as_is.json").read_text())["webgpu"]
    # ORT's own shape inference folds or fuses a few of them otherwise than onnx's (a Slice of a Shape becomes a
    # Gather): the ops the report names are among those measured, and none is inside a deform block
    assert as_is.cpu_nodes > 0 and predicted["inside_blocks"] == {}, as_is.cpu_ops
    assert predicted["outside_blocks"] and set(predicted["outside_blocks"]) <= set(as_is.cpu_ops), (as_is.cpu_ops,
                                                                                                   predicted)


def test_shape_computations_after_a_contrib_op_count_as_folded(repo, tmp_path):
    """A shape computation downstream of MatMulNBits is counted as folded (ORT folds it: on the real q4 file the
    report predicts 0 CPU nodes, as placement measures); an int64 Add of a graph input is counted."""
    from onnx import TensorProto, helper, numpy_helper

    import deform_surgeon as ds

    model = onnx.load(repo / "onnx" / "model_q4.onnx")
    matmul = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    g = model.graph
    g.initializer.extend([numpy_helper.from_array(np.array(2, np.int64), "two"),
                          numpy_helper.from_array(np.array(1, np.int64), "one")])
    # its input reshaped by a computed shape, as in a Swin window partition
    at = list(g.node).index(matmul)
    g.node.insert(at, helper.make_node("Shape", [matmul.input[0]], ["a_shape"]))
    g.node.insert(at + 1, helper.make_node("Reshape", [matmul.input[0], "a_shape"], ["a_reshaped"]))
    matmul.input[0] = "a_reshaped"
    g.node.extend([helper.make_node("Shape", [matmul.output[0]], ["mm_shape"]),
                   helper.make_node("Gather", ["mm_shape", "two"], ["mm_h"]),
                   helper.make_node("Add", ["mm_h", "one"], ["mm_h1"])])
    g.output.append(helper.make_tensor_value_info("mm_h1", TensorProto.INT64, []))
    onnx.save(model, tmp_path / "q4_shape.onnx")
    assert ds.inspect(tmp_path / "q4_shape.onnx").webgpu.cpu_nodes == 0
    g.input.append(helper.make_tensor_value_info("count", TensorProto.INT64, []))
    g.node.append(helper.make_node("Add", ["mm_h1", "count"], ["counted"]))
    g.output.append(helper.make_tensor_value_info("counted", TensorProto.INT64, []))
    onnx.save(model, tmp_path / "q4_data.onnx")
    assert ds.inspect(tmp_path / "q4_data.onnx").webgpu.outside == {"Add": 1}


@pytest.mark.webgpu
def test_jsep_only_entries_match_the_browser(patched):
    """The bnb4 replica in headless Chromium: the JSEP bundle puts its MatMulBnb4 on the CPU EP, as the report's
    JSEP line says; the native WebGPU bundle runs every node on the GPU."""
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    _, out, _, _, summary = patched
    predicted = KernelReport.from_dict(next(m["webgpu"] for m in summary["models"]
                                            if m["model"].endswith("model_bnb4.onnx")))
    jsep = measure_placement(out / "onnx" / "model_bnb4.onnx", "browser", "jsep")
    assert jsep.session_ok, jsep.error
    assert jsep.cpu_ops == predicted.jsep_only == {"MatMulBnb4": 1}
    native = measure_placement(out / "onnx" / "model_bnb4.onnx", "browser", "webgpu")
    assert native.session_ok and native.cpu_nodes == 0 and native.memcpy == 0, native.cpu_ops


# ------------------------------------------------- contrib ops' outputs typed: a float16 Split after MatMulNBits
@pytest.fixture(scope="module")
def split_variants(tmp_path_factory):
    """The q4f16 and bnb4 replicas with a Split after the 4-bit MatMul, as in Swin's attention (the real q4f16 file
    has 9 float16 Splits after MatMulNBits), patched with --verify."""
    d = tmp_path_factory.mktemp("split")
    paths = build_variants(d, ("q4f16", "bnb4"), split=True)
    procs = {v: run_cli("patch", p.name, f"patched_{p.name}", "--verify", "--iterations", "1", "--report",
                        f"{p.stem}.json", cwd=d) for v, p in paths.items()}
    return d, paths, procs


@pytest.mark.parametrize("variant, op", [("q4f16", "MatMulNBits"), ("bnb4", "MatMulBnb4")])
def test_contrib_outputs_are_typed_as_onnxruntime_computes_them(split_variants, variant, op):
    """The declared type and shape of a contrib op's output (contrib.py's rule) is what ORT CPU computes: the output
    made a graph output with that declaration loads (ORT checks an output's declared type) and runs to that shape."""
    import onnxruntime as ort
    from onnx import helper

    from deform_surgeon.files import infer_value_types

    _, paths, _ = split_variants
    model = onnx.load(paths[variant])
    node = next(n for n in model.graph.node if n.op_type == op and n.domain == "com.microsoft")
    elem, shape = infer_value_types(model)[node.output[0]]
    assert (elem, shape) == ((onnx.TensorProto.FLOAT16 if variant == "q4f16" else onnx.TensorProto.FLOAT),
                             (1, 1, 64, 64))
    split = next(n for n in model.graph.node if n.op_type == "Split")
    assert infer_value_types(model)[split.output[0]] == (elem, (1, 1, 64, 32))
    model.graph.output.append(helper.make_tensor_value_info(node.output[0], elem, list(shape)))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"image": np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)}
    got = session.run([node.output[0]], feed)[0]
    assert got.shape == shape and got.dtype == onnx.helper.tensor_dtype_to_np_dtype(elem)


def test_a_float16_split_after_matmulnbits_is_named_then_rewritten(split_variants):
    """On the q4f16 input, the report's table names the float16 Split (no JSEP kernel); the patch rewrites it into
    Slices (its type and sizes now known), verifies byte-identical, and nothing is left for JSEP."""
    from deform_surgeon.files import infer_value_types
    from deform_surgeon.graph.kernels import kernel_report

    d, paths, procs = split_variants
    model = onnx.load(paths["q4f16"])
    before = kernel_report(model, infer_value_types(model))
    assert before.jsep_only == {"Split": 1} and before.outside == {}, before  # the rest: the deform blocks' own
    assert before.reasons["Split"].startswith("a float16 Split: no JSEP kernel")
    proc = procs["q4f16"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: PASSED" in proc.stdout
    assert re.search(r"rewritten\s+Split\s+proj_split: float16 Split -> 2 Slice\(s\) along axis 3 \(sizes \[32, 32\]\)",
                     proc.stdout), proc.stdout
    report = json.loads((d / "model_q4f16.json").read_text())
    assert report["webgpu"]["jsep_only"] == {} and report["webgpu"]["outside_blocks"] == {}
    patched = onnx.load(d / "patched_model_q4f16.onnx")
    assert not [n for n in patched.graph.node if n.op_type == "Split"]
    # the bnb4 file's Split is float32: left alone, its MatMulBnb4 still named for JSEP
    assert json.loads((d / "model_bnb4.json").read_text())["webgpu"]["jsep_only"] == {"MatMulBnb4": 1}


@pytest.mark.webgpu
def test_the_split_after_matmulnbits_on_the_jsep_bundle(split_variants):
    """In headless Chromium's JSEP bundle the q4f16 input runs the Split on the CPU EP, as the report's table
    says; the patched file has no CPU node and no Memcpy (the Slices and MatMulNBits on the GPU)."""
    from deform_surgeon.files import infer_value_types
    from deform_surgeon.graph.kernels import kernel_report
    from deform_surgeon.webgpu.placement import measure_placement, missing_setup

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    d, paths, procs = split_variants
    assert procs["q4f16"].returncode == 0, procs["q4f16"].stderr
    model = onnx.load(paths["q4f16"])
    predicted = kernel_report(model, infer_value_types(model))
    original = measure_placement(paths["q4f16"], "browser", "jsep")
    assert original.total_nodes > 0, original.error
    # besides the deform blocks' own int64 nodes (the patch's work), the float16 Split the report names
    assert predicted.jsep_only == {"Split": 1} and "proj_split" in original.cpu_node_names, original.cpu_node_names
    patched = measure_placement(d / "patched_model_q4f16.onnx", "browser", "jsep")
    assert patched.total_nodes > 0, patched.error
    assert patched.cpu_nodes == 0 and patched.memcpy == 0, patched.cpu_ops
