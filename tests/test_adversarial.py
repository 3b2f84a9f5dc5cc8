"""The holes an adversarial run found, as a table: each case must end with its exit code, ONE stderr line
naming the file and the problem, no traceback, the inputs' bytes unchanged and nothing left behind.

Every case prepares files in an empty folder (the working directory) and returns the command line, the exit code,
the file the error line must start with (None: no file) and a regex the problem must match. Cases that need more
than one line or more than one process (signals, batch) follow the table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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
from helpers import ERROR_PREFIX, FIXTURES, copy_fixture, one_error_line, run
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


# second round: names a system call would refuse, FIFOs among the options' files, numbers out of range
def _long(stem: str, total: int, suffix: str = ".onnx") -> str:
    """A file name of `total` bytes."""
    return stem * (total - len(suffix)) + suffix


def _out_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return ["patch", "m.onnx", _long("o", 256)], 2, _long("o", 256), r"OUT has a name of 256 bytes"


def _out_in_a_folder_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, "m.onnx")
    (d / "out").mkdir()
    return ["patch", "m.onnx", f"out/{_long('a', 256)}"], 2, f"out/{_long('a', 256)}", r"OUT has a name of 256"


def _default_out_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, _long("m", 250))  # its default OUT, <name>.patched.onnx, is 258 bytes
    return ["patch", _long("m", 250)], 2, "m" * 245 + ".patched.onnx", r"OUT has a name of 258 bytes"


def _input_name_too_long(d: Path):
    return ["inspect", _long("m", 256)], 2, _long("m", 256), r"the model has a name of 256 bytes"


def _report_name_too_long(d: Path):  # nothing is written: OUT is not written before the report fails
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return (["patch", "m.onnx", "o.onnx", "--report", _long("r", 256, ".json")], 2, _long("r", 256, ".json"),
            r"--report has a name of 256 bytes")


def _json_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return ["inspect", "m.onnx", "--json", _long("r", 300, ".json")], 2, _long("r", 300, ".json"), r"--json has a"


def _out_data_name_too_long(d: Path):  # OUT fits, <OUT>.data does not: refused before any work
    external(d / "x")
    return (["patch", "x/model.onnx", _long("o", 252)], 2, _long("o", 252) + ".data",
            r"OUT's external data file has a name of 257 bytes")


def _bad_location(command: str, location: str, problem: str):
    def case(d: Path):
        external(d, "e.onnx", "e.data")
        model = onnx.load(d / "e.onnx", load_external_data=False)
        for t in model.graph.initializer:
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save(model, d / "m.onnx")
        argv = {"patch": ["patch", "m.onnx", "o.onnx"], "inspect": ["inspect", "m.onnx"],
                "budget": ["budget", "m.onnx"], "verify": ["verify", "e.onnx", "m.onnx"]}[command]
        return argv, 2, "m.onnx", rf"external data location of tensor '\S+' {problem}"
    case.__name__ = f"_location_{'nul' if chr(0) in location else 'too_long'}_{command}"
    return case


def _fifo_option(argv: list, option_file: str = "p.json"):
    def case(d: Path):
        copy_fixture("sum_only.onnx", d, "m.onnx")
        os.mkfifo(d / option_file)
        return argv, 2, option_file, r"is a FIFO, not a regular file"
    case.__name__ = f"_fifo_{argv[0]}_{argv[-2].strip('-').replace('-', '_')}"
    return case


def _seed_out_of_range(d: Path):  # the seed is named, not the model
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return (["patch", "m.onnx", "o.onnx", "--verify", "--seed", "99999999999999999999"], 2, None,
            r"^seed must be an integer from 0 to 4,294,967,295 - iterations \+ 1 \(got 99999999999999999999\)")


def _iterations_out_of_range(d: Path):  # refused at once: it used to grow memory without end
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return (["patch", "m.onnx", "o.onnx", "--verify", "--iterations", "99999999999999999999"], 2, None,
            r"^iterations must be an integer from 1 to 10,000")


def _seed_plus_iterations_out_of_range(d: Path):
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return (["verify", "m.onnx", "m.onnx", "--seed", str(2**32 - 2), "--iterations", "3"], 2, None,
            r"^seed must be an integer from 0 to")


ROUND_TWO = [_out_name_too_long, _out_in_a_folder_name_too_long, _default_out_name_too_long, _input_name_too_long,
             _report_name_too_long, _json_name_too_long, _out_data_name_too_long,
             *[_bad_location(c, "l" * 300, r"has a name of 300 bytes") for c in ("patch", "inspect", "budget",
                                                                                 "verify")],
             *[_bad_location(c, "e.data\0x", r"contains a NUL byte") for c in ("patch", "inspect", "budget", "verify")],
             _fifo_option(["patch", "m.onnx", "o.onnx", "--device-profile", "p.json"]),
             _fifo_option(["inspect", "m.onnx", "--device-profile", "p.json"]),
             _fifo_option(["budget", "m.onnx", "--device-profile", "p.json"]),
             _fifo_option(["budget", "m.onnx", "--device-limits", "p.json"]),
             _seed_out_of_range, _iterations_out_of_range, _seed_plus_iterations_out_of_range]


CASES = [_placement_json_is_the_model, _placement_limits_out_is_dev_null, _device_profile_missing,
         _out_is_input_data, _report_is_input_data, _inspect_json_is_input_data, _budget_json_is_input_data,
         _verify_json_is_input_data, _report_is_outputs_data, _report_hard_link_to_input, _report_is_dev_null,
         _out_is_dev_null, _json_is_fifo, _data_symlink_leaves_the_folder, _fifo_input, _fifo_input_to_inspect,
         _fifo_input_to_verify, _negative_offset, _negative_offset_inspect, _val_range_not_numbers, _bad_int_option,
         _missing_argument, _bad_choice, _patched_model_cannot_run, _verify_options_in_batch_manifest, *ROUND_TWO]


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
    from deform_surgeon.webgpu.placement import missing_setup

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


# ------------------------------------------------------------------------------------ the Python API, checked
def test_api_options_of_the_wrong_type_are_refused_before_any_work(tmp_path):
    """`allow_unproven="no"` is true to Python: it used to rewrite the 4 unproven gathers of this fixture (indices
    down to -8 against a size of 42). Every option is checked: a wrong one is a one-line SurgeonError naming it."""
    import deform_surgeon as ds

    src = copy_fixture("gathernd_refused.onnx", tmp_path, "m.onnx")
    os.mkfifo(tmp_path / "fifo.json")
    before = state(tmp_path)
    out = tmp_path / "o.onnx"
    bad = [({"allow_unproven": "no"}, "allow_unproven must be True or False"),
           ({"strict": "false"}, "strict must be True or False"), ({"verify": 1}, "verify must be True or False"),
           ({"copy_unchanged": None}, "copy_unchanged must be True or False"),
           ({"device_profile": 5}, "device_profile must be"), ({"device_profile": {"maxBufferSize": 1}}, "device_prof"),
           ({"device_profile": tmp_path / "fifo.json"}, "is a FIFO, not a regular file"),
           ({"progress": "x"}, "progress must be a function"), ({"sum_mode": ["chain"]}, "unknown sum mode"),
           ({"max_buffer": "lots"}, "max_buffer: bad size 'lots'"), ({"max_memory": 0}, "max_memory: bad size '0'"),
           ({"max_memory": True}, "max_memory: bad size 'True'"), ({"opt_level": "max"}, "unexpected keyword argument "
                                                                                          "'opt_level'"),
           ({"verify_options": {"opt_level": "max"}}, "unknown opt level 'max'"),
           ({"verify_options": {"seed": 2**40}}, "seed must be an integer from 0")]
    for kwargs, problem in bad:
        with pytest.raises(ds.SurgeonError) as info:
            ds.patch(src, out, **kwargs)
        assert problem in info.value.one_line() and "\n" not in info.value.one_line(), (kwargs, info.value)
        if set(kwargs) <= {"allow_unproven", "sum_mode", "max_buffer", "max_memory", "device_profile"}:
            with pytest.raises(ds.SurgeonError, match=re.escape(problem)):
                ds.inspect(src, **kwargs)
    for path, problem in [(5, "the model must be a path (str or pathlib.Path), not int"), (None, "not NoneType"),
                          ([str(src)], "not list"), (bytes(src), "not bytes"), (f"{src}\0x", "contains a NUL byte"),
                          (tmp_path / ("m" * 256), "has a name of 256 bytes")]:
        with pytest.raises(ds.SurgeonError, match=re.escape(problem)):
            ds.patch(path, out)
        with pytest.raises(ds.SurgeonError, match=re.escape(problem.replace("the model", "the original"))):
            ds.verify(path, src)
    for target, problem in [("x" * 300, "the output has a name of 300 bytes"), (f"{out}\0", "contains a NUL byte"),
                            (b"o.onnx", "not bytes")]:
        with pytest.raises(ds.SurgeonError, match=re.escape(problem)):
            ds.patch(src, target)
    with pytest.raises(ds.SurgeonError, match="quiet must be True or False"):
        ds.verify(src, src, quiet="no")
    assert state(tmp_path) == before  # nothing written, nothing left


def test_api_takes_the_command_lines_sizes_and_its_report_names_api_options(tmp_path):
    import deform_surgeon as ds

    src = copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    report = ds.patch(src, tmp_path / "o.onnx", max_buffer="256MiB", max_memory="1.5GB")
    assert report.written and report.options["max_buffer"] == 256 * 2**20
    assert report.options["max_memory"] == 1_500_000_000
    assert ds.inspect(src, max_buffer="0.25GiB").options["max_buffer"] == 256 * 2**20
    text = report.format()
    assert "more (format(verbose=True) or to_json() lists all)" in text and "--verbose" not in text, text
    assert "max_memory 1.50 GB (1.40 GiB): peak of live activations" in text and "--" not in text, text  # the note
    proc = run("patch", "m.onnx", "o2.onnx", "--max-memory", "1.5GB", cwd=tmp_path)
    assert "more (--verbose or --report FILE.json lists all)" in proc.stdout, proc.stdout
    assert "--max-memory 1.50 GB (1.40 GiB): peak of live activations" in proc.stdout, proc.stdout
    strict = ds.patch(copy_fixture("gathernd_refused.onnx", tmp_path, "r.onnx"), tmp_path / "r.out.onnx", strict=True)
    assert not strict.written and strict.format().splitlines()[-1].startswith("strict: "), strict.format()


def _change_input(tmp_path: Path, change: str) -> Path:
    """Change one input of an external-data model in place or by rename, same size, its mtime put back (what
    `touch -r` does): only the inode's change time tells. Returns the file changed."""
    path = tmp_path / ("model.onnx" if change.startswith("model") else "w.data")
    st = path.stat()
    data = bytearray(path.read_bytes())
    if change.startswith("model"):
        at = data.index(b"doc-v1")
        data[at:at + 6] = b"doc-v2"  # a valid model still, with another doc string
    else:
        data[:64] = bytes(255 - b for b in data[:64])  # weights that change the outputs
    if change.endswith("replaced"):
        (tmp_path / "new").write_bytes(data)
        os.utime(tmp_path / "new", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp_path / "new", path)
    else:
        with open(path, "r+b") as fh:
            fh.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    return path


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
@pytest.mark.parametrize("change", ["data_edited", "data_replaced", "model_edited", "model_replaced"])
def test_an_input_changed_during_a_patch_is_seen_with_its_mtime_put_back(tmp_path, change, verify):
    """The model or its external data file changed after the model was loaded (at the `export` stage, or while
    the written model is verified): nothing is written, the changed file is named, nothing is left behind."""
    import deform_surgeon as ds

    model = graphs.exporter_like(H=30, W=40, C=8)
    model.doc_string = "doc-v1"
    onnx.save(model, tmp_path / "model.onnx", save_as_external_data=True, location="w.data", size_threshold=0)
    when = "verify" if verify else "export"
    changed = []

    def progress(stage: str) -> None:
        if stage == when:
            changed.append(_change_input(tmp_path, change))

    with pytest.raises(ds.SurgeonError) as info:
        ds.patch(tmp_path / "model.onnx", tmp_path / "out.onnx", verify=verify, progress=progress)
    assert changed and info.value.path == str(changed[0]), info.value
    assert "changed while it was being patched; nothing was written" in info.value.problem
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "w.data"]


