"""The holes an adversarial run found, as a table: each case must end with its exit code, ONE stderr line
naming the file and the problem, no traceback, the inputs' bytes unchanged and nothing left behind.

Every case prepares files in an empty folder (the working directory) and returns the command line, the exit code,
the file the error line must start with (None: no file) and a regex the problem must match. The command line's cases
that need more than one line follow the table; those of signals, batch, the API and files are in the folders of
what they test (base/, commands/, files/).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import ERROR_PREFIX, copy_fixture, graphs, one_error_line, run
from helpers.bad_input import DS, external, long_name, state, summary_rows
from onnx import TensorProto, helper


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


# names a system call would refuse, FIFOs among the options' files, numbers out of range


def _out_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return ["patch", "m.onnx", long_name("o", 256)], 2, long_name("o", 256), r"OUT has a name of 256 bytes"


def _out_in_a_folder_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, "m.onnx")
    (d / "out").mkdir()
    return ["patch", "m.onnx", f"out/{long_name('a', 256)}"], 2, f"out/{long_name('a', 256)}", r"OUT has a name of 256"


def _default_out_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, long_name("m", 250))  # its default OUT, <name>.patched.onnx, is 258 bytes
    return ["patch", long_name("m", 250)], 2, "m" * 245 + ".patched.onnx", r"OUT has a name of 258 bytes"


def _input_name_too_long(d: Path):
    return ["inspect", long_name("m", 256)], 2, long_name("m", 256), r"the model has a name of 256 bytes"


def _report_name_too_long(d: Path):  # nothing is written: OUT is not written before the report fails
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return (["patch", "m.onnx", "o.onnx", "--report", long_name("r", 256, ".json")], 2, long_name("r", 256, ".json"),
            r"--report has a name of 256 bytes")


def _json_name_too_long(d: Path):
    copy_fixture("sum_only.onnx", d, "m.onnx")
    return (["inspect", "m.onnx", "--json", long_name("r", 300, ".json")], 2, long_name("r", 300, ".json"),
            r"--json has a")


def _out_data_name_too_long(d: Path):  # OUT fits, <OUT>.data does not: refused before any work
    external(d / "x")
    return (["patch", "x/model.onnx", long_name("o", 252)], 2, long_name("o", 252) + ".data",
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


def _iterations_out_of_range(d: Path):  # refused at once: taken, it would grow memory without end
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
                     r"9223372036854775807 is not from 1 to 2,147,483,647", summary_rows(proc.stdout)["1"])


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
