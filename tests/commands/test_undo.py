"""`patch`'s write stage: one rewrite undone at a time, float16 rewrites shown exact on their own, stage costs.

A check that fails undoes only the rewrite(s) that make the difference (found by a search over the rewrites the
check covered, as `bisect` searches over prefixes), names each with the difference measured, and writes the rest;
a float16 rewrite is shown exact on the nodes around it when ORT CPU rounds them as in the whole models
(proofs/precision.py); the report gives each stage's wall time and peak RSS.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from helpers import ENTRY_POINTS, FIXTURES, assert_bytes_equal
from helpers import run as run_command
from helpers.bands import LEVELS, KiB, bands_actions, feeds_for, over, run
from helpers.graphs import decoder_tail

from deform_surgeon import patch
from deform_surgeon.commands.cli import main as cli_main
from deform_surgeon.commands.patch import PatchRun
from deform_surgeon.graph.pipeline import Outcome

LIMIT = 300 * KiB  # the decoder tail's four rewrites (test_bands.py)


def _scale(graph: gs.Graph, node: gs.Node, by: float) -> None:
    """`node`'s output multiplied by `by`: a Mul after it, which its readers read instead."""
    out = node.outputs[0]
    raw = gs.Variable(f"{out.name}/planted", dtype=out.dtype, shape=out.shape)
    node.outputs[0] = raw
    graph.nodes.append(gs.Node("Mul", f"{node.name}/planted", inputs=[raw, gs.Constant(
        f"{node.name}/planted_by", np.array(by, np.float32))], outputs=[out]))


def _plant_wrong(monkeypatch, node: str, proofs: bool = False) -> list[str]:
    """Every lift of the decoder tail gets one wrong rewrite: the first band Conv made for `node` reads its weights
    scaled by 1.001 (a rewrite whose proof was wrong). Without `proofs`, no rewrite is shown exact on its own, so
    all four are left to the whole-model check. Returns the lifts' planted node names (one per lift with it)."""
    real_lift = PatchRun.lift_once
    planted: list[str] = []

    def lift_with_a_wrong_rewrite(run):
        lifted = real_lift(run)
        act = next((a for a in lifted.actions if a.node == node and a.action == Outcome.REWRITTEN), None)
        if act is not None:
            made = set(act.new_nodes)
            conv = next(n for n in lifted.graph.nodes if n.name in made and n.op == "Conv")
            _scale(lifted.graph, conv, 1.001)
            planted.append(conv.name)
        return lifted

    monkeypatch.setattr(PatchRun, "lift_once", lift_with_a_wrong_rewrite)
    if not proofs:
        monkeypatch.setattr(PatchRun, "prove", lambda run: None)
    return planted


def test_a_wrong_rewrite_planted_among_correct_ones_is_the_only_one_undone(tmp_path, monkeypatch):
    """Four rewrites left to the whole-model check, one of them planted wrong: the check differs, the search finds
    that one (named with the difference it measured), undoes it alone, and the other three are written, shown
    exact on the whole model; the written file gives the original's bytes at both levels."""
    planted = _plant_wrong(monkeypatch, "Conv_att_conv1")
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    onnx.save(decoder_tail(), src)
    report = patch(src, out, max_buffer=LIMIT)
    acts = {a.node: a for a in bands_actions(report.actions)}
    wrong = acts["Conv_att_conv1"]
    assert wrong.action == Outcome.REFUSED and wrong.details["undone"] == "whole_model"
    assert wrong.details["level"] == "all" and "differs (max |diff|" in wrong.details["difference"]
    assert ("found by a search over the 4 rewrite(s) the check covered, with every input and thread count the check "
            "ran, the others kept") in wrong.reason and "with it alone undone it did not" in wrong.reason
    others = [a for name, a in acts.items() if name != "Conv_att_conv1"]
    assert len(others) == 3 and all(a.action == Outcome.REWRITTEN and a.details["shown_exact"] == "whole_model"
                                    for a in others)
    assert "1 rewrite(s) undone (1 bands): not shown exact (see their lines); the others written" in report.note
    assert report.written and planted  # (the planted node was in the lifts the search made)
    patched = onnx.load(out)
    assert not any(n.name.startswith("Conv_att_conv1/") for n in patched.graph.node)  # kept whole
    assert any(n.name.startswith("Conv_mask/") for n in patched.graph.node)  # the others written
    assert over(str(out), LIMIT) == ["att_cat"]  # only what the undone rewrite would have fitted
    model = onnx.load(src)
    for seed in (0, 1):
        feeds = feeds_for(model, seed)
        for level in LEVELS:
            assert_bytes_equal(run(model, feeds, level), run(str(out), feeds, level))
    stages = [s["stage"] for s in report.stages]
    assert stages[:5] == ["lift", "prove", "export", "write", "verify"] and stages[5] == "undo"


