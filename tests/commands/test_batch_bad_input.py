"""`batch` given entries, manifests and folders a user gets wrong: each ends in one line naming it, exit 2 (or
the entry fails alone), nothing written outside OUTDIR and the inputs unchanged."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import copy_fixture, one_error_line, run
from helpers.bad_input import DS, external, long_name, state, summary_rows, without_permission_bypass


def test_batch_entry_may_not_write_another_models_data_file(tmp_path):
    external(tmp_path / "a")
    copy_fixture("sum_only.onnx", tmp_path, "b.onnx")
    (tmp_path / "m.toml").write_text('[[model]]\ninput = "b.onnx"\noutput = "a/w.data"\n'
                                     '[[model]]\ninput = "a/model.onnx"\noutput = "a.patched.onnx"\n')
    before = state(tmp_path / "a")
    proc = run("batch", "m.toml", "--jobs", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = summary_rows(proc.stdout)
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
    rows = summary_rows(proc.stdout)
    assert rows["1"].split()[1] == "ok", proc.stdout
    assert re.search(r"m\.toml, \[\[model\]\] #2: option iterations = 0 should be at least 1", rows["2"])
    assert re.search(r"m\.toml, \[\[model\]\] #3: val_range\.x0 = \[1, 0\] should be finite with lo <= hi", rows["3"])
    assert re.search(r"m\.toml, \[\[model\]\] #4: option opt_level = 'max' should be one of", rows["4"])
    assert not any((tmp_path / n).exists() for n in ("b.onnx", "c.onnx", "d.onnx", "b.report.json"))


# ------------------------------------------------------------------------------- batch: sizes, links, folders
def test_batch_sizes_like_the_command_line_and_bad_entries_fail_alone_while_planning(tmp_path):
    """`max_memory = "1GB"` is taken as `--max-memory 1GB` is (not failed at run time); `max_memory = 0` and an
    output name over 255 bytes fail their entry while planning (no report, no worker), and the rest runs."""
    copy_fixture("sum_only.onnx", tmp_path, "m.onnx")
    long_out = long_name("o", 256)
    (tmp_path / "m.toml").write_text(
        f'[[model]]\ninput = "m.onnx"\noutput = "{long_out}"\n'
        '[[model]]\ninput = "m.onnx"\noutput = "b.onnx"\nmax_memory = "1GB"\nmax_buffer = "1.5MiB"\n'
        '[[model]]\ninput = "m.onnx"\noutput = "c.onnx"\nmax_memory = 0\n'
        '[[model]]\ninput = "m.onnx"\noutput = "d.onnx"\nseed = 4294967295\niterations = 2\n')
    proc = run("batch", "m.toml", "--jobs", "1", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    rows = summary_rows(proc.stdout)
    assert re.search(rf"failed .*{long_out}: the output of entry 1 \(m\.onnx\) has a name of 256 bytes", rows["1"])
    assert rows["2"].split()[1] == "ok", proc.stdout
    report = json.loads((tmp_path / "b.report.json").read_text())
    assert report["options"]["max_memory"] == 10**9 and report["options"]["max_buffer"] == 3 * 2**19
    assert re.search(r"m\.toml, \[\[model\]\] #3: option max_memory: bad size '0'", rows["3"]), proc.stdout
    assert re.search(r"m\.toml, \[\[model\]\] #4: option seed = 4294967295 should be at most", rows["4"]), proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.onnx", "b.report.json", "m.onnx", "m.toml"]


def _model_folder(d: Path) -> Path:
    """DIR with a model, a subfolder with another, and a link to that subfolder."""
    src = d / "src"
    (src / "real").mkdir(parents=True)
    copy_fixture("sum_only.onnx", src, "m.onnx")
    copy_fixture("sum_only.onnx", src / "real", "r.onnx")
    (src / "alias").symlink_to("real")
    return src


def test_batch_folder_follows_a_link_to_a_folder_inside_dir_and_refuses_others(tmp_path):
    """A linked subfolder of DIR is never passed over without a word. Inside DIR it is followed (its models
    patched under the link's name); a link out of DIR, or to a folder that holds it, is one line, exit 2."""
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
    """A linked subfolder the user has in OUTDIR is refused: followed, it would land the outputs in its target,
    outside OUTDIR."""
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
    """A batch refused once the output folders are made (here: a file to copy onto a FIFO in OUTDIR) takes them
    back: no empty folders are left behind."""
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
        sock.bind(str(src / "zz.sock"))  # after the configs: the batch must fail before it copies them
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
    """Only regular files inside DIR are read: anything else is one line, exit 2, before anything is written. Each
    case would otherwise leave something behind: a link to /dev/zero in DIR copied without end; a socket in DIR
    failing only after the other files were copied; a FIFO config.json leaving an empty OUTDIR/onnx/; a read-only
    OUTDIR/onnx/ leaving the configs copied without the model; file links leading outside DIR copied (they are
    refused, as folder links leading outside DIR are). (The run's files are
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
        proc = subprocess.run([*without_permission_bypass(), *DS, "batch", "src", "out", "--no-progress"],
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
