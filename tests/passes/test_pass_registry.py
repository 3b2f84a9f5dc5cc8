"""The pass registry and `--skip-pass`: the passes `patch` runs come from the registry, a skipped pass leaves
exactly its own rewrites out (and the result still verifies byte-identical), unknown names are refused in the CLI,
the Python API and batch manifests, and the report lists the passes that ran."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from helpers import FIXTURES, one_error_line, op_count, run, snapshot

import deform_surgeon as ds
from deform_surgeon.commands.patch import default_passes
from deform_surgeon.graph.pipeline import Refuse
from deform_surgeon.passes.registry import PASS_NAMES, REGISTRY, make_passes
from deform_surgeon.passes.run_state import RunState

WHOLE_MODEL_STEPS = {"input-shape", "fold", "slices"}  # model-level steps before the passes: not in the registry


def _rewrites(report: ds.PatchReport) -> dict[str, set[tuple[str, str]]]:
    """Pass name -> the (node, outcome) pairs it reported."""
    out: dict[str, set[tuple[str, str]]] = {}
    for a in report.actions:
        out.setdefault(a.pass_name, set()).add((a.node, str(a.action)))
    return out


def test_default_passes_are_the_registry_in_order():
    assert PASS_NAMES == ("deform_conv", "gathernd", "gather_elements", "residency", "sum_chain", "fit", "split",
                          "bands")
    assert [p.name for p in default_passes()] == list(PASS_NAMES)
    assert [type(p) for p in default_passes()] == [r.cls for r in REGISTRY]
    assert all(r.summary and "\n" not in r.summary for r in REGISTRY)
    state = RunState()
    split, bands = make_passes(state, ("deform_conv", "gathernd", "gather_elements", "residency", "sum_chain", "fit"))
    assert split.run_state is state and bands.run_state is state  # one run's passes share its state


def test_the_run_state_is_saved_and_restored_whole():
    """`RunState.snapshot` and `restore` cover every field, whatever it is named (the undo search lifts the model
    with some rewrites kept aside, then puts the run's state back as it was), a dict keeping its identity (a pass
    made for the run holds it); `start_lift` forgets the per-lift records only."""
    state = RunState()
    dicts = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if isinstance(getattr(state, f.name),
                                                                                              dict)}
    saved = state.snapshot()
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, dict):
            value["changed"] = Refuse("changed")
        else:
            setattr(state, f.name, not value)
    state.restore(saved)
    assert state == RunState() and all(getattr(state, name) is d for name, d in dicts.items())
    state.keep_whole["Conv_1"] = Refuse("kept whole")
    state.min_chunks["Conv_1"] = 3
    state.proofs["Conv_1"] = None
    state.rows["Conv_1"] = {}
    state.start_lift()
    assert (state.proofs, state.rows, state.min_chunks) == ({}, {}, {"Conv_1": 3}) and "Conv_1" in state.keep_whole


def test_every_action_of_a_patch_names_a_registered_pass(tmp_path):
    report = ds.patch(FIXTURES / "decoder_gathernd.onnx", tmp_path / "out.onnx", max_buffer=64 * 1024)
    assert report.written and report.actions
    assert {a.pass_name for a in report.actions} <= set(PASS_NAMES) | WHOLE_MODEL_STEPS


@pytest.mark.parametrize("fixture, skipped, op", [
    ("decoder_gathernd.onnx", "sum_chain", "Sum"),
    ("decoder_gathernd.onnx", "gathernd", "GatherND"),
    ("decoder_gatherelements.onnx", "gather_elements", "GatherElements"),
])
def test_skipping_a_pass_leaves_exactly_its_rewrites_out(tmp_path, fixture, skipped, op):
    src = FIXTURES / fixture
    full = ds.patch(src, tmp_path / "full.onnx", verify=True)
    part = ds.patch(src, tmp_path / "part.onnx", verify=True, skip_passes=[skipped])
    assert full.verification.identical and part.verification.identical  # byte for byte on ORT CPU
    before = op_count(onnx.load(src), op)
    assert before > 0 and full.ops_after.get(op, 0) == 0
    assert part.ops_after.get(op, 0) == before  # the pass's pattern is all still there
    done, left = _rewrites(full), _rewrites(part)
    assert done.get(skipped) and skipped not in left
    # every other pass did what it did before, but on the nodes the skipped pass built (the residency pass
    # rewrites the int32 Casts the gathernd pass makes: without those, it has nothing to do)
    built = {n for a in full.actions if a.pass_name == skipped for n in a.new_nodes}
    expected = {k: {(node, what) for node, what in v if node not in built} for k, v in done.items() if k != skipped}
    assert left == {k: v for k, v in expected.items() if v}
    assert part.passes == [n for n in PASS_NAMES if n != skipped] and full.passes == list(PASS_NAMES)


def test_skipping_every_pass_changes_nothing(tmp_path):
    report = ds.patch(FIXTURES / "decoder_gathernd.onnx", tmp_path / "out.onnx", skip_passes=list(PASS_NAMES))
    assert report.passes == [] and not report.actions and not report.written
    assert report.ops_after == report.ops_before


def test_the_report_names_the_passes_that_ran(tmp_path):
    out, js = tmp_path / "out.onnx", tmp_path / "r.json"
    proc = run("patch", FIXTURES / "decoder_gathernd.onnx", out, "--skip-pass", "sum_chain", "--skip-pass", "fit",
               "--report", js, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ran = [n for n in PASS_NAMES if n not in ("sum_chain", "fit")]
    assert f"passes: {', '.join(ran)} (skipped: sum_chain, fit)" in proc.stdout.splitlines()
    doc = json.loads(js.read_text())
    assert doc["passes"] == ran and doc["options"]["skip_passes"] == ["sum_chain", "fit"]
    assert op_count(onnx.load(out), "Sum") == op_count(onnx.load(FIXTURES / "decoder_gathernd.onnx"), "Sum") > 0
    plain = ds.inspect(FIXTURES / "decoder_gathernd.onnx")
    assert plain.passes == list(PASS_NAMES) and f"passes: {', '.join(PASS_NAMES)}" in plain.format().splitlines()
    assert plain.to_dict()["passes"] == list(PASS_NAMES)


def test_an_unknown_pass_is_refused_on_the_command_line(tmp_path):
    before = snapshot(tmp_path)
    for command in (["patch", FIXTURES / "decoder_gathernd.onnx", tmp_path / "out.onnx"],
                    ["inspect", FIXTURES / "decoder_gathernd.onnx"]):
        proc = run(*command, "--skip-pass", "sum_chian", cwd=tmp_path)
        assert proc.returncode == 2
        line = one_error_line(proc)
        assert "--skip-pass" in line and "sum_chian" in line and all(n in line for n in PASS_NAMES), line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("value", [["sum_chian"], "sum_chain", [1]])
def test_an_unknown_pass_is_refused_by_the_api(tmp_path, value):
    for call in (lambda: ds.patch(FIXTURES / "decoder_gathernd.onnx", tmp_path / "o.onnx", skip_passes=value),
                 lambda: ds.inspect(FIXTURES / "decoder_gathernd.onnx", skip_passes=value)):
        with pytest.raises(ds.SurgeonError) as exc:
            call()
        line = exc.value.one_line()
        assert "skip_passes" in line and ", ".join(PASS_NAMES) in line and "\n" not in line
    assert not (tmp_path / "o.onnx").exists()


def test_batch_manifests_take_skip_passes(tmp_path):
    src = FIXTURES / "decoder_gathernd.onnx"
    (tmp_path / "m.toml").write_text(f"""