def test_two_wrong_rewrites_are_both_found(tmp_path, monkeypatch):
    """Two planted wrong: each found by its own search, both undone, the other two written."""
    _plant_wrong(monkeypatch, "Conv_att_conv1")
    second = PatchRun.lift_once

    def and_the_mask(run):
        lifted = second(run)
        act = next((a for a in lifted.actions if a.node == "Conv_mask" and a.action == Outcome.REWRITTEN), None)
        if act is not None:
            conv = next(n for n in lifted.graph.nodes if n.name in set(act.new_nodes) and n.op == "Conv")
            _scale(lifted.graph, conv, 0.999)
        return lifted

    monkeypatch.setattr(PatchRun, "lift_once", and_the_mask)
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    onnx.save(decoder_tail(), src)
    report = patch(src, out, max_buffer=LIMIT)
    acts = {a.node: a for a in bands_actions(report.actions)}
    assert {n for n, a in acts.items() if a.action == Outcome.REFUSED} == {"Conv_att_conv1", "Conv_mask"}
    assert {n for n, a in acts.items() if a.action == Outcome.REWRITTEN} == {"Conv_ipt_conv_out", "Resize_dec_up"}
    assert report.written
    model = onnx.load(src)
    feeds = feeds_for(model, 0)
    for level in LEVELS:
        assert_bytes_equal(run(model, feeds, level), run(str(out), feeds, level))


def _verify_inputs(path: Path, tensor: str, iterations: int = 3) -> list[float]:
    """The largest value of `tensor` (a graph input, or one the model computes) on each of `verify`'s seeded
    inputs (polygraphy's DataLoader, seed and ranges as `verify` makes them): what a rewrite visible on one input
    only is planted by."""
    from polygraphy.comparator import DataLoader

    from deform_surgeon.checks.verify import DEFAULT_SEED, default_val_ranges

    probe = onnx.load(path)
    probe.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None))
    from polygraphy.common import TensorMetadata

    meta = TensorMetadata()
    for vi in probe.graph.input:
        meta.add(vi.name, np.float32, tuple(d.dim_value for d in vi.type.tensor_type.shape.dim))
    loader = DataLoader(seed=DEFAULT_SEED, iterations=iterations, val_range=default_val_ranges(path),
                        input_metadata=meta)
    import onnxruntime as ort

    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    return [float(session.run([tensor], dict(feeds))[0].max()) for feeds in loader]