# ------------------------------------------------------------------------------------------ the background child
_STOP_THE_PARENT_WHILE_THE_CHILD_REPORTS = """
import os, signal, sys
from deform_surgeon.commands import cli
from deform_surgeon.commands.patching import lift
from deform_surgeon.base.errors import SurgeonError

def checker_that_fails(model, path, weights):  # runs in the background child (background.py)
    os.kill(os.getppid(), signal.SIGTERM)  # the parent is stopped now...
    raise SurgeonError(path, "fails onnx.checker: " + "x" * (1 << 20))  # ...while this (1 MB) is being sent

lift.checked_types = checker_that_fails
sys.exit(cli.main(["inspect", sys.argv[1]]))
"""


def test_stopping_the_parent_while_the_background_child_reports_an_error(tmp_path):
    """SIGTERM reaches the CLI while its background checker child sends its error (an answer too long for the pipe:
    the child is blocked sending it; the parent may be reading it, or not). The parent leaves with exit 143 and its
    one line; the child is stopped quietly, not through the CLI's handler it inherited (which used to raise
    `Terminated` in the child and print two tracebacks), and nothing hangs. Eight at once on two cores: under
    load, each ordering of the two processes' steps is met."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    (tmp_path / "stop.py").write_text(_STOP_THE_PARENT_WHILE_THE_CHILD_REPORTS)
    before = state(tmp_path)
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, "stop.py", "m.onnx"], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(8)]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 143 and err == "deform-surgeon: terminated\n", err[-3000:]
    assert state(tmp_path) == before


# ------------------------------------------------------------------------------------- signals during start-up
_HOLD_IMPORT = """
import os, sys, time