[[model]]
input = "{src}"
output = "kept.onnx"
skip_passes = ["sum_chain"]

[[model]]
input = "{src}"
output = "bad.onnx"
skip_passes = ["sum_chian"]
""")
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "batch", "m.toml", "--no-progress",
                           "--summary", "s.json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the bad entry fails, alone
    assert op_count(onnx.load(tmp_path / "kept.onnx"), "Sum") == op_count(onnx.load(src), "Sum") > 0
    assert not (tmp_path / "bad.onnx").exists()
    assert re.search(r"unknown pass 'sum_chian' in option skip_passes \(known passes: deform_conv, ", proc.stdout)
    report = json.loads((tmp_path / "kept.report.json").read_text())
    assert "sum_chain" not in report["passes"] and report["options"]["skip_passes"] == ["sum_chain"]

    (tmp_path / "d.toml").write_text(f'[defaults]\nskip_passes = ["nope"]\n[[model]]\ninput = "{src}"\n')
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "batch", "d.toml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "[defaults]: unknown pass 'nope' in option skip_passes" in one_error_line(proc)


def test_batch_command_line_skip_pass_applies_to_every_entry(tmp_path):
    src = Path(FIXTURES / "sum_only.onnx")
    proc = subprocess.run([sys.executable, "-m", "deform_surgeon", "batch", "--glob", str(src), "--out-dir",
                           str(tmp_path), "--skip-pass", "sum_chain", "--copy-unchanged", "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert op_count(onnx.load(tmp_path / "sum_only.patched.onnx"), "Sum") == op_count(onnx.load(src), "Sum") > 0