def test_a_rewrite_wrong_on_the_second_input_only_is_found_with_it_and_no_exact_one_is_undone(tmp_path,
                                                                                               monkeypatch):
    """Two wrong rewrites planted among four, one of them wrong only where the image peaks past a value that input
    0 of `verify`'s seeded inputs does not reach and input 1 does: the check (3 inputs) fails on input
    1, and the search, asking with every input it ran, finds both, each blamed with the difference measured with
    it applied (iteration 1 for the second); the two exact ones are kept and written."""
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    model = decoder_tail()
    onnx.save(model, src)
    peaks = _verify_inputs(src, "image")
    assert peaks[1] != peaks[0]
    threshold = (peaks[0] + peaks[1]) / 2
    _plant_wrong(monkeypatch, "Conv_att_conv1")
    first = PatchRun.lift_once

    def and_the_mask_on_input_one(run):
        lifted = first(run)
        act = next((a for a in lifted.actions if a.node == "Conv_mask" and a.action == Outcome.REWRITTEN), None)
        if act is not None:  # y * (1.001 where max(x) is past the threshold on input 1's side, else 1)
            conv = next(n for n in lifted.graph.nodes if n.name in set(act.new_nodes) and n.op == "Conv")
            out_t = conv.outputs[0]
            raw = gs.Variable(f"{out_t.name}/planted", dtype=out_t.dtype, shape=out_t.shape)
            conv.outputs[0] = raw
            peak, past, by = (gs.Variable(f"{conv.name}/{k}") for k in ("peak", "past", "by"))
            compare = "Greater" if peaks[1] > peaks[0] else "Less"
            lifted.graph.nodes += [
                gs.Node("ReduceMax", f"{conv.name}/peak", {"keepdims": 0}, [lifted.graph.tensors()["image"]],
                        [peak]),
                gs.Node(compare, f"{conv.name}/past", inputs=[peak, gs.Constant(f"{conv.name}/threshold", np.array(
                    threshold, np.float32))], outputs=[past]),
                gs.Node("Where", f"{conv.name}/by", inputs=[past, gs.Constant(f"{conv.name}/off", np.array(
                    1.001, np.float32)), gs.Constant(f"{conv.name}/one", np.array(1, np.float32))], outputs=[by]),
                gs.Node("Mul", f"{conv.name}/planted", inputs=[raw, by], outputs=[out_t])]
        return lifted

    monkeypatch.setattr(PatchRun, "lift_once", and_the_mask_on_input_one)
    report = patch(src, out, max_buffer=LIMIT)
    acts = {a.node: a for a in bands_actions(report.actions)}
    assert {n for n, a in acts.items() if a.action == Outcome.REFUSED} == {"Conv_att_conv1", "Conv_mask"}
    assert {n for n, a in acts.items() if a.action == Outcome.REWRITTEN} == {"Conv_ipt_conv_out", "Resize_dec_up"}
    mask = acts["Conv_mask"]
    assert "(iteration 1" in mask.details["difference"] and "with it alone undone it did not" in mask.reason
    assert "(iteration 0" in acts["Conv_att_conv1"].details["difference"]
    kept = [acts["Conv_ipt_conv_out"], acts["Resize_dec_up"]]
    assert all(a.details["shown_exact"] == "whole_model" and "3 input(s)" in a.reason for a in kept)
    for seed in (0, 1):
        feeds = feeds_for(model, seed)
        for level in LEVELS:
            assert_bytes_equal(run(model, feeds, level), run(str(out), feeds, level))


def test_with_verify_the_rewrites_not_shown_on_their_own_are_still_checked_at_their_thread_counts(tmp_path,
                                                                                                    monkeypatch):
    """`--verify` is the user's comparison, at ORT's default thread count; rewrites left to the whole-model check
    are also compared at their proofs' thread-count classes (a comparison at the default count alone showed them
    exact at that count only), and their lines say where."""
    _plant_wrong(monkeypatch, "no such node")  # (nothing planted: every proof skipped)
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    onnx.save(decoder_tail(), src)
    report = patch(src, out, max_buffer=LIMIT, verify=True)
    assert report.verification.identical and report.verification.threads is None  # the user's, as asked
    kept = [a for a in bands_actions(report.actions) if a.action == Outcome.REWRITTEN]
    assert kept and all(a.details["shown_exact"] == "whole_model" for a in kept)
    for a in kept:
        assert "ORT's default intra-op threads" in a.reason and len(a.details["threads"]) > 1, a.reason
        assert re.search(r"level 'all', 3 input\(s\), intra-op threads \d+(, \d+)+", a.reason), a.reason


