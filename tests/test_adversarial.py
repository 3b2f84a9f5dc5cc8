"""The holes an adversarial run found, as a table: each case must end with its exit code, ONE stderr line
naming the file and the problem, no traceback, the inputs' bytes unchanged and nothing left behind.

Every case prepares files in an empty folder (the working directory) and returns the command line, the exit code,
the file the error line must start with (None: no file) and a regex the problem must match. Cases that need more
than one line or more than one process (signals, batch) follow the table.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import graphs
import numpy as np
import onnx
import pytest
from helpers import ERROR_PREFIX, FIXTURES, copy_fixture, run
from onnx import TensorProto, helper

DS = [sys.executable, "-m", "deform_surgeon"]


def state(folder: Path) -> dict[str, tuple]:
    """Every entry below `folder` (hidden ones included): bytes and mtime of regular files, the kind of others
    (a FIFO is never opened)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            st = p.lstat()
            out[str(p.relative_to(folder))] = (p.read_bytes() if stat.S_ISREG(st.st_mode) else stat.S_IFMT(st.st_mode),
                                               st.st_mtime_ns)
    return out


def external(folder: Path, name: str = "model.onnx", location: str = "w.data") -> Path:
    """A small rewritable model with every weight in one external data file."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    onnx.save(graphs.exporter_like(H=30, W=40, C=8), path, save_as_external_data=True, all_tensors_to_one_file=True,
              location=location, size_threshold=0)
    return path


# ---------------------------------------------------------------------------------------------------- the table
def _out_is_input_data(d: Path):
    external(d / "x")
    return ["patch", "x/model.onnx", "x/w.data"], 2, "x/w.data", r"OUT would overwrite the input's data"


def _report_is_input_data(d: Path):
    external(d / "x")
    return (["patch", "x/model.onnx", "y.onnx", "--report", "x/w.data"], 2, "x/w.data",
            r"--report would overwrite the input's data: it is an external data file of x/model\.onnx")


def _inspect_json_is_input_data(d: Path):
    external(d / "x")
    return ["inspect", "x/model.onnx", "--json", "x/w.data"], 2, "x/w.data", r"--json would overwrite the input's"


def _budget_json_is_input_data(d: Path):
    external(d / "x")
    return ["budget", "x/model.onnx", "--json", "x/w.data"], 2, "x/w.data", r"--json would overwrite the input's"


def _verify_json_is_input_data(d: Path):
    external(d / "x")
    return (["verify", "x/model.onnx", "x/model.onnx", "--json", "x/w.data"], 2, "x/w.data",
            r"--json would overwrite the input's")


def _report_is_outputs_data(d: Path):
    external(d / "x")
    return (["patch", "x/model.onnx", "y.onnx", "--verify", "--report", "y.onnx.data"], 2, "y.onnx.data",
            r"--report is also OUT's external data file")


def _report_hard_link_to_input(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    os.link(d / "model.onnx", d / "alias.json")
    return (["patch", "model.onnx", "out.onnx", "--report", "alias.json"], 2, "alias.json",
            r"--report is the input model")


def _report_is_dev_null(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return ["patch", "model.onnx", "out.onnx", "--report", "/dev/null"], 2, "/dev/null", r"--report is a device"


def _out_is_dev_null(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return ["patch", "model.onnx", "/dev/null"], 2, "/dev/null", r"OUT is a device, not a regular file"


def _json_is_fifo(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    os.mkfifo(d / "pipe.json")
    return ["inspect", "model.onnx", "--json", "pipe.json"], 2, "pipe.json", r"--json is a FIFO"


def _data_symlink_leaves_the_folder(d: Path):
    external(d, "model.onnx", "w.data")
    (d / "x").mkdir()
    (d / "model.onnx").rename(d / "x" / "model.onnx")
    (d / "x" / "w.data").symlink_to("../w.data")
    return (["patch", "x/model.onnx", "y.onnx"], 2, "x/model.onnx",
            r"external data file 'w\.data' .* is a link to .*, outside the model's folder")


def _fifo_input(d: Path):
    os.mkfifo(d / "pipe.onnx")
    return ["patch", "pipe.onnx", "out.onnx"], 2, "pipe.onnx", r"is a FIFO, not a regular file"


def _fifo_input_to_inspect(d: Path):
    os.mkfifo(d / "pipe.onnx")
    return ["inspect", "pipe.onnx"], 2, "pipe.onnx", r"is a FIFO, not a regular file"


def _fifo_input_to_verify(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    os.mkfifo(d / "pipe.onnx")
    return ["verify", "model.onnx", "pipe.onnx"], 2, "pipe.onnx", r"is a FIFO, not a regular file"


def _negative_offset(d: Path, command: str = "patch"):
    path = external(d)
    model = onnx.load(str(path), load_external_data=False)
    entry = next(e for e in model.graph.initializer[0].external_data if e.key == "offset")
    entry.value = "-5"
    onnx.save(model, path)
    argv = ["patch", "model.onnx", "out.onnx"] if command == "patch" else ["inspect", "model.onnx"]
    return argv, 2, "model.onnx", r"negative offset"


def _negative_offset_inspect(d: Path):
    return _negative_offset(d, "inspect")


def _val_range_not_numbers(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return (["patch", "model.onnx", "out.onnx", "--verify", "--val-range", "[a,b]"], 2, None,
            r"bad --val-range '\[a,b\]'")


def _bad_int_option(d: Path):
    return ["patch", "model.onnx", "--iterations", "x"], 2, None, r"argument --iterations: invalid int value: 'x'"


def _missing_argument(d: Path):
    return ["verify", "model.onnx"], 2, None, r"required: patched .*see `deform-surgeon verify --help`"


def _bad_choice(d: Path):
    return ["inspect", "m.onnx", "--sum-mode", "fast"], 2, None, r"argument --sum-mode: invalid choice: 'fast'"


def _patched_model_cannot_run(d: Path):
    onnx.save(graphs.exporter_like(source=graphs.UNCLAMPED, margin=2), d / "m.onnx")
    # negative indices in [-H, -1] are valid for the original GatherND; linearised they leave the data
    return (["patch", "m.onnx", "out.onnx", "--allow-unproven", "--verify", "--val-range", "offset:[-8,-6]",
             "data:[0,1]"], 1, "out.onnx", r"the patched model fails to run on ORT CPU .*where the original runs")


def _verify_options_in_batch_manifest(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    (d / "m.toml").write_text('[defaults]\nopt_level = "max"\n[[model]]\ninput = "model.onnx"\n')
    return ["batch", "m.toml", "--no-progress"], 2, "m.toml", r"\[defaults\]: option opt_level = 'max' should be one of"


def _placement_json_is_the_model(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return ["placement", "model.onnx", "--json", "model.onnx"], 2, "model.onnx", r"--json is the input model"


def _placement_limits_out_is_dev_null(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return (["placement", "model.onnx", "--device-limits-out", "/dev/null"], 2, "/dev/null",
            r"--device-limits-out is a device, not a regular file")


def _device_profile_missing(d: Path):
    copy_fixture("sum_only.onnx", d, "model.onnx")
    return ["patch", "model.onnx", "out.onnx", "--device-profile", "gpu.json"], 2, "gpu.json", r"no such"


CASES = [_placement_json_is_the_model, _placement_limits_out_is_dev_null, _device_profile_missing,
         _out_is_input_data, _report_is_input_data, _inspect_json_is_input_data, _budget_json_is_input_data,
         _verify_json_is_input_data, _report_is_outputs_data, _report_hard_link_to_input, _report_is_dev_null,
         _out_is_dev_null, _json_is_fifo, _data_symlink_leaves_the_folder, _fifo_input, _fifo_input_to_inspect,
         _fifo_input_to_verify, _negative_offset, _negative_offset_inspect, _val_range_not_numbers, _bad_int_option,
         _missing_argument, _bad_choice, _patched_model_cannot_run, _verify_options_in_batch_manifest]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_adversarial_case(tmp_path, case):
    argv, code, named, problem = case(tmp_path)
    before = state(tmp_path)
    proc = subprocess.run([*DS, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), proc.stderr
    line = lines[0][len(ERROR_PREFIX):]
    if named is not None:
        assert line.startswith(f"{named}: "), line
    assert re.search(problem, line), line
    assert state(tmp_path) == before  # inputs unchanged; no output, report or temporary file


def test_help_still_prints_the_usage(tmp_path):
    proc = run("patch", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: deform-surgeon patch") and not proc.stderr


# ------------------------------------------------------------------------------------------ not one-line cases
def test_a_long_output_name_works(tmp_path):
    """OUT names of up to 255 bytes: the temporary names next to them stay short."""
    copy_fixture("sum_only.onnx", tmp_path, "model.onnx")
    for length in (236, 255):
        out = "o" * (length - 5) + ".onnx"
        proc = run("patch", "model.onnx", out, "--report", "r.json", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / out).is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.onnx", out, "r.json"])
        (tmp_path / out).unlink()


def test_non_utf8_names_with_verify(tmp_path):
    copy_fixture("sum_only.onnx", tmp_path, "model.onnx")
    proc = subprocess.run([*DS, "patch", "model.onnx", b"out\xff.onnx", "--verify", "--report", b"r\xfe.json"],
                          cwd=tmp_path, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr
    assert sorted(os.listdir(bytes(tmp_path))) == [b"model.onnx", b"out\xff.onnx", b"r\xfe.json"]


def test_verify_of_models_with_different_inputs_says_the_inputs_differ(tmp_path):
    copy_fixture("sum_only.onnx", tmp_path, "a.onnx")
    onnx.save(graphs.sum_only(shape=(3, 2)), tmp_path / "b.onnx")
    proc = run("verify", "a.onnx", "b.onnx", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verify: FAILED: the models' inputs differ" in proc.stdout and "bytes differ" not in proc.stdout


def test_generated_names_do_not_collide_with_subgraph_names(tmp_path):
    """A valid model whose If branch holds a tensor named like a name the patch generates (exit 2 "SSA" before)."""
    model = graphs.sum_only()
    onnx.save(model, tmp_path / "plain.onnx")
    assert run("patch", "plain.onnx", "plain.out.onnx", cwd=tmp_path).returncode == 0
    generated = sorted(_tensor_names(onnx.load(tmp_path / "plain.out.onnx")) - _tensor_names(model))
    assert generated
    taken = generated[0]
    branch = helper.make_graph([helper.make_node("Identity", ["k"], [taken])], "branch", [],
                               [helper.make_tensor_value_info(taken, TensorProto.FLOAT, [1])],
                               [onnx.numpy_helper.from_array(np.ones(1, np.float32), "k")])
    model.graph.node.append(helper.make_node("If", ["cond"], ["if_out"], then_branch=branch, else_branch=branch))
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    model.graph.output.append(helper.make_tensor_value_info("if_out", TensorProto.FLOAT, [1]))
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, tmp_path / "m.onnx")
    proc = run("patch", "m.onnx", "out.onnx", "--verify", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert taken not in _tensor_names(onnx.load(tmp_path / "out.onnx"))


def _tensor_names(model: onnx.ModelProto) -> set[str]:
    """Main-graph node outputs and initializers."""
    return {o for n in model.graph.node for o in n.output} | {t.name for t in model.graph.initializer}


# --------------------------------------------------------------------------------------------------- signals
def _signal_during(tmp_path: Path, argv: list, wait_for: str, sig: int = signal.SIGTERM
                   ) -> subprocess.CompletedProcess:
    """Start a command, send `sig` as soon as a file whose name starts with `wait_for` appears, wait for the end."""
    proc = subprocess.Popen([*DS, *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(wait_for) for p in tmp_path.iterdir()):
            break
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_during_patch_leaves_no_temporary_file(tmp_path):
    """SIGTERM is handled like Ctrl-C: the temporary model and data files are removed, exit 143, one line."""
    onnx.save(onnx.load(FIXTURES / "decoder_gathernd.onnx"), tmp_path / "model.onnx", save_as_external_data=True,
              location="w.data", size_threshold=4096)  # conv weights external, shape constants embedded
    before = state(tmp_path)
    for _ in range(3):
        proc = _signal_during(tmp_path, ["patch", "model.onnx", "out.onnx", "--verify"], ".out.onnx")
        assert proc.returncode in (143, 0), proc.stderr  # 0: it finished before the signal landed
        assert "Traceback" not in proc.stderr
        left = {k for k in state(tmp_path) if k not in before}
        assert left <= {"out.onnx", "out.onnx.data"}, left  # a finished output, never a temporary
        if proc.returncode == 143:
            assert not left and proc.stderr.strip() == "deform-surgeon: terminated", proc.stderr
        for name in left:
            (tmp_path / name).unlink()


def test_sigterm_stops_a_batch_and_its_workers(tmp_path):
    for k in range(4):
        external(tmp_path, f"m{k}.onnx", f"m{k}.data")
    before = state(tmp_path)
    proc = _signal_during(tmp_path, ["batch", "--glob", "m*.onnx", "--jobs", "2", "--verify", "--no-progress"],
                          ".m0.patched")
    assert proc.returncode == 143, proc.stdout + proc.stderr
    time.sleep(3)  # a worker that went on would write its output now
    left = {k for k in state(tmp_path) if k not in before}
    assert not {n for n in left if n.startswith(".") or "tmp" in n}, left  # no temporaries
    assert not {n for n in left if n.endswith(".report.json")}, left  # stopped before the reports
    for name in left:  # what a worker finished before the signal is complete: a model and its data
        assert name.endswith((".patched.onnx", ".patched.onnx.data")), left


# ------------------------------------------------------------------------------------------------------ batch
def _summary_rows(stdout: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"^\s+(\d+)\s+\S+.*$", stdout, re.M)}


def test_batch_entry_may_not_write_another_models_data_file(tmp_path):
    external(tmp_path / "a")
    copy_fixture("sum_only.onnx", tmp_path, "b.onnx")
    (tmp_path / "m.toml").write_text('[[model]]\ninput = "b.onnx"\noutput = "a/w.data"\n'
                                     '[[model]]\ninput = "a/model.onnx"\noutput = "a.patched.onnx"\n')
    before = state(tmp_path / "a")
    proc = run("batch", "m.toml", "--jobs", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _summary_rows(proc.stdout)
    assert rows["1"].split()[1] == "failed" and re.search(r"a/w\.data: the output of entry 1 .* would overwrite the "
                                                          r"input's data: it is an external data file of .*a/model",
                                                          rows["1"]), proc.stdout
    assert rows["2"].split()[1] == "ok", proc.stdout
    assert state(tmp_path / "a") == before  # the first model's weights are intact


def test_batch_options_like_the_command_line_and_errors_that_name_the_entry(tmp_path):
    copy_fixture("sum_only.onnx", tmp_path, "model.onnx")
    (tmp_path / "m.toml").write_text(
        '[[model]]\ninput = "model.onnx"\noutput = "a.onnx"\nmax_buffer = "256MiB"\n'
        '[[model]]\ninput = "model.onnx"\noutput = "b.onnx"\niterations = 0\n'
        '[[model]]\ninput = "model.onnx"\noutput = "c.onnx"\nval_range = { x0 = [1, 0] }\n'
        '[[model]]\ninput = "model.onnx"\noutput = "d.onnx"\nopt_level = "max"\n')
    proc = run("batch", "m.toml", "--jobs", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    rows = _summary_rows(proc.stdout)
    assert rows["1"].split()[1] == "ok", proc.stdout
    assert re.search(r"m\.toml, \[\[model\]\] #2: option iterations = 0 should be at least 1", rows["2"])
    assert re.search(r"m\.toml, \[\[model\]\] #3: val_range\.x0 = \[1, 0\] should be finite with lo <= hi", rows["3"])
    assert re.search(r"m\.toml, \[\[model\]\] #4: option opt_level = 'max' should be one of", rows["4"])
    assert not any((tmp_path / n).exists() for n in ("b.onnx", "c.onnx", "d.onnx", "b.report.json"))


def test_python_api_errors_are_surgeon_errors(tmp_path):
    import deform_surgeon as ds

    good = copy_fixture("sum_only.onnx", tmp_path, "good.onnx")
    (tmp_path / "noise.onnx").write_bytes(b"\x08\x96\x01garbage")
    (tmp_path / "folder.onnx").mkdir()
    calls = [lambda: ds.verify(good, tmp_path / "missing.onnx"), lambda: ds.verify(tmp_path / "noise.onnx", good),
             lambda: ds.verify(good, tmp_path / "folder.onnx"), lambda: ds.verify(good, good, opt_level="max"),
             lambda: ds.verify(good, good, iterations="3"),
             lambda: ds.patch(good, tmp_path / "o.onnx", verify=True, verify_options={"val_range": {"x0": "0,1"}})]
    for call in calls:
        with pytest.raises(ds.SurgeonError) as info:
            call()
        assert "\n" not in info.value.one_line()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.onnx", "good.onnx", "noise.onnx"]


# --------------------------------------------------------------------------------------------------- placement
@pytest.mark.webgpu
def test_placement_run_timeout_is_reported_as_what_happened(tmp_path):
    """The session is created in about a second; the original 1024 fixture's run takes 15-30 s on the software
    adapter (CPU fallback): with --timeout 8 the report says the session was created and the run timed out, and
    the run is FAILED even if its result lands while the harness is being stopped (CI once saw both)."""
    from deform_surgeon.placement import missing_setup

    if missing_setup() is not None:
        pytest.skip(f"WebGPU runtimes not set up: {missing_setup()}")
    proc = run("placement", FIXTURES / "decoder_gathernd_1024.onnx", "--run", "--timeout", "8", "--json", "p.json",
               cwd=tmp_path)
    assert "Traceback" not in proc.stdout + proc.stderr
    assert re.search(r"^session: ok in \d+\.\d+ s$", proc.stdout, re.M), proc.stdout
    assert "session creation failed" not in proc.stdout
    assert re.search(r"session created in \d+\.\d+ s, then the run timed out after 8 s", proc.stdout), proc.stdout
    assert re.search(r"^run:\s+FAILED", proc.stdout, re.M), proc.stdout


# ---------------------------------------------------------------------------------------------------- full disk
@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs filled up (needs root and mount rights; skipped otherwise)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with open(mnt / "filler", "wb", buffering=0) as fh, pytest.raises(OSError):
            while True:
                fh.write(b"\0" * 4096)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("argv, named", [
    (["patch", FIXTURES / "no_deform.onnx", "{d}/copy.onnx", "--copy-unchanged"], "copy.onnx"),
    (["inspect", FIXTURES / "decoder_gathernd.onnx", "--json", "{d}/report.json"], "report.json"),
    (["patch", FIXTURES / "decoder_gathernd.onnx", "{d}/out.onnx"], "out.onnx"),
], ids=["copy-unchanged", "inspect-json", "patch"])
def test_a_full_disk_is_one_line(full_disk, argv, named):
    before = state(full_disk)
    proc = subprocess.run([*DS, *(str(a).format(d=full_disk) for a in argv)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line == f"{ERROR_PREFIX}{full_disk / named}: could not be written (No space left on device)", line
    assert state(full_disk) == before
