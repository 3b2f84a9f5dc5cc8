"""stdout and stderr that are full, closed or left by their reader (base/streams.py), through the command."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import ERROR_PREFIX, copy_fixture
from helpers.bad_input import DS

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
    """With stdout on /dev/full, every command (`patch`, `inspect`, `budget`, `verify`, `placement`) ends in one
    line on stderr, exit 2, not a traceback: a command writes its files before it prints its report, and the line
    names the files written all the same (the docs say nothing is written when a command fails, so a silent OUT
    beside an OSError traceback would contradict them)."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*DS, *argv], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=600)
    assert proc.returncode == 2 and proc.stderr == FULL_LINE + fate + "\n", proc.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(["m.onnx", *re.findall(r"[\w.]+\.(?:onnx_data|onnx|json)", fate)]), written


def test_a_reader_that_left_ends_the_command_quietly_with_141(tmp_path):
    """`patch ... | head -1`: a reader of stdout that left (here before the command started: the same every run)
    ends the command as SIGPIPE ends a command, quietly with 141, not with a BrokenPipeError traceback and exit 1;
    its files were written before its report."""
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
    """Stdout closed (`>&-`) or stderr closed (`2>&-`) is refused before any work, one line on the other, exit 2
    (not an AttributeError traceback from base/background.py, nor exit 1 without a word)."""
    copy_fixture("decoder_gathernd.onnx", tmp_path, "m.onnx")
    redirect = ">&-" if closed == "stdout" else "2>&-"
    proc = subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", *DS, "patch", "m.onnx", "out.onnx"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    said = proc.stderr if closed == "stdout" else proc.stdout
    assert proc.returncode == 2 and (proc.stdout if closed == "stdout" else proc.stderr) == ""
    assert said == (f"{ERROR_PREFIX}{closed} is closed, so what the command says there would be lost; nothing was "
                    f"done (give {'>' if closed == 'stdout' else '2>'}/dev/null to discard it)\n"), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
