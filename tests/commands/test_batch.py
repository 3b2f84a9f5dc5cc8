"""`deform-surgeon batch`, end to end: real subprocesses on real files. A bad entry (missing model, corrupt file,
unwritable output, duplicate output path, unknown option) fails alone, with its reason in the summary; every
other entry completes; nothing partial is left; inputs are untouched; the exit code says what happened.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from helpers import FIXTURES, graphs, one_error_line, snapshot

CMD = [sys.executable, "-m", "deform_surgeon", "batch"]


def batch(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600)


def summary_rows(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """Entry number -> the summary table's row."""
    return {m.group(1): line for line in proc.stdout.splitlines() if (m := re.match(r"\s+(\d+)\s{2}", line))}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One batch with two good models and every kind of bad entry, run once for the module."""
    d = tmp_path_factory.mktemp("mixed")
    (d / "out").mkdir()
    onnx.save(graphs.exporter_like(H=30, W=40, C=8), d / "good.onnx")
    shutil.copyfile(FIXTURES / "sum_only.onnx", d / "sum.onnx")
    data = (FIXTURES / "decoder_gathernd.onnx").read_bytes()
    (d / "corrupt.onnx").write_bytes(data[: len(data) // 2])
    (d / "a_file").write_text("not a folder\n")
    (d / "m.toml").write_text("""
[defaults]
out_dir = "out"

[[model]]
input = "good.onnx"

[[model]]
input = "missing.onnx"

[[model]]
input = "corrupt.onnx"

[[model]]
input = "sum.onnx"
output = "a_file/sum.onnx"

[[model]]
input = "sum.onnx"
output = "out/good.patched.onnx"

[[model]]
input = "sum.onnx"
verfy = true

