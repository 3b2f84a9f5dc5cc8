"""The Python API refuses what the command line refuses, as a `SurgeonError`, before any work."""

from __future__ import annotations

import os
import re

import pytest
from helpers import FIXTURES, copy_fixture, run
from helpers.bad_input import state


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


# ------------------------------------------------------------------------------------ the Python API, checked
def test_api_options_of_the_wrong_type_are_refused_before_any_work(tmp_path):
    """`allow_unproven="no"` is true to Python: taken as given, it would rewrite the 4 unproven gathers of this
    fixture (indices down to -8 against a size of 42). Every option is checked: a wrong one is a one-line
    SurgeonError naming it, before any work."""
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


@pytest.mark.parametrize("value", [5, 3.5, None])
def test_api_skip_passes_of_the_wrong_type_and_a_generator(tmp_path, value):
    """`skip_passes=5` or `3.5` is a one-line SurgeonError, not a TypeError; a generator is read once, so the type
    check does not consume it and leave nothing skipped, silently: what it names is skipped."""
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
