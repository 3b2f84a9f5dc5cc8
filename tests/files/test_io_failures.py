"""Files that fail under a command: a full disk, an input changed or removed while it is patched, a folder that
cannot be searched, a nearly full TMPDIR. Each is one line naming the file, nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from helpers import ERROR_PREFIX, FIXTURES, copy_fixture, graphs, one_error_line, run
from helpers.bad_input import DS, external, state, without_permission_bypass


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


# ------------------------------------------------------------------------------------------- folders out of reach
@pytest.mark.parametrize("argv, named, problem", [
    (["patch", "d/m.onnx", "o.onnx"], "d/m.onnx", "cannot be read (Permission denied)"),
    (["patch", "m.onnx", "d/o.onnx"], "d/o.onnx", "OUT cannot be written there (Permission denied)"),
    (["inspect", "m.onnx", "--json", "d/r.json"], "d/r.json", "--json cannot be written there (Permission denied)"),
    (["verify", "m.onnx", "d/m.onnx"], "d/m.onnx", "cannot be read (Permission denied)"),
    (["budget", "d/m.onnx"], "d/m.onnx", "cannot be read (Permission denied)"),
    (["patch", "m.onnx", "o.onnx", "--device-profile", "d/p.json"], "d/p.json", "cannot read device profile"),
], ids=["patch-input", "patch-output", "inspect-json", "verify", "budget", "device-profile"])
def test_a_folder_that_cannot_be_searched_is_one_line(tmp_path, argv, named, problem):
    prefix = without_permission_bypass()
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
    removed once loaded: a SurgeonError naming it (not a FileNotFoundError traceback), nothing written."""
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


@pytest.mark.parametrize("size, argv, needed_for", [
    ("100k", ["patch", FIXTURES / "decoder_gathernd_fp16.onnx", "out.onnx", "--max-buffer", "100KiB"],
     "ORT CPU's graph of the model"),
    ("400k", ["patch", FIXTURES / "decoder_gathernd_fp16.onnx", "out.onnx", "--max-buffer", "100KiB"],
     "the model kept aside for the float16 proofs and ORT CPU's graphs of the models they compare"),
    ("100k", ["verify", FIXTURES / "decoder_gathernd.onnx", FIXTURES / "decoder_gathernd.onnx", "--iterations", "3"],
     "the outputs verify compares"),
], ids=["patch-lift", "patch-float16-proofs", "verify"])
def test_a_nearly_full_tmpdir_is_one_line_and_nothing_is_left_there(tmp_path, size, argv, needed_for):
    """TMPDIR nearly full: each use of TMPDIR is a folder the command removes whatever happens (also a child's,
    stopped while ORT writes in a folder of its own: no `ds-rounding-*` folder is left), and a TMPDIR out of space is
    one line naming it, what the command keeps there and the space it had, not onnxruntime's traceback from
    proofs/precision.py. (A small tmpfs: root only.)"""
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
