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

import graphs
import onnx
import pytest
from helpers import FIXTURES, one_error_line, snapshot

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
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["make", "-n", "batch", "MANIFEST=models.toml", "ARGS=--jobs 2"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"deform-surgeon batch models\.toml --jobs 2", proc.stdout), proc.stdout
    proc = subprocess.run(["make", "-s", "-o", ".venv/.installed", "batch"], cwd=root, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "usage: make batch MANIFEST=" in proc.stdout


@pytest.mark.parametrize("case", ["infinity", "overflow_count", "big_float_elsewhere", "deep", "lone_surrogate"])
def test_a_config_json_that_cannot_be_written_back_is_left_as_it_was_in_one_line(tmp_path, case):
    """Fourth round: `use_external_data_format` of Infinity or 1e400 (OverflowError), 5,000 levels of nesting
    (RecursionError), a lone surrogate (UnicodeEncodeError) ended in tracebacks after the models were written, and a
    valid `"max_value": 1e400` elsewhere was written back as `Infinity` (JSON.parse rejects it). Now the config is
    left as copied, byte for byte, and one line says why."""
    from deform_surgeon.batch import update_transformers_config

    (tmp_path / "onnx").mkdir()
    model = tmp_path / "onnx" / "model.onnx"
    model.write_bytes(b"")
    (tmp_path / "onnx" / "model.onnx_data").write_bytes(b"")
    text = {"infinity": '{"transformers.js_config": {"use_external_data_format": Infinity}}',
            "overflow_count": '{"transformers.js_config": {"use_external_data_format": {"model.onnx": 1e400}}}',
            "big_float_elsewhere": '{"max_value": 1e400}',
            "deep": "[" * 5000 + "]" * 5000,
            "lone_surrogate": '{"name": "\\ud800"}'}[case]
    (tmp_path / "config.json").write_text(text)
    said = update_transformers_config(tmp_path, [model])
    assert said is not None and said.startswith(f"{tmp_path / 'config.json'}: ") and "not updated" in said
    assert "\n" not in said and (tmp_path / "config.json").read_text() == text


def test_a_config_json_with_a_bom_is_updated_and_keeps_it(tmp_path):
    """transformers.js reads a config.json that starts with a UTF-8 BOM; it was left unread ("not JSON")."""
    from deform_surgeon.batch import update_transformers_config

    (tmp_path / "onnx").mkdir()
    model = tmp_path / "onnx" / "model.onnx"
    model.write_bytes(b"")
    (tmp_path / "onnx" / "model.onnx_data").write_bytes(b"")
    (tmp_path / "config.json").write_bytes("\ufeff".encode() + b'{"model_type": "birefnet", "x": "\xc3\xa9"}')
    said = update_transformers_config(tmp_path, [model])
    assert said and "set to the data files written (model.onnx: 1)" in said
    raw = (tmp_path / "config.json").read_bytes()
    assert raw.startswith("\ufeff".encode())
    config = json.loads(raw.decode("utf-8-sig"))
    assert config["x"] == "é" and config["transformers.js_config"]["use_external_data_format"] == {"model.onnx": 1}