def test_a_difference_none_of_the_rewrites_makes_is_not_blamed_on_them(tmp_path, monkeypatch):
    """When the model differs with every checked rewrite undone (here an exact-by-construction pass made wrong),
    no rewrite is blamed: the patch fails as a failed verification does, and nothing is written."""
    from deform_surgeon.base.errors import VerificationError

    _plant_wrong(monkeypatch, "Conv_att_conv1")
    real_lift = PatchRun.lift_once

    def everything_wrong(run):
        lifted = real_lift(run)
        relu = next(n for n in lifted.graph.nodes if n.op == "Relu")
        relu.op = "Sigmoid"  # outside any rewrite the search can undo
        return lifted

    monkeypatch.setattr(PatchRun, "lift_once", everything_wrong)
    src, out = tmp_path / "tail.onnx", tmp_path / "tail.patched.onnx"
    onnx.save(decoder_tail(), src)
    with pytest.raises(VerificationError, match="patched model differs from the original, not written"):
        patch(src, out, max_buffer=LIMIT)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["tail.onnx"]


def test_the_report_gives_each_stage_its_time_and_peak(tmp_path, capsys):
    """`--report` JSON and the terminal report: each stage in order, its wall time and peak RSS read from the
    process (a positive number of bytes), the child processes' largest."""
    src = FIXTURES / "decoder_gathernd_fp16.onnx"
    out, report_json = tmp_path / "out.onnx", tmp_path / "report.json"
    assert cli_main(["patch", str(src), str(out), "--max-buffer", "110000", "--report", str(report_json)]) == 0
    stages = json.loads(report_json.read_text())["stages"]
    assert [s["stage"] for s in stages] == ["lift", "prove", "export", "write", "verify"]
    assert all(s["seconds"] >= 0 and s["peak_rss_bytes"] > 10**6 and s["children_peak_rss_bytes"] >= 0
               for s in stages)
    printed = capsys.readouterr().out
    assert "stages (wall time / peak RSS reached by its end): lift " in printed and ", verify " in printed


def _stderr_on_a_terminal(*args: str, cwd: Path) -> tuple[int, str, str]:
    """The command with its stderr on a pseudo-terminal (as at a user's shell), stdout a pipe: exit code, stderr,
    stdout. The terminal is read until the command closes it, then the command is waited for."""
    import pty
    import subprocess

    master, slave = pty.openpty()
    proc = subprocess.Popen([*ENTRY_POINTS["module"], *args], cwd=cwd, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # (Linux: EIO once the other end is closed)
            break
        if not data:
            break
        err += data
    os.close(master)
    out = proc.stdout.read()
    proc.stdout.close()
    return proc.wait(), err.decode().replace("\r\n", "\n"), out.decode()


def test_a_patch_on_a_terminal_shows_each_stage_and_step(tmp_path):
    """On a terminal `patch` says, while it runs, each stage it enters and each proof it runs (with the stage's
    time so far and the memory in use), so a user waiting minutes sees it move; in a pipe, and with
    `--no-progress`, stderr stays empty (the report on stdout is the same either way)."""
    src = FIXTURES / "decoder_gathernd.onnx"
    code, err, out = _stderr_on_a_terminal("patch", str(src), str(tmp_path / "a.onnx"), "--max-buffer", "40000",
                                           cwd=tmp_path)
    assert code == 3, err  # (a tensor stays over so small a limit: refused as a finding, written all the same)
    lines = err.splitlines()
    assert [x for x in lines if re.fullmatch(r"deform-surgeon: \w+", x)][:4] == [
        f"deform-surgeon: {s}" for s in ("lift", "prove", "export", "write")]
    proofs = [x for x in lines if "local proof" in x]
    assert proofs and all(re.fullmatch(r"deform-surgeon: prove \d+ s, .* resident: local proof \d+ of \d+: "
                                       r"split '\w+'", x) for x in proofs), lines
    piped = run_command("patch", src, tmp_path / "b.onnx", "--max-buffer", "40000", cwd=tmp_path)
    quiet = _stderr_on_a_terminal("patch", str(src), str(tmp_path / "c.onnx"), "--max-buffer", "40000",
                                  "--no-progress", cwd=tmp_path)
    assert (piped.returncode, piped.stderr) == (3, "") and quiet[:2] == (3, "")
    same = re.compile(r"stages \(.*|wrote .*|/tmp/\S+")  # (times and paths differ between the runs)
    assert same.sub("", piped.stdout) == same.sub("", out) == same.sub("", quiet[2])