class _Hold:
    '''The first import of $DS_HOLD_IMPORT (by the first process to reach it) waits there for a signal: the signal
    lands during that import, as a Ctrl-C a second into start-up does. DS_HOLD_AS=ImportError: the import then
    fails as onnxruntime's does when interrupted ("ImportError: initialization failed").'''

    def find_spec(self, name, path=None, target=None):
        if name != os.environ.get("DS_HOLD_IMPORT"):
            return None
        try:
            os.close(os.open(os.environ["DS_HOLD_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        try:
            while True:
                time.sleep(0.01)
        except KeyboardInterrupt as exc:
            if os.environ.get("DS_HOLD_AS") == "ImportError":
                raise ImportError("initialization failed") from exc
            raise

sys.meta_path.insert(0, _Hold())
"""


def _signal_at_import(tmp_path: Path, argv: list, module: str, sig: int, as_import_error: bool = False,
                      entry: str = "module") -> subprocess.CompletedProcess:
    """Run a command whose first import of `module` waits (see _HOLD_IMPORT); once it waits, send `sig` to the
    command's whole process group (what a terminal's Ctrl-C does); wait for the end."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOLD_IMPORT)
    mark = tmp_path / "hook" / "holding"
    mark.unlink(missing_ok=True)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "DS_HOLD_IMPORT": module, "DS_HOLD_MARK": str(mark),
           "DS_HOLD_AS": "ImportError" if as_import_error else ""}
    command = [*DS] if entry == "module" else [str(Path(sys.executable).parent / "deform-surgeon")]
    proc = subprocess.Popen([*command, *argv], cwd=tmp_path / "work", env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mark.exists(), f"the import of {module} was never reached"
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("argv, module, sig, as_import_error, entry", [
    (["patch", "m.onnx", "o.onnx"], "onnx", signal.SIGINT, False, "module"),
    (["patch", "m.onnx", "o.onnx"], "onnx", signal.SIGINT, False, "script"),
    (["patch", "m.onnx", "o.onnx"], "onnx", signal.SIGTERM, False, "module"),
    (["inspect", "m.onnx"], "onnx_graphsurgeon", signal.SIGINT, False, "module"),
    (["patch", "m.onnx", "o.onnx", "--verify"], "onnxruntime", signal.SIGINT, True, "module"),
    (["patch", "m.onnx", "o.onnx", "--verify"], "onnxruntime", signal.SIGTERM, True, "module"),
    (["verify", "m.onnx", "m.onnx"], "polygraphy", signal.SIGINT, False, "module"),
    (["batch", "--glob", "m.onnx", "--no-progress"], "onnx", signal.SIGINT, False, "module"),
    # the package's __init__ imported device -> runtimes -> ctypes before the handlers (issue 33): 0.18 s of start-up
    (["patch", "m.onnx", "o.onnx"], "ctypes", signal.SIGINT, False, "module"),
    (["patch", "m.onnx", "o.onnx"], "ctypes", signal.SIGINT, False, "script"),
    (["patch", "m.onnx", "o.onnx"], "ctypes", signal.SIGTERM, False, "module"),
], ids=["patch-onnx-int", "script-onnx-int", "patch-onnx-term", "inspect-gs-int", "verify-ort-int", "verify-ort-term",
        "verify-polygraphy-int", "batch-onnx-int", "patch-ctypes-int", "script-ctypes-int", "patch-ctypes-term"])
def test_a_signal_during_start_up_is_one_line(tmp_path, argv, module, sig, as_import_error, entry):
    """Ctrl-C or SIGTERM while the command imports its libraries: exit 130 / 143 and one line, like at any other
    moment (it was a KeyboardInterrupt traceback and exit -2; in onnxruntime's import, an ImportError and exit 1)."""
    work = tmp_path / "work"
    work.mkdir()
    copy_fixture("decoder_gathernd.onnx", work, "m.onnx")
    before = state(work)
    proc = _signal_at_import(tmp_path, argv, module, sig, as_import_error, entry)
    expected = {signal.SIGINT: (130, "deform-surgeon: interrupted\n"), signal.SIGTERM: (143, "deform-surgeon: "
                                                                                        "terminated\n")}[sig]
    assert (proc.returncode, proc.stderr) == expected, proc.stderr
    assert state(work) == before


def test_ctrl_c_stops_a_batch_and_its_workers_quietly(tmp_path):
    """Ctrl-C reaches the whole process group, the workers too: they leave it to the batch, which stops them
    (a worker used to print KeyboardInterrupt or FileNotFoundError tracebacks)."""
    for k in range(4):
        copy_fixture("decoder_gathernd.onnx", tmp_path, f"m{k}.onnx")
    before = state(tmp_path)
    proc = subprocess.Popen([*DS, "batch", "--glob", "m*.onnx", "--jobs", "2", "--verify", "--no-progress"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(".m0.patched") for p in tmp_path.iterdir()):
            break
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert (proc.returncode, err) == (130, "deform-surgeon: interrupted\n"), out + err
    left = {k for k in state(tmp_path) if k not in before}
    assert not {n for n in left if n.startswith(".") or "tmp" in n}, left  # no temporaries
    for name in left:  # what a worker finished before the signal is complete: a model and its data
        assert name.endswith((".patched.onnx", ".patched.onnx.data")), left


def _grandchildren(pid: int) -> int:
    """How many children the children of `pid` have, read from /proc: batch's workers (the fork server's)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or one that ended meanwhile
            continue
    children = {p for p, parent in parents.items() if parent == pid}
    return sum(parent in children for parent in parents.values())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers in /proc")
def test_ctrl_c_while_batch_workers_start_is_one_line(tmp_path):
    """Fourth round: about 1 Ctrl-C in 15 while the workers started printed a multiprocessing traceback after
    "interrupted": a Ctrl-C inside `Process.start()` left a worker the batch did not know of, so did not stop; it
    read its start-up data after the batch had exited and removed the queue's semaphore (FileNotFoundError). Ctrl-C
    the moment the first, then the second worker exists, a few times over: one line, exit 130, every time."""
    for k in range(4):
        copy_fixture("decoder_gathernd.onnx", tmp_path, f"m{k}.onnx")
    before = state(tmp_path)
    for attempt in range(8):
        proc = subprocess.Popen([*DS, "batch", "--glob", "m*.onnx", "--jobs", "2", "--no-progress"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        while proc.poll() is None and _grandchildren(proc.pid) < 1 + attempt % 2:
            time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
        assert (proc.returncode, err) == (130, "deform-surgeon: interrupted\n"), f"attempt {attempt}: {out}{err}"
        left = {k for k in state(tmp_path) if k not in before}
        assert not {n for n in left if n.startswith(".") or "tmp" in n}, left  # no temporaries
        for name in left:  # a worker that finished before the signal: its output is complete
            assert name.endswith(".patched.onnx"), left
            (tmp_path / name).unlink()


def _fork_server_of(pid: int) -> bool:
    """Whether a child of `pid` is multiprocessing's fork server (read from /proc)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"forkserver" in Path(f"/proc/{entry}/cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the fork server in /proc")
@pytest.mark.parametrize("wait", [0.0, 0.05, 0.1, 0.2, 0.3])
def test_ctrl_c_while_the_fork_server_loads_is_one_line(tmp_path, wait):
    """Campaign after the fourth round: a Ctrl-C reaches the whole process group, and the fork server batch starts
    spends about half a second importing the patch stack; a Ctrl-C then printed its KeyboardInterrupt traceback (10
    to 28 lines) before "interrupted", and one the batch took while a worker was being forked left that worker
    reading its start-up data after the batch had gone (FileNotFoundError). Ctrl-C `wait` seconds after the fork
    server exists (the signal lands in its start-up): one line, exit 130, no temporary file."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m0.onnx")
    before = state(tmp_path)
    proc = subprocess.Popen([*DS, "batch", "--glob", "m*.onnx", "--jobs", "1", "--no-progress"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while proc.poll() is None and not _fork_server_of(proc.pid):
        time.sleep(0.001)
    time.sleep(wait)  # (where in the fork server's start-up the signal lands; no time is asserted)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    if "1 ok, 0 unchanged, 0 refused, 0 failed" in out:  # done first: exit 0, or the signal ended Python's own
        assert (proc.returncode, err) in ((0, ""), (-signal.SIGINT, "")), out + err  # shutdown (robustness.md)
    else:
        assert (proc.returncode, err) == (130, "deform-surgeon: interrupted\n"), out + err
    left = {k for k in state(tmp_path) if k not in before}
    assert not {n for n in left if n.startswith(".") or "tmp" in n}, left


# ------------------------------------------------------------------------------------------- folders out of reach
def _without_permission_bypass() -> list[str]:
    """The prefix that runs a command without the capability to bypass file permissions (root has it)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}"]


@pytest.mark.parametrize("argv, named, problem", [
    (["patch", "d/m.onnx", "o.onnx"], "d/m.onnx", "cannot be read (Permission denied)"),
    (["patch", "m.onnx", "d/o.onnx"], "d/o.onnx", "OUT cannot be written there (Permission denied)"),
    (["inspect", "m.onnx", "--json", "d/r.json"], "d/r.json", "--json cannot be written there (Permission denied)"),
    (["verify", "m.onnx", "d/m.onnx"], "d/m.onnx", "cannot be read (Permission denied)"),
    (["budget", "d/m.onnx"], "d/m.onnx", "cannot be read (Permission denied)"),
    (["patch", "m.onnx", "o.onnx", "--device-profile", "d/p.json"], "d/p.json", "cannot read device profile"),
], ids=["patch-input", "patch-output", "inspect-json", "verify", "budget", "device-profile"])
def test_a_folder_that_cannot_be_searched_is_one_line(tmp_path, argv, named, problem):
    prefix = _without_permission_bypass()
    copy_fixture("sum_only.onnx", tmp_path, "m.onnx")
    (tmp_path / "d").mkdir()
    copy_fixture("sum_only.onnx", tmp_path / "d", "m.onnx")
    before = state(tmp_path)
    (tmp_path / "d").chmod(0)
    try:
        proc = subprocess.run([*prefix, *DS, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        (tmp_path / "d").chmod(0o755)
    assert (proc.returncode, proc.stderr) == (2, f"{ERROR_PREFIX}{named}: {problem}\n") or (
        proc.returncode == 2 and proc.stderr.startswith(f"{ERROR_PREFIX}{named}: {problem}")), proc.stderr
    assert state(tmp_path) == before


@pytest.mark.parametrize("stage", ["export", "write"])
@pytest.mark.parametrize("removed", ["model", "embedded_model", "data"])
def test_an_input_removed_after_it_was_loaded_is_one_line(tmp_path, removed, stage):
    """The model (weights in an external file, or embedded: read again when the output is written) or its data file
    removed once loaded: a SurgeonError naming it (it was a FileNotFoundError traceback), nothing written."""
    import deform_surgeon as ds

    if removed == "embedded_model":
        copy_fixture("decoder_gathernd.onnx", tmp_path, "model.onnx")
    else:
        external(tmp_path)
    gone = tmp_path / ("w.data" if removed == "data" else "model.onnx")
    before = sorted(p.name for p in tmp_path.iterdir())

    def progress(at: str) -> None:
        if at == stage:
            gone.unlink()

    with pytest.raises(ds.SurgeonError) as info:
        ds.patch(tmp_path / "model.onnx", tmp_path / "out.onnx", progress=progress)
    assert info.value.path == str(gone) and "\n" not in info.value.one_line(), info.value
    assert sorted(p.name for p in tmp_path.iterdir()) == [n for n in before if n != gone.name]
    proc = run("patch", "model.onnx", "out.onnx", cwd=tmp_path)  # and the command line names it too
    assert proc.returncode == 2 and proc.stderr.startswith(ERROR_PREFIX) and gone.name in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


# ------------------------------------------------------------------------------------------- batch, second round
def test_batch_sizes_like_the_command_line_and_bad_entries_fail_alone_while_planning(tmp_path):
    """`max_memory = "1GB"` is taken as `--max-memory 1GB` is (it failed at run time); `max_memory = 0` and an
    output name over 255 bytes fail their entry while planning (no report, no worker), and the rest runs."""
    copy_fixture("sum_only.onnx", tmp_path, "m.onnx")
    long_out = _long("o", 256)
    (tmp_path / "m.toml").write_text(
        f'[[model]]\ninput = "m.onnx"\noutput = "{long_out}"\n'
        '[[model]]\ninput = "m.onnx"\noutput = "b.onnx"\nmax_memory = "1GB"\nmax_buffer = "1.5MiB"\n'
        '[[model]]\ninput = "m.onnx"\noutput = "c.onnx"\nmax_memory = 0\n'
        '[[model]]\ninput = "m.onnx"\noutput = "d.onnx"\nseed = 4294967295\niterations = 2\n')
    proc = run("batch", "m.toml", "--jobs", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    rows = _summary_rows(proc.stdout)
    assert re.search(rf"failed .*{long_out}: the output of entry 1 \(m\.onnx\) has a name of 256 bytes", rows["1"])
    assert rows["2"].split()[1] == "ok", proc.stdout
    report = json.loads((tmp_path / "b.report.json").read_text())
    assert report["options"]["max_memory"] == 10**9 and report["options"]["max_buffer"] == 3 * 2**19
    assert re.search(r"m\.toml, \[\[model\]\] #3: option max_memory: bad size '0'", rows["3"]), proc.stdout
    assert re.search(r"m\.toml, \[\[model\]\] #4: option seed = 4294967295 should be at most", rows["4"]), proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.onnx", "b.report.json", "m.onnx", "m.toml"]


# ------------------------------------------------------------------------------------------ third round (issue 33)
def _symbolic(d: Path, name: str = "sym.onnx", dims: int = 1) -> Path:
    """The 4-input Sum model with its first `dims` dims symbolic."""
    model = graphs.sum_only()
    for vi in [*model.graph.input, *model.graph.output]:
        for k in range(dims):
            vi.type.tensor_type.shape.dim[k].dim_param = f"d{k}"
    onnx.save(model, d / name)
    return d / name


@pytest.mark.parametrize("argv, problem", [
    (["inspect", "sym.onnx", "--input-shapes", "x0:99999999999999999999999,3"],
     r"^--input-shape x0:99999999999999999999999,3: dim 99999999999999999999999 is not from 1 to 2,147,483,647"),
    (["patch", "sym.onnx", "o.onnx", "--input-shapes", "x0:2147483648,3"], r"dim 2147483648 is not from 1 to"),
    (["inspect", "sym2.onnx", "--input-shapes", "x0:2147483647,2147483647"],
     r"^sym2\.onnx: --input-shape x0:2147483647,2147483647 makes an input of 18,446,744,056,529,682,436 bytes, more "
     r"than a 64-bit size can hold"),
    (["inspect", "sym.onnx", "--input-shapes", "x0:2,3", "--input-shapes", "x1:2,3", "--input-shapes", "x0:4,3"],
     r"^--input-shape names 'x0' twice \(x0:2,3 and 'x0:4,3'\) \(give each input once\)"),
], ids=["huge-dim", "dim-over-int32", "size-over-int64", "repeated"])
def test_input_shapes_out_of_range_or_repeated_are_one_line(tmp_path, argv, problem):
    """A dim of 2^63 or more ended in "ValueError: Value out of range" (exit 1); a repeated input kept the last
    shape without a word. Dims are from 1 to 2^31 - 1, an input's bytes fit an int64, each input is given once."""
    _symbolic(tmp_path)
    _symbolic(tmp_path, "sym2.onnx", dims=2)
    before = state(tmp_path)
    proc = run(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(problem, one_error_line(proc)), proc.stderr
    assert state(tmp_path) == before


def test_input_shapes_out_of_range_through_the_api_and_a_manifest(tmp_path):
    import deform_surgeon as ds

    src = _symbolic(tmp_path)
    with pytest.raises(ds.SurgeonError, match=r"^input_shapes x0:10{23},3: dim 10{23} is not from 1 to"):
        ds.inspect(src, input_shapes={"x0": [10**23, 3]})
    (tmp_path / "m.toml").write_text('[[model]]\ninput = "sym.onnx"\noutput = "a.onnx"\n'
                                     'input_shapes = { x0 = [9223372036854775807, 3] }\n')
    proc = run("batch", "m.toml", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 1 and "internal error" not in proc.stdout and "Traceback" not in proc.stderr
    assert re.search(r"m\.toml, \[\[model\]\] #1: option input_shapes: input_shapes x0:9223372036854775807,3: dim "
                     r"9223372036854775807 is not from 1 to 2,147,483,647", _summary_rows(proc.stdout)["1"])


@pytest.mark.parametrize("value", [5, 3.5, None])
def test_api_skip_passes_of_the_wrong_type_and_a_generator(tmp_path, value):
    """`skip_passes=5` or `3.5` was a TypeError; a generator was consumed by the type check, so nothing was
    skipped, silently: it is read once, and what it names is skipped."""
    import deform_surgeon as ds

    src = FIXTURES / "decoder_gathernd.onnx"
    if value is None:
        report = ds.inspect(src, skip_passes=(n for n in ["sum_chain", "fit"]))
        assert "sum_chain" not in report.passes and "fit" not in report.passes and "gathernd" in report.passes
        assert report.options["skip_passes"] == ("sum_chain", "fit")
        return
    problem = f"skip_passes takes a list of pass names, not {value!r}"
    with pytest.raises(ds.SurgeonError, match=f"^{re.escape(problem)}"):
        ds.patch(src, tmp_path / "o.onnx", skip_passes=value)
    assert not list(tmp_path.iterdir())


def _limit_address_space() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


def test_verify_at_a_size_that_cannot_be_allocated_says_the_size_needs_it(tmp_path):
    """`--verify --input-shapes` at a size whose seeded input cannot be allocated (here under a 3 GiB address-space
    limit) told the user to give the size with --input-shapes: it says the size given needs 22.4 GiB."""
    _symbolic(tmp_path)
    before = state(tmp_path)
    proc = subprocess.run([*DS, "patch", "sym.onnx", "o.onnx", "--verify", "--input-shapes", "x0:1000000000,3"],
                          cwd=tmp_path, capture_output=True, text=True, preexec_fn=_limit_address_space)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = one_error_line(proc)
    assert line.startswith("sym.onnx: fails to run on ORT CPU with the seeded inputs: the size given with "
                           "--input-shapes (x0:1000000000,3) needs 22.4 GiB in one allocation, which failed"), line
    assert "give the size" not in line
    assert state(tmp_path) == before


def _model_folder(d: Path) -> Path:
    """DIR with a model, a subfolder with another, and a link to that subfolder."""
    src = d / "src"
    (src / "real").mkdir(parents=True)
    copy_fixture("sum_only.onnx", src, "m.onnx")
    copy_fixture("sum_only.onnx", src / "real", "r.onnx")
    (src / "alias").symlink_to("real")
    return src


def test_batch_folder_follows_a_link_to_a_folder_inside_dir_and_refuses_others(tmp_path):
    """A linked subfolder of DIR was neither patched nor copied nor reported. Inside DIR it is followed (its
    models patched under the link's name); a link out of DIR, or to a folder that holds it, is one line, exit 2."""
    src = _model_folder(tmp_path)
    proc = run("batch", "src", "out", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^\s+alias/r\.onnx\s+ok", proc.stdout, re.M), proc.stdout
    assert (tmp_path / "out" / "alias" / "r.onnx").is_file() and not (tmp_path / "out" / "alias").is_symlink()
    (tmp_path / "ext").mkdir()
    for link, target, named, problem in [
            ("outside", "../ext", "outside", r"is a link to a folder outside DIR \(.*/ext\)"),
            ("real/loop", "..", "alias/loop", r"is a link to .*/src, a folder that holds it")]:  # (alias first)
        (src / link).symlink_to(target)
        before = state(tmp_path)
        proc = run("batch", "src", "out2", "--no-progress", cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = one_error_line(proc)
        assert line.startswith(f"src/{named}: ") and re.search(problem, line), line
        assert state(tmp_path) == before
        (src / link).unlink()


def test_batch_folder_output_through_a_link_in_outdir_is_refused(tmp_path):
    """A linked subfolder the user has in OUTDIR was followed: the outputs landed in its target, outside OUTDIR."""
    _model_folder(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / "real").symlink_to("../elsewhere")
    before = state(tmp_path)
    proc = run("batch", "src", "out", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.match(r"out/real: leads outside OUTDIR \(out\) through a link, to .*/elsewhere",
                    one_error_line(proc))
    assert state(tmp_path) == before and not list((tmp_path / "elsewhere").iterdir())


def test_batch_folder_refused_up_front_leaves_no_folders(tmp_path):
    """A batch refused once the output folders were made (here: a file to copy onto a FIFO in OUTDIR) left them
    behind, empty; they are taken back."""
    src = _model_folder(tmp_path)
    (src / "notes.txt").write_text("notes")
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / "notes.txt")
    before = state(tmp_path)
    proc = run("batch", "src", "out", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2 and "is a FIFO" in one_error_line(proc), proc.stderr
    assert set(state(tmp_path)) == set(before)  # no out/alias, no out/real (only out's mtime moved)


def _a_link_to_dev_zero(src: Path) -> tuple[str, str]:
    (src / "tokenizer.json").symlink_to("/dev/zero")
    return "src/tokenizer.json", r"is a link to a file outside DIR \(/dev/zero\)"


def _a_link_to_a_file_outside(src: Path) -> tuple[str, str]:
    (src.parent / "private.txt").write_text("not part of the folder")
    (src / "notes.txt").symlink_to("../private.txt")
    return "src/notes.txt", r"is a link to a file outside DIR \(.*/private\.txt\)"


def _a_socket(src: Path) -> tuple[str, str]:
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "zz.sock"))  # after the configs: they were copied before the socket failed the batch
    return "src/zz.sock", "is a socket, not a regular file"


def _a_fifo_config(src: Path) -> tuple[str, str]:
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    return "src/config.json", "is a FIFO, not a regular file"


def _a_read_only_onnx_folder_in_outdir(src: Path) -> tuple[str, str]:
    (src.parent / "out" / "onnx").mkdir(parents=True)
    (src.parent / "out" / "onnx").chmod(0o555)
    return "out/onnx/m.onnx", "folder out/onnx is not writable"


@pytest.mark.parametrize("make", [_a_link_to_dev_zero, _a_link_to_a_file_outside, _a_socket, _a_fifo_config,
                                  _a_read_only_onnx_folder_in_outdir])
def test_batch_folder_reads_only_regular_files_in_dir_and_refuses_before_writing(tmp_path, make):
    """Fourth round: a link to /dev/zero in DIR was copied without end; a socket in DIR was exit 2 after the other
    files were copied; a FIFO config.json left an empty OUTDIR/onnx/; a read-only OUTDIR/onnx/ left the configs
    copied without the model; file links leading outside DIR were copied (folder links were refused). Only regular
    files inside DIR are read: anything else is one line, exit 2, before anything is written. (The run's files are
    limited to 64 MiB: a copy without end stops there instead of filling the disk.)"""
    import resource

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))

    src = tmp_path / "src"
    (src / "onnx").mkdir(parents=True)
    copy_fixture("sum_only.onnx", src / "onnx", "m.onnx")
    (src / "config.json").write_text('{"model_type": "birefnet"}')
    (src / "preprocessor_config.json").write_text("{}")
    named, problem = make(src)
    before = state(tmp_path)
    try:
        proc = subprocess.run([*_without_permission_bypass(), *DS, "batch", "src", "out", "--no-progress"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, preexec_fn=limited)
    finally:
        if (tmp_path / "out" / "onnx").is_dir():
            (tmp_path / "out" / "onnx").chmod(0o755)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"{named}: ") and re.search(problem, line), line
    assert state(tmp_path) == before


def test_batch_folder_copies_only_what_a_regular_file_held_when_opened(tmp_path):
    """What the walk checked may be swapped before it is copied: the copy takes only a regular file, and at most
    the bytes it had when opened (its fstat size), all of DIR's files or none."""
    from deform_surgeon.base.errors import SurgeonError
    from deform_surgeon.commands.batch import copy_files

    (tmp_path / "out").mkdir()
    (tmp_path / "a.txt").write_text("a")
    os.mkfifo(tmp_path / "b.json")
    with pytest.raises(SurgeonError, match=r"b\.json: is a FIFO, not a regular file"):
        copy_files([(tmp_path / "a.txt", tmp_path / "out" / "a.txt"),
                    (tmp_path / "b.json", tmp_path / "out" / "b.json")])
    assert not list((tmp_path / "out").iterdir())  # not a.txt either, and no temporary file
    with pytest.raises(SurgeonError, match=r"zero: is a device, not a regular file"):
        copy_files([(Path("/dev/zero"), tmp_path / "out" / "zero")])
    copy_files([(tmp_path / "a.txt", tmp_path / "out" / "a.txt")])
    assert (tmp_path / "out" / "a.txt").read_text() == "a"


def test_two_output_links_to_one_file_are_named(tmp_path):
    """Two outputs that are links to one file: the refusal says which two, and the file they are."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a", "b"):
        copy_fixture("sum_only.onnx", src, f"{name}.onnx")
    (tmp_path / "out").mkdir()
    (tmp_path / "x.onnx").write_bytes(b"")
    for name in ("a", "b"):
        (tmp_path / "out" / f"{name}.onnx").symlink_to("../x.onnx")
    proc = run("batch", "src", "out", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # a folder's OUTDIR is one whole: refused up front
    assert re.match(r"out/b\.onnx: the output of entry 2 \(src/b\.onnx\) is also the output of entry 1 "
                    r"\(src/a\.onnx\) \(out/b\.onnx and out/a\.onnx are both .*/x\.onnx\): one would overwrite",
                    one_error_line(proc)), proc.stderr


# ------------------------------------------------------------------------------------------ fifth round (issue 46)
@pytest.mark.parametrize("argv, option", [
    (["verify", "m.onnx", "m.onnx", "--segment-memory", "99999999999999999999999999999"], "--segment-memory"),
    (["patch", "m.onnx", "o.onnx", "--max-memory", "9000000TiB"], "--max-memory"),
], ids=["verify-segment-memory", "patch-max-memory"])
def test_a_size_past_64_bits_is_refused_and_one_within_is_read_as_given(tmp_path, argv, option):
    """`--segment-memory 99999999999999999999999999999` printed "99999999999999983616.00 GB", a number the user
    did not give (the size went through a float). A size is read exactly, and one over 2**63 - 1 bytes, which no
    file or memory holds, is refused in one line."""
    from deform_surgeon.base.sizes import parse_size

    copy_fixture("sum_only.onnx", tmp_path, "m.onnx")
    proc = run(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert one_error_line(proc) == (f"argument {option}: bad size '{argv[-1]}' (more than 2**63 - 1 bytes (9.22 EB), "
                                    f"which no file or memory holds) (see `deform-surgeon {argv[0]} --help`)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    assert parse_size("9223372036854775807") == 2**63 - 1 and parse_size("8589934591.999999999GiB") == 2**63 - 1


@pytest.mark.parametrize("size, argv, needed_for", [
    ("100k", ["patch", FIXTURES / "decoder_gathernd_fp16.onnx", "out.onnx", "--max-buffer", "100KiB"],
     "ORT CPU's graph of the model"),
    ("400k", ["patch", FIXTURES / "decoder_gathernd_fp16.onnx", "out.onnx", "--max-buffer", "100KiB"],
     "the model kept aside for the float16 proofs and ORT CPU's graphs of the models they compare"),
    ("100k", ["verify", FIXTURES / "decoder_gathernd.onnx", FIXTURES / "decoder_gathernd.onnx", "--iterations", "3"],
     "the outputs verify compares"),
], ids=["patch-lift", "patch-float16-proofs", "verify"])
def test_a_nearly_full_tmpdir_is_one_line_and_nothing_is_left_there(tmp_path, size, argv, needed_for):
    """Fifth round: `patch` of the float16 fixture with TMPDIR nearly full died with onnxruntime's traceback from
    proofs/precision.py (exit 1) and left a `ds-rounding-*` folder there (a child stopped while ORT wrote in a folder
    of its own). Each use of TMPDIR is now a folder the command removes whatever happens, and a TMPDIR out of space is
    one line naming it, what the command keeps there and the space it had. (A small tmpfs: root only.)"""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(tmpdir)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        env = {**os.environ, "TMPDIR": str(tmpdir)}
        subprocess.run([sys.executable, "-c", "import onnxruntime"], env=env, check=True)  # (ORT's own `.ses`)
        before = state(tmpdir)
        proc = subprocess.run([*DS, *map(str, argv)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert re.fullmatch(rf"{re.escape(str(tmpdir))}: the temporary folder \(TMPDIR\) ran out of space: more than "
                            rf"the [\d,]+ B that was free there is needed for {re.escape(needed_for)} \(set TMPDIR to "
                            r"a folder with more free space\)", one_error_line(proc)), proc.stderr
        assert state(tmpdir) == before and sorted(p.name for p in tmp_path.iterdir()) == ["tmpdir"]
    finally:
        subprocess.run(["umount", str(tmpdir)], check=True)


FULL_LINE = f"{ERROR_PREFIX}stdout: could not be written (No space left on device); "


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv, fate", [
    (["patch", "m.onnx", "out.onnx", "--external-data", "always", "--report", "r.json"],
     "written all the same: out.onnx, out.onnx_data, r.json"),
    (["inspect", "m.onnx", "--json", "i.json"], "written all the same: i.json"),
    (["budget", "m.onnx"], "no file was written"),
    (["verify", "m.onnx", "m.onnx", "--iterations", "1"], "no file was written"),
    (["placement", "--help"], "no file was written"),
], ids=["patch", "inspect", "budget", "verify", "placement-help"])
def test_a_full_stdout_is_one_line_naming_what_was_written(tmp_path, argv, fate):
    """Fifth round: with stdout on /dev/full, `patch` wrote OUT, then ended in an OSError traceback (exit 1), as
    the docs said nothing is written when a command fails; `inspect`, `budget`, `verify`, `placement`: tracebacks.
    A command now writes its files before it prints its report, and a stdout that cannot take it is one line on
    stderr naming the files written all the same, exit 2."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*DS, *argv], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=600)
    assert proc.returncode == 2 and proc.stderr == FULL_LINE + fate + "\n", proc.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(["m.onnx", *re.findall(r"[\w.]+\.(?:onnx_data|onnx|json)", fate)]), written


def test_a_reader_that_left_ends_the_command_quietly_with_141(tmp_path):
    """Fifth round: `patch ... | head -1` ended in a BrokenPipeError traceback, exit 1, after OUT was written. A
    reader of stdout that left (here before the command started: the same every run) ends it as SIGPIPE ends a
    command, quietly with 141; its files were written before its report."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([*DS, "patch", "m.onnx", "out.onnx", "--report", "r.json"], cwd=tmp_path,
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out.onnx", "r.json"]


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_closed_stream_is_refused_in_one_line_on_the_other(tmp_path, closed):
    """Fifth round: stdout closed (`>&-`) ended in an AttributeError traceback from base/background.py; stderr
    closed (`2>&-`), exit 1 without a word. Either is refused before any work, one line on the other, exit 2."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    redirect = ">&-" if closed == "stdout" else "2>&-"
    proc = subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", *DS, "patch", "m.onnx", "out.onnx"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    said = proc.stderr if closed == "stdout" else proc.stdout
    assert proc.returncode == 2 and (proc.stdout if closed == "stdout" else proc.stderr) == ""
    assert said == (f"{ERROR_PREFIX}{closed} is closed, so what the command says there would be lost; nothing was "
                    f"done (give {'>' if closed == 'stdout' else '2>'}/dev/null to discard it)\n"), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