[[model]]
input = "sum.onnx"
output = "out/sum.patched.onnx"
verify = true
""")
    before = snapshot(d)
    proc = batch("m.toml", "--jobs", "2", "--summary", "summary.json", cwd=d)
    return d, before, proc


def test_bad_entries_fail_alone(mixed):
    d, before, proc = mixed
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = summary_rows(proc)
    assert [rows[str(k)].split()[1] for k in range(1, 8)] == ["ok", "failed", "failed", "failed", "failed", "failed",
                                                              "ok"], proc.stdout
    assert re.search(r"missing\.onnx: no such file", rows["2"])
    assert re.search(r"corrupt\.onnx: not (a readable|an) ONNX model", rows["3"])
    assert re.search(r"a_file/sum\.onnx: output folder a_file does not exist or is not a folder", rows["4"])
    assert re.search(r"out/good\.patched\.onnx: the output of entry 5.* is also the output of entry 1 \(.*good\.onnx\)",
                     rows["5"])
    assert re.search(r"unknown option\(s\) verfy", rows["6"])
    assert "(verified)" in rows["7"]
    assert proc.stdout.splitlines()[-1] == "2 ok, 0 unchanged, 0 refused, 5 failed"


def test_only_the_good_outputs_and_reports_are_left(mixed):
    d, before, _ = mixed
    after = snapshot(d)
    new = sorted(set(after) - set(before))
    assert new == ["out/corrupt.patched.report.json", "out/good.patched.onnx", "out/good.patched.report.json",
                   "out/missing.patched.report.json", "out/sum.patched.onnx", "out/sum.patched.report.json",
                   "summary.json"]  # failed entries: a report if they ran, never an output or a temporary file
    assert all(after[k] == v for k, v in before.items() if not k.startswith("out"))  # inputs: same bytes, mtime
    for name in ("good", "sum"):
        onnx.checker.check_model(onnx.load(d / "out" / f"{name}.patched.onnx"), full_check=True)


def test_reports_and_summary_json(mixed):
    d, _, proc = mixed
    good = json.loads((d / "out" / "good.patched.report.json").read_text())
    assert good["status"] == "ok" and good["written"] and good["error"] is None
    assert good["summary"]["rewritten"] > 0 and good["ops_before"]["GatherND"] == 4
    verified = json.loads((d / "out" / "sum.patched.report.json").read_text())
    assert verified["verification"]["identical"] is True
    missing = json.loads((d / "out" / "missing.patched.report.json").read_text())
    assert missing["status"] == "failed" and "no such file" in missing["error"] and not missing["written"]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["exit_code"] == 1 and len(summary["models"]) == 7
    assert [m["status"] for m in summary["models"]] == ["ok"] + ["failed"] * 5 + ["ok"]


def test_outputs_equal_single_patch(mixed, tmp_path):
    d, _, _ = mixed
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "patch", d / "good.onnx", tmp_path / "one.onnx"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "one.onnx").read_bytes() == (d / "out" / "good.patched.onnx").read_bytes()


def test_progress_lines_on_stderr(mixed):
    _, _, proc = mixed
    lines = proc.stderr.splitlines()
    assert any(re.fullmatch(r"\[1/7\] .*good\.onnx: prove", ln) for ln in lines), proc.stderr
    assert any(re.fullmatch(r"\[1/7\] .*good\.onnx: ok \(\d+\.\d s\)", ln) for ln in lines), proc.stderr
    assert any(re.fullmatch(r"\[7/7\] .*sum\.onnx: verify", ln) for ln in lines), proc.stderr
    assert "Traceback" not in proc.stderr


def test_globs_refusals_and_strict(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "out").mkdir()
    shutil.copyfile(FIXTURES / "gathernd_refused.onnx", tmp_path / "models" / "refused.onnx")
    shutil.copyfile(FIXTURES / "no_deform.onnx", tmp_path / "models" / "plain.onnx")
    proc = batch("--glob", "models/*.onnx", "--out-dir", "out", "--jobs", "2", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # refused nodes, nothing failed
    assert proc.stderr == ""
    rows = summary_rows(proc)
    assert rows["1"].split()[1] == "unchanged" and rows["2"].split()[1] == "refused", proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["plain.patched.report.json",
                                                                    "refused.patched.onnx",
                                                                    "refused.patched.report.json"]
    shutil.rmtree(tmp_path / "out")
    (tmp_path / "out").mkdir()
    proc = batch("--glob", "models/*.onnx", "--out-dir", "out", "--strict", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "refused.patched.onnx").exists()


def _sum_over_the_profile() -> onnx.ModelProto:
    """A 3-input Sum of a 16,384 B tensor: `sum_chain` rewrites it, no pass computes its output in parts and nothing
    is refused; patched with --max-buffer 10KiB, a model that is written and stays over the profile (as HR 2048's
    Resize, Add and Concat outputs stay over spec-default)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Sum", ["x", "x", "x"], ["y"], name="sum3")], "sum",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 64])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_model_written_over_the_profile_is_refused_by_patch_and_batch_alike(tmp_path):
    """One verdict for one outcome: a model written with tensors still over the device profile is a finding, as a
    refused node is: `patch` and `batch` both say `refused` and exit 3, and write it unless --strict."""
    (tmp_path / "models").mkdir()
    onnx.save(_sum_over_the_profile(), tmp_path / "models" / "sum.onnx")
    patch = [sys.executable, "-m", "deform_surgeon", "patch", "models/sum.onnx", "sum.out.onnx", "--max-buffer",
             "10KiB", "--report", "r.json"]
    proc = subprocess.run(patch, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "refused: 1 tensor(s) over the device profile; sum.out.onnx written all the same" in proc.stdout
    assert "STAYS OVER the device profile: 1 tensor(s)" in proc.stdout and (tmp_path / "sum.out.onnx").exists()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "refused" and report["stays_over"] == ["y"] and report["written"]
    assert report["summary"] == {"rewritten": 1, "rewritten_unproven": 0, "refused": 0}

    (tmp_path / "out").mkdir()
    proc = batch("--glob", "models/*.onnx", "--out-dir", "out", "--max-buffer", "10KiB", "--no-progress",
                 cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert summary_rows(proc)["1"].split()[1] == "refused", proc.stdout
    assert (tmp_path / "out" / "sum.patched.onnx").exists()

    strict = subprocess.run([*patch[:5], "strict.onnx", *patch[6:], "--strict"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert strict.returncode == 3 and not (tmp_path / "strict.onnx").exists(), strict.stdout + strict.stderr
    assert "--strict: 1 tensor(s) over the device profile; strict.onnx not written; STAYS OVER" in strict.stdout


@pytest.mark.parametrize("setup, args, named, problem", [
    (None, ["nothing.toml"], "nothing.toml", r"no such file"),
    ("[[model]\ninput = 1", ["bad.toml"], "bad.toml", r"not a valid TOML manifest"),
    ("[models]\ninput = 'a.onnx'", ["bad.toml"], "bad.toml", r"unknown manifest key\(s\): models"),
    ("[defaults]\nverfy = true\n[[model]]\ninput = 'a.onnx'", ["bad.toml"], "bad.toml", r"unknown option\(s\)"),
    ("", ["bad.toml"], "bad.toml", r"no models"),
    (None, ["--glob", "*.onnx", "--out-dir", "nowhere"], "nowhere", r"not an existing folder"),
], ids=["missing", "syntax", "unknown-key", "unknown-default", "empty", "out-dir"])
def test_a_batch_that_cannot_start_is_one_line_exit_2(tmp_path, setup, args, named, problem):
    if setup is not None:
        (tmp_path / "bad.toml").write_text(setup)
    before = snapshot(tmp_path)
    proc = batch(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"{named}: ") and re.search(problem, line), line
    assert snapshot(tmp_path) == before


def test_make_batch_target():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(["make", "-n", "batch", "MANIFEST=models.toml", "ARGS=--jobs 2"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"deform-surgeon batch models\.toml --jobs 2", proc.stdout), proc.stdout
    proc = subprocess.run(["make", "-s", "-o", ".venv/.installed", "batch"], cwd=root, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "usage: make batch MANIFEST=" in proc.stdout


def _tjs_folder(root: Path, config: bytes, models: tuple[str, ...] = ("model.onnx",)) -> Path:
    """A transformers.js model folder: config.json (these bytes) beside onnx/ with `models` (the float32 or float16
    decoder fixture, by name)."""
    src = root / "src"
    (src / "onnx").mkdir(parents=True)
    for name in models:
        fixture = "decoder_gathernd_fp16.onnx" if "fp16" in name else "decoder_gathernd.onnx"
        shutil.copyfile(FIXTURES / fixture, src / "onnx" / name)
    (src / "config.json").write_bytes(config)
    return src


CANNOT_BE_WRITTEN_BACK = {
    "infinity": b'{"transformers.js_config": {"use_external_data_format": Infinity}}',
    "overflow_count": b'{"transformers.js_config": {"use_external_data_format": {"model.onnx": 1e400}}}',
    "big_float_elsewhere": b'{"max_value": 1e400}',
    "deep": b"{" + b'"a": [' * 5000 + b"]" * 5000 + b"}",
    "lone_surrogate": b'{"name": "\\ud800"}',
    "not_an_object": b"[]"}


@pytest.mark.parametrize("case", list(CANNOT_BE_WRITTEN_BACK))
def test_a_config_json_that_cannot_be_written_back_is_decided_before_any_model_is_written(tmp_path, case):
    """A config.json with `use_external_data_format` of Infinity or 1e400, 5,000 levels of nesting, or a lone
    surrogate is judged before anything is written: where the config would have to change (here: --external-data
    always), one line naming it, exit 2, OUTDIR not made. Found after the models are written, it would leave a
    folder transformers.js does not fetch the data of, with a traceback or exit 0."""
    src = _tjs_folder(tmp_path, CANNOT_BE_WRITTEN_BACK[case])
    before = snapshot(tmp_path)
    proc = batch(src, tmp_path / "out", "--external-data", "always", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"{src / 'config.json'}: ") and "cannot make it say which models in onnx/ have external " \
        "data" in line, line
    assert snapshot(tmp_path) == before


def test_a_config_json_that_cannot_be_written_back_but_says_the_right_thing_is_copied(tmp_path):
    """The same config where it need not change (small files, one file each: the config says no data file): the
    batch runs and the config is copied byte for byte."""
    src = _tjs_folder(tmp_path, CANNOT_BE_WRITTEN_BACK["big_float_elsewhere"])
    proc = batch(src, tmp_path / "out", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "out" / "config.json").read_bytes() == CANNOT_BE_WRITTEN_BACK["big_float_elsewhere"]
    assert "use_external_data_format" not in proc.stdout


def test_a_config_json_with_a_bom_is_updated_and_keeps_it(tmp_path):
    """transformers.js reads a config.json that starts with a UTF-8 BOM, so the tool reads it too (not "not
    JSON") and writes it back with its BOM."""
    src = _tjs_folder(tmp_path, "\ufeff".encode() + b'{"model_type": "birefnet", "x": "\xc3\xa9"}')
    proc = batch(src, tmp_path / "out", "--external-data", "always", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "set to the data files written (model.onnx: 1)" in proc.stdout
    raw = (tmp_path / "out" / "config.json").read_bytes()
    assert raw.startswith("\ufeff".encode())
    config = json.loads(raw.decode("utf-8-sig"))
    assert config["x"] == "é" and config["transformers.js_config"]["use_external_data_format"] == {"model.onnx": 1}


# ---------------------------------------------------------------------- what transformers.js itself reads (node)
TJS_FILES = """
const [modules, root, id, dtypes, values] = process.argv.slice(2);
const { env, ModelRegistry } = await import(`${modules}/@huggingface/transformers/dist/transformers.node.mjs`);
env.allowRemoteModels = false;
env.localModelPath = root;
const out = [];
if (values === undefined) {  // the folder's own config.json, as a page's pipeline reads it
    for (const dtype of JSON.parse(dtypes)) out.push(await ModelRegistry.get_model_files(id, { dtype }));
} else {  // each use_external_data_format value in a config of its own
    for (const value of JSON.parse(values)) {
        const config = { model_type: 'birefnet', 'transformers.js_config': { use_external_data_format: value } };
        for (const dtype of JSON.parse(dtypes)) out.push(await ModelRegistry.get_model_files(id, { config, dtype }));
    }
}
console.log(JSON.stringify(out));
"""


def _transformers_js_files(tmp_path: Path, folder: Path, dtypes: list[str], values: list | None = None) -> list:
    """The files transformers.js 4.3.1 itself (ModelRegistry.get_model_files: the files `pipeline(..., {dtype})`
    loads; both call `resolveExternalDataFormat(config, fullName, fileName)`, src/utils/model-loader.js) fetches
    for each dtype: from `folder`'s config.json, or for each `use_external_data_format` value of `values`."""
    import shutil as sh

    from deform_surgeon.base import js_runtimes as runtimes

    modules = runtimes.runtimes_dir()
    if modules is None or sh.which("node") is None:
        pytest.skip("transformers.js not installed (deform-surgeon setup)")
    script = tmp_path / "files.mjs"
    script.write_text(TJS_FILES)
    args = ["node", script, modules / "node_modules", f"{folder.parent}/", folder.name, json.dumps(dtypes)]
    proc = subprocess.run([*map(str, args), *([json.dumps(values)] if values is not None else [])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_data_files_read_as_transformers_js_reads_them(tmp_path):
    """The tool reads a count as transformers.js does, not as Python's int() does (1.5: transformers.js fetches 2,
    int() gives 1), and looks a file up as it does: by full name, then by the name every dtype's file shares
    (`model`), not by the file's own stem (`model_q4`). The tool's reading against transformers.js's own, value
    by value."""
    from deform_surgeon.commands.batch import data_files_read

    values = [1.5, 0.1, "2", " 3 ", "\u00a02", "0x2", "0b11", "1e0", "", "abc", "-1", -1, True, False, 0, None, [1],
              {"model": 1}, {"model": 1.5}, {"model": "2"}, {"model_fp16.onnx": "1"}, {"model.onnx": [2]},
              {"model": [[3]]}, {"model": [1, 2]}, {"model": [None]}, {"model": {}}, {"model": True},
              {"model.onnx": 0, "model": 1}, {"model_fp16": 1}, {"model": " 0x1 "}]
    dtypes = {"fp32": "model.onnx", "fp16": "model_fp16.onnx"}
    listed = iter(_transformers_js_files(tmp_path, tmp_path / "m", list(dtypes), values))
    for value in values:
        for name in dtypes.values():
            theirs = sum(f.startswith(f"onnx/{name}_data") for f in next(listed))
            assert data_files_read(value, name, "model") == theirs, (value, name)


def _fetched_data_files(tmp_path: Path, out: Path) -> dict[str, set[str]]:
    """Per model in OUTDIR/onnx/: the data files transformers.js fetches for it, from OUTDIR's own config.json."""
    models = sorted(p.name for p in (out / "onnx").glob("*.onnx"))
    dtypes = {"model.onnx": "fp32", "model_fp16.onnx": "fp16"}
    lists = _transformers_js_files(tmp_path, out, [dtypes[m] for m in models])
    return {m: {f.removeprefix("onnx/") for f in files if "_data" in f} for m, files in zip(models, lists, strict=True)}


@pytest.mark.parametrize("case", ["base_name", "fraction", "stale"])
def test_transformers_js_fetches_exactly_the_data_files_each_written_model_reads(tmp_path, case):
    """Asked of transformers.js itself, from the written config.json as a page's pipeline reads it: each model's
    data files are exactly those the written model refers to. The cases: `{"model": 1}` for a folder of
    `model_fp16.onnx` only (left as copied, transformers.js would fetch a `model_fp16.onnx_data` that does not
    exist); `1.5` for a model written with one data file (transformers.js fetches `_data_1` too); a
    `model.onnx_data` an earlier run left in OUTDIR (not written by this one)."""
    from deform_surgeon.files.io_check import external_locations

    config, models, args = {
        "base_name": ({"model": 1}, ("model_fp16.onnx",), ()),
        "fraction": ({"model.onnx": 1.5}, ("model.onnx",), ("--external-data", "always")),
        "stale": ({}, ("model.onnx",), ())}[case]
    src = _tjs_folder(tmp_path, json.dumps({"model_type": "birefnet", "transformers.js_config": {
        "use_external_data_format": config}}).encode(), models)
    out = tmp_path / "out"
    if case == "stale":
        (out / "onnx").mkdir(parents=True)
        (out / "onnx" / "model.onnx_data").write_bytes(b"an earlier run's")
    proc = batch(src, out, *args, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fetched = _fetched_data_files(tmp_path, out)
    assert fetched == {m: set(external_locations(out / "onnx" / m)) for m in models}, (fetched, proc.stdout)
