"""One verdict vocabulary (deform_surgeon/checks/verdict.py) and the repeated runtime errors shown once.

The verdicts are judged from `compare_outputs` entries of real arrays; the error summary from the real error text
JSEP gave for the unpatched 64x64 fixture (tests/fixtures/jsep_gathernd_run_error.txt, from `deform-surgeon
placement --compare tests/fixtures/decoder_gathernd.onnx PATCHED --run --runtime browser --bundle jsep`), and its JS
copy in placement/harness_node_and_page.mjs is run by node on the same text.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from deform_surgeon.checks.verdict import GPU_TOLERANCE, combine, judge, judge_outputs, split_errors, summarize_errors
from deform_surgeon.webgpu.placement.command import format_comparison, format_placement
from deform_surgeon.webgpu.placement.logparse import LogSummary
from deform_surgeon.webgpu.placement.result import Placement
from deform_surgeon.webgpu.placement.runner import compare_outputs

FIXTURES = Path(__file__).parents[1] / "fixtures"
HARNESS = Path(__file__).parents[2] / "deform_surgeon" / "webgpu" / "placement" / "harness_node_and_page.mjs"
JSEP_ERROR = (FIXTURES / "jsep_gathernd_run_error.txt").read_text()


def _entry(got: np.ndarray, ref: np.ndarray) -> dict:
    return compare_outputs({"y": got}, {"y": ref})["y"]


REF = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)


def test_byte_identical() -> None:
    for same_runtime in (True, False):
        v = judge(_entry(REF.copy(), REF), same_runtime=same_runtime)
        assert (v.kind, v.passed, v.text, v.short) == ("byte-identical", True, "byte-identical (max |diff| 0)",
                                                       "byte-identical")


def test_a_gpu_run_within_the_tolerance_agrees_and_shows_its_number() -> None:
    got = REF.copy()
    got[1, 2] = np.nextafter(got[1, 2], np.float32(2))  # one ulp: what a GPU's other summation order gives
    d = float(abs(np.float64(got[1, 2]) - np.float64(REF[1, 2])))
    v = judge(_entry(got, REF), same_runtime=False)
    assert v.kind == "agrees" and v.passed and v.max_abs_diff == d
    assert v.text == f"agrees with ORT CPU within the GPU tolerance (max |diff| {d:.3g}, tolerance 0.001)"
    assert v.short == f"agrees ({d:.3g} <= 0.001)"
    # the same difference on the same runtime (verify, patched vs original) is not allowed
    v = judge(_entry(got, REF), same_runtime=True)
    assert not v.passed and v.text == f"differs (max |diff| {d:.3g} > 0)"


def test_beyond_the_tolerance_differs() -> None:
    got = REF + np.float32(0.25)
    v = judge(_entry(got, REF), same_runtime=False)
    assert not v.passed and v.text == "differs (max |diff| 0.25 > 0.001)" and v.short == v.text
    half = REF.astype(np.float16)
    v = judge(_entry(half + np.float16(0.005), half), same_runtime=False)  # float16: tolerance 1e-2
    assert v.passed and v.tolerance == GPU_TOLERANCE["float16"]


def test_what_a_number_does_not_show_differs_with_its_reason() -> None:
    neg = REF.copy()
    neg[0, 0], ref0 = -0.0, REF.copy()
    ref0[0, 0] = 0.0
    v = judge(_entry(neg, ref0), same_runtime=True)
    assert v.text == "differs (max |diff| 0; equal values with other bytes (-0.0 vs +0.0 or NaN payloads))"
    nan = REF.copy()
    nan[2, 3] = np.nan
    v = judge(_entry(nan, REF), same_runtime=False)
    assert not v.passed and "1 non-finite value(s) differ" in v.text
    v = judge(_entry(REF.reshape(4, 3), REF), same_runtime=False)
    assert v.text == "differs (float32 [4, 3] vs ORT CPU's float32 [3, 4])"
    v = judge(compare_outputs({}, {"y": REF})["y"], same_runtime=False)
    assert v.text == "differs (output missing)"


def test_combine_takes_the_worst_output() -> None:
    close = REF.copy()
    close[0, 1] += np.float32(1e-6)
    vs = judge_outputs(compare_outputs({"a": REF.copy(), "b": close}, {"a": REF, "b": REF}), same_runtime=False)
    assert [v.kind for v in vs.values()] == ["byte-identical", "agrees"]
    assert combine(vs.values()).kind == "agrees" and combine([]) is None


def _placement(run: dict | None, error: str | None = None) -> Placement:
    return Placement(runtime="browser", bundle="jsep", session_ok=True, error=None, log=LogSummary(), adapter=None,
                     run=run if error is None else {**(run or {}), "ok": False, "error": error})


def test_placement_prints_the_same_verdict_with_its_number() -> None:
    got = REF.copy()
    got[0, 0] += np.float32(8.9e-7)
    outputs = compare_outputs({"mask": got}, {"mask": REF})
    p = _placement({"ok": True, "error": None, "outputs": outputs, "identical": False})
    v = judge(outputs["mask"], same_runtime=False)
    assert f"  mask (float32 [3, 4]): {v.text}" in format_placement(p).splitlines()
    table = format_comparison(p, _placement({"ok": True, "error": None, "identical": True,
                                             "outputs": compare_outputs({"mask": REF.copy()}, {"mask": REF})}))
    (row,) = [ln for ln in table.splitlines() if ln.startswith("run vs ORT CPU")]
    assert row.split() == ["run", "vs", "ORT", "CPU", "agrees", f"({v.max_abs_diff:.3g}", "<=", "0.001)",
                           "byte-identical"]


def test_repeated_errors_are_counted_and_shown_once() -> None:
    errors = split_errors(JSEP_ERROR)
    assert len(errors) == 32
    assert summarize_errors(errors) == [
        "GPU validation error for kernel \"[GatherND] GatherND_106\": Error while parsing WGSL: :27:18 error: no "
        "matching constructor for 'i32(vec4<u32>)'",
        "GPU validation error for kernel \"[GatherND] GatherND_96\": [Invalid ComputePipeline \"computeSliceOffsets\"]"
        " is invalid due to a previous error. (x31)"]
    assert summarize_errors(["a", "b", "a"]) == ["a (x2)", "b"]
    assert split_errors("one error\n\nwith a paragraph") == ["one error\n\nwith a paragraph"]


def test_compare_table_comes_first_and_errors_are_not_repeated() -> None:
    """`placement --compare ... --run` on JSEP: the original's 32 kernel errors are two lines after the table."""
    ok = {"ok": True, "error": None, "identical": True,
          "outputs": compare_outputs({"mask": REF.copy()}, {"mask": REF})}
    text = format_comparison(_placement({"outputs": {}}, error=JSEP_ERROR), _placement(ok)).splitlines()
    assert text[0].split() == ["original", "patched"] and len(text) < 20, text
    tail = text[text.index("original run error: 32 errors, 2 distinct (full text: --json FILE)"):]
    assert len(tail) == 3 and tail[2].endswith("(x31)")


@pytest.mark.skipif(subprocess.run(["node", "--version"], capture_output=True).returncode != 0, reason="no node")
def test_the_pages_js_copy_gives_the_same_summary() -> None:
    script = ("import(process.argv[1]).then((m) => { const t = require('fs').readFileSync(0, 'utf8'); "
              "console.log(JSON.stringify({split: m.splitErrors(t).length, summary: m.summarizeErrors("
              "m.splitErrors(t))})); })")
    r = subprocess.run(["node", "-e", script, HARNESS.as_uri()], input=JSEP_ERROR, capture_output=True, text=True,
                       timeout=60, check=True)
    got = json.loads(r.stdout)
    assert got == {"split": len(split_errors(JSEP_ERROR)), "summary": summarize_errors(split_errors(JSEP_ERROR))}
