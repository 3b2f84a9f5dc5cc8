"""The `deform-surgeon` command line, end to end: real subprocesses (`python -m deform_surgeon` and the installed
console script) on real files in a temporary folder.

Bad input must end as exit code 2 and ONE stderr line naming the file and the problem, with the input untouched
and nothing (no output, no temporary file) left in the output folder.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from helpers import CONSOLE_SCRIPT, ENTRY_POINTS, FIXTURES, copy_fixture, graphs, one_error_line, run, snapshot
from onnx import TensorProto, helper

REFUSED_GATHERS = ["GatherND_v_tl", "GatherND_v_br", "GatherND_v_bl", "GatherND_v_tr"]  # gathernd_refused.onnx


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def broken_model() -> onnx.ModelProto:
    """Parses as ONNX but fails onnx.checker: a node reads a tensor nothing defines."""
    graph = helper.make_graph([helper.make_node("Add", ["x", "undefined_tensor"], ["y"], name="add")], "broken",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model, full_check=True)
    return model


# -- bad input ---------------------------------------------------------------------------------------------------
# Each case prepares files in the (empty) folder and returns (argv, the file the error line must name, a regex
# the problem must match). The folder is the working directory, the input folder and the output folder.

def _missing(d: Path):
    return ["patch", "missing.onnx", "out.onnx"], "missing.onnx", r"no such file"


def _text(d: Path):
    (d / "notes.onnx").write_text("This is a text file, not an ONNX model.\nSecond line.\n")
    return ["patch", "notes.onnx", "out.onnx"], "notes.onnx", r"not (a readable|an) ONNX model"


def _random_bytes(d: Path):
    (d / "noise.onnx").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return ["patch", "noise.onnx", "out.onnx"], "noise.onnx", r"not (a readable|an) ONNX model"


def _empty(d: Path):
    (d / "empty.onnx").write_bytes(b"")
    return ["patch", "empty.onnx", "out.onnx"], "empty.onnx", r"not (a readable|an) ONNX model"


def _truncated(d: Path):
    data = (FIXTURES / "decoder_gathernd.onnx").read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 2])
    return ["patch", "truncated.onnx", "out.onnx"], "truncated.onnx", r"not (a readable|an) ONNX model"


def _input_is_folder(d: Path):
    (d / "folder.onnx").mkdir()
    return ["patch", "folder.onnx", "out.onnx"], "folder.onnx", r"folder"


def _no_output_folder(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return ["patch", "model.onnx", "nodir/out.onnx"], "nodir/out.onnx", r"nodir.*does not exist"


def _report_folder_missing(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return (["patch", "model.onnx", "out.onnx", "--report", "nodir/report.json"], "nodir/report.json",
            r"nodir.*does not exist")


def _out_is_in(d: Path):
    (d / "x").mkdir()
    copy_fixture("sum_only.onnx", d / "x", "model.onnx")
    return ["patch", "x/model.onnx", "x/model.onnx"], "x/model.onnx", r"is the input"


def _out_is_in_other_spelling(d: Path):
    (d / "x").mkdir()
    copy_fixture("sum_only.onnx", d / "x", "model.onnx")
    return ["patch", "x/model.onnx", "./x/../x/model.onnx"], "x/../x/model.onnx", r"is the input"


def _out_is_in_absolute(d: Path):
    (d / "x").mkdir()
    copy_fixture("sum_only.onnx", d / "x", "model.onnx")
    return ["patch", "x/model.onnx", d / "x" / "model.onnx"], str(d / "x" / "model.onnx"), r"is the input"


def _out_is_symlink_to_in(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    (d / "link.onnx").symlink_to("model.onnx")
    return ["patch", "model.onnx", "link.onnx"], "link.onnx", r"is the input"


def _fails_checker(d: Path):
    onnx.save(broken_model(), d / "broken.onnx")
    return ["patch", "broken.onnx", "out.onnx"], "broken.onnx", r"onnx\.checker"


BAD_INPUTS = [_missing, _text, _random_bytes, _empty, _truncated, _input_is_folder, _no_output_folder,
              _report_folder_missing, _out_is_in, _out_is_in_other_spelling, _out_is_in_absolute,
              _out_is_symlink_to_in, _fails_checker]
BAD_CASES = [pytest.param(case, "module", id=case.__name__.strip("_")) for case in BAD_INPUTS] + [
    pytest.param(case, "script", id=f"{case.__name__.strip('_')}-console-script")
    for case in (_missing, _out_is_in_other_spelling)]


@pytest.mark.parametrize("case, entry", BAD_CASES)
def test_bad_input_exit_2_one_line_nothing_written(tmp_path, case, entry):
    argv, named, problem = case(tmp_path)
    before = snapshot(tmp_path)
    proc = run(*argv, cwd=tmp_path, entry=entry)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"{named}: "), line
    assert re.search(problem, line[len(named) + 2:]), line
    assert "Traceback" not in proc.stdout + proc.stderr
    assert snapshot(tmp_path) == before  # input bytes and mtime unchanged, no output and no temporary file


@pytest.mark.parametrize("command, case", [
    (["inspect", "{m}"], _missing), (["inspect", "{m}"], _truncated), (["inspect", "{m}"], _fails_checker),
    (["verify", "good.onnx", "{m}"], _missing), (["verify", "good.onnx", "{m}"], _truncated),
    (["verify", "{m}", "good.onnx"], _fails_checker)], ids=lambda v: v.__name__.strip("_") if callable(v) else v[0])
def test_bad_input_to_inspect_and_verify(tmp_path, command, case):
    argv, named, problem = case(tmp_path)
    if case is _fails_checker and command[0] == "verify":
        problem = r"onnx\.checker|[Ii]nvalid model"  # verify lets ORT's loader find the fault
    copy_fixture("sum_only.onnx", tmp_path, "good.onnx")
    before = snapshot(tmp_path)
    proc = run(*[a.format(m=argv[1]) for a in command], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"{named}: ") and re.search(problem, line), line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv, clobbered", [
    (["patch", "model.onnx", "out.onnx", "--report", "model.onnx"], "model.onnx"),
    (["patch", "model.onnx", "out.onnx", "--report", "./out.onnx"], "out.onnx"),
    (["inspect", "model.onnx", "--json", "model.onnx"], "model.onnx"),
    (["verify", "model.onnx", "other.onnx", "--json", "other.onnx"], "other.onnx"),
], ids=["patch-report-is-input", "patch-report-is-output", "inspect-json-is-input", "verify-json-is-input"])
def test_report_path_may_not_be_a_model(tmp_path, argv, clobbered):
    copy_fixture("sum_only.onnx", tmp_path, "model.onnx")
    copy_fixture("sum_only.onnx", tmp_path, "other.onnx")
    before = snapshot(tmp_path)
    proc = run(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert clobbered in one_error_line(proc)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("entry", ["module", "script"])
def test_nothing_to_rewrite_is_not_an_error(tmp_path, entry):
    model = copy_fixture("no_deform.onnx", tmp_path)
    before = snapshot(tmp_path)
    proc = run("patch", model.name, "out.onnx", cwd=tmp_path, entry=entry)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "nothing to rewrite" in proc.stdout
    assert snapshot(tmp_path) == before

    proc = run("patch", model.name, "out.onnx", "--copy-unchanged", cwd=tmp_path, entry=entry)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to rewrite" in proc.stdout
    assert (tmp_path / "out.onnx").read_bytes() == model.read_bytes()
    after = snapshot(tmp_path)
    assert after.pop("out.onnx") and after == before


def test_console_script_and_module_agree(tmp_path):
    assert CONSOLE_SCRIPT.is_file(), "the deform-surgeon console script is not installed"
    outs = [run("--version", cwd=tmp_path, entry=e) for e in ENTRY_POINTS]
    assert [p.returncode for p in outs] == [0, 0]
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.startswith("deform-surgeon ")


def test_failed_verification_writes_nothing(tmp_path):
    """`--sum-mode tree` is not bit-identical, so `--verify` must refuse to write (exit 1, one line)."""
    model = copy_fixture("sum_only.onnx", tmp_path)
    before = snapshot(tmp_path)
    proc = run("patch", model.name, "out.onnx", "--sum-mode", "tree", "--verify", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith("out.onnx: ") and "differs" in line and "'y'" in line, line
    assert snapshot(tmp_path) == before


# -- a real exporter fixture, patched once for the module --------------------------------------------------------

@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decoder")
    source = FIXTURES / "decoder_gathernd.onnx"
    out, report = folder / "decoder_gathernd.patched.onnx", folder / "report.json"
    proc = run("patch", source, out, "--verify", "--report", report, cwd=folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return SimpleNamespace(proc=proc, source=source, out=out, report=report, folder=folder)


def check_report(report: dict, original: onnx.ModelProto, patched: onnx.ModelProto) -> None:
    """The JSON report agrees with itself and with the two models."""
    kinds = Counter(n["action"] for n in report["nodes"])
    assert report["summary"] == {"rewritten": kinds["rewritten"], "rewritten_unproven": kinds["rewritten_unproven"],
                                 "refused": kinds["refused"]}
    assert sum(report["summary"].values()) == len(report["nodes"])
    assert report["ops_before"] == dict(ops(original))
    assert report["ops_after"] == dict(ops(patched))
    patched_names = {n.name for n in patched.graph.node}
    for entry in report["nodes"]:
        assert entry["reason"], entry
        if entry["action"] == "refused":  # left unchanged
            assert entry["node"] in patched_names and not entry["new_nodes"], entry
        else:  # replaced
            assert entry["node"] not in patched_names and entry["new_nodes"], entry
    # every node the patch added is listed under some rewrite
    added = patched_names - {n.name for n in original.graph.node}
    assert added <= {name for entry in report["nodes"] for name in entry["new_nodes"]}


def gathernd_actions(report: dict) -> Counter:
    return Counter(n["action"] for n in report["nodes"] if n["op"] == "GatherND")


def test_patch_verify_writes_output_and_passes(decoder):
    assert decoder.proc.stderr == ""
    assert any(line.startswith("verify: PASSED") for line in decoder.proc.stdout.splitlines()), decoder.proc.stdout
    assert sorted(p.name for p in decoder.folder.iterdir()) == sorted([decoder.out.name, decoder.report.name])
    onnx.checker.check_model(onnx.load(decoder.out), full_check=True)


def test_report_json(decoder):
    report = json.loads(decoder.report.read_text())
    original, patched = onnx.load(decoder.source), onnx.load(decoder.out)
    check_report(report, original, patched)
    assert report["written"] is True and report["verification"]["identical"] is True
    assert report["ops_before"]["GatherND"] > 0 and report["ops_before"]["Sum"] > 0
    assert "GatherND" not in report["ops_after"] and "Sum" not in report["ops_after"]
    assert report["summary"]["refused"] == report["summary"]["rewritten_unproven"] == 0
    rewritten = Counter(n["op"] for n in report["nodes"] if n["action"] == "rewritten")
    assert rewritten["GatherND"] == report["ops_before"]["GatherND"] and rewritten["Sum"] == report["ops_before"]["Sum"]


def test_the_reports_verification_names_out(decoder):
    """`verification.patched` names OUT, the file the verdict is about, not the temporary file the comparison ran
    on, which is gone once OUT takes its place."""
    verification = json.loads(decoder.report.read_text())["verification"]
    assert verification["original"] == str(decoder.source) and verification["patched"] == str(decoder.out)


def test_names_unique_and_derived_from_replaced_nodes(decoder):
    original, patched = onnx.load(decoder.source), onnx.load(decoder.out)
    assert_unique_names(patched)
    before, after = {n.name for n in original.graph.node}, {n.name for n in patched.graph.node}
    replaced, new = before - after, after - before
    assert {n.name for n in original.graph.node if n.op_type in ("GatherND", "Sum")} <= replaced
    assert new
    assert sorted(name for name in new if not any(name.startswith(f"{r}/") for r in replaced)) == []


def assert_unique_names(model: onnx.ModelProto) -> None:
    names = [n.name for n in model.graph.node]
    assert all(names), "a node has no name"
    assert [k for k, v in Counter(names).items() if v > 1] == []
    defined = ([i.name for i in model.graph.input] + [i.name for i in model.graph.initializer]
               + [o for n in model.graph.node for o in n.output if o])
    assert [k for k, v in Counter(defined).items() if v > 1] == []


def test_new_names_avoid_existing_names(tmp_path):
    """Give surviving nodes and tensors the very names the rewrite would pick; the rewrite must pick others."""
    model = graphs.exporter_like()
    onnx.save(model, tmp_path / "first.onnx")
    assert run("patch", "first.onnx", "first.patched.onnx", cwd=tmp_path).returncode == 0
    first = onnx.load(tmp_path / "first.patched.onnx")
    old_nodes = {n.name for n in model.graph.node}
    old_tensors = {t for n in model.graph.node for t in n.output}
    new_nodes = [n.name for n in first.graph.node if n.name not in old_nodes]
    new_tensors = [t for n in first.graph.node for t in n.output if t not in old_tensors]

    surviving = {n.name for n in first.graph.node}
    survivors = [n for n in model.graph.node if n.name in surviving]
    graph_io = {v.name for v in list(model.graph.input) + list(model.graph.output)}
    node_names = dict(zip([n.name for n in survivors], new_nodes, strict=False))
    tensor_names = dict(zip([t for n in survivors for t in n.output if t not in graph_io], new_tensors, strict=False))
    assert len(node_names) >= 5 and len(tensor_names) >= 5
    for n in model.graph.node:
        n.name = node_names.get(n.name, n.name)
        n.input[:] = [tensor_names.get(t, t) for t in n.input]
        n.output[:] = [tensor_names.get(t, t) for t in n.output]
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / "second.onnx")

    proc = run("patch", "second.onnx", "second.patched.onnx", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    second = onnx.load(tmp_path / "second.patched.onnx")
    assert ops(second)["GatherND"] == 0 and ops(second)["Sum"] == 0
    assert_unique_names(second)
    assert {n.name for n in model.graph.node if n.name in node_names.values()} <= {n.name for n in second.graph.node}


def test_model_fields_survive(tmp_path):
    model = onnx.load(FIXTURES / "decoder_gathernd_fp16.onnx")
    onnx.helper.set_model_props(model, {"author": "deform_surgeon tests", "license": "MIT"})
    onnx.save(model, tmp_path / "meta.onnx")
    proc = run("patch", "meta.onnx", "out.onnx", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    patched = onnx.load(tmp_path / "out.onnx")
    assert ops(patched)["GatherND"] == 0
    assert list(patched.graph.input) == list(model.graph.input)  # names, dtypes, shapes
    assert list(patched.graph.output) == list(model.graph.output)
    assert list(patched.opset_import) == list(model.opset_import)
    assert patched.ir_version == model.ir_version
    assert {p.key: p.value for p in patched.metadata_props} == {"author": "deform_surgeon tests", "license": "MIT"}
    assert list(patched.metadata_props) == list(model.metadata_props)


def test_two_runs_are_byte_identical(tmp_path):
    """Separate processes with different hash seeds, different output names: the same bytes."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = copy_fixture("decoder_gathernd_b2g2.onnx", tmp_path)
    for sub, hash_seed in (("a", "1"), ("b", "2")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = run("patch", model, tmp_path / sub / f"{sub}.onnx", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "a" / "a.onnx").read_bytes() == (tmp_path / "b" / "b.onnx").read_bytes()


@pytest.fixture
def refused_patched(tmp_path):
    copy_fixture("gathernd_refused.onnx", tmp_path, "refused.onnx")
    proc = run("patch", "refused.onnx", "refused.patched.onnx", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # a finding, written all the same (as batch's "refused")
    return tmp_path / "refused.patched.onnx"


@pytest.mark.parametrize("which", ["decoder", "refused"])
def test_patching_a_patched_model_changes_nothing(tmp_path, which, request):
    patched = request.getfixturevalue("decoder").out if which == "decoder" else request.getfixturevalue(
        "refused_patched")
    proc = run("patch", patched, tmp_path / "again.onnx", "--copy-unchanged", "--report", tmp_path / "r.json",
               cwd=tmp_path)
    assert proc.returncode == (3 if which == "refused" else 0), proc.stdout + proc.stderr  # refused: still a finding
    assert "nothing to rewrite" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["rewritten"] == report["summary"]["rewritten_unproven"] == 0
    assert (tmp_path / "again.onnx").read_bytes() == patched.read_bytes()


# -- refusals: inspect, --strict, --allow-unproven ---------------------------------------------------------------

def test_fixture_has_the_expected_gathers():
    model = onnx.load(FIXTURES / "gathernd_refused.onnx")
    assert [n.name for n in model.graph.node if n.op_type == "GatherND"] == REFUSED_GATHERS


def test_inspect_writes_nothing_and_lists_refusals(tmp_path):
    copy_fixture("gathernd_refused.onnx", tmp_path, "refused.onnx")
    before = snapshot(tmp_path)
    proc = run("inspect", "refused.onnx", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert snapshot(tmp_path) == before
    for name in REFUSED_GATHERS:
        lines = [ln for ln in proc.stdout.splitlines() if re.search(rf"\brefused\b.*\b{name}\b", ln)]
        assert len(lines) == 1, (name, proc.stdout)
        reason = lines[0].split(f"{name}:", 1)[1]
        assert re.search(r"not proven|out of range", reason) and len(reason) > 20, lines[0]


def test_strict_exit_3(tmp_path):
    copy_fixture("gathernd_refused.onnx", tmp_path, "refused.onnx")
    proc = run("patch", "refused.onnx", "out.onnx", "--strict", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not (tmp_path / "out.onnx").exists() and "not written" in proc.stdout
    proc = run("inspect", "refused.onnx", "--strict", "--json", "inspect.json", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "inspect.json").read_text())
    assert sorted(n["node"] for n in report["nodes"] if n["action"] == "refused" and n["op"] == "GatherND") == sorted(
        REFUSED_GATHERS)
    # and --strict is not "always 3": a fully proven model passes it
    copy_fixture("gathernd_b2g2.onnx", tmp_path, "proven.onnx")
    proc = run("patch", "proven.onnx", "proven.patched.onnx", "--strict", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_allow_unproven_rewrites_and_warns(tmp_path):
    source = copy_fixture("gathernd_refused.onnx", tmp_path, "refused.onnx")
    proc = run("patch", "refused.onnx", "out.onnx", "--allow-unproven", "--report", "r.json", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # the unproven gathers' index Casts are still refused
    warnings = [ln for ln in proc.stdout.splitlines() if ln.startswith("WARNING")]
    for name in REFUSED_GATHERS:
        assert any(re.search(rf"\b{name}\b", ln) for ln in warnings), (name, proc.stdout)
    patched = onnx.load(tmp_path / "out.onnx")
    assert ops(patched)["GatherND"] == 0 and ops(patched)["Gather"] >= len(REFUSED_GATHERS)
    report = json.loads((tmp_path / "r.json").read_text())
    check_report(report, onnx.load(source), patched)
    assert gathernd_actions(report) == {"rewritten_unproven": len(REFUSED_GATHERS)}
    assert report["summary"]["rewritten_unproven"] == len(REFUSED_GATHERS)


def test_without_allow_unproven_gathers_are_kept(tmp_path):
    source = copy_fixture("gathernd_refused.onnx", tmp_path, "refused.onnx")
    proc = run("patch", "refused.onnx", "out.onnx", "--report", "r.json", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # refused nodes: a finding; the model is written
    assert "refused: 4 node(s) refused; out.onnx written all the same" in proc.stdout.splitlines(), proc.stdout
    assert not any(ln.startswith("WARNING") for ln in proc.stdout.splitlines())
    patched = onnx.load(tmp_path / "out.onnx")
    assert [n.name for n in patched.graph.node if n.op_type == "GatherND"] == REFUSED_GATHERS
    report = json.loads((tmp_path / "r.json").read_text())
    check_report(report, onnx.load(source), patched)
    assert gathernd_actions(report) == {"refused": len(REFUSED_GATHERS)}
    assert report["summary"]["rewritten_unproven"] == 0


@pytest.mark.parametrize("fixture", ["sum_only.onnx", "no_deform.onnx"])
def test_written_model_has_the_usual_permissions(tmp_path, fixture):
    """Not mkstemp's 0600: a patched model is meant to be served, so it gets the mode any new file would."""
    mask = os.umask(0o022)
    os.umask(mask)
    copy_fixture(fixture, tmp_path, "in.onnx")
    proc = run("patch", "in.onnx", "out.onnx", "--copy-unchanged", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert oct((tmp_path / "out.onnx").stat().st_mode & 0o777) == oct(0o666 & ~mask)
